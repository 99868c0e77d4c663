"""The KV-cache formats: one table that the bundle, both backends, the memory fit check and the
docs read (the native library's C header carries the same row layout). Standard library only.

A cache row is one position of one KV head:

- ``float32``: head_dim floats; ``float16``: head_dim halves;
- ``int8``: head_dim int8 codes (per 32 values at scale max|x| / 127), then the row's float32
  scales, one per 32 values: 1.125 bytes a value. The scales are per 32 values, so an int8
  cache needs a head_dim that is a multiple of 32 (:func:`int8_blocker`).

ONNX Runtime's graphs read float32 and float16 caches (``GRAPH_KV_DTYPES``); the native backend
reads all three.

What ``kv_dtype="auto"`` keeps (``AUTO_KV_DTYPES``): the narrowest cache whose answers differ
from the fp32 cache's no more than fp32's own do between kernel sets (the same arithmetic summed
in another order), and that decodes fastest on the kernels that read it. The native AVX-512 VNNI
kernels score int8 rows as integer dot products (key channels scaled by their peaks), so int8
reads 0.56x fp16's bytes at fp16's quality and decodes long contexts faster there; the other
native kernels keep fp16 (half fp32's bytes; llama.cpp's default cache too), since int8 has not
been measured on an AVX2-only CPU and the generic kernels widen every code to a float. ONNX
Runtime keeps fp32: its fp16 graphs widen the cache with Casts that cost decode speed. The
measurements: docs/measured/2026-12-02-int8-keys-per-channel.md and
docs/measured/2026-12-02-native-default-kv-fp16.md.
"""

from __future__ import annotations

from edgeroute.errors import InputError

KV_DTYPES = ("float32", "float16", "int8")
KV_DTYPE_CHOICES = ("auto", *KV_DTYPES)  # auto: AUTO_KV_DTYPES of the backend and kernel set
GRAPH_KV_DTYPES = ("float32", "float16")  # the caches ONNX Runtime's attention graphs read
INT8_GROUP = 32  # values per int8 scale

# backend, or "native:<kernel set>" where a kernel set differs -> what "auto" keeps
AUTO_KV_DTYPES = {"onnxruntime": "float32", "native": "float16", "native:avx512-vnni": "int8"}


def check_kv_dtype(kv_dtype: str, choices: tuple[str, ...] = KV_DTYPES) -> str:
    """``kv_dtype`` if it is one of ``choices`` (a cache's types; KV_DTYPE_CHOICES where "auto" may be asked)."""
    if kv_dtype not in choices:
        raise InputError(f"KV dtype {kv_dtype!r} is not one of {', '.join(choices)}")
    return kv_dtype


def kv_row_bytes(head_dim: int, kv_dtype: str) -> int:
    """Bytes of one cached position of one KV head."""
    groups = -(-head_dim // INT8_GROUP)
    return {"float32": 4 * head_dim, "float16": 2 * head_dim, "int8": head_dim + 4 * groups}[check_kv_dtype(kv_dtype)]


def int8_blocker(head_dim: int) -> str | None:
    """Why an int8 cache cannot hold rows of ``head_dim`` values (None: it can)."""
    if head_dim % INT8_GROUP:
        return (f"an int8 KV cache keeps scales per {INT8_GROUP} values: head_dim {head_dim} is not a multiple of "
                f"{INT8_GROUP} (use kv_dtype='float16')")
    return None


def check_int8_head_dim(head_dim: int, what: str) -> None:
    """Raise an InputError naming ``what`` (a model) when an int8 cache cannot hold its rows."""
    if (why := int8_blocker(head_dim)) is not None:
        raise InputError(f"the {what}: {why}")


def auto_kv_dtype(backend: str, kernels: str | None, head_dim: int) -> str:
    """What ``kv_dtype="auto"`` keeps on ``backend`` ("native" or "onnxruntime") with the native
    ``kernels`` set ("avx512-vnni", "avx2", "generic"; ignored for ONNX Runtime) for rows of
    ``head_dim``: int8 only where the rows fit it, else the backend's own default."""
    if backend != "native":
        return AUTO_KV_DTYPES[backend]
    cache = AUTO_KV_DTYPES.get(f"native:{kernels}", AUTO_KV_DTYPES["native"])
    return cache if cache != "int8" or int8_blocker(head_dim) is None else AUTO_KV_DTYPES["native"]

