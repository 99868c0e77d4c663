"""GPTQ quantization and the auto-gptq / GPTQModel checkpoint layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edgeroute.export.gptq import HessianAccumulator, gptq_quantize
from edgeroute.export.gptq_format import pack_gptq_linear, unpack_gptq_linear
from edgeroute.export.quantize import rtn_quantize
from edgeroute.export.tensors import Linear


def correlated_activations(rng: np.random.Generator, n: int = 2048, d: int = 256) -> np.ndarray:
    """Activations with strongly correlated channels and uneven channel scales, as in LLMs."""
    mix = rng.standard_normal((d, d)) * (0.8 ** np.arange(d) ** 0.5)[:, None]  # decaying spectrum
    x = rng.standard_normal((n, d)) @ mix
    return (x * rng.uniform(0.2, 3.0, d)).astype(np.float32)


def output_error(x: np.ndarray, w: np.ndarray, wq: np.ndarray) -> float:
    return float(np.linalg.norm(x @ w.T - x @ wq.T))


def test_gptq_beats_rtn_on_correlated_activations() -> None:
    rng = np.random.default_rng(0)
    x = correlated_activations(rng)
    w = rng.standard_normal((128, 256)).astype(np.float32)
    acc = HessianAccumulator()
    for chunk in np.split(x, 4):
        acc.add(torch.from_numpy(chunk))
    gptq = gptq_quantize(w, acc.hessian(), bits=4, block=32)
    rtn = rtn_quantize(w, bits=4, block=32)
    err_gptq = output_error(x, w, gptq.dequantize())
    err_rtn = output_error(x, w, rtn.dequantize())
    print(f"output error ||XW^T - XWq^T||: gptq {err_gptq:.1f}  rtn {err_rtn:.1f}  "
          f"ratio {err_gptq / err_rtn:.3f}")
    assert gptq.origin == "gptq"
    assert err_gptq < 0.8 * err_rtn


def test_gptq_codes_in_range_and_scales_positive() -> None:
    rng = np.random.default_rng(1)
    x = correlated_activations(rng, 512, 96)
    w = (rng.standard_normal((40, 96)) * 3).astype(np.float32)
    for bits, (lo, hi) in ((4, (-8, 7)), (8, (-128, 127))):
        # batch_columns not a multiple of block and in (96) not a multiple of block (40).
        qw = gptq_quantize(w, x.T @ x, bits=bits, block=40, batch_columns=50)
        assert qw.q.dtype == np.int8 and qw.q.shape == w.shape
        assert lo <= qw.q.min() and qw.q.max() <= hi
        assert qw.scale.shape == (40, 3) and (qw.scale > 0).all()
        assert qw.offset is None and qw.bits == bits and qw.block == 40


@pytest.mark.parametrize("asymmetric", [False, True])
def test_gptq_with_diagonal_hessian_equals_rtn(asymmetric: bool) -> None:
    # Uncorrelated inputs give GPTQ nothing to compensate with: it must reduce to RTN.
    rng = np.random.default_rng(2)
    w = rng.standard_normal((16, 64)).astype(np.float32)
    qw = gptq_quantize(w, np.diag(rng.uniform(0.5, 2.0, 64)).astype(np.float32), block=16, asymmetric=asymmetric)
    rtn = rtn_quantize(w, block=16, asymmetric=asymmetric)
    np.testing.assert_array_equal(qw.q, rtn.q)
    np.testing.assert_array_equal(qw.scale, rtn.scale)
    assert (qw.offset is None) == (rtn.offset is None) == (not asymmetric)
    if asymmetric:
        np.testing.assert_array_equal(qw.offset, rtn.offset)


def test_asymmetric_blocks_hold_a_one_sided_block_with_less_error() -> None:
    """Weights that lean to one side (as GGUF Q4_1 blocks can): the offset spends every code
    on the block's range, a symmetric block half of them on values that do not occur."""
    rng = np.random.default_rng(5)
    w = rng.uniform(0.2, 1.0, (32, 128)).astype(np.float32)
    asym, sym = rtn_quantize(w, block=64, asymmetric=True), rtn_quantize(w, block=64)
    assert asym.q.min() >= -8 and asym.q.max() <= 7 and (asym.scale > 0).all()
    assert asym.q.min() == -8 and asym.q.max() == 7  # the whole grid is used
    err_asym, err_sym = (float(np.abs(q.dequantize() - w).max()) for q in (asym, sym))
    assert err_asym < 0.6 * err_sym


