"""The device runtime: onnxruntime, numpy and tokenizers only (no torch, no transformers)."""

from edgeroute.bundle import Bundle
from edgeroute.runtime.answer_memory import AnswerMemory
from edgeroute.runtime.attention import KVCache
from edgeroute.runtime.backends.onnxruntime import OrtModel
from edgeroute.runtime.decoding import DecodeOptions
from edgeroute.runtime.engine import Engine, Generation, GenerationStats
from edgeroute.runtime.options import EngineOptions

__all__ = ["AnswerMemory", "Bundle", "DecodeOptions", "Engine", "EngineOptions", "Generation", "GenerationStats", "KVCache",
           "OrtModel"]
