"""Lean storage that stays exact: int4 embedding tables two codes per byte, fp16 block
scales where every scale is an fp16 value."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from edgeroute.arch import ArchConfig
from edgeroute.export.graphs import GraphBuilder, build_embed
from edgeroute.export.tensors import BlockQuantWeight, Linear
from edgeroute.runtime.model import session_options

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
