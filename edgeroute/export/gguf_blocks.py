"""Exact carry-over of GGUF tensors into :class:`BlockQuantWeight`.

Every ggml block format handled here is, per block (or per sub-block of a K-quant
super-block), an affine map of small unsigned integer codes, so it is rewritten as
``scale * q + offset`` with the codes copied, never re-quantized. Byte layouts follow
llama.cpp's ``dequantize_row_*`` (mirrored by gguf-py's ``gguf/quants.py``).

Only numpy is needed: the type is dispatched on ``qtype.name``, so ``gguf`` stays a
reader-side dependency.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from edgeroute.export.tensors import BlockFactors, BlockQuantWeight

if TYPE_CHECKING:
    import gguf

FLOAT_TYPES = ("F32", "F16", "BF16")
# name -> (elements per block, bytes per block), as in gguf.constants.GGML_QUANT_SIZES
_BLOCK_SIZES = {
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q8_0": (32, 34),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
}
SUPPORTED_GGUF_TYPES: tuple[str, ...] = (*FLOAT_TYPES, *_BLOCK_SIZES)
DECODE_ROWS = 4096


class UnsupportedTensorFormat(ValueError):
    """A GGUF tensor type with no exact ``scale * q + offset`` form here (IQ*, Q2_K, Q3_K, TQ*, ...)."""


def _blocks(raw: np.ndarray, shape: tuple[int, int], block: int, type_size: int) -> np.ndarray:
    """The bytes as [rows, blocks per row, bytes per block]."""
    rows, cols = shape
    if cols % block:
        raise ValueError(f"row length {cols} is not a multiple of the block size {block}")
    data = np.ascontiguousarray(raw).view(np.uint8)
    n = cols // block
    if data.size != rows * n * type_size:
        raise ValueError(f"{data.size} bytes do not hold a {shape} tensor ({type_size} bytes per {block})")
    return data.reshape(rows, n, type_size)


def _f16(b: np.ndarray, at: int) -> np.ndarray:
    """The fp16 field at byte ``at`` of every block, as float32 [rows, blocks]."""
    return np.ascontiguousarray(b[..., at:at + 2]).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray, group: int) -> np.ndarray:
    """Unpack 4-bit codes: each run of ``group`` bytes holds ``group`` low nibbles, then the highs."""
    lead = qs.shape[:-1]
    q = qs.reshape(*lead, -1, 1, group) >> np.array([0, 4], np.uint8).reshape(2, 1)
    return (q & 0x0F).reshape(*lead, -1)


def _scale_min_k4(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp get_scale_min_k4: 8 six-bit scales and mins packed in 12 bytes -> [..., 8] each."""
    lo, mid, hi = sc[..., 0:4], sc[..., 4:8], sc[..., 8:12]
    scale = np.concatenate([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)], axis=-1)
    return scale.astype(np.float32), mins.astype(np.float32)


def _rows(x: np.ndarray) -> np.ndarray:
    """Merge the trailing (super-block, sub-block / element) axes into one per-row axis."""
    return np.ascontiguousarray(x).reshape(x.shape[0], -1)


def _decode_float(raw: np.ndarray, name: str, shape: tuple[int, int]) -> np.ndarray:
    data = np.ascontiguousarray(raw)
    if name == "BF16":
        # bf16 is the top half of a float32; GGUFReader hands it over as raw bytes
        bits = data.view(np.uint8).view(np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32).reshape(shape)
    dtype = np.float32 if name == "F32" else np.float16
    if data.dtype == np.uint8:
        data = data.view(dtype)
    return data.astype(np.float32).reshape(shape)


@dataclass
class _Decoded:
    """One chunk of rows: codes, scales and offsets, and for K-quants their integer factors
    (sub-block codes [rows, super-blocks, sub-blocks] times the super-block's fp16 step)."""

    q: np.ndarray
    scale: np.ndarray
    offset: np.ndarray | None
    bits: int
    block: int
    scale_codes: np.ndarray | None = None
    scale_step: np.ndarray | None = None
    offset_codes: np.ndarray | None = None
    offset_step: np.ndarray | None = None
    zero: int = 0


