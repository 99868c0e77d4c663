"""Measurement: what `edgeroute bench` times (backends against llama.cpp, the memory floor)
and what a decode step reads (step_bytes). It drives the runtime; the runtime imports nothing
from here."""
