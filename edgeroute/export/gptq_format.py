"""Reading and writing 4-bit linears in the auto-gptq / GPTQModel checkpoint layout (numpy only).

Per linear with ``in`` inputs, ``out`` outputs and ``n_groups`` groups::

    qweight  int32 [in/8, out]        8 codes per int32 along the input, lowest nibble first
    qzeros   int32 [n_groups, out/8]  8 zeros per int32 along the output, lowest nibble first
    scales   fp16  [n_groups, out]
    g_idx    int32 [in]               group of each input channel

    W[o, i] = scales[g, o] * (code[i, o] - zero[g, o]),  g = g_idx[i]

auto-gptq ("gptq", v1) stores ``zero - 1`` and its kernels add the 1 back (so a stored 15
reads as 16); GPTQModel ("gptq_v2") stores the zero itself.
"""

from __future__ import annotations

import numpy as np

from edgeroute.export.tensors import BlockQuantWeight

FORMATS = ("gptq", "gptq_v2")
_PER_INT32 = 8  # 4-bit values per int32
_SHIFTS = np.arange(_PER_INT32, dtype=np.uint32) * 4


def _check_format(bits: int, checkpoint_format: str) -> None:
    if bits != 4:
        raise ValueError(f"only 4-bit GPTQ checkpoints are supported, got bits={bits}")
    if checkpoint_format not in FORMATS:
        raise ValueError(f"checkpoint_format must be one of {FORMATS}, got {checkpoint_format!r}")


def _unpack_rows(packed: np.ndarray) -> np.ndarray:
    """int32 [r, c] -> nibbles int16 [8r, c]: row 8k+j comes from bits 4j..4j+3 of row k."""
    u = np.asarray(packed).astype(np.int64).astype(np.uint32)  # two's complement bits, no sign
    nibbles = (u[:, None, :] >> _SHIFTS[None, :, None]) & 0xF
    return nibbles.reshape(-1, u.shape[1]).astype(np.int16)


def _pack_rows(values: np.ndarray) -> np.ndarray:
    """Inverse of ``_unpack_rows``: nibbles [8r, c] (0..15) -> int32 [r, c]."""
    v = values.astype(np.uint32).reshape(-1, _PER_INT32, values.shape[1])
    return np.bitwise_or.reduce(v << _SHIFTS[None, :, None], axis=1).view(np.int32)


def _group_size(g_idx: np.ndarray, n_groups: int) -> int:
    if g_idx.size and (g_idx.min() < 0 or g_idx.max() >= n_groups):
        raise ValueError(f"g_idx values must lie in [0, {n_groups}), got [{g_idx.min()}, {g_idx.max()}]")
    counts = np.bincount(g_idx, minlength=n_groups)
    if n_groups == 0 or (counts != counts[0]).any() or counts[0] == 0:
        sizes = sorted(set(counts.tolist()))
        raise ValueError(f"groups must all have the same number of input channels, got sizes {sizes}")
    return int(counts[0])


