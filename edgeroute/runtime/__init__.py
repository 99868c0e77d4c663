"""The device runtime: onnxruntime, numpy and tokenizers only (no torch, no transformers)."""

from edgeroute.bundle import Bundle
from edgeroute.runtime.engine import Engine, Generation, GenerationStats
from edgeroute.runtime.model import KVCache, OrtModel

__all__ = ["Bundle", "Engine", "Generation", "GenerationStats", "KVCache", "OrtModel"]
