"""The weight bytes one decode step reads, per backend: on a CPU, decode is bound by them, so
they times tokens/s is the memory bandwidth a backend draws (``edgeroute bench``), and their
ratio between backends bounds the ratio of their speeds (``tools/bundle_bytes.py``).

A decode step runs every layer and the head once. The native backend and llama.cpp read every
``blk.*`` tensor and the output matrix (``output.weight``, or the embedding where the head is
tied to it) as the GGUF stores them; the embedding is otherwise gathered, one row per token.
ONNX Runtime reads the initializers of the step's graphs *after* its optimizations
(DequantizeLinear + MatMul fused into MatMulNBits: packed codes, fp32 scales, plus the offset
Gemm's fp32 offsets), measured by saving each optimized graph. The KV cache's reads, which
grow with the context, are not counted here.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from pathlib import Path

import onnxruntime as ort

from edgeroute.bundle import Bundle, GraphEntry, ModelEntry
from edgeroute.runtime.backends.onnxruntime import session_options

OUTPUT, TIED = "output.weight", "token_embd.weight"


def gguf_tensor_step_bytes(sizes: Mapping[str, int]) -> int:
    """Of tensors by GGUF name -> bytes, what one decode step reads: the ``blk.*`` tensors and
    the head (``output.weight``, else the tied ``token_embd.weight``)."""
    head = OUTPUT if OUTPUT in sizes else TIED
    return sum(n for name, n in sizes.items() if name.startswith("blk.")) + sizes[head]


def native_step_bytes(entry: ModelEntry) -> int | None:
    """The native backend's bytes per decode step, from the manifest (None: no native weights)."""
    if entry.native is None:
        return None
    return gguf_tensor_step_bytes({name: t.bytes for name, t in entry.native.tensors.items()})


def gguf_step_bytes(path: Path) -> int:
    """llama.cpp's bytes per decode step of the GGUF file at ``path`` (needs the ``gguf`` package)."""
    import gguf

    return gguf_tensor_step_bytes({t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors})


def ort_step_graphs(entry: ModelEntry, flavour: str, kv_dtype: str = "float32") -> list[GraphEntry]:
    """The graphs one ONNX Runtime decode step runs: every layer in ``flavour`` with a ``kv_dtype``
    cache, and the head (a bundle also carries other variants' layer graphs, over the same weights)."""
    return [entry.graph("layer", i, flavour, kv_dtype) for i in range(entry.num_layers)] + [entry.graph("head")]


def save_optimized(graph: Path, directory: Path) -> tuple[Path, Path]:
    """``graph`` after ONNX Runtime's full optimization with the runtime's session options (same
    optimizations, same shared thread pool), saved into ``directory``: the model, and the file
    that holds every one of its initializers."""
    model, data = directory / "optimized.onnx", directory / "optimized.data"
    options = session_options()
    options.log_severity_level = 3
    options.optimized_model_filepath = str(model)
    options.add_session_config_entry("session.optimized_model_external_initializers_file_name", data.name)
    options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "0")
    ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
    return model, data


def optimized_initializer_bytes(graph: Path) -> int:
    """Bytes of the initializers of ``graph`` after ONNX Runtime's optimizations: the size of the
    file that ``save_optimized`` writes them to (ONNX Runtime aligns some of them there: at most
    0.05% over their own bytes, measured on the SmolLM2 and Qwen2.5-Coder-1.5B layers and heads).
    No ``onnx`` package needed."""
    with tempfile.TemporaryDirectory() as tmp:
        data = save_optimized(graph, Path(tmp))[1]
        return data.stat().st_size if data.exists() else 0


def ort_step_bytes(bundle: Bundle, role: str, flavour: str, kv_dtype: str = "float32") -> int:
    """ONNX Runtime's bytes per decode step of ``role``'s model (see ``optimized_initializer_bytes``)."""
    graphs = ort_step_graphs(bundle.models[role], flavour, kv_dtype)
    return sum(optimized_initializer_bytes(bundle.file(g.file)) for g in graphs)
