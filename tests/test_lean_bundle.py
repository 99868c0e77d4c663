"""Lean storage that stays exact: int4 embedding tables two codes per byte, fp16 block
scales where every scale is an fp16 value, K-quant tables as integer codes times a step."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from edgeroute.arch import ArchConfig
from edgeroute.export.graphs import GraphBuilder, build_embed
from edgeroute.export.tensors import BlockQuantWeight, Linear, fuse_linears
from edgeroute.runtime.backends.onnxruntime import session_options

ARCH = ArchConfig(family="qwen2", hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                  intermediate_size=128, vocab_size=300, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=64)


@pytest.mark.parametrize("with_offset", [True, False])
def test_packed_int4_embedding_gathers_exactly_the_dequantized_rows(with_offset):
    rng = np.random.default_rng(0)
    shape = (ARCH.vocab_size, ARCH.hidden_size)
    table = BlockQuantWeight(rng.integers(-8, 8, shape).astype(np.int8),
                             rng.uniform(1e-3, 1e-1, (shape[0], 2)).astype(np.float32), 4, 32,
                             rng.normal(0, 0.05, (shape[0], 2)).astype(np.float32) if with_offset else None, "gguf:Q4_K")
    model = build_embed(ARCH, table)
    packed = [t for t in model.graph.initializer if t.name.endswith("qweight_packed")]
    assert packed and packed[0].dims == [ARCH.vocab_size, ARCH.hidden_size // 2]  # half a byte per code
    session = ort.InferenceSession(model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])
    ids = np.array([0, 299, 17, 17, 150], np.int64)
    got = session.run(None, {"input_ids": ids})[0]
    np.testing.assert_array_equal(got, table.dequantize()[ids])


def _linear_graph(weight: BlockQuantWeight) -> onnx.ModelProto:
    g = GraphBuilder("linear")
    x = g.input("x", onnx.TensorProto.FLOAT, ["tokens", weight.shape[1]])
    g.output(g.linear(x, Linear(weight), "/proj"), "y", onnx.TensorProto.FLOAT, ["tokens", weight.shape[0]])
    return g.build()


def test_scales_that_are_fp16_values_are_stored_as_fp16_and_still_fuse(tmp_path):
    rng = np.random.default_rng(1)
    codes = rng.integers(-128, 128, (96, 64)).astype(np.int8)
    fp16_scales = rng.uniform(1e-3, 1e-1, (96, 2)).astype(np.float16).astype(np.float32)  # GGUF Q8_0: d is fp16
    lean = _linear_graph(BlockQuantWeight(codes, fp16_scales, 8, 32, origin="gguf:Q8_0"))
    other = _linear_graph(BlockQuantWeight(codes, fp16_scales * np.float32(1.0001), 8, 32))
    assert {t.name for t in lean.graph.initializer} >= {"/proj.scales.fp16"}
    assert "/proj.scales" in {t.name for t in other.graph.initializer}  # not fp16 values: kept fp32

    options = session_options()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    session = ort.InferenceSession(lean.SerializeToString(), options, providers=["CPUExecutionProvider"])
    assert [n.op_type for n in onnx.load(str(tmp_path / "optimized.onnx")).graph.node] == ["MatMulNBits"]
    x = rng.normal(size=(3, 64)).astype(np.float32)
    reference = x @ BlockQuantWeight(codes, fp16_scales, 8, 32).dequantize().T
    np.testing.assert_allclose(session.run(None, {"x": x})[0], reference, rtol=1e-2, atol=1e-2 * np.abs(reference).max())


def test_negative_scales_of_int8_blocks_are_absorbed_by_negated_codes_without_an_offset():
    rng = np.random.default_rng(3)
    codes = rng.integers(-32, 32, (8, 64)).astype(np.int8)  # Q6_K codes in int8 storage
    scale = rng.uniform(-0.1, 0.1, (8, 4)).astype(np.float32)
    weight = BlockQuantWeight(codes, scale, 8, 16, origin="gguf:Q6_K")
    positive = weight.with_positive_scales()
    assert (positive.scale >= 0).all() and positive.offset is None
    np.testing.assert_array_equal(positive.dequantize(), weight.dequantize())


def test_a_block_holding_the_minimum_code_keeps_the_offset_form():
    codes = np.full((1, 32), -8, np.int8)  # int4: -(-8) is out of range
    weight = BlockQuantWeight(codes, np.array([[-0.5]], np.float32), 4, 32).with_positive_scales()
    assert weight.offset is not None and (weight.q == 7).all()
    np.testing.assert_array_equal(weight.dequantize(), np.full((1, 32), 4.0, np.float32))


def _k_quant(name: str, shape: tuple[int, int], seed: int) -> BlockQuantWeight:
    """Random K-quant blocks with positive super-block d / dmin, as quantizers write them."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from edgeroute.export.gguf_blocks import decode_gguf_tensor
    from tests.test_gguf_blocks import FP16_FIELDS, random_raw

    qtype = GGMLQuantizationType[name]
    blocks = random_raw(name, shape, np.random.default_rng(seed)).reshape(shape[0], -1, GGML_QUANT_SIZES[qtype][1])
    for at in FP16_FIELDS[name]:
        blocks[..., at + 1] &= 0x7F  # the fp16 sign bit
    return decode_gguf_tensor(blocks.reshape(shape[0], -1), qtype, shape)