def test_gptq_zeroes_dead_input_columns() -> None:
    rng = np.random.default_rng(3)
    x = correlated_activations(rng, 256, 64)
    x[:, [5, 40]] = 0  # channels never active during calibration
    w = rng.standard_normal((8, 64)).astype(np.float32)
    qw = gptq_quantize(w, x.T @ x, block=32)
    assert (qw.q[:, [5, 40]] == 0).all()
    assert np.isfinite(qw.dequantize()).all()


def test_hessian_accumulator_averages_over_all_rows() -> None:
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 10, 12)).astype(np.float32)
    acc = HessianAccumulator(12)
    acc.add(torch.from_numpy(x[:1]))
    acc.add(torch.from_numpy(x[1:]))
    flat = x.reshape(-1, 12).astype(np.float64)
    np.testing.assert_allclose(acc.hessian(), 2 / 30 * flat.T @ flat, rtol=1e-5, atol=1e-5)
    assert acc.hessian().dtype == np.float32


def direct_weight(codes: np.ndarray, zeros: np.ndarray, scales: np.ndarray, g_idx: np.ndarray) -> np.ndarray:
    """W[o, i] = scales[g, o] * (code[o, i] - zero[g, o]) with g = g_idx[i], in float32."""
    s = scales.astype(np.float16).astype(np.float32)[g_idx].T
    return (s * (codes.astype(np.float32) - zeros.astype(np.float32)[g_idx].T)).astype(np.float32)


