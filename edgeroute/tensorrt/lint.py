"""Which nodes of a bundle's graphs TensorRT 10 cannot take, named, with the rule and its source.

``edgeroute inspect BUNDLE --tensorrt`` prints what :func:`lint_bundle` finds. Three kinds of rule:

- ``parser``: what onnx-tensorrt's operator support matrix documents, at the TensorRT 10.1 GA
  release (github.com/onnx/onnx-tensorrt, docs/operators.md, commit 96e7811): operators it
  marks unsupported, tensor types outside an operator's "Supported Types" (checked on the data
  input, and on a Cast's target type), inputs its "Restrictions" require to be initializers,
  and its note that INT8/INT4/FP8 are "Quantized Types" reached only by dequantizing; plus the
  DequantizeLinear importer's own checks in that release (onnxOpImporters.cpp,
  QuantDequantLinearHelper): all-zero zero points, one blocking axis, an even last dimension
  for INT4. An operator outside the ONNX domain (com.microsoft contrib ops) has no importer.
- ``builder``: TensorRT 10's blocked quantization, as issue 30 states it (the developer guide,
  "Working with Quantized Types"; no copy in reach to re-check): blocked DequantizeLinear is
  INT4 weight-only (an initializer), block size 64 or 128, blocked along one of the last two
  axes; and the importer's "Inferred block size is not an integer" (the blocked axis a
  multiple of the block).
- ``target``: what the tensorrt bundle target adds: MatMul and Gemm compute in float16.

The 10.1 matrix documents opsets 9 to 20; blocked DequantizeLinear needs opset 21, which the
tensorrt target writes, as issue 30 asks (not checked against a parser here: no GPU).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper
from onnx.external_data_helper import load_external_data_for_tensor

from edgeroute.bundle import Bundle

# docs/operators.md of the 10.1 release, as data: the operators marked N, and the supported
# types of the others (grouped by type list)
UNSUPPORTED_OPS = frozenset({
    "AffineGrid", "Bernoulli", "BitShift", "BitwiseAnd", "BitwiseNot", "BitwiseOr", "BitwiseXor",
    "BlackmanWindow", "Col2Im", "CenterCropPad", "Compress", "ConcatFromSequence", "ConvInteger", "DFT",
    "Det", "DynamicQuantizeLinear", "HammingWindow", "HannWindow", "ImageDecoder", "MatMulInteger",
    "MaxRoiPool", "MaxUnpool", "MelWeightMatrix", "Multinomial", "NegativeLogLikelihoodLoss", "Optional",
    "OptionalGetElement", "OptionalHasElement", "QLinearConv", "QLinearMatMul", "RegexFullMatch", "STFT",
    "SequenceAt", "SequenceConstruct", "SequenceEmpty", "SequenceErase", "SequenceInsert", "SequenceLength",
    "SequenceMap", "SoftmaxCrossEntropyLoss", "SplitToSequence", "StringConcat", "StringNormalizer",
    "StringSplit", "TfIdfVectorizer", "Unique",
})
OPERATOR_TYPES: dict[str, frozenset[str]] = {op: frozenset(types.split()) for types, ops in (
    ("FP32 FP16 BF16 INT32 INT64", (
        "Abs", "Add", "ArgMax", "ArgMin", "DepthToSpace", "Div", "Equal", "Greater", "GreaterOrEqual",
        "IsNaN", "Less", "LessOrEqual", "Max", "Min", "Mod", "Mul", "Neg", "Pad", "Range", "ReduceL1",
        "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax", "ReduceMean", "ReduceMin", "ReduceProd",
        "ReduceSum", "ReduceSumSquare", "Relu", "Scatter", "ScatterElements", "ScatterND", "Shrink", "Sign",
        "SpaceToDepth", "Sub", "Sum", "TopK",
    )),
    ("FP32 FP16 BF16", (
        "Acos", "Acosh", "Asin", "Asinh", "Atan", "Atanh", "AveragePool", "BatchNormalization", "Ceil",
        "Celu", "Clip", "Conv", "ConvTranspose", "Cos", "Cosh", "CumSum", "Dropout", "Einsum", "Elu", "Erf",
        "Exp", "Floor", "Gemm", "GlobalAveragePool", "GlobalLpPool", "GlobalMaxPool", "GroupNormalization",
        "GRU", "HardSigmoid", "HardSwish", "Hardmax", "ImageScaler", "InstanceNormalization", "IsInf",
        "LayerNormalization", "LeakyRelu", "Log", "LogSoftmax", "LRN", "LSTM", "LpNormalization", "LpPool",
        "MatMul", "MaxPool", "MeanVarianceNormalization", "ParametricSoftplus", "Pow", "PRelu",
        "QuantizeLinear", "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike",
        "Reciprocal", "Resize", "RNN", "Round", "ScaledTanh", "Scan", "Selu", "Sigmoid", "Sin", "Sinh",
        "Softmax", "Softplus", "Softsign", "Sqrt", "Tan", "Tanh", "ThresholdedRelu", "Upsample",
    )),
    ("BOOL", (
        "And", "Not", "Or", "Xor",
    )),
    ("FP32 FP16 BF16 INT32 INT64 UINT8 BOOL", (
        "Cast", "CastLike",
    )),
    ("FP32 FP16 BF16 INT32 INT64 BOOL", (
        "Concat", "Constant", "Expand", "EyeLike", "Flatten", "Gather", "GatherElements", "GatherND",
        "Identity", "If", "Loop", "OneHot", "Reshape", "ReverseSequence", "Shape", "Size", "Slice", "Split",
        "Squeeze", "Tile", "Transpose", "Trilu", "Unsqueeze", "Where",
    )),
    ("FP32 FP16 BF16 INT32 INF64 BOOL", (
        "ConstantOfShape",
    )),
    ("FP32 FP16", (
        "DeformConv", "GridSample", "Mish", "NonMaxSuppression", "NonZero", "RoiAlign",
    )),
    ("INT8 FP8 INT4", (
        "DequantizeLinear",
    )),
    ("FP32 FP16 BF16 INT8 INT32 INT64", (
        "Gelu",
    )),
    ("FP32 FP16 BF16 FP8 INT32 INT64", (
        "Mean",
    )),
) for op in ops}
# operator -> inputs that "must be an initializer" (Restrictions column); Unsqueeze: "a constant tensor"
INITIALIZER_INPUTS = {**{op: (1,) for op in ("ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax",
                                             "ReduceMean", "ReduceMin", "ReduceProd", "ReduceSum", "ReduceSumSquare",
                                             "Squeeze", "Unsqueeze", "CumSum")},
                      "Slice": (3,), "Pad": (3,)}
QUANTIZED_TYPES = {"INT8", "INT4", "FP8"}
BLOCK_SIZES = (64, 128)
TYPE_NAMES = {TensorProto.FLOAT: "FP32", TensorProto.FLOAT16: "FP16", TensorProto.BFLOAT16: "BF16",
              TensorProto.FLOAT8E4M3FN: "FP8"}
RULES = {  # rule -> (kind, what it flags)
    "domain": ("parser", "an operator outside the ONNX domain (no importer)"),
    "operator": ("parser", "an operator the support matrix marks unsupported or does not list"),
    "dtype": ("parser", "a tensor type outside the operator's supported types"),
    "initializer-input": ("parser", "an input the matrix requires to be an initializer"),
    "quantized-input": ("parser", "a quantized (INT8/INT4/FP8) tensor not dequantized from an initializer"),
    "zero-point": ("parser", "a DequantizeLinear zero point that is not all zeros"),
    "int4-odd-last-dim": ("parser", "an INT4 tensor with an odd last dimension"),
    "blocked-quantization": ("builder", "blocked DequantizeLinear other than INT4 weights, block 64/128, last two axes"),
    "fp32-activations": ("target", "a MatMul or Gemm computing in float32 (the tensorrt target computes in float16)"),
}


@dataclass(frozen=True)
class Finding:
    graph: str
    node: str
    op: str
    rule: str
    detail: str

    @property
    def kind(self) -> str:
        return RULES[self.rule][0]


def _type_name(elem_type: int) -> str:
    return TYPE_NAMES.get(elem_type, TensorProto.DataType.Name(elem_type))


class _Graph:
    """A graph's value types and initializers (shape inference over the graph file; external
    weights are read only for the few tensors a rule needs the values of)."""

    def __init__(self, model: onnx.ModelProto, base_dir: Path | None) -> None:
        model = onnx.shape_inference.infer_shapes(model)
        self.graph, self.base_dir = model.graph, base_dir
        self.initializers = {t.name: t for t in self.graph.initializer}
        self.types: dict[str, int] = {t.name: t.data_type for t in self.graph.initializer}
        self.shapes: dict[str, list[int | str]] = {t.name: list(t.dims) for t in self.graph.initializer}
        for v in [*self.graph.input, *self.graph.value_info, *self.graph.output]:
            tensor = v.type.tensor_type
            self.types.setdefault(v.name, tensor.elem_type)
            self.shapes.setdefault(v.name, [d.dim_param or d.dim_value for d in tensor.shape.dim])
        self.producers = {out: node for node in self.graph.node for out in node.output}

    def is_constant(self, name: str) -> bool:
        return name in self.initializers or getattr(self.producers.get(name), "op_type", None) == "Constant"

    def values(self, name: str) -> np.ndarray:
        tensor = onnx.TensorProto()
        tensor.CopyFrom(self.initializers[name])
        if tensor.data_location == TensorProto.EXTERNAL and self.base_dir is not None:
            load_external_data_for_tensor(tensor, str(self.base_dir))
        return numpy_helper.to_array(tensor)


def _attribute(node: onnx.NodeProto, name: str, default: int) -> int:
    return next((onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def _dequantize_findings(g: _Graph, node: onnx.NodeProto) -> Iterator[tuple[str, str]]:
    x, scale = node.input[0], node.input[1]
    x_type, shape = _type_name(g.types.get(x, 0)), g.shapes.get(x, [])
    if not g.is_constant(x) and getattr(g.producers.get(x), "op_type", None) != "QuantizeLinear":
        yield "quantized-input", f"dequantizes {x!r} ({x_type}), which is computed, not an initializer"
    if len(node.input) > 2 and node.input[2] and (node.input[2] not in g.initializers
                                                   or np.any(g.values(node.input[2]) != 0)):
        yield "zero-point", f"zero point {node.input[2]!r} is not an all-zero initializer (TensorRT is symmetric only)"
    if x_type == "INT4" and shape and isinstance(shape[-1], int) and shape[-1] % 2:
        yield "int4-odd-last-dim", f"{x!r} has shape {shape}: INT4 needs an even last dimension (packing)"
    block = _attribute(node, "block_size", 0)
    if not block:
        return
    axis = _attribute(node, "axis", 1)
    rank = len(shape)
    scale_shape = g.shapes.get(scale, [])
    problems = []
    if x_type != "INT4":
        problems.append(f"codes are {x_type}, not INT4")
    if not g.is_constant(x):
        problems.append("codes are not an initializer (weight-only)")
    if block not in BLOCK_SIZES:
        problems.append(f"block size {block}, not {' or '.join(map(str, BLOCK_SIZES))}")
    if rank and (axis % rank) < rank - 2:
        problems.append(f"blocked along axis {axis} of a rank-{rank} tensor, not one of the last two")
    length = shape[axis % rank] if rank else None
    if isinstance(length, int) and length % block:
        problems.append(f"axis length {length} is not a multiple of the block size {block} (the importer infers "
                        "the block from the volumes)")
    if len(scale_shape) != rank:
        problems.append(f"scales of rank {len(scale_shape)} for codes of rank {rank} (one blocking axis)")
    if problems:
        yield "blocked-quantization", "; ".join(problems)


def _node_findings(g: _Graph, node: onnx.NodeProto) -> Iterator[tuple[str, str]]:
    op = node.op_type
    if node.domain not in ("", "ai.onnx"):
        yield "domain", f"{node.domain}.{op} is not an ONNX operator"
        return
    if op in UNSUPPORTED_OPS or op not in OPERATOR_TYPES:
        yield "operator", f"{op} is " + ("marked unsupported" if op in UNSUPPORTED_OPS else "not in the support matrix")
        return
    supported = OPERATOR_TYPES[op]
    data = node.input[0] if node.input and node.input[0] else None
    # a type shape inference could not give (after a contrib op) is not judged
    if data is not None and g.types.get(data, 0) and op != "DequantizeLinear":
        data_type = _type_name(g.types[data])
        if data_type not in supported:
            yield "dtype", f"{op} on {data_type} ({data!r}); supported: {', '.join(sorted(supported))}"
        elif data_type in QUANTIZED_TYPES and op != "QuantizeLinear":
            yield "quantized-input", f"{op} reads the quantized {data_type} tensor {data!r}"
    if op == "Cast":
        to = _type_name(_attribute(node, "to", 0))
        if to not in supported:
            yield "dtype", f"Cast to {to}; supported: {', '.join(sorted(supported))}"
    for index in INITIALIZER_INPUTS.get(op, ()):
        if index < len(node.input) and node.input[index] and not g.is_constant(node.input[index]):
            yield "initializer-input", f"input {index} ({node.input[index]!r}) of {op} must be an initializer"
    if op == "DequantizeLinear":
        yield from _dequantize_findings(g, node)
    if op in ("MatMul", "Gemm") and data is not None and g.types.get(data) == TensorProto.FLOAT:
        yield "fp32-activations", f"{op} on FP32 ({data!r})"


def lint_model(model: onnx.ModelProto, graph: str, base_dir: Path | None = None) -> list[Finding]:
    """Every node of ``model`` a rule flags (``base_dir``: where its external data lies)."""
    g = _Graph(model, base_dir)
    return [Finding(graph, node.name, node.op_type, rule, detail)
            for node in g.graph.node for rule, detail in _node_findings(g, node)]


def lint_bundle(bundle: Bundle) -> list[Finding]:
    """Every finding in every graph of every model of the bundle (graphs by manifest name,
    ``llm/layer_000``)."""
    findings = []
    for role, entry in bundle.models.items():
        for name, graph in entry.graphs.items():
            path = bundle.file(graph.file)
            model = onnx.load(str(path), load_external_data=False)
            findings += lint_model(model, f"{role}/{name}", path.parent)
    return findings


@dataclass(frozen=True)
class FindingGroup:
    rule: str
    op: str
    findings: list[Finding]

    @property
    def kind(self) -> str:
        return RULES[self.rule][0]

    @property
    def graphs(self) -> int:
        return len({f.graph for f in self.findings})


def grouped(findings: list[Finding]) -> list[FindingGroup]:
    """Findings by (rule, operator), in rule order: what a table of a large bundle shows."""
    groups: dict[tuple[str, str], list[Finding]] = {}
    for f in findings:
        groups.setdefault((f.rule, f.op), []).append(f)
    order = list(RULES)
    return [FindingGroup(rule, op, items) for (rule, op), items in
            sorted(groups.items(), key=lambda kv: (order.index(kv[0][0]), kv[0][1]))]