def _decode_blocks(b: np.ndarray, name: str) -> _Decoded:
    """The raw representation; scales may still be negative."""
    f64 = np.float64  # offsets sum two products: one float32 rounding instead of three
    if name in ("Q4_0", "Q4_1"):
        d = _f16(b, 0)
        q = _nibbles(b[..., (4 if name == "Q4_1" else 2):], 16).astype(np.int8) - 8
        offset = None if name == "Q4_0" else _f16(b, 2).astype(f64) + 8 * d.astype(f64)
        return _Decoded(q, d, offset, 4, 32)
    if name in ("Q5_0", "Q5_1"):
        d = _f16(b, 0)
        at = 4 if name == "Q5_1" else 2
        high = np.unpackbits(b[..., at:at + 4], axis=-1, bitorder="little")  # bit j -> element j
        q = (_nibbles(b[..., at + 4:], 16) | (high << 4)).astype(np.int8) - 16
        offset = None if name == "Q5_0" else _f16(b, 2).astype(f64) + 16 * d.astype(f64)
        return _Decoded(q, d, offset, 8, 32)
    if name == "Q8_0":
        return _Decoded(np.ascontiguousarray(b[..., 2:]).view(np.int8), _f16(b, 0), None, 8, 32)
    if name in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b, 0)[..., None], _f16(b, 2)[..., None]
        sc, m = _scale_min_k4(b[..., 4:16])
        if name == "Q4_K":
            q, zero = _nibbles(b[..., 16:], 32).astype(np.int8) - 8, 8
        else:
            # qh[l] bit i is the fifth bit of element l of sub-block i
            high = np.unpackbits(b[..., 16:48, None], axis=-1, bitorder="little").swapaxes(-1, -2)
            q = (_nibbles(b[..., 48:], 32) | (high.reshape(*b.shape[:-1], 256) << 4)).astype(np.int8) - 16
            zero = 16
        # both products are exact in float32, so the sum is rounded once, as BlockFactors.table does
        scale = d * sc
        offset = np.float32(zero) * scale + (-dmin) * m
        return _Decoded(q, scale, offset, 4 if name == "Q4_K" else 8, 32, sc, d, m, -dmin, zero)
    if name == "Q6_K":
        lead = b.shape[:-1]
        ql = (b[..., :128].reshape(*lead, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)) & 0x0F
        qh = (b[..., 128:192].reshape(*lead, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 3
        q = (ql.reshape(*lead, 256) | (qh.reshape(*lead, 256) << 4)).astype(np.int8) - 32
        d, sc = _f16(b, 208)[..., None], b[..., 192:208].view(np.int8)
        return _Decoded(q, d * sc.astype(np.float32), None, 8, 16, sc, d)
    raise AssertionError(name)


_FIELD_TYPES = {"q": np.int8, "scale": np.float32, "offset": np.float32, "scale_codes": np.int16,
                "scale_step": np.float32, "offset_codes": np.int16, "offset_step": np.float32}


def decode_gguf_tensor(
    raw: np.ndarray, qtype: gguf.GGMLQuantizationType, shape: tuple[int, int]
) -> BlockQuantWeight | np.ndarray:
    """A GGUF tensor's ``data`` (as GGUFReader gives it) as float32 or an exact BlockQuantWeight.

    ``shape`` is (rows, cols) in numpy order, i.e. GGUFReader's ``tensor.shape`` reversed.
    Block formats keep their integer codes; all returned scales are >= 0."""
    name = getattr(qtype, "name", str(qtype))
    if name in FLOAT_TYPES:
        return _decode_float(raw, name, shape)
    if name not in _BLOCK_SIZES:
        raise UnsupportedTensorFormat(
            f"GGUF tensor type {name} has no exact block-quantized form here; "
            f"supported types: {', '.join(SUPPORTED_GGUF_TYPES)}"
        )
    blocks = _blocks(raw, shape, *_BLOCK_SIZES[name])
    # row chunks bound the decoding temporaries (several int arrays per element) for a
    # 150k-row vocabulary matrix to a few MB instead of ~1 GB; results go straight into
    # whole-tensor arrays, allocated once the first chunk shows which fields this format has
    whole: dict[str, np.ndarray] = {}
    for start in range(0, shape[0], DECODE_ROWS):
        chunk = _decode_blocks(blocks[start:start + DECODE_ROWS], name)
        for field, dtype in _FIELD_TYPES.items():
            value = getattr(chunk, field)
            if value is None:
                continue
            value = _rows(value)
            if field not in whole:
                whole[field] = np.empty((shape[0], value.shape[1]), dtype)
            whole[field][start:start + DECODE_ROWS] = value
    scale_factors = offset_factors = None
    if "scale_codes" in whole:
        scale_factors = BlockFactors(whole["scale_codes"], whole["scale_step"], chunk.scale_codes.shape[-1])
    if "offset_codes" in whole:
        offset_factors = BlockFactors(whole["offset_codes"], whole["offset_step"], chunk.offset_codes.shape[-1],
                                      chunk.zero)
    weight = BlockQuantWeight(whole["q"], whole["scale"], chunk.bits, chunk.block, whole.get("offset"),
                              f"gguf:{name}", scale_factors, offset_factors)
    # files may hold negative d (Q4_0 stores max / -8) or negative Q6_K sub-scales
    return weight.with_positive_scales()
