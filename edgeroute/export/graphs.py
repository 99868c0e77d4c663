"""ONNX graphs written node by node from the weights (no tracing), standard ops, opset 21.

One model becomes a set of small graphs the runtime can drive token by token and layer by
layer (see docs/bundle-format.md):

- ``embed``:   input_ids [T] -> hidden [T, d]
- ``attn_i``:  hidden, cos, sin, attn_bias, past_key, past_value -> hidden, key, value
  (pre-norm self-attention sub-layer of decoder layer i incl. its residual; key/value are the
  T new cache rows, which the runtime writes into its fixed-capacity buffers)
- ``mlp_i``:   hidden -> hidden (pre-norm MLP sub-layer incl. residual)
- ``kv_i``:    hidden, cos, sin -> key, value (layer i's K/V projections only: the CALM-style
  fill for a token that skips the layer)
- ``head``:    hidden -> logits (final norm + LM head)

Activations are 2-D [T, features] float32; caches are [positions, kv_heads, head_dim].
Quantized weights are int4/int8 ``DequantizeLinear`` (blocked, symmetric, positive scales)
feeding a ``MatMul``: TensorRT 10 parses it, and ONNX Runtime fuses it into MatMulNBits.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from edgeroute.arch import ArchConfig
from edgeroute.export.tensors import (
    BlockQuantWeight,
    FloatWeight,
    LayerWeights,
    Linear,
    ModelWeights,
    Weight,
    fuse_linears,
    scale_linear,
)

OPSET = 21
EXTERNAL_MIN_BYTES = 1024  # smaller initializers (shape constants) stay inside the graph


class WeightFile:
    """One external-data file for the graphs of a group (ONNX external data): each named
    initializer is written once and referenced by offset from every graph that uses it.
    Keeps graph files small (protobuf caps one at 2 GiB) and a layer's weights on disk once."""

    ALIGN = 64

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = open(path, "wb")  # noqa: SIM115 - closed by close()
        self._entries: dict[str, tuple[int, int, bytes]] = {}

    def externalize(self, tensor: TensorProto) -> None:
        data = tensor.raw_data
        if len(data) < EXTERNAL_MIN_BYTES:
            return
        digest = hashlib.blake2b(data, digest_size=16).digest()
        if tensor.name in self._entries:
            offset, length, known = self._entries[tensor.name]
            if known != digest:
                raise ValueError(f"two different tensors are named {tensor.name}")
        else:
            offset = self._file.tell()
            offset += -offset % self.ALIGN
            self._file.seek(offset)
            self._file.write(data)
            length = len(data)
            self._entries[tensor.name] = (offset, length, digest)
        tensor.ClearField("raw_data")
        tensor.data_location = TensorProto.EXTERNAL
        for key, value in (("location", self.path.name), ("offset", str(offset)), ("length", str(length))):
            tensor.external_data.add(key=key, value=value)

    def close(self) -> None:
        self._file.close()


def _pack_int4(values: np.ndarray) -> bytes:
    nibbles = (values.astype(np.int8).reshape(-1) & 0x0F).astype(np.uint8)
    if nibbles.size % 2:
        nibbles = np.append(nibbles, np.uint8(0))
    return (nibbles[0::2] | (nibbles[1::2] << 4)).tobytes()


