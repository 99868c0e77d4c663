"""decode_gguf_tensor must reproduce gguf-py's dequantization while keeping the stored codes."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize

from edgeroute.export.gguf_blocks import (
    SUPPORTED_GGUF_TYPES,
    UnsupportedTensorFormat,
    decode_gguf_tensor,
)
from edgeroute.export.tensors import QUANT_RANGES, BlockQuantWeight

T = GGMLQuantizationType
# (bits, block) each format must come out as
EXPECTED_LAYOUT = {
    "Q4_0": (4, 32), "Q4_1": (4, 32), "Q5_0": (8, 32), "Q5_1": (8, 32), "Q8_0": (8, 32),
    "Q4_K": (4, 32), "Q5_K": (8, 32), "Q6_K": (8, 16),
}
# byte offsets of the fp16 d / dmin fields in each block: random bytes there could be inf/NaN
FP16_FIELDS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
}
GGUF_PY_QUANTIZES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
SHAPES = [(64, 512), (3, 256)]


def random_raw(name: str, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """Random blocks of a format, with finite d/dmin of both signs (exercises the scale flip)."""
    block, type_size = GGML_QUANT_SIZES[T[name]]
    rows, cols = shape
    raw = rng.integers(0, 256, (rows, cols // block, type_size), dtype=np.uint8)
    for at in FP16_FIELDS[name]:
        field = rng.uniform(-0.05, 0.05, (rows, cols // block)).astype(np.float16)
        raw[..., at:at + 2] = field.view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, -1)


def assert_matches_reference(decoded: np.ndarray, raw: np.ndarray, qtype: GGMLQuantizationType) -> None:
    ref = dequantize(raw, qtype).reshape(decoded.shape)
    assert decoded.dtype == np.float32
    assert np.isfinite(ref).all()
    tol = 1e-6 * np.abs(ref).max() + 1e-7
    assert np.abs(decoded - ref).max() <= tol


def check_block_weight(w: BlockQuantWeight, name: str, shape: tuple[int, int]) -> None:
    bits, block = EXPECTED_LAYOUT[name]
    lo, hi = QUANT_RANGES[bits]
    assert (w.bits, w.block, w.shape) == (bits, block, shape)
    assert w.q.dtype == np.int8 and lo <= w.q.min() and w.q.max() <= hi
    assert w.scale.dtype == np.float32 and (w.scale >= 0).all()
    assert w.offset is None or w.offset.dtype == np.float32
    assert w.origin == f"gguf:{name}"


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", GGUF_PY_QUANTIZES)
def test_quantized_by_gguf_py_carry_over_is_exact(name: str, shape: tuple[int, int]) -> None:
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    raw = quantize(x, T[name])
    w = decode_gguf_tensor(raw, T[name], shape)
    check_block_weight(w, name, shape)
    assert_matches_reference(w.dequantize(), raw, T[name])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", list(EXPECTED_LAYOUT))
def test_random_blocks_carry_over_is_exact(name: str, shape: tuple[int, int]) -> None:
    raw = random_raw(name, shape, np.random.default_rng(1))
    w = decode_gguf_tensor(raw, T[name], shape)
    check_block_weight(w, name, shape)
    assert_matches_reference(w.dequantize(), raw, T[name])


def test_q4_1_carry_over_is_exact() -> None:
    # Q4_1 keeps every nibble: the codes are the stored ones shifted by -8
    x = np.random.default_rng(2).standard_normal((8, 64)).astype(np.float32)
    raw = quantize(x, T.Q4_1)
    w = decode_gguf_tensor(raw, T.Q4_1, x.shape)
    first = raw.reshape(8, 2, 20)[:, 0, 4:]
    np.testing.assert_array_equal(w.q[:, :16] + 8, first & 0x0F)
    np.testing.assert_array_equal(w.q[:, 16:32] + 8, first >> 4)
    assert w.offset is not None
    assert_matches_reference(w.dequantize(), raw, T.Q4_1)


def test_q8_0_codes_are_the_stored_bytes() -> None:
    x = np.random.default_rng(3).standard_normal((4, 64)).astype(np.float32)
    raw = quantize(x, T.Q8_0)
    w = decode_gguf_tensor(raw, T.Q8_0, x.shape)
    stored = np.ascontiguousarray(raw.reshape(4, 2, 34)[..., 2:]).view(np.int8).reshape(4, 64)
    np.testing.assert_array_equal(w.q, stored)  # gguf-py writes d = max|x| / 127 > 0: no flip
    assert w.offset is None


def test_q4_0_negative_scales_become_positive_with_an_offset() -> None:
    # gguf-py stores d = max / -8, so a block whose extreme is positive has d < 0
    x = np.abs(np.random.default_rng(4).standard_normal((2, 64))).astype(np.float32)
    raw = quantize(x, T.Q4_0)
    assert (raw.reshape(2, 2, 18)[..., :2].copy().view(np.float16) < 0).all()
    w = decode_gguf_tensor(raw, T.Q4_0, x.shape)
    assert (w.scale > 0).all() and w.offset is not None
    assert_matches_reference(w.dequantize(), raw, T.Q4_0)


@pytest.mark.parametrize("name", ["F32", "F16", "BF16"])
def test_float_tensors_decode_to_float32(name: str) -> None:
    x = np.random.default_rng(5).standard_normal((3, 40)).astype(np.float32)
    raw = quantize(x, T[name])
    w = decode_gguf_tensor(raw, T[name], x.shape)
    assert isinstance(w, np.ndarray) and w.shape == x.shape
    assert_matches_reference(w, raw, T[name])


@pytest.mark.parametrize("name", ["Q2_K", "Q3_K", "IQ4_NL", "IQ2_XXS", "TQ1_0"])
def test_unsupported_type_raises_with_supported_list(name: str) -> None:
    block, type_size = GGML_QUANT_SIZES[T[name]]
    raw = np.zeros((2, 256 // block * type_size), np.uint8)
    with pytest.raises(UnsupportedTensorFormat) as err:
        decode_gguf_tensor(raw, T[name], (2, 256))
    assert isinstance(err.value, ValueError)
    assert name in str(err.value)
    assert all(t in str(err.value) for t in SUPPORTED_GGUF_TYPES)


def test_wrong_byte_count_is_rejected() -> None:
    raw = quantize(np.ones((2, 64), np.float32), T.Q8_0)
    with pytest.raises(ValueError, match="bytes"):
        decode_gguf_tensor(raw, T.Q8_0, (3, 64))
    with pytest.raises(ValueError, match="multiple"):
        decode_gguf_tensor(raw, T.Q8_0, (4, 48))


def test_smollm2_gguf_tensors_match_gguf_py() -> None:
    from edgeroute.export.sources import packaged_gguf

    path = packaged_gguf()  # the project installs it: a missing model is a failure, not a skip
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    for name, qtype in [("blk.0.ffn_down.weight", T.Q4_1), ("token_embd.weight", T.Q8_0)]:
        t = tensors[name]
        assert t.tensor_type == qtype
        shape = tuple(int(n) for n in reversed(t.shape))
        w = decode_gguf_tensor(t.data, t.tensor_type, shape)
        check_block_weight(w, qtype.name, shape)
        assert_matches_reference(w.dequantize(), t.data, qtype)


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q4_1"])
def test_decoding_in_row_chunks_equals_decoding_at_once(name: str, monkeypatch) -> None:
    from edgeroute.export import gguf_blocks

    raw = random_raw(name, (64, 512), np.random.default_rng(2))
    whole = decode_gguf_tensor(raw, T[name], (64, 512))
    monkeypatch.setattr(gguf_blocks, "DECODE_ROWS", 5)  # 13 chunks, the last one short
    chunked = decode_gguf_tensor(raw, T[name], (64, 512))
    for field in ("q", "scale", "offset"):
        np.testing.assert_array_equal(getattr(chunked, field), getattr(whole, field))
