"""The native weight file: a GGUF model's tensors copied block for block into the bundle.

The native backend (``runtime/native``, ``edgeroute.runtime.native``) reads the GGUF block
formats directly, so a decode step reads the source's bytes and no more (the ONNX graphs'
repacked int4 weights read 1.4x as many on the Qwen2.5-Coder 1.5B). Nothing is re-quantized:
the bytes are the file's, except that Llama's Q/K rows are put back in rotate-half order (as
the graphs' weights are, see ``gguf_source``) and a float16 vector is widened to float32.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from edgeroute.arch import ArchConfig
from edgeroute.bundle import NATIVE_ALIGNMENT, NATIVE_FORMATS, NativeTensor, NativeWeights
from edgeroute.export.gguf_source import _unpermute_rows
from edgeroute.export.source_model import RawTensor, SourceModel

NATIVE_FAMILIES = ("llama", "qwen2")  # no per-head q/k norm (Qwen3) in the native layer yet
LAYER_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
LAYER_VECTORS = ("attn_norm.weight", "ffn_norm.weight")
BIASES = ("attn_q.bias", "attn_k.bias", "attn_v.bias")


def _tensors(arch: ArchConfig, head_rows: bool) -> Iterator[str]:
    """The GGUF names the native backend reads, in file order."""
    yield "token_embd.weight"
    for i in range(arch.num_layers):
        for vector in LAYER_VECTORS:
            yield f"blk.{i}.{vector}"
        for matrix in LAYER_MATRICES:
            yield f"blk.{i}.{matrix}.weight"
        if arch.attention_bias:
            for bias in BIASES:
                yield f"blk.{i}.{bias}"
    yield "output_norm.weight"
    if head_rows:
        yield "output.weight"


def native_unsupported(source: SourceModel, arch: ArchConfig, reduced_head: bool = False) -> str | None:
    """Why the native backend cannot run this model (None: it can)."""
    if reduced_head:
        return "a reduced-vocabulary head (its rest column is an ONNX graph's)"
    if source.raw_tensor is None:
        return f"{source.format} source (native weights are GGUF blocks)"
    if arch.family not in NATIVE_FAMILIES or arch.qk_norm:
        return f"architecture {arch.family}{' with q/k norms' if arch.qk_norm else ''}"
    if arch.hidden_size % 32 or arch.intermediate_size % 32 or (arch.num_heads * arch.head_dim) % 32:
        return "sizes that are not multiples of 32"
    if arch.head_dim % 8:
        return f"a head size of {arch.head_dim} (not a multiple of 8)"
    return None


def _rows_to_keep(name: str, arch: ArchConfig) -> np.ndarray | None:
    """The rows of ``name`` the native file keeps, in order (None: all, as stored)."""
    if arch.family == "llama" and name.endswith(("attn_q.weight", "attn_q.bias", "attn_k.weight", "attn_k.bias")):
        heads = arch.num_heads if ".attn_q." in name else arch.num_kv_heads
        return _unpermute_rows(heads * arch.head_dim, heads)
    return None


def _native_bytes(raw: RawTensor, rows: np.ndarray | None) -> tuple[str, tuple[int, ...], np.ndarray]:
    fmt, shape, data = raw.type_name, raw.shape, raw.data
    if fmt == "F16":
        fmt, data = "F32", data.view(np.float16).astype(np.float32).view(np.uint8)
    if fmt not in NATIVE_FORMATS:
        raise ValueError(f"format {fmt}")
    if rows is not None:  # a row's bytes are contiguous, for a matrix of blocks as for a vector
        data = data.reshape(shape[0], -1)[rows].reshape(-1)
        shape = (len(rows), *shape[1:])
    return fmt, shape, data


def write_native_weights(source: SourceModel, arch: ArchConfig, path: Path, rel: str,
                         reduced_head: bool = False) -> NativeWeights | str:
    """Write ``arch.num_layers`` layers (an SLM may use the first layers only) of a GGUF source to
    ``path``; returns the manifest entry, or why the model has none (a tensor in a format the
    kernels do not read: the model then runs on ONNX Runtime only)."""
    reason = native_unsupported(source, arch, reduced_head)
    if reason is not None:
        return reason
    assert source.raw_tensor is not None
    head_rows = not arch.tie_word_embeddings  # a tied head reads the embedding's rows
    tensors: dict[str, NativeTensor] = {}
    with open(path, "wb") as f:
        for name in _tensors(arch, head_rows):
            try:
                fmt, shape, data = _native_bytes(source.raw_tensor(name), _rows_to_keep(name, arch))
            except ValueError as err:
                f.close()
                path.unlink()
                return f"tensor {name} in {err}"
            pad = -f.tell() % NATIVE_ALIGNMENT
            f.write(b"\0" * pad)
            tensors[name] = NativeTensor(fmt, tuple(shape), f.tell(), int(data.size))
            f.write(np.ascontiguousarray(data).tobytes())
    return NativeWeights(rel, tensors)
