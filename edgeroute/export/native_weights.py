"""The native weight file: a GGUF model's tensors copied block for block into the bundle.

The native backend (``libedgeroute``, ``edgeroute.runtime.backends.native``) reads the GGUF block
formats directly, so a decode step reads the source's bytes and no more (the ONNX graphs'
repacked int4 weights read 1.4x as many on the Qwen2.5-Coder 1.5B). Nothing is re-quantized:
the bytes are the file's, except that Llama's Q/K rows are put back in rotate-half order (as
the graphs' weights are, see ``gguf_source``) and a float16 vector is widened to float32.

The file is itself a GGUF (version 3): its header names every tensor (type, shape, offset)
and carries the dimensions the C library needs (``edgeroute.*`` keys, docs/guide/native.md),
so libedgeroute opens it without the bundle's manifest and any GGUF tool can read it. The
header also carries a digest of the tensor data (``edgeroute.data_digest``, ``digest.py``),
which the library checks when it opens the file: weights damaged in place are refused.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from edgeroute.arch import ArchConfig
from edgeroute.bundle import NATIVE_ALIGNMENT, NATIVE_FORMATS, NativeTensor, NativeWeights
from edgeroute.export.digest import Digest
from edgeroute.export.gguf_source import _unpermute_rows
from edgeroute.export.source_model import RawTensor, SourceModel
from edgeroute.rope import inverse_frequencies

NATIVE_FAMILIES = ("llama", "qwen2")  # no per-head q/k norm (Qwen3) in the native layer yet
LAYER_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
LAYER_VECTORS = ("attn_norm.weight", "ffn_norm.weight")
BIASES = ("attn_q.bias", "attn_k.bias", "attn_v.bias")
NATIVE_FILE_VERSION = 1  # edgeroute.native.version: what libedgeroute/src/gguf.c reads
GGML_TYPE_IDS = {"F32": 0, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14}
_U32, _F32, _STRING, _ARRAY, _U64, _F64 = 4, 6, 8, 9, 10, 12  # GGUF metadata value types


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


def _string(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


def _metadata(arch: ArchConfig, context_length: int, data_digest: int) -> list[bytes]:
    """The GGUF key-value pairs the library reads (and the architecture's name)."""
    sizes = {"layers": arch.num_layers, "hidden": arch.hidden_size, "heads": arch.num_heads,
             "kv_heads": arch.num_kv_heads, "head_dim": arch.head_dim, "ffn": arch.intermediate_size,
             "vocab": arch.vocab_size, "context_length": context_length}
    inv = inverse_frequencies(arch.head_dim, arch.rope_theta, arch.rope_scaling).astype("<f8")
    return [_string("general.architecture") + struct.pack("<I", _STRING) + _string(arch.family),
            _string("general.alignment") + struct.pack("<II", _U32, NATIVE_ALIGNMENT),
            _string("edgeroute.native.version") + struct.pack("<II", _U32, NATIVE_FILE_VERSION),
            *(_string(f"edgeroute.{key}") + struct.pack("<II", _U32, value) for key, value in sizes.items()),
            _string("edgeroute.rms_eps") + struct.pack("<If", _F32, arch.rms_norm_eps),
            _string("edgeroute.rope.inv_freq") + struct.pack("<IIQ", _ARRAY, _F64, inv.size) + inv.tobytes(),
            _string("edgeroute.data_digest") + struct.pack("<IQ", _U64, data_digest)]


def write_native_weights(source: SourceModel, arch: ArchConfig, path: Path, rel: str, context_length: int,
                         reduced_head: bool = False) -> NativeWeights | str:
    """Write ``arch.num_layers`` layers (an SLM may use the first layers only) of a GGUF source to
    ``path`` as a GGUF file; returns the manifest entry, or why the model has none (a tensor in a
    format the kernels do not read: the model then runs on ONNX Runtime only)."""
    reason = native_unsupported(source, arch, reduced_head)
    if reason is not None:
        return reason
    assert source.raw_tensor is not None
    head_rows = not arch.tie_word_embeddings  # a tied head reads the embedding's rows
    tensors: list[tuple[str, str, tuple[int, ...], np.ndarray]] = []
    for name in _tensors(arch, head_rows):
        try:
            tensors.append((name, *_native_bytes(source.raw_tensor(name), _rows_to_keep(name, arch))))
        except ValueError as err:
            return f"tensor {name} in {err}"
    infos, offset, digest = [], 0, Digest()  # the digest of the data section, laid out as written below
    for name, fmt, shape, data in tensors:
        digest.update(bytes(-offset % NATIVE_ALIGNMENT))
        offset += -offset % NATIVE_ALIGNMENT
        dims = tuple(reversed(shape))  # GGUF lists the innermost dimension first
        infos.append(_string(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, GGML_TYPE_IDS[fmt], offset))
        digest.update(np.ascontiguousarray(data))
        offset += data.size
    metadata = _metadata(arch, context_length, digest.value())
    header = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(metadata)) + b"".join(metadata) + b"".join(infos)
    data_start = len(header) + -len(header) % NATIVE_ALIGNMENT
    entries: dict[str, NativeTensor] = {}
    with open(path, "wb") as f:
        f.write(header + b"\0" * (data_start - len(header)))
        for name, fmt, shape, data in tensors:
            f.write(b"\0" * (-f.tell() % NATIVE_ALIGNMENT))
            entries[name] = NativeTensor(fmt, tuple(shape), f.tell(), int(data.size))
            f.write(np.ascontiguousarray(data).tobytes())
    return NativeWeights(rel, entries)