def unpack_gptq_linear(
    qweight: np.ndarray,
    qzeros: np.ndarray,
    scales: np.ndarray,
    g_idx: np.ndarray,
    bits: int = 4,
    checkpoint_format: str = "gptq",
) -> tuple[BlockQuantWeight, np.ndarray | None]:
    """The exact ``BlockQuantWeight`` of one GPTQ linear, and the input order it needs.

    The second value is ``None`` for checkpoints whose groups are already contiguous; for
    act-order (desc_act) ones it is the permutation of input channels that makes each group
    contiguous, to pass as ``Linear.input_order``."""
    _check_format(bits, checkpoint_format)
    scales = np.asarray(scales)
    g_idx = np.asarray(g_idx).astype(np.int64)
    if scales.ndim != 2 or g_idx.ndim != 1:
        raise ValueError(f"scales must be 2-D and g_idx 1-D, got shapes {scales.shape} and {g_idx.shape}")
    (n_groups, out), inp = scales.shape, g_idx.shape[0]
    if inp % _PER_INT32 or out % _PER_INT32:
        raise ValueError(f"in ({inp}) and out ({out}) must be multiples of {_PER_INT32} for packed int4")
    if np.shape(qweight) != (inp // _PER_INT32, out):
        expected = (inp // _PER_INT32, out)
        raise ValueError(f"qweight shape {np.shape(qweight)} != {expected} (from g_idx and scales)")
    if np.shape(qzeros) != (n_groups, out // _PER_INT32):
        raise ValueError(f"qzeros shape {np.shape(qzeros)} != {(n_groups, out // _PER_INT32)} (from scales)")
    group = _group_size(g_idx, n_groups)

    codes = _unpack_rows(qweight)  # [in, out], 0..15
    # Zeros are packed along the output: unpack the transpose, then back to [n_groups, out].
    zeros = _unpack_rows(np.asarray(qzeros).T).T
    if checkpoint_format == "gptq":
        zeros = zeros + 1  # v1 stores zero - 1; no wrap, exactly as auto-gptq's kernels read it

    order = np.argsort(g_idx, kind="stable")
    if (order == np.arange(inp)).all():
        order = None
    else:
        codes = codes[order]  # sorted by group: group g is rows g*group .. (g+1)*group - 1

    scale = scales.astype(np.float32).T  # [out, n_groups]; fp16 -> fp32 is exact
    zero = zeros.T.astype(np.float32)
    # s * (code - zero) = s * (code - 8) + s * (8 - zero); both products are exact in fp32.
    offset = None if (zero == 8).all() else scale * (8 - zero)
    q = (codes.T - 8).astype(np.int8)
    weight = BlockQuantWeight(np.ascontiguousarray(q), np.ascontiguousarray(scale), 4, group,
                              offset if offset is None else np.ascontiguousarray(offset), "gptq-checkpoint")
    return weight, order


def pack_gptq_linear(
    w_q: np.ndarray,
    zeros: np.ndarray,
    scales: np.ndarray,
    g_idx: np.ndarray,
    checkpoint_format: str = "gptq",
) -> dict[str, np.ndarray]:
    """qweight / qzeros / scales / g_idx for codes ``w_q`` [out, in] (0..15) and ``zeros``
    [n_groups, out] such that W[o, i] = scales[g, o] * (w_q[o, i] - zeros[g, o]).

    The v1 format cannot hold a zero of 0 (it stores zero - 1 in a nibble): its zeros must
    lie in 1..16, those of gptq_v2 in 0..15."""
    _check_format(4, checkpoint_format)
    w_q, zeros, scales = np.asarray(w_q), np.asarray(zeros), np.asarray(scales)
    g_idx = np.asarray(g_idx)
    out, inp = w_q.shape
    if inp % _PER_INT32 or out % _PER_INT32:
        raise ValueError(f"in ({inp}) and out ({out}) must be multiples of {_PER_INT32} for packed int4")
    if zeros.shape != scales.shape or scales.ndim != 2 or scales.shape[1] != out or g_idx.shape != (inp,):
        raise ValueError(f"zeros {zeros.shape} and scales {scales.shape} must be [n_groups, {out}], "
                         f"g_idx {g_idx.shape} must be [{inp}]")
    _group_size(g_idx.astype(np.int64), scales.shape[0])
    if w_q.min() < 0 or w_q.max() > 15:
        raise ValueError("codes must lie in 0..15")
    stored = zeros - 1 if checkpoint_format == "gptq" else zeros
    if stored.min() < 0 or stored.max() > 15:
        allowed = "1..16" if checkpoint_format == "gptq" else "0..15"
        raise ValueError(f"zeros must lie in {allowed} for checkpoint_format={checkpoint_format!r}")
    return {
        "qweight": _pack_rows(w_q.T),
        "qzeros": np.ascontiguousarray(_pack_rows(stored.T).T),
        "scales": scales.astype(np.float16),
        "g_idx": g_idx.astype(np.int32),
    }
