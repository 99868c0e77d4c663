"""Round-to-nearest block quantization of float weights (symmetric, signed ints)."""

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


def quantize_with_scales(w: np.ndarray, scale: np.ndarray, bits: int, block: int) -> np.ndarray:
    lo, hi = QUANT_RANGES[bits]
    expanded = np.repeat(scale, block, axis=1)[:, : w.shape[1]]
    return np.clip(np.rint(w / expanded), lo, hi).astype(np.int8)


def rtn_quantize(w: np.ndarray, bits: int = 4, block: int = 32) -> BlockQuantWeight:
    """Row chunks bound the float temporaries (a 7B model's 152k x 3584 head is 2.2 GB in
    float32; each step here would copy it once more); rows are independent, so the result
    is the same as in one go."""
    w = np.asarray(w, np.float32)
    q = np.empty(w.shape, np.int8)
    scale = np.empty((w.shape[0], -(-w.shape[1] // block)), np.float32)
    for start in range(0, w.shape[0], RTN_ROWS):
        rows = slice(start, start + RTN_ROWS)
        scale[rows] = block_scales(w[rows], bits, block)
        q[rows] = quantize_with_scales(w[rows], scale[rows], bits, block)
    return BlockQuantWeight(q, scale, bits, block, origin="rtn")
