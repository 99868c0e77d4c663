"""edgeroute: LLMs on edge devices, full compute only for the tokens that need it.

The device side (``edgeroute.runtime``, ``edgeroute.bundle``) needs only onnxruntime, numpy
and tokenizers; ``edgeroute.export`` (torch, transformers, onnx) runs on a workstation.
"""

__version__ = "0.1.0"
