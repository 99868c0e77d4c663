"""GPTQ (Frantar et al. 2022, arXiv:2210.17323) for one weight matrix, on the CPU with torch.

Columns are quantized left to right; each column's rounding error, weighted by the inverse
Hessian of the layer's reconstruction loss, is pushed onto the columns not yet quantized.
The output is the same blocked format as ``rtn_quantize`` (positive scales from
``block_scales``; or, ``asymmetric``, scales and offsets from ``asymmetric_block_params``), so
the graph builder treats both alike.
"""

from __future__ import annotations

import numpy as np
import torch

from edgeroute.export.quantize import asymmetric_block_params, block_scales
from edgeroute.export.tensors import QUANT_RANGES, BlockQuantWeight


class HessianAccumulator:
    """Collects H = 2/n * X^T X over the calibration activations that feed one linear."""

    def __init__(self, in_features: int | None = None) -> None:
        self._sum: torch.Tensor | None = None
        if in_features is not None:
            self._sum = torch.zeros(in_features, in_features, dtype=torch.float32)
        self.n = 0  # activation rows (tokens) seen

    def add(self, x: torch.Tensor) -> None:
        """Add activations of shape [..., in]; every leading index counts as one row."""
        x = x.detach().reshape(-1, x.shape[-1]).to(torch.float32)
        if self._sum is None:
            self._sum = torch.zeros(x.shape[1], x.shape[1], dtype=torch.float32)
        if x.shape[1] != self._sum.shape[0]:
            raise ValueError(f"activations have {x.shape[1]} features, the accumulator {self._sum.shape[0]}")
        # A plain sum, scaled once at the end: no drift from rescaling after every batch.
        self._sum += x.T @ x
        self.n += x.shape[0]

    def hessian(self) -> np.ndarray:
        if self._sum is None or self.n == 0:
            raise ValueError("no activations were added to the Hessian accumulator")
        return (self._sum * (2.0 / self.n)).numpy().astype(np.float32)


def _upper_cholesky_of_inverse(h: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor U of (H + damp*mean(diag H)*I)^-1 (float64, so U is accurate).

    Few calibration tokens leave H nearly singular; if the dampened H still does not
    factor, the dampening is doubled a few times rather than giving up."""
    extra = damp * h.diagonal().mean()
    for _ in range(6):
        damped = h.clone()
        damped.diagonal().add_(extra)
        low, info = torch.linalg.cholesky_ex(damped)
        if info == 0:
            upper, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(low), upper=True)
            if info == 0:
                return upper
        extra = 2 * extra if extra > 0 else h.diagonal().mean() * 1e-2
    raise ValueError("the Hessian is not positive definite even after dampening; pass a larger damp")


def gptq_quantize(
    w: np.ndarray,
    hessian: np.ndarray,
    bits: int = 4,
    block: int = 32,
    damp: float = 0.01,
    batch_columns: int = 128,
    asymmetric: bool = False,
) -> BlockQuantWeight:
    """Quantize ``w`` [out, in] to ``bits``-bit blocks of ``block`` input columns with GPTQ.

    ``hessian`` [in, in] is X^T X up to a constant factor (see ``HessianAccumulator``).
    Columns go in natural order (no act-order): the blocked format needs each group to be
    ``block`` contiguous columns."""
    if bits not in QUANT_RANGES:
        raise ValueError(f"bits must be one of {sorted(QUANT_RANGES)}, got {bits}")
    if block < 1 or batch_columns < 1:
        raise ValueError(f"block and batch_columns must be positive, got {block} and {batch_columns}")
    w = np.asarray(w, np.float32)
    if w.ndim != 2:
        raise ValueError(f"weight must be 2-D [out, in], got shape {w.shape}")
    out, n = w.shape
    if np.shape(hessian) != (n, n):
        raise ValueError(f"hessian shape {np.shape(hessian)} != {(n, n)} for a weight of shape {w.shape}")
    lo, hi = QUANT_RANGES[bits]

    weight = torch.tensor(w)  # a copy: updated in place below
    h = torch.tensor(np.asarray(hessian), dtype=torch.float64)
    # Dead inputs (never active in calibration) carry no information: as in the reference,
    # give them a unit Hessian entry so H stays invertible and zero their weights.
    dead = h.diagonal() == 0
    h[dead, dead] = 1.0
    weight[:, dead] = 0.0
    hinv = _upper_cholesky_of_inverse(h, damp).to(torch.float32)

    q = torch.zeros((out, n), dtype=torch.int8)
    scale = np.empty((out, -(-n // block)), np.float32)
    offset = np.zeros_like(scale)
    if asymmetric and n % block:
        raise ValueError(f"asymmetric blocks need the input size ({n}) to be a multiple of the block ({block})")
    # Batches of whole groups, so a group's scale is always computed from its weights with
    # every earlier error already applied (the reference can miss in-batch updates there).
    step = max(block, batch_columns // block * block)
    for b0 in range(0, n, step):
        b1 = min(b0 + step, n)
        w1 = weight[:, b0:b1].clone()
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[b0:b1, b0:b1]
        col_scale = col_offset = torch.empty(0)
        for i in range(b1 - b0):
            col = b0 + i
            if col % block == 0:  # first column of a group: fix its scale now
                g = col // block
                group = w1[:, i : i + block].numpy()
                if asymmetric:
                    scale[:, g], offset[:, g] = (v[:, 0] for v in asymmetric_block_params(group, bits, block))
                else:
                    scale[:, g] = block_scales(group, bits, block)[:, 0]
                col_scale, col_offset = torch.from_numpy(scale[:, g].copy()), torch.from_numpy(offset[:, g].copy())
            c = w1[:, i]
            qc = torch.clamp(torch.round((c - col_offset) / col_scale), lo, hi)
            q[:, col] = qc.to(torch.int8)
            err = (c - (qc * col_scale + col_offset)) / hinv1[i, i]
            # Optimal update of the remaining columns of this batch (rank-1, eq. 3 of the paper).
            w1[:, i:] -= torch.outer(err, hinv1[i, i:])
            err1[:, i] = err
        # Lazy batch update: the later columns get this batch's errors in one matmul.
        weight[:, b1:] -= err1 @ hinv[b0:b1, b1:]
    return BlockQuantWeight(q.numpy(), scale, bits, block, offset if asymmetric else None,
                            origin="gptq-asym" if asymmetric else "gptq")
