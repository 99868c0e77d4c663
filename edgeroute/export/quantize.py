"""Round-to-nearest block quantization of float weights (signed ints; symmetric, or with a
per-block offset)."""

from __future__ import annotations

import numpy as np

from edgeroute.export.tensors import QUANT_RANGES, BlockQuantWeight

RTN_ROWS = 8192


def block_scales(w: np.ndarray, bits: int, block: int) -> np.ndarray:
    """Per-block positive scale [out, ceil(in/block)] (TensorRT rejects negative scales).

    A block whose largest-magnitude value is negative maps it onto the grid's -8 code
    (int4; -128 for int8), one whose extreme is positive onto +7, so no code is wasted."""
    lo, hi = QUANT_RANGES[bits]
    out, inp = w.shape
    n_blocks = -(-inp // block)
    padded = np.zeros((out, n_blocks * block), np.float32)
    padded[:, :inp] = w
    blocks = padded.reshape(out, n_blocks, block)
    idx = np.abs(blocks).argmax(axis=2)
    extreme = np.take_along_axis(blocks, idx[..., None], axis=2)[..., 0]
    scale = np.abs(extreme) / np.where(extreme < 0, -lo, hi)
    return np.where(scale == 0, 1.0, scale).astype(np.float32)


def asymmetric_block_params(w: np.ndarray, bits: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Per block [out, in / block]: a positive scale and an offset with ``w = scale * q + offset``
    spanning the block's min..max with the whole grid (a block that leans to one side wastes
    no code, as a symmetric one does: GGUF's Q4_1 and Q4_K store blocks this way)."""
    lo, hi = QUANT_RANGES[bits]
    out, inp = w.shape
    blocks = w.reshape(out, inp // block, block)
    smallest, largest = blocks.min(axis=2), blocks.max(axis=2)
    scale = np.where(largest > smallest, (largest - smallest) / (hi - lo), 1.0).astype(np.float32)
    return scale, (smallest - lo * scale).astype(np.float32)


def quantize_with_scales(w: np.ndarray, scale: np.ndarray, bits: int, block: int,
                         offset: np.ndarray | None = None) -> np.ndarray:
    lo, hi = QUANT_RANGES[bits]
    expanded = np.repeat(scale, block, axis=1)[:, : w.shape[1]]
    if offset is not None:
        w = w - np.repeat(offset, block, axis=1)
    return np.clip(np.rint(w / expanded), lo, hi).astype(np.int8)


def rtn_quantize(w: np.ndarray, bits: int = 4, block: int = 32, asymmetric: bool = False) -> BlockQuantWeight:
    """Row chunks bound the float temporaries (a 7B model's 152k x 3584 head is 2.2 GB in
    float32; each step here would copy it once more); rows are independent, so the result
    is the same as in one go. ``asymmetric``: with a per-block offset (the input size a
    multiple of the block)."""
    w = np.asarray(w, np.float32)
    q = np.empty(w.shape, np.int8)
    scale = np.empty((w.shape[0], -(-w.shape[1] // block)), np.float32)
    offset = np.empty_like(scale) if asymmetric else None
    for start in range(0, w.shape[0], RTN_ROWS):
        rows = slice(start, start + RTN_ROWS)
        if offset is None:
            scale[rows] = block_scales(w[rows], bits, block)
        else:
            scale[rows], offset[rows] = asymmetric_block_params(w[rows], bits, block)
        q[rows] = quantize_with_scales(w[rows], scale[rows], bits, block, None if offset is None else offset[rows])
    return BlockQuantWeight(q, scale, bits, block, offset, origin="rtn-asym" if asymmetric else "rtn")