class GraphBuilder:
    """Accumulates nodes and initializers under stable, viewer-friendly names."""

    def __init__(self, name: str, weights: WeightFile | None = None) -> None:
        self.name = name
        self.weights = weights
        self._output_values: list[tuple[str, str]] = []
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self._constants: dict[tuple, str] = {}

    def input(self, name: str, dtype: int, shape: list) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, dtype, shape))
        return name

    def output(self, value: str, name: str, dtype: int, shape: list) -> None:
        self._output_values.append((value, name))
        self.outputs.append(helper.make_tensor_value_info(name, dtype, shape))

    def _bind_outputs(self) -> None:
        """Give output values their public names: rename the producing node's output where
        nothing else reads it (an Identity would cost a kernel per call), else an Identity."""
        for value, name in self._output_values:
            producer = next((n for n in self.nodes if value in n.output), None)
            if producer is not None and not any(value in n.input for n in self.nodes):
                producer.output[list(producer.output).index(value)] = name
            else:
                self.op("Identity", [value], name=f"/output/{name}", outputs=[name])

    def op(self, op_type: str, inputs: list[str], name: str, outputs: list[str] | None = None,
           n_outputs: int = 1, **attrs) -> str | list[str]:
        outputs = outputs or [f"{name}/output_{i}" for i in range(n_outputs)]
        self.nodes.append(helper.make_node(op_type, inputs, outputs, name=name, **attrs))
        return outputs[0] if n_outputs == 1 else outputs

    def tensor(self, name: str, array: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def int_tensor(self, name: str, codes: np.ndarray, bits: int) -> str:
        if bits == 8:
            return self.tensor(name, codes.astype(np.int8))
        proto = TensorProto(name=name, data_type=TensorProto.INT4, dims=list(codes.shape))
        proto.raw_data = _pack_int4(codes)
        self.initializers.append(proto)
        return name

    def const(self, values, dtype=np.int64) -> str:
        array = np.asarray(values, dtype=dtype)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self._constants:  # named by content: graphs sharing a weight file agree on it
            digest = hashlib.blake2b(array.tobytes() + array.dtype.str.encode() + str(array.shape).encode(),
                                     digest_size=6).hexdigest()
            self._constants[key] = self.tensor(f"/const/{digest}", array)
        return self._constants[key]

    # -- building blocks -------------------------------------------------------------------

    def float_weight(self, name: str, w: np.ndarray, storage: str) -> str:
        if storage == "fp16":
            stored = self.tensor(f"{name}.fp16", w.astype(np.float16))
            return self.op("Cast", [stored], name=f"{name}/Cast", to=TensorProto.FLOAT)
        return self.tensor(name, w.astype(np.float32))

    def linear(self, x: str, linear: Linear, name: str) -> str:
        if linear.input_order is not None:
            order = self.tensor(f"{name}.input_order", linear.input_order.astype(np.int64))
            x = self.op("Gather", [x, order], name=f"{name}/InputOrder", axis=1)
        weight = linear.weight
        if isinstance(weight, FloatWeight):
            y = self.op("MatMul", [x, self.float_weight(f"{name}.weight", weight.w.T, weight.storage)],
                        name=f"{name}/MatMul")
        else:
            y = self._block_quant_matmul(x, weight.with_positive_scales(), name)
        if linear.bias is not None:
            y = self.op("Add", [y, self.tensor(f"{name}.bias", linear.bias.astype(np.float32))],
                        name=f"{name}/BiasAdd")
        return y

    def fused_linear(self, x: str, linears: list[Linear], name: str) -> list[str]:
        """Several linears reading the same input as one MatMul and a Split: fewer kernel
        launches per token, which is where small models spend their decode time."""
        fused = fuse_linears(linears)
        if fused is None:
            return [self.linear(x, lin, f"{name}/{i}") for i, lin in enumerate(linears)]
        y = self.linear(x, fused, name)
        sizes = self.const([lin.weight.shape[0] for lin in linears])
        return self.op("Split", [y, sizes], name=f"{name}/Split", n_outputs=len(linears), axis=-1)

    def _block_quant_matmul(self, x: str, weight: BlockQuantWeight, name: str) -> str:
        codes = self.int_tensor(f"{name}.qweight", weight.q.T, weight.bits)
        scales = self.tensor(f"{name}.scales", weight.scale.T.astype(np.float32))
        w = self.op("DequantizeLinear", [codes, scales], name=f"{name}/DequantizeLinear",
                    axis=0, block_size=weight.block)
        y = self.op("MatMul", [x, w], name=f"{name}/MatMul")
        if weight.offset is None:
            return y
        # offset term: blocksum(x) @ offset.T, added by one Gemm
        n_blocks = weight.offset.shape[1]
        blocks = self.op("Reshape", [x, self.const([-1, n_blocks, weight.block])], name=f"{name}/Blocks")
        sums = self.op("ReduceSum", [blocks, self.const([-1])], name=f"{name}/BlockSums", keepdims=0)
        offsets = self.tensor(f"{name}.offsets", weight.offset.T.astype(np.float32))
        return self.op("Gemm", [sums, offsets, y], name=f"{name}/OffsetGemm")

    def rms_norm(self, x: str, weight: np.ndarray, eps: float, name: str) -> str:
        # Pow/ReduceMean/Add/Sqrt/Div/Mul: the pattern ORT fuses into SimplifiedLayerNormalization
        sq = self.op("Pow", [x, self.const(2.0, np.float32)], name=f"{name}/Pow")
        mean = self.op("ReduceMean", [sq, self.const([-1])], name=f"{name}/ReduceMean", keepdims=1)
        var = self.op("Add", [mean, self.const(eps, np.float32)], name=f"{name}/Add")
        std = self.op("Sqrt", [var], name=f"{name}/Sqrt")
        normed = self.op("Div", [x, std], name=f"{name}/Div")
        return self.op("Mul", [normed, self.tensor(f"{name}.weight", weight.astype(np.float32))],
                       name=f"{name}/Mul")

    def rope(self, x: str, cos: str, sin: str, head_dim: int, name: str) -> str:
        """rotate-half RoPE (the transformers convention) on x [T, heads, head_dim]:
        x * cos + rotate_half(x) * sin, rotate_half as a MatMul with a constant signed
        permutation (4 kernels instead of a Split/Concat chain)."""
        half = head_dim // 2
        rotation = np.zeros((head_dim, head_dim), np.float32)
        rotation[np.arange(half) + half, np.arange(half)] = -1.0
        rotation[np.arange(half), np.arange(half) + half] = 1.0
        rotated = self.op("MatMul", [x, self.const(rotation, np.float32)], name=f"{name}/RotateHalf")
        return self.op("Add", [self.op("Mul", [x, cos], name=f"{name}/MulCos"),
                               self.op("Mul", [rotated, sin], name=f"{name}/MulSin")], name=f"{name}/Add")

    def heads(self, x: str, n_heads: int, head_dim: int, name: str) -> str:
        return self.op("Reshape", [x, self.const([-1, n_heads, head_dim])], name=f"{name}/Reshape")

    def build(self) -> onnx.ModelProto:
        self._bind_outputs()
        if self.weights is not None:
            for tensor in self.initializers:
                self.weights.externalize(tensor)
        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, self.initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                                  producer_name="edgeroute")
        model.ir_version = 10
        return model


