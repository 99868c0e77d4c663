"""Narrow integer codes held in int8 (GGUF Q5_0/Q5_1/Q5_K: 5 bits, Q6_K: 6 bits) stored with
the bits they need: a nibble plane two codes per byte plus one bit plane per extra bit.

ONNX has int4 and int8 but nothing between, so a 5-bit embedding code used to take a whole
byte on disk and in memory. Packed, it takes 5/8 of one; the embedding graph gathers the
packed rows of its tokens and unpacks them with standard integer ops (BitShift, BitwiseAnd,
BitwiseOr). Linear layers keep int8 codes: unpacking theirs would be folded at every load,
which ONNX Runtime does slowly (see ``GraphBuilder.unpacked_codes``).

Codes are packed in the weight's own [rows, cols] orientation, blocks along ``cols``. A
block whose scale was negated to make it positive holds negated codes (-15..16 for Q5_0);
such blocks are stored un-negated with a sign bit, so every block fits the narrow range.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PLANE_BITS = 8  # codes per byte of a bit plane


@dataclass(frozen=True)
class PackedCodes:
    """int8 codes [rows, cols] as ``sign * (nibbles + sum(plane_k << (4 + k)) + low)``."""

    nibbles: np.ndarray  # uint8 [rows, cols / 2]: even column in the low nibble
    planes: np.ndarray  # uint8 [rows, width - 4, cols / 8]: bit j of a byte is column 8 * byte + j
    negated: np.ndarray | None  # uint8 [rows, ceil(n_blocks / 8)] sign bits (1: negate the block), or None
    low: int  # the smallest code of the narrow range, -2 ** (width - 1)
    block: int

    @property
    def width(self) -> int:
        return 4 + self.planes.shape[1]

    @property
    def shape(self) -> tuple[int, int]:
        return self.nibbles.shape[0], self.nibbles.shape[1] * 2

    def unpack(self) -> np.ndarray:
        """The int8 codes, as the graph computes them (for tests and checks)."""
        rows, cols = self.shape
        nibbles = np.stack([self.nibbles & 0x0F, self.nibbles >> 4], axis=-1).reshape(rows, cols).astype(np.int32)
        bits = np.unpackbits(self.planes, axis=-1, bitorder="little").astype(np.int32)
        weights = (1 << np.arange(4, self.width, dtype=np.int32))[None, :, None]
        codes = nibbles + (bits * weights).sum(axis=1) + self.low
        if self.negated is not None:
            n_blocks = cols // self.block
            signs = 1 - 2 * np.unpackbits(self.negated, axis=-1, bitorder="little")[:, :n_blocks].astype(np.int32)
            codes = (codes.reshape(rows, n_blocks, self.block) * signs[..., None]).reshape(rows, cols)
        return codes.astype(np.int8)


CHUNK_ROWS = 4096  # bounds the packing temporaries for a 150k-row vocabulary table


def _fits(smallest: np.ndarray, largest: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Per block: fits as stored, fits once negated."""
    lo, hi = -(1 << (width - 1)), (1 << (width - 1)) - 1
    return (smallest >= lo) & (largest <= hi), (smallest >= -hi) & (largest <= -lo)


def _pack_rows(q: np.ndarray, flip: np.ndarray, width: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    rows, cols = q.shape
    signs = np.where(flip, -1, 1).astype(np.int16)[..., None]
    u = (q.reshape(rows, -1, block) * signs + (1 << (width - 1))).reshape(rows, cols).astype(np.uint8)
    nibbles = u[:, 0::2] & 0x0F | (u[:, 1::2] & 0x0F) << 4
    planes = np.stack([np.packbits((u >> k) & 1, axis=-1, bitorder="little") for k in range(4, width)], axis=1)
    return nibbles, planes


def pack_codes(q: np.ndarray, block: int) -> PackedCodes | None:
    """``q`` (int8 [rows, cols], blocks of ``block`` along cols) in the fewest bits (5..7) that
    hold every block, possibly negated; None when it needs all 8 or the shape does not pack."""
    rows, cols = q.shape
    if cols % PLANE_BITS or cols % block or q.size == 0:
        return None
    blocks = q.reshape(rows, cols // block, block)
    smallest, largest = blocks.min(axis=-1).astype(np.int16), blocks.max(axis=-1).astype(np.int16)
    for width in (5, 6, 7):
        as_is, negated = _fits(smallest, largest, width)
        if (as_is | negated).all():
            break
    else:
        return None
    flip = ~as_is  # negate only the blocks that need it
    parts = [_pack_rows(q[start:start + CHUNK_ROWS], flip[start:start + CHUNK_ROWS], width, block)
             for start in range(0, rows, CHUNK_ROWS)]
    packed_signs = np.packbits(flip.astype(np.uint8), axis=-1, bitorder="little") if flip.any() else None
    return PackedCodes(np.concatenate([n for n, _ in parts]), np.concatenate([p for _, p in parts]),
                       packed_signs, -(1 << (width - 1)), block)
