"""The TensorRT lint: each rule flags a small hand-built graph that breaks it, a legal graph
passes, the tensorrt target passes, and the default target's known differences are found."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgeroute.bundle import Bundle
from edgeroute.tensorrt.lint import RULES, grouped, lint_bundle, lint_model
from tests.conftest import export_tiny


def _int4(name: str, shape: list[int]) -> TensorProto:
    codes = np.zeros(int(np.prod(shape)) + (int(np.prod(shape)) % 2), np.uint8)
    proto = TensorProto(name=name, data_type=TensorProto.INT4, dims=shape)
    proto.raw_data = (codes[0::2] | (codes[1::2] << 4)).tobytes()
    return proto


def _model(nodes, inputs=(), initializers=(), dtype=TensorProto.FLOAT16):
    outputs = [helper.make_tensor_value_info(nodes[-1].output[0], dtype, None)]
    graph = helper.make_graph(nodes, "g", list(inputs), outputs, list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    return model


def _x(dtype=TensorProto.FLOAT16, shape=("T", 128)):
    return helper.make_tensor_value_info("x", dtype, list(shape))


def _scales(shape, dtype=np.float16):
    return numpy_helper.from_array(np.full(shape, 0.01, dtype), "s")


def _weight_matmul(codes: TensorProto, scales: TensorProto, dtype=TensorProto.FLOAT16, **dq):
    nodes = [helper.make_node("DequantizeLinear", [codes.name, "s"], ["w"], name="dq", **dq),
             helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")]
    return _model(nodes, [_x(dtype)], [codes, scales], dtype)


def rules_of(model) -> set[str]:
    return {f.rule for f in lint_model(model, "g")}


def test_int4_weight_only_matmul_in_fp16_breaks_no_rule():
    assert rules_of(_weight_matmul(_int4("q", [128, 64]), _scales([2, 64]), axis=0, block_size=64)) == set()


BROKEN = {
    "domain": lambda: _model([helper.make_node("GroupQueryAttention", ["x"], ["y"], name="n", domain="com.microsoft")],
                             [_x()]),
    "operator": lambda: _model([helper.make_node("BitShift", ["x", "x"], ["y"], name="n", direction="RIGHT")],
                               [_x(TensorProto.UINT8)], dtype=TensorProto.UINT8),
    "dtype": lambda: _model([helper.make_node("Gather", ["t", "i"], ["y"], name="n", axis=0)],
                            [helper.make_tensor_value_info("i", TensorProto.INT64, ["T"])],
                            [numpy_helper.from_array(np.zeros((8, 4), np.int8), "t")], TensorProto.INT8),
    "initializer-input": lambda: _model([helper.make_node("ReduceMean", ["x", "axes"], ["y"], name="n")],
                                        [_x(), helper.make_tensor_value_info("axes", TensorProto.INT64, [1])]),
    "quantized-input": lambda: _model([helper.make_node("DequantizeLinear", ["x", "s"], ["y"], name="n", axis=1)],
                                      [_x(TensorProto.INT8, (4, 128))], [_scales([128])]),
    "zero-point": lambda: _model([helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"], name="n", axis=1)],
                                 [], [numpy_helper.from_array(np.zeros((4, 8), np.int8), "q"), _scales([8]),
                                      numpy_helper.from_array(np.full(8, 3, np.int8), "z")]),
    "int4-odd-last-dim": lambda: _model([helper.make_node("DequantizeLinear", ["q", "s"], ["y"], name="n")],
                                        [], [_int4("q", [4, 3]), numpy_helper.from_array(np.float16(0.1), "s")]),
    "blocked-quantization": lambda: _weight_matmul(_int4("q", [128, 64]), _scales([4, 64]), axis=0, block_size=32),
    "fp32-activations": lambda: _weight_matmul(_int4("q", [128, 64]), _scales([2, 64], np.float32),
                                               TensorProto.FLOAT, axis=0, block_size=64),
}


def test_every_rule_has_a_graph_that_breaks_it():
    assert set(BROKEN) == set(RULES)


@pytest.mark.parametrize("rule", list(BROKEN))
def test_a_graph_breaking_a_rule_is_flagged_with_its_node(rule):
    findings = lint_model(BROKEN[rule](), "g")
    assert rule in {f.rule for f in findings}
    assert all(f.node and f.graph == "g" and f.detail for f in findings)


@pytest.mark.parametrize("dq, problem", [
    (dict(axis=0, block_size=64), "not INT4"),  # int8 blocked
    (dict(axis=0, block_size=256), "block size 256"),
])
def test_blocked_quantization_names_what_is_wrong(dq, problem):
    codes = _int4("q", [256, 64]) if "256" in problem else numpy_helper.from_array(np.zeros((128, 64), np.int8), "q")
    model = _weight_matmul(codes, _scales([1 if "256" in problem else 2, 64]), **dq)
    details = [f.detail for f in lint_model(model, "g") if f.rule == "blocked-quantization"]
    assert details and problem in details[0]


def test_a_blocked_axis_that_is_no_multiple_of_the_block_is_flagged():
    """SmolLM2's hidden size 576 at block 128: 4.5 blocks."""
    model = _weight_matmul(_int4("q", [576, 64]), _scales([5, 64]), axis=0, block_size=128)
    details = [f.detail for f in lint_model(model, "g") if f.rule == "blocked-quantization"]
    assert details and "axis length 576 is not a multiple of the block size 128" in details[0]


def test_blocking_outside_the_last_two_axes_is_flagged():
    model = _model([helper.make_node("DequantizeLinear", ["q", "s"], ["y"], name="n", axis=0, block_size=64)],
                   [], [_int4("q", [128, 4, 8]), _scales([2, 4, 8])])
    details = [f.detail for f in lint_model(model, "g") if f.rule == "blocked-quantization"]
    assert details and "axis 0 of a rank-3 tensor" in details[0]


@pytest.fixture(scope="module")
def tiny_int4_targets(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("lint")
    src = tiny_models["llama"][0]
    return {target: export_tiny(src, root / target, quant="int4-rtn", target=target).out
            for target in ("onnxruntime", "tensorrt")}


def test_the_tensorrt_target_passes_the_lint(tiny_int4_targets):
    assert lint_bundle(Bundle.open(tiny_int4_targets["tensorrt"])) == []


def test_the_default_target_differences_are_listed(tiny_int4_targets):
    """The ort flavour's contrib op, the embedding's gathered int8 codes, 32-wide blocks,
    float32 MatMuls: what the tensorrt target changes."""
    groups = {(g.rule, g.op) for g in grouped(lint_bundle(Bundle.open(tiny_int4_targets["onnxruntime"])))}
    assert {("domain", "GroupQueryAttention"), ("dtype", "Gather"), ("quantized-input", "DequantizeLinear"),
            ("blocked-quantization", "DequantizeLinear"), ("fp32-activations", "MatMul")} <= groups