# -- graph I/O ---------------------------------------------------------------------------------

def _activation_inputs(g: GraphBuilder, arch: ArchConfig) -> tuple[str, str, str]:
    hidden = g.input("hidden", TensorProto.FLOAT, ["tokens", arch.hidden_size])
    cos = g.input("cos", TensorProto.FLOAT, ["tokens", 1, arch.head_dim])
    sin = g.input("sin", TensorProto.FLOAT, ["tokens", 1, arch.head_dim])
    return hidden, cos, sin


def _heads(g: GraphBuilder, arch: ArchConfig, flat: str, n_heads: int, norm: np.ndarray | None, cos: str, sin: str,
           name: str) -> str:
    x = g.heads(flat, n_heads, arch.head_dim, f"{name}_heads")
    if norm is not None:
        x = g.rms_norm(x, norm, arch.rms_norm_eps, f"{name}_norm")
    return g.rope(x, cos, sin, arch.head_dim, f"{name}_rope")


def _kv_outputs(g: GraphBuilder, arch: ArchConfig, k: str, v: str) -> None:
    shape = ["tokens", arch.num_kv_heads, arch.head_dim]
    g.output(k, "key", TensorProto.FLOAT, shape)
    g.output(v, "value", TensorProto.FLOAT, shape)


def _prescaled_query(arch: ArchConfig, layer: LayerWeights) -> tuple[Linear, np.ndarray | None]:
    """The attention's 1/sqrt(head_dim) folded into q's weights (or q's norm, which comes
    after the projection in Qwen3): one Mul fewer per layer and token. RoPE is linear, so
    scaling before it is the same."""
    factor = arch.head_dim ** -0.5
    if layer.q_norm is not None:
        return layer.q_proj, layer.q_norm * factor
    return scale_linear(layer.q_proj, factor), None


def _attention_inputs(g: GraphBuilder, arch: ArchConfig) -> tuple[str, ...]:
    hidden, cos, sin = _activation_inputs(g, arch)
    bias = g.input("attn_bias", TensorProto.FLOAT, ["tokens", "total"])
    cache_shape = ["past", arch.num_kv_heads, arch.head_dim]
    past_k = g.input("past_key", TensorProto.FLOAT, cache_shape)
    past_v = g.input("past_value", TensorProto.FLOAT, cache_shape)
    return hidden, cos, sin, bias, past_k, past_v