def _optimized(model: onnx.ModelProto, tmp_path) -> tuple[ort.InferenceSession, list[str]]:
    options = session_options()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session, [n.op_type for n in onnx.load(str(tmp_path / "optimized.onnx")).graph.node]


def _table_bytes(model: onnx.ModelProto) -> int:
    return sum(len(t.raw_data) for t in model.graph.initializer if "qweight" not in t.name)


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_tables_are_stored_factored_and_give_the_same_bits(name, tmp_path):
    weight = _k_quant(name, (96, 512), seed=4)
    assert weight.scale_factors is not None
    assert (weight.offset_factors is not None) == (name != "Q6_K")
    plain = dataclasses.replace(weight, scale_factors=None, offset_factors=None)
    factored_graph, plain_graph = _linear_graph(weight), _linear_graph(plain)
    assert _table_bytes(factored_graph) * 3 < _table_bytes(plain_graph)
    x = np.random.default_rng(5).normal(size=(3, 512)).astype(np.float32)
    (factored, ops), (reference, plain_ops) = _optimized(factored_graph, tmp_path), _optimized(plain_graph, tmp_path)
    assert ops == plain_ops and ops[0] == "MatMulNBits"  # multiplied out at load, still the fused kernel
    np.testing.assert_array_equal(factored.run(None, {"x": x})[0], reference.run(None, {"x": x})[0])


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K"])
def test_factored_embedding_rows_equal_the_dequantized_table(name):
    shape = (ARCH.vocab_size, 256)
    arch = dataclasses.replace(ARCH, hidden_size=256)
    table = _k_quant(name, shape, seed=6)
    model = build_embed(arch, table)
    assert any(t.name.endswith("scales.codes") for t in model.graph.initializer)
    session = ort.InferenceSession(model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])
    ids = np.array([0, 299, 17, 17, 150], np.int64)
    np.testing.assert_array_equal(session.run(None, {"input_ids": ids})[0], table.dequantize()[ids])


def test_factors_follow_exact_transforms_and_are_dropped_by_inexact_ones():
    weight = _k_quant("Q4_K", (64, 512), seed=7)
    rows = np.array([5, 0, 63])
    assert weight.take_rows(rows).scale_factors is not None
    assert weight.times(0.25).scale_factors is not None and weight.times(0.25).offset_factors is not None
    assert weight.times(2 ** -3.5).scale_factors is None  # 1/sqrt(128): the factored form would round twice
    np.testing.assert_array_equal(weight.times(2 ** -3.5).scale, weight.scale * np.float32(2 ** -3.5))
    fused = fuse_linears([Linear(weight), Linear(_k_quant("Q4_K", (32, 512), seed=8))])
    assert fused.weight.scale_factors is not None
    mixed = fuse_linears([Linear(weight), Linear(dataclasses.replace(weight, offset_factors=None))])
    assert mixed.weight.scale_factors is not None and mixed.weight.offset_factors is None
    with pytest.raises(ValueError, match="reproduce"):
        dataclasses.replace(weight, scale=weight.scale * np.float32(1.5))


def _narrow_codes(width: int, shape: tuple[int, int], block: int, seed: int) -> np.ndarray:
    """Codes of a ``width``-bit format after with_positive_scales: some blocks negated (-15..16 for 5 bits)."""
    rng = np.random.default_rng(seed)
    lo = -(1 << (width - 1))
    q = rng.integers(lo, -lo, shape).astype(np.int8)
    blocks = q.reshape(shape[0], -1, block)
    blocks[rng.random(blocks.shape[:2]) < 0.5] *= -1
    return q


@pytest.mark.parametrize(("width", "block"), [(5, 32), (6, 16), (7, 32)])
def test_narrow_codes_pack_into_their_bits_and_unpack_exactly(width, block):
    from edgeroute.export.packing import pack_codes

    q = _narrow_codes(width, (40, 256), block, seed=width)
    packed = pack_codes(q, block)
    assert packed.width == width and packed.negated is not None
    stored = packed.nibbles.nbytes + packed.planes.nbytes + packed.negated.nbytes
    assert stored <= q.nbytes * (width + 0.5) / 8
    np.testing.assert_array_equal(packed.unpack(), q)


def test_full_range_int8_codes_stay_bytes():
    from edgeroute.export.packing import pack_codes

    assert pack_codes(np.array([[-128, 127] * 16], np.int8), 32) is None
    assert pack_codes(np.zeros((2, 36), np.int8), 4) is None  # columns not a multiple of 8


@pytest.mark.parametrize(("width", "block"), [(5, 32), (6, 16)])
def test_packed_embedding_rows_equal_the_dequantized_table(width, block):
    q = _narrow_codes(width, (ARCH.vocab_size, ARCH.hidden_size), block, seed=11)
    scale = np.random.default_rng(12).uniform(1e-3, 1e-1, (ARCH.vocab_size, ARCH.hidden_size // block))
    table = BlockQuantWeight(q, scale.astype(np.float32), 8, block)
    model = build_embed(ARCH, table)
    assert any(t.name.endswith("qweight.plane4") for t in model.graph.initializer)
    session = ort.InferenceSession(model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])
    ids = np.array([0, 299, 17, 17, 150], np.int64)
    np.testing.assert_array_equal(session.run(None, {"input_ids": ids})[0], table.dequantize()[ids])
