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
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

from edgeroute.bundle import Bundle, GraphEntry, ModelEntry

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


def optimized_initializer_bytes(graph: Path) -> tuple[int, Counter]:
    """Bytes of the initializers of ``graph`` after ONNX Runtime's full optimization (the runtime's
    session options), and its op counts. Needs the ``onnx`` package (the export extra)."""
    import onnx
    import onnxruntime as ort
    from onnx.external_data_helper import uses_external_data

    from edgeroute.runtime.model import session_options

    with tempfile.TemporaryDirectory() as tmp:
        options = session_options()  # the runtime's: same optimizations, same (shared) thread pool
        options.log_severity_level = 3
        options.optimized_model_filepath = str(Path(tmp) / "opt.onnx")
        options.add_session_config_entry("session.optimized_model_external_initializers_file_name", "opt.data")
        options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "64")
        ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
        model = onnx.load(str(Path(tmp) / "opt.onnx"), load_external_data=False)
    total = 0
    for t in model.graph.initializer:
        if uses_external_data(t):
            total += int({e.key: e.value for e in t.external_data}["length"])
        else:
            total += onnx.numpy_helper.to_array(t).nbytes
    return total, Counter(n.op_type for n in model.graph.node)


def ort_step_bytes(bundle: Bundle, role: str, flavour: str, kv_dtype: str = "float32") -> int:
    """ONNX Runtime's bytes per decode step of ``role``'s model (see ``optimized_initializer_bytes``)."""
    graphs = ort_step_graphs(bundle.models[role], flavour, kv_dtype)
    return sum(optimized_initializer_bytes(bundle.file(g.file))[0] for g in graphs)