def add_attention(g: GraphBuilder, arch: ArchConfig, layer: LayerWeights, index: int, hidden: str, cos: str,
                  sin: str, bias: str, past_k: str, past_v: str) -> str:
    """Pre-norm self-attention of layer ``index`` incl. the residual; emits key/value."""
    prefix = f"/model/layers.{index}/attn"
    normed = g.rms_norm(hidden, layer.attn_norm, arch.rms_norm_eps, f"{prefix}/norm")
    q_proj, q_norm = _prescaled_query(arch, layer)
    q, k, v = g.fused_linear(normed, [q_proj, layer.k_proj, layer.v_proj], f"{prefix}/qkv_proj")
    q = _heads(g, arch, q, arch.num_heads, q_norm, cos, sin, f"{prefix}/q")
    k = _heads(g, arch, k, arch.num_kv_heads, layer.k_norm, cos, sin, f"{prefix}/k")
    v = g.heads(v, arch.num_kv_heads, arch.head_dim, f"{prefix}/v_heads")
    _kv_outputs(g, arch, k, v)

    group = arch.num_heads // arch.num_kv_heads
    keys = g.op("Concat", [past_k, k], name=f"{prefix}/KeyConcat", axis=0)  # [S, kv, hd]
    values = g.op("Concat", [past_v, v], name=f"{prefix}/ValueConcat", axis=0)
    q = g.op("Reshape", [q, g.const([-1, arch.num_kv_heads, group, arch.head_dim])], name=f"{prefix}/QGroups")
    q = g.op("Transpose", [q], name=f"{prefix}/QTranspose", perm=[1, 2, 0, 3])  # [kv, group, T, hd]
    kt = g.op("Transpose", [keys], name=f"{prefix}/KTranspose", perm=[1, 2, 0])  # [kv, hd, S]
    kt = g.op("Unsqueeze", [kt, g.const([1])], name=f"{prefix}/KUnsqueeze")
    scores = g.op("MatMul", [q, kt], name=f"{prefix}/Scores")  # [kv, group, T, S]
    scores = g.op("Add", [scores, bias], name=f"{prefix}/Mask")
    probs = g.op("Softmax", [scores], name=f"{prefix}/Softmax", axis=-1)
    vt = g.op("Transpose", [values], name=f"{prefix}/VTranspose", perm=[1, 0, 2])  # [kv, S, hd]
    vt = g.op("Unsqueeze", [vt, g.const([1])], name=f"{prefix}/VUnsqueeze")
    ctx = g.op("MatMul", [probs, vt], name=f"{prefix}/Context")  # [kv, group, T, hd]
    ctx = g.op("Transpose", [ctx], name=f"{prefix}/CtxTranspose", perm=[2, 0, 1, 3])
    ctx = g.op("Reshape", [ctx, g.const([-1, arch.num_heads * arch.head_dim])], name=f"{prefix}/CtxFlat")
    return g.op("Add", [hidden, g.linear(ctx, layer.o_proj, f"{prefix}/o_proj")], name=f"{prefix}/Residual")


def add_mlp(g: GraphBuilder, arch: ArchConfig, layer: LayerWeights, index: int, hidden: str) -> str:
    """Pre-norm SwiGLU MLP of layer ``index`` incl. the residual."""
    prefix = f"/model/layers.{index}/mlp"
    normed = g.rms_norm(hidden, layer.mlp_norm, arch.rms_norm_eps, f"{prefix}/norm")
    gate, up = g.fused_linear(normed, [layer.gate_proj, layer.up_proj], f"{prefix}/gate_up_proj")
    silu = g.op("Mul", [gate, g.op("Sigmoid", [gate], name=f"{prefix}/Sigmoid")], name=f"{prefix}/SiLU")
    act = g.op("Mul", [silu, up], name=f"{prefix}/GateMul")
    return g.op("Add", [hidden, g.linear(act, layer.down_proj, f"{prefix}/down_proj")], name=f"{prefix}/Residual")


def _hidden_output(g: GraphBuilder, arch: ArchConfig, value: str) -> onnx.ModelProto:
    g.output(value, "hidden_out", TensorProto.FLOAT, ["tokens", arch.hidden_size])
    return g.build()


def build_layer(arch: ArchConfig, layer: LayerWeights, index: int, weights: WeightFile | None = None) -> onnx.ModelProto:
    """The whole decoder layer: the runtime's path for a token that skips nothing."""
    g = GraphBuilder(f"layer_{index}", weights)
    hidden, *rest = _attention_inputs(g, arch)
    return _hidden_output(g, arch, add_mlp(g, arch, layer, index, add_attention(g, arch, layer, index, hidden, *rest)))


def build_attention(arch: ArchConfig, layer: LayerWeights, index: int,
                    weights: WeightFile | None = None) -> onnx.ModelProto:
    g = GraphBuilder(f"attn_{index}", weights)
    return _hidden_output(g, arch, add_attention(g, arch, layer, index, *_attention_inputs(g, arch)))


def build_mlp(arch: ArchConfig, layer: LayerWeights, index: int, weights: WeightFile | None = None) -> onnx.ModelProto:
    g = GraphBuilder(f"mlp_{index}", weights)
    hidden = g.input("hidden", TensorProto.FLOAT, ["tokens", arch.hidden_size])
    return _hidden_output(g, arch, add_mlp(g, arch, layer, index, hidden))