def random_checkpoint(rng: np.random.Generator, out: int, inp: int, group: int, symmetric: bool,
                      fmt: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n_groups = inp // group
    codes = rng.integers(0, 16, (out, inp))
    lowest = 1 if fmt == "gptq" else 0  # v1 cannot store a zero of 0
    zeros = np.full((n_groups, out), 8) if symmetric else rng.integers(lowest, 16, (n_groups, out))
    scales = rng.uniform(0.001, 0.1, (n_groups, out)).astype(np.float16)
    return codes, zeros, scales


@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("symmetric", [True, False])
def test_gptq_checkpoint_round_trip_is_exact(fmt: str, symmetric: bool) -> None:
    rng = np.random.default_rng(5)
    out, inp, group = 24, 128, 32
    codes, zeros, scales = random_checkpoint(rng, out, inp, group, symmetric, fmt)
    g_idx = np.arange(inp) // group
    packed = pack_gptq_linear(codes, zeros, scales, g_idx, checkpoint_format=fmt)
    assert packed["qweight"].dtype == np.int32 and packed["qweight"].shape == (inp // 8, out)
    assert packed["qzeros"].dtype == np.int32 and packed["qzeros"].shape == (inp // group, out // 8)
    weight, order = unpack_gptq_linear(**packed, checkpoint_format=fmt)
    assert order is None
    assert weight.bits == 4 and weight.block == group and weight.origin == "gptq-checkpoint"
    assert (weight.offset is None) == symmetric
    np.testing.assert_array_equal(weight.q, codes - 8)
    np.testing.assert_array_equal(weight.dequantize(), direct_weight(codes, zeros, scales, g_idx))


def test_v1_zero_nibble_15_reads_as_16_like_auto_gptq() -> None:
    # auto-gptq adds 1 to the stored nibble without wrapping, so a stored 15 means zero 16.
    rng = np.random.default_rng(6)
    codes, _, scales = random_checkpoint(rng, 8, 32, 32, True, "gptq")
    zeros = np.full((1, 8), 16)
    packed = pack_gptq_linear(codes, zeros, scales, np.zeros(32, int), checkpoint_format="gptq")
    assert packed["qzeros"].view(np.uint32)[0, 0] == 0xFFFFFFFF
    weight, _ = unpack_gptq_linear(**packed, checkpoint_format="gptq")
    np.testing.assert_array_equal(weight.dequantize(), direct_weight(codes, zeros, scales, np.zeros(32, int)))


@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
def test_act_order_checkpoint_maps_to_contiguous_groups(fmt: str) -> None:
    rng = np.random.default_rng(7)
    out, inp, group = 16, 256, 64
    codes, zeros, scales = random_checkpoint(rng, out, inp, group, False, fmt)
    g_idx = rng.permutation(np.arange(inp) // group)  # desc_act: groups scattered over the inputs
    packed = pack_gptq_linear(codes, zeros, scales, g_idx, checkpoint_format=fmt)
    weight, order = unpack_gptq_linear(**packed, checkpoint_format=fmt)
    assert order is not None and sorted(order) == list(range(inp))
    # The reordered columns form contiguous groups of `group` channels.
    np.testing.assert_array_equal(g_idx[order], np.arange(inp) // group)
    expected = direct_weight(codes, zeros, scales, g_idx)
    np.testing.assert_array_equal(Linear(weight, input_order=order).dequantize(), expected)
    # The graph computes x[..., order] @ Wq^T: the same outputs as the model's own x @ W^T.
    x = rng.standard_normal((5, inp)).astype(np.float32)
    np.testing.assert_allclose(x[:, order] @ weight.dequantize().T, x @ expected.T, rtol=1e-5, atol=1e-5)


def packed_example() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(8)
    codes, zeros, scales = random_checkpoint(rng, 16, 64, 32, False, "gptq")
    return pack_gptq_linear(codes, zeros, scales, np.arange(64) // 32)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"bits": 8}, "only 4-bit"),
        ({"checkpoint_format": "awq"}, "checkpoint_format"),
        ({"qweight": np.zeros((4, 16), np.int32)}, "qweight shape"),
        ({"qzeros": np.zeros((2, 3), np.int32)}, "qzeros shape"),
        ({"g_idx": np.r_[np.zeros(40), np.ones(24)].astype(np.int32)}, "same number"),
        ({"g_idx": np.full(64, 2, np.int32)}, "g_idx values"),
    ],
)
def test_unpack_rejects_bad_checkpoints_clearly(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        unpack_gptq_linear(**{**packed_example(), **change})


def test_pack_rejects_unrepresentable_values() -> None:
    g_idx = np.arange(32) // 32
    codes, scales = np.zeros((8, 32), int), np.ones((1, 8), np.float16)
    with pytest.raises(ValueError, match=r"zeros must lie in 1\.\.16"):
        pack_gptq_linear(codes, np.zeros((1, 8), int), scales, g_idx, checkpoint_format="gptq")
    with pytest.raises(ValueError, match=r"zeros must lie in 0\.\.15"):
        pack_gptq_linear(codes, np.full((1, 8), 16), scales, g_idx, checkpoint_format="gptq_v2")
    with pytest.raises(ValueError, match="codes must lie"):
        pack_gptq_linear(codes + 16, np.zeros((1, 8), int), scales, g_idx, checkpoint_format="gptq_v2")


def test_gptq_rejects_bad_arguments_clearly() -> None:
    w = np.zeros((8, 16), np.float32)
    with pytest.raises(ValueError, match="hessian shape"):
        gptq_quantize(w, np.eye(8, dtype=np.float32))
    with pytest.raises(ValueError, match="bits"):
        gptq_quantize(w, np.eye(16, dtype=np.float32), bits=3)
    with pytest.raises(ValueError, match="no activations"):
        HessianAccumulator(16).hessian()
    with pytest.raises(ValueError, match="features"):
        HessianAccumulator(16).add(torch.zeros(2, 8))