def build_kv_fill(arch: ArchConfig, layer: LayerWeights, index: int,
                  weights: WeightFile | None = None) -> onnx.ModelProto:
    prefix = f"/model/layers.{index}/kv_fill"
    g = GraphBuilder(f"kv_{index}", weights)
    hidden, cos, sin = _activation_inputs(g, arch)
    normed = g.rms_norm(hidden, layer.attn_norm, arch.rms_norm_eps, f"{prefix}/norm")
    k, v = g.fused_linear(normed, [layer.k_proj, layer.v_proj], f"{prefix}/kv_proj")
    k = _heads(g, arch, k, arch.num_kv_heads, layer.k_norm, cos, sin, f"{prefix}/k")
    _kv_outputs(g, arch, k, g.heads(v, arch.num_kv_heads, arch.head_dim, f"{prefix}/v_heads"))
    return g.build()


def build_embed(arch: ArchConfig, embedding: Weight, weights: WeightFile | None = None) -> onnx.ModelProto:
    prefix = "/model/embed_tokens"
    g = GraphBuilder("embed", weights)
    ids = g.input("input_ids", TensorProto.INT64, ["tokens"])
    if isinstance(embedding, FloatWeight):
        table = g.float_weight(f"{prefix}.weight", embedding.w, embedding.storage)
        hidden = g.op("Gather", [table, ids], name=f"{prefix}/Gather", axis=0)
    else:
        # int4 codes are stored one per byte: Gather has no int4 kernel, and the table is
        # only gathered (one row per token), so its size matters more than its bandwidth.
        emb = embedding.with_positive_scales()
        codes = g.tensor(f"{prefix}.qweight", emb.q.astype(np.int8))
        rows = g.op("Gather", [codes, ids], name=f"{prefix}/GatherCodes", axis=0)
        scales = g.op("Gather", [g.tensor(f"{prefix}.scales", emb.scale.astype(np.float32)), ids],
                      name=f"{prefix}/GatherScales", axis=0)
        hidden = g.op("DequantizeLinear", [rows, scales], name=f"{prefix}/DequantizeLinear",
                      axis=1, block_size=emb.block)
        if emb.offset is not None:
            offsets = g.op("Gather", [g.tensor(f"{prefix}.offsets", emb.offset.astype(np.float32)), ids],
                           name=f"{prefix}/GatherOffsets", axis=0)
            offsets = g.op("Unsqueeze", [offsets, g.const([-1])], name=f"{prefix}/OffsetUnsqueeze")
            blocks = g.op("Reshape", [hidden, g.const([0, -1, emb.block])], name=f"{prefix}/Blocks")
            blocks = g.op("Add", [blocks, offsets], name=f"{prefix}/OffsetAdd")
            hidden = g.op("Reshape", [blocks, g.const([0, arch.hidden_size])], name=f"{prefix}/Flat")
    g.output(hidden, "hidden", TensorProto.FLOAT, ["tokens", arch.hidden_size])
    return g.build()


def build_head(arch: ArchConfig, final_norm: np.ndarray, lm_head: Linear,
               weights: WeightFile | None = None) -> onnx.ModelProto:
    g = GraphBuilder("head", weights)
    hidden = g.input("hidden", TensorProto.FLOAT, ["tokens", arch.hidden_size])
    normed = g.rms_norm(hidden, final_norm, arch.rms_norm_eps, "/model/norm")
    logits = g.linear(normed, lm_head, "/lm_head")
    g.output(logits, "logits", TensorProto.FLOAT, ["tokens", lm_head.weight.shape[0]])  # reduced heads: fewer
    return g.build()


GraphSpec = tuple[str, str, "int | None", Callable[["WeightFile | None"], onnx.ModelProto]]


def model_graphs(arch: ArchConfig, weights: ModelWeights) -> list[tuple[str, list[GraphSpec]]]:
    """Groups of (graph name, kind, layer, build(weight_file)); the graphs of one group share
    one external weight file, so a layer's weights are stored once for its four graphs."""
    groups: list[tuple[str, list[GraphSpec]]] = [
        ("embed", [("embed", "embed", None, lambda w: build_embed(arch, weights.embedding, w))])]
    for i, layer in enumerate(weights.layers):
        groups.append((f"layer_{i:03d}", [
            (f"{kind}_{i:03d}", kind, i, lambda w, build=build, i=i, layer=layer: build(arch, layer, i, w))
            for kind, build in (("layer", build_layer), ("attn", build_attention), ("mlp", build_mlp),
                                ("kv", build_kv_fill))]))
    groups.append(("head", [("head", "head", None, lambda w: build_head(arch, weights.final_norm, weights.lm_head, w))]))
    return groups
