"""ONNX graphs written node by node from the weights (no tracing), opset 21.

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

Every graph exists in the *portable* flavour (standard ops only; the tensorrt target's, in
float16 and without the storage forms TensorRT rejects, are what its parser takes). The
attention graphs (``layer_i``, ``attn_i``) also come in the *ort* flavour (``layer_i_ort``,
``attn_i_ort``): ONNX Runtime's contrib ``GroupQueryAttention``, which writes the new K/V
rows into the runtime's cache buffer in place (bound as both past and present) and reads
the past where it lies, instead of concatenating and transposing the whole past per token.
And portable ones for an fp16 KV cache (``layer_i_kv16``, ``attn_i_kv16``): half the cache's
memory, the same weights (graphs of a layer share one weight file).

Activations are 2-D [T, features] float32; portable caches are [positions, kv_heads,
head_dim], ort caches [1, kv_heads, capacity, head_dim].
Quantized weights are int4/int8 ``DequantizeLinear`` (blocked, symmetric, positive scales)
feeding a ``MatMul``: ONNX Runtime fuses it into MatMulNBits, and TensorRT 10 takes it as int4
blocked 64 or 128 wide (the tensorrt target; ``edgeroute/tensorrt/lint.py`` has the rules).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from edgeroute.arch import ArchConfig
from edgeroute.bundle import ATTENTION_VARIANTS, DEFAULT_TARGET, TARGETS, Target, attention_graph_name
from edgeroute.export.packing import PackedCodes, pack_codes
from edgeroute.export.tensors import (
    BlockFactors,
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
CONTRIB_DOMAIN = "com.microsoft"  # ONNX Runtime's contrib ops (the ort flavour only)
KV_TYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}  # the K/V cache's (and activations') type
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


def _exact_in_fp16(values: np.ndarray) -> bool:
    values = np.asarray(values, np.float32)
    with np.errstate(over="ignore"):
        return bool(np.array_equal(values.astype(np.float16).astype(np.float32), values))


def _fp16_nonzero(values: np.ndarray) -> np.ndarray:
    """``values`` in fp16, where a nonzero one never rounds to zero (a zero scale would drop its
    block): the smallest subnormal of its sign at least."""
    narrow = values.astype(np.float16)
    lost = (narrow == 0) & (values != 0)
    narrow[lost] = np.copysign(np.float16(2.0 ** -24), values[lost])
    return narrow


def _narrow_ints(codes: np.ndarray) -> np.ndarray:
    """Integer codes in the one-byte type that holds them (signed Q6_K sub-scales, or up to 255)."""
    return codes.astype(np.int8 if codes.min(initial=0) < 0 else np.uint8)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """int4 codes [rows, cols] (cols even) as uint8 [rows, cols / 2]: code + 8, even column low."""
    u = (q + np.int8(8)).view(np.uint8)  # -8..7 -> 0..15, no wider temporary for a 233M-code table
    return u[:, 0::2] | (u[:, 1::2] << 4)


def _pack_int4(values: np.ndarray) -> bytes:
    nibbles = (values.astype(np.int8).reshape(-1) & 0x0F).astype(np.uint8)
    if nibbles.size % 2:
        nibbles = np.append(nibbles, np.uint8(0))
    return (nibbles[0::2] | (nibbles[1::2] << 4)).tobytes()


class GraphBuilder:
    """Accumulates nodes and initializers under stable, viewer-friendly names.

    ``activations`` is the type the projections, attention and MLP compute in; the residual
    stream between graphs (``hidden``) and the norms stay float32 either way, so a float16
    graph narrows each norm's output and widens what it adds to the residual."""

    def __init__(self, name: str, weights: WeightFile | None = None, activations: str = "float32") -> None:
        self.name = name
        self.weights = weights
        self.activations = activations
        self.act = KV_TYPES[activations]
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

    def narrow(self, value: str, name: str) -> str:
        """A float32 value in the activation type."""
        return value if self.act == TensorProto.FLOAT else self.op("Cast", [value], name=f"{name}/Narrow", to=self.act)

    def widen(self, value: str, name: str) -> str:
        """An activation-typed value in float32."""
        return value if self.act == TensorProto.FLOAT else self.op("Cast", [value], name=f"{name}/Widen",
                                                                     to=TensorProto.FLOAT)

    def act_const(self, values) -> str:
        return self.const(values, np.float32 if self.act == TensorProto.FLOAT else np.float16)

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
        """A float table in the activation type (fp16 storage in a float32 graph: Cast at load)."""
        if storage == "fp16":
            stored = self.tensor(f"{name}.fp16", w.astype(np.float16))
            return stored if self.act == TensorProto.FLOAT16 else self.op("Cast", [stored], name=f"{name}/Cast",
                                                                           to=TensorProto.FLOAT)
        return self.narrow(self.tensor(name, w.astype(np.float32)), name)

    def block_params(self, name: str, values: np.ndarray) -> str:
        """Block scales or offsets: stored as fp16 where every value is exactly an fp16 (GGUF
        Q4_0/Q5_0/Q8_0 scales are), half the bytes on disk; ONNX Runtime folds the Cast, so
        its fused kernel still gets the same fp32 values (measured: still MatMulNBits). In a
        float16 graph they are fp16 initializers, which DequantizeLinear takes as they are
        (TensorRT wants its scales as initializers)."""
        if self.act == TensorProto.FLOAT16:
            return self.tensor(f"{name}.fp16", _fp16_nonzero(values))
        return self.float_weight(name, values, "fp16" if _exact_in_fp16(values) else "fp32")

    def block_table(self, name: str, table: np.ndarray, factors: BlockFactors | None, ids: str | None = None,
                    scale: str | None = None) -> str:
        """A per-block table [rows, n_blocks] (scales or offsets): every row, or the rows of
        the token ids ``ids``. With ``factors`` it is stored as integer codes and a step per
        group (``scale``: the value of the same rows' scales, for offsets that add a multiple
        of them) and multiplied out in float32: once at load for a weight (ONNX Runtime folds
        the constants, then still fuses MatMulNBits), per gathered row for an embedding."""
        if factors is None:  # (a weight's plain table never comes here: _weight_table stores it transposed)
            return self.gathered_rows(name, table, ids, f"{name}/Gather")
        codes = self.tensor(f"{name}.codes", _narrow_ints(factors.codes))
        if ids is None:
            step = self.block_params(f"{name}.step", factors.step)
        else:
            codes = self.op("Gather", [codes, ids], name=f"{name}/GatherCodes", axis=0)
            step = self.gathered_rows(f"{name}.step", factors.step, ids, f"{name}/GatherStep")
        codes = self.op("Cast", [codes], name=f"{name}/CodesCast", to=TensorProto.FLOAT)
        groups = self.op("Reshape", [codes, self.const([0, -1, factors.group])], name=f"{name}/Groups")
        steps = self.op("Unsqueeze", [step, self.const([-1])], name=f"{name}/StepUnsqueeze")
        values = self.op("Reshape", [self.op("Mul", [groups, steps], name=f"{name}/Mul"), self.const([0, -1])],
                         name=f"{name}/Flat")
        if factors.scale_multiple:
            multiple = self.op("Mul", [scale, self.const(float(factors.scale_multiple), np.float32)],
                               name=f"{name}/ScaleMultiple")
            values = self.op("Add", [multiple, values], name=f"{name}/Add")
        return values

    def nibble_pairs(self, packed: str, width: int, name: str) -> str:
        """uint8 [rows, width / 2] bytes -> their nibbles [rows, width], low nibble first."""
        low = self.op("BitwiseAnd", [packed, self.const(15, np.uint8)], name=f"{name}/LowNibble")
        high = self.op("BitShift", [packed, self.const(4, np.uint8)], name=f"{name}/HighNibble", direction="RIGHT")
        pairs = self.op("Concat", [self.op("Unsqueeze", [low, self.const([-1])], name=f"{name}/LowUnsqueeze"),
                                   self.op("Unsqueeze", [high, self.const([-1])], name=f"{name}/HighUnsqueeze")],
                        name=f"{name}/Interleave", axis=-1)
        return self.op("Reshape", [pairs, self.const([0, width])], name=f"{name}/Nibbles")

    def _bits(self, packed: str, name: str) -> str:
        """uint8 [rows, n] -> its bits [rows, 8 n] as uint8 0/1 (bit j of byte i: element 8 i + j)."""
        shifted = self.op("BitShift", [self.op("Unsqueeze", [packed, self.const([-1])], name=f"{name}/Unsqueeze"),
                                       self.const(np.arange(8), np.uint8)], name=f"{name}/Shift", direction="RIGHT")
        bits = self.op("BitwiseAnd", [shifted, self.const(1, np.uint8)], name=f"{name}/And")
        return self.op("Reshape", [bits, self.const([0, -1])], name=f"{name}/Flat")

    def unpacked_codes(self, name: str, packed: PackedCodes, ids: str) -> str:
        """The int8 codes [T, cols] of the rows ``ids`` of ``packed``, unpacked per gathered row.

        Only gathered tables are packed: a linear's codes would be unpacked by constant
        folding at load, and ONNX Runtime's folding copies each intermediate (measured on the
        1.5B: its load went from 9 s to 48 s, 9 GB peak for the Q6_K head)."""
        cols = packed.shape[1]

        def stored(suffix: str, array: np.ndarray) -> str:
            return self.op("Gather", [self.tensor(f"{name}.{suffix}", np.ascontiguousarray(array)), ids],
                           name=f"{name}/Gather_{suffix}", axis=0)

        # bits 0-3 from the nibbles, bit k from plane k - 4: disjoint, so OR-ed in uint8
        u = self.nibble_pairs(stored("nibbles", packed.nibbles), cols, name)
        for k in range(4, packed.width):
            plane = self._bits(stored(f"plane{k}", packed.planes[:, k - 4]), f"{name}/Plane{k}")
            shifted = self.op("BitShift", [plane, self.const(k, np.uint8)], name=f"{name}/Plane{k}/ToBit",
                              direction="LEFT")
            u = self.op("BitwiseOr", [u, shifted], name=f"{name}/Plane{k}/Or")
        codes = self.op("Add", [self.op("Cast", [u], name=f"{name}/Widen", to=TensorProto.INT32),
                                self.const(packed.low, np.int32)], name=f"{name}/Low")
        if packed.negated is not None:
            n_blocks = cols // packed.block
            flips = self.op("Slice", [self._bits(stored("negated", packed.negated), f"{name}/Signs"),
                                      self.const([0]), self.const([n_blocks]), self.const([1])],
                            name=f"{name}/SignSlice")
            # 1 - 2 * flip: +1 kept, -1 negated
            signs = self.op("Sub", [self.const(1, np.int32),
                                    self.op("Mul", [self.op("Cast", [flips], name=f"{name}/SignCast",
                                                            to=TensorProto.INT32), self.const(2, np.int32)],
                                            name=f"{name}/SignDouble")], name=f"{name}/Signs")
            blocks = self.op("Reshape", [codes, self.const([0, n_blocks, packed.block])], name=f"{name}/Blocks")
            signed = self.op("Mul", [blocks, self.op("Unsqueeze", [signs, self.const([-1])], name=f"{name}/SignsUnsq")],
                             name=f"{name}/Negate")
            codes = self.op("Reshape", [signed, self.const([0, cols])], name=f"{name}/Flat")
        return self.op("Cast", [codes], name=f"{name}/Cast", to=TensorProto.INT8)

    def gathered_rows(self, name: str, table: np.ndarray, ids: str, node: str) -> str:
        """Rows of a per-row table for the gathered token ids, stored as fp16 where exact
        (cast after the gather, so the table stays fp16 in memory too)."""
        if not _exact_in_fp16(table):
            return self.op("Gather", [self.tensor(name, table.astype(np.float32)), ids], name=node, axis=0)
        rows = self.op("Gather", [self.tensor(f"{name}.fp16", table.astype(np.float16)), ids], name=node, axis=0)
        return self.op("Cast", [rows], name=f"{node}/Cast", to=TensorProto.FLOAT)

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
            bias = linear.bias.astype(np.float32 if self.act == TensorProto.FLOAT else np.float16)
            y = self.op("Add", [y, self.tensor(f"{name}.bias", bias)], name=f"{name}/BiasAdd")
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
        scales, scale_rows = self._weight_table(f"{name}.scales", weight.scale, weight.scale_factors)
        w = self.op("DequantizeLinear", [codes, scales], name=f"{name}/DequantizeLinear",
                    axis=0, block_size=weight.block)
        y = self.op("MatMul", [x, w], name=f"{name}/MatMul")
        if weight.offset is None:
            return y
        # offset term: blocksum(x) @ offset.T, added by one Gemm
        n_blocks = weight.offset.shape[1]
        blocks = self.op("Reshape", [x, self.const([-1, n_blocks, weight.block])], name=f"{name}/Blocks")
        sums = self.op("ReduceSum", [blocks, self.const([-1])], name=f"{name}/BlockSums", keepdims=0)
        if scale_rows is None and weight.offset_factors is not None and weight.offset_factors.scale_multiple:
            scale_rows = self.op("Transpose", [scales], name=f"{name}/ScaleRows")
        offsets, _ = self._weight_table(f"{name}.offsets", weight.offset, weight.offset_factors, scale_rows)
        return self.op("Gemm", [sums, offsets, y], name=f"{name}/OffsetGemm")

    def _weight_table(self, name: str, table: np.ndarray, factors: BlockFactors | None,
                      scale_rows: str | None = None) -> tuple[str, str | None]:
        """A weight's per-block table as DequantizeLinear and the offset Gemm read it, [n_blocks,
        out], and for a factored one the [out, n_blocks] value it is transposed from."""
        if factors is None:
            return self.block_params(name, table.T), None
        rows = self.block_table(name, table, factors, scale=scale_rows)
        return self.op("Transpose", [rows], name=f"{name}/Transpose"), rows

    def rms_norm(self, x: str, weight: np.ndarray, eps: float, name: str) -> str:
        """float32 ``x`` -> normed, in the activation type (in float16 the mean of squares of
        activations in the hundreds would overflow)."""
        # Pow/ReduceMean/Add/Sqrt/Div/Mul: the pattern ORT fuses into SimplifiedLayerNormalization
        sq = self.op("Pow", [x, self.const(2.0, np.float32)], name=f"{name}/Pow")
        mean = self.op("ReduceMean", [sq, self.const([-1])], name=f"{name}/ReduceMean", keepdims=1)
        var = self.op("Add", [mean, self.const(eps, np.float32)], name=f"{name}/Add")
        std = self.op("Sqrt", [var], name=f"{name}/Sqrt")
        normed = self.op("Div", [x, std], name=f"{name}/Div")
        return self.narrow(self.op("Mul", [normed, self.tensor(f"{name}.weight", weight.astype(np.float32))],
                                   name=f"{name}/Mul"), name)

    def rope(self, x: str, cos: str, sin: str, head_dim: int, name: str) -> str:
        """rotate-half RoPE (the transformers convention) on x [T, heads, head_dim]:
        x * cos + rotate_half(x) * sin, rotate_half as a MatMul with a constant signed
        permutation (4 kernels instead of a Split/Concat chain)."""
        half = head_dim // 2
        rotation = np.zeros((head_dim, head_dim), np.float32)
        rotation[np.arange(half) + half, np.arange(half)] = -1.0
        rotation[np.arange(half), np.arange(half) + half] = 1.0
        rotated = self.op("MatMul", [x, self.act_const(rotation)], name=f"{name}/RotateHalf")
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
        opsets = [helper.make_opsetid("", OPSET)]
        if any(n.domain == CONTRIB_DOMAIN for n in self.nodes):
            opsets.append(helper.make_opsetid(CONTRIB_DOMAIN, 1))
        model = helper.make_model(graph, opset_imports=opsets, producer_name="edgeroute")
        model.ir_version = 10
        return model


# -- graph I/O ---------------------------------------------------------------------------------

def _activation_inputs(g: GraphBuilder, arch: ArchConfig) -> tuple[str, str, str]:
    """hidden (float32), cos and sin (in the activation type)."""
    hidden = g.input("hidden", TensorProto.FLOAT, ["tokens", arch.hidden_size])
    cos = g.input("cos", TensorProto.FLOAT, ["tokens", 1, arch.head_dim])
    sin = g.input("sin", TensorProto.FLOAT, ["tokens", 1, arch.head_dim])
    return hidden, g.narrow(cos, "/rope/cos"), g.narrow(sin, "/rope/sin")


def _heads(g: GraphBuilder, arch: ArchConfig, flat: str, n_heads: int, norm: np.ndarray | None, cos: str, sin: str,
           name: str) -> str:
    x = g.heads(flat, n_heads, arch.head_dim, f"{name}_heads")
    if norm is not None:
        x = g.rms_norm(g.widen(x, f"{name}_norm"), norm, arch.rms_norm_eps, f"{name}_norm")
    return g.rope(x, cos, sin, arch.head_dim, f"{name}_rope")


def _kv_outputs(g: GraphBuilder, arch: ArchConfig, k: str, v: str, kv_dtype: str) -> None:
    shape = ["tokens", arch.num_kv_heads, arch.head_dim]
    g.output(k, "key", KV_TYPES[kv_dtype], shape)
    g.output(v, "value", KV_TYPES[kv_dtype], shape)


def _prescaled_query(arch: ArchConfig, layer: LayerWeights) -> tuple[Linear, np.ndarray | None]:
    """The attention's 1/sqrt(head_dim) folded into q's weights (or q's norm, which comes
    after the projection in Qwen3): one Mul fewer per layer and token. RoPE is linear, so
    scaling before it is the same."""
    factor = arch.head_dim ** -0.5
    if layer.q_norm is not None:
        return layer.q_proj, layer.q_norm * factor
    return scale_linear(layer.q_proj, factor), None


def _attention_inputs(g: GraphBuilder, arch: ArchConfig, kv_dtype: str = "float32") -> tuple[str, ...]:
    hidden, cos, sin = _activation_inputs(g, arch)
    bias = g.input("attn_bias", TensorProto.FLOAT, ["tokens", "total"])
    cache_shape = ["past", arch.num_kv_heads, arch.head_dim]
    past_k = g.input("past_key", KV_TYPES[kv_dtype], cache_shape)
    past_v = g.input("past_value", KV_TYPES[kv_dtype], cache_shape)
    return hidden, cos, sin, bias, past_k, past_v


def _gqa_inputs(g: GraphBuilder, arch: ArchConfig) -> tuple[str, ...]:
    hidden, cos, sin = _activation_inputs(g, arch)
    bias = g.input("attn_bias", TensorProto.FLOAT, [1, 1, "tokens", "total"])
    cache_shape = [1, arch.num_kv_heads, "capacity", arch.head_dim]
    past_k = g.input("past_key", TensorProto.FLOAT, cache_shape)
    past_v = g.input("past_value", TensorProto.FLOAT, cache_shape)
    seqlens = g.input("seqlens_k", TensorProto.INT32, [1])
    total = g.input("total_sequence_length", TensorProto.INT32, [])
    return hidden, cos, sin, bias, past_k, past_v, seqlens, total


def _projections(g: GraphBuilder, arch: ArchConfig, layer: LayerWeights, hidden: str, cos: str, sin: str,
                 prefix: str) -> tuple[str, str, str]:
    """Normed hidden -> q [T, heads, hd] (pre-scaled, RoPE), k [T, kv, hd] (RoPE), v [T, kv*hd]."""
    normed = g.rms_norm(hidden, layer.attn_norm, arch.rms_norm_eps, f"{prefix}/norm")
    q_proj, q_norm = _prescaled_query(arch, layer)
    q, k, v = g.fused_linear(normed, [q_proj, layer.k_proj, layer.v_proj], f"{prefix}/qkv_proj")
    q = _heads(g, arch, q, arch.num_heads, q_norm, cos, sin, f"{prefix}/q")
    k = _heads(g, arch, k, arch.num_kv_heads, layer.k_norm, cos, sin, f"{prefix}/k")
    return q, k, v


def _output_projection(g: GraphBuilder, layer: LayerWeights, hidden: str, ctx: str, prefix: str) -> str:
    out = g.widen(g.linear(ctx, layer.o_proj, f"{prefix}/o_proj"), f"{prefix}/o_proj")
    return g.op("Add", [hidden, out], name=f"{prefix}/Residual")


def add_attention(g: GraphBuilder, arch: ArchConfig, layer: LayerWeights, index: int, hidden: str, cos: str,
                  sin: str, bias: str, past_k: str, past_v: str, kv_dtype: str = "float32") -> str:
    """Pre-norm self-attention of layer ``index`` incl. the residual; emits key/value (portable).

    With an fp16 cache (``kv_dtype``) the new rows are rounded to fp16 before attention uses
    them, so a token sees its own K/V as every later token will (a multi-token pass still
    equals one-token steps), and the cache is widened to the activation type once, after the
    Concat (in a float16 graph nothing is cast).

    The query heads that share a KV head are folded into the MatMuls' rows ([kv, group*T, hd]):
    a one-token step then multiplies with M = group, not 1, and ONNX Runtime's float MatMul
    gives each row the same bits for every M >= 2 (M = 1 takes a GEMV path that rounds
    differently), so a multi-token verification pass reproduces one-token steps exactly."""
    prefix = f"/model/layers.{index}/attn"
    q, k, v = _projections(g, arch, layer, hidden, cos, sin, prefix)
    v = g.heads(v, arch.num_kv_heads, arch.head_dim, f"{prefix}/v_heads")
    cast = KV_TYPES[kv_dtype] != g.act
    if cast:
        k = g.op("Cast", [k], name=f"{prefix}/KeyNarrow", to=KV_TYPES[kv_dtype])
        v = g.op("Cast", [v], name=f"{prefix}/ValueNarrow", to=KV_TYPES[kv_dtype])
    _kv_outputs(g, arch, k, v, kv_dtype)

    kv, group, hd = arch.num_kv_heads, arch.num_heads // arch.num_kv_heads, arch.head_dim
    keys = g.op("Concat", [past_k, k], name=f"{prefix}/KeyConcat", axis=0)  # [S, kv, hd]
    values = g.op("Concat", [past_v, v], name=f"{prefix}/ValueConcat", axis=0)
    if cast:
        keys = g.op("Cast", [keys], name=f"{prefix}/KeyWiden", to=g.act)
        values = g.op("Cast", [values], name=f"{prefix}/ValueWiden", to=g.act)
    q = g.op("Reshape", [q, g.const([-1, kv, group, hd])], name=f"{prefix}/QGroups")
    q = g.op("Transpose", [q], name=f"{prefix}/QTranspose", perm=[1, 2, 0, 3])  # [kv, group, T, hd]
    q = g.op("Reshape", [q, g.const([kv, -1, hd])], name=f"{prefix}/QFold")  # [kv, group*T, hd]
    kt = g.op("Transpose", [keys], name=f"{prefix}/KTranspose", perm=[1, 2, 0])  # [kv, hd, S]
    scores = g.op("MatMul", [q, kt], name=f"{prefix}/Scores")  # [kv, group*T, S]
    # float32 min narrows to -inf in float16: masked positions still get probability 0
    folded_bias = g.op("Tile", [g.narrow(bias, f"{prefix}/Mask"), g.const([group, 1])],
                       name=f"{prefix}/MaskTile")  # [group*T, S]
    scores = g.op("Add", [scores, folded_bias], name=f"{prefix}/Mask")
    probs = g.op("Softmax", [scores], name=f"{prefix}/Softmax", axis=-1)
    vt = g.op("Transpose", [values], name=f"{prefix}/VTranspose", perm=[1, 0, 2])  # [kv, S, hd]
    ctx = g.op("MatMul", [probs, vt], name=f"{prefix}/Context")  # [kv, group*T, hd]
    ctx = g.op("Reshape", [ctx, g.const([kv, group, -1, hd])], name=f"{prefix}/CtxUnfold")
    ctx = g.op("Transpose", [ctx], name=f"{prefix}/CtxTranspose", perm=[2, 0, 1, 3])  # [T, kv, group, hd]
    ctx = g.op("Reshape", [ctx, g.const([-1, arch.num_heads * hd])], name=f"{prefix}/CtxFlat")
    return _output_projection(g, layer, hidden, ctx, prefix)


def add_gqa_attention(g: GraphBuilder, arch: ArchConfig, layer: LayerWeights, index: int, hidden: str, cos: str,
                      sin: str, bias: str, past_k: str, past_v: str, seqlens: str, total: str) -> str:
    """The same attention as :func:`add_attention` on ONNX Runtime's GroupQueryAttention (ort
    flavour). The runtime binds one buffer per layer as both ``past_*`` and ``present_*``, so
    the kernel writes the new rows at their positions and reads the past in place: no copy of
    the past per token."""
    prefix = f"/model/layers.{index}/attn"
    q, k, v = _projections(g, arch, layer, hidden, cos, sin, prefix)
    hd = arch.head_dim
    q = g.op("Reshape", [q, g.const([-1, arch.num_heads * hd])], name=f"{prefix}/QFlat")
    k = g.op("Reshape", [k, g.const([-1, arch.num_kv_heads * hd])], name=f"{prefix}/KFlat")
    packed = g.op("Concat", [q, k, v], name=f"{prefix}/QKVPack", axis=-1)  # [T, (heads + 2 kv) hd]
    packed = g.op("Unsqueeze", [packed, g.const([0])], name=f"{prefix}/Batch")
    ctx, present_k, present_v = g.op(
        "GroupQueryAttention", [packed, "", "", past_k, past_v, seqlens, total, "", "", "", bias],
        name=f"{prefix}/GroupQueryAttention", n_outputs=3, domain=CONTRIB_DOMAIN,
        num_heads=arch.num_heads, kv_num_heads=arch.num_kv_heads, scale=1.0)  # 1/sqrt(hd) is in q already
    cache_shape = [1, arch.num_kv_heads, "capacity", hd]
    g.output(present_k, "present_key", TensorProto.FLOAT, cache_shape)
    g.output(present_v, "present_value", TensorProto.FLOAT, cache_shape)
    ctx = g.op("Reshape", [ctx, g.const([-1, arch.num_heads * hd])], name=f"{prefix}/CtxFlat")
    return _output_projection(g, layer, hidden, ctx, prefix)


ATTENTION_FLAVOURS = {"portable": (_attention_inputs, add_attention), "ort": (_gqa_inputs, add_gqa_attention)}


def graph_flavour(model: onnx.ModelProto) -> str:
    """``ort`` for a graph that needs ONNX Runtime's contrib ops, else ``portable``."""
    return "ort" if any(o.domain == CONTRIB_DOMAIN for o in model.opset_import) else "portable"


def add_mlp(g: GraphBuilder, arch: ArchConfig, layer: LayerWeights, index: int, hidden: str) -> str:
    """Pre-norm SwiGLU MLP of layer ``index`` incl. the residual."""
    prefix = f"/model/layers.{index}/mlp"
    normed = g.rms_norm(hidden, layer.mlp_norm, arch.rms_norm_eps, f"{prefix}/norm")
    gate, up = g.fused_linear(normed, [layer.gate_proj, layer.up_proj], f"{prefix}/gate_up_proj")
    silu = g.op("Mul", [gate, g.op("Sigmoid", [gate], name=f"{prefix}/Sigmoid")], name=f"{prefix}/SiLU")
    act = g.op("Mul", [silu, up], name=f"{prefix}/GateMul")
    down = g.widen(g.linear(act, layer.down_proj, f"{prefix}/down_proj"), f"{prefix}/down_proj")
    return g.op("Add", [hidden, down], name=f"{prefix}/Residual")


def _hidden_output(g: GraphBuilder, arch: ArchConfig, value: str) -> onnx.ModelProto:
    g.output(value, "hidden_out", TensorProto.FLOAT, ["tokens", arch.hidden_size])
    return g.build()


def _attention_graph(name: str, arch: ArchConfig, layer: LayerWeights, index: int, weights: WeightFile | None,
                     flavour: str, with_mlp: bool, kv_dtype: str, activations: str) -> onnx.ModelProto:
    if (flavour, kv_dtype) not in ATTENTION_VARIANTS or (flavour != "portable" and activations != "float32"):
        raise ValueError(f"no {flavour} attention graphs for a {kv_dtype} cache and {activations} activations "
                         f"(variants: {ATTENTION_VARIANTS}; the ort flavour computes in float32)")
    g = GraphBuilder(name, weights, activations)
    inputs, attention = ATTENTION_FLAVOURS[flavour]
    cache = {} if kv_dtype == "float32" else {"kv_dtype": kv_dtype}  # only the portable flavour takes another
    hidden, *rest = inputs(g, arch, **cache)
    hidden = attention(g, arch, layer, index, hidden, *rest, **cache)
    return _hidden_output(g, arch, add_mlp(g, arch, layer, index, hidden) if with_mlp else hidden)


def build_layer(arch: ArchConfig, layer: LayerWeights, index: int, weights: WeightFile | None = None,
                flavour: str = "portable", kv_dtype: str = "float32", activations: str = "float32") -> onnx.ModelProto:
    """The whole decoder layer: the runtime's path for a token that skips nothing."""
    return _attention_graph(f"layer_{index}", arch, layer, index, weights, flavour, True, kv_dtype, activations)


def build_attention(arch: ArchConfig, layer: LayerWeights, index: int, weights: WeightFile | None = None,
                    flavour: str = "portable", kv_dtype: str = "float32",
                    activations: str = "float32") -> onnx.ModelProto:
    return _attention_graph(f"attn_{index}", arch, layer, index, weights, flavour, False, kv_dtype, activations)


def build_mlp(arch: ArchConfig, layer: LayerWeights, index: int, weights: WeightFile | None = None,
              activations: str = "float32") -> onnx.ModelProto:
    g = GraphBuilder(f"mlp_{index}", weights, activations)
    hidden = g.input("hidden", TensorProto.FLOAT, ["tokens", arch.hidden_size])
    return _hidden_output(g, arch, add_mlp(g, arch, layer, index, hidden))


def build_kv_fill(arch: ArchConfig, layer: LayerWeights, index: int, weights: WeightFile | None = None,
                  activations: str = "float32") -> onnx.ModelProto:
    """Outputs in the activation type: the runtime rounds them into its cache's type."""
    prefix = f"/model/layers.{index}/kv_fill"
    g = GraphBuilder(f"kv_{index}", weights, activations)
    hidden, cos, sin = _activation_inputs(g, arch)
    normed = g.rms_norm(hidden, layer.attn_norm, arch.rms_norm_eps, f"{prefix}/norm")
    k, v = g.fused_linear(normed, [layer.k_proj, layer.v_proj], f"{prefix}/kv_proj")
    k = _heads(g, arch, k, arch.num_kv_heads, layer.k_norm, cos, sin, f"{prefix}/k")
    _kv_outputs(g, arch, k, g.heads(v, arch.num_kv_heads, arch.head_dim, f"{prefix}/v_heads"), activations)
    return g.build()


def build_embed(arch: ArchConfig, embedding: Weight, weights: WeightFile | None = None,
                activations: str = "float32") -> onnx.ModelProto:
    """A float16 graph gathers float16 rows and widens them (TensorRT gathers no int8 or
    int4 codes, and its DequantizeLinear takes no gathered codes)."""
    prefix = "/model/embed_tokens"
    g = GraphBuilder("embed", weights, activations)
    ids = g.input("input_ids", TensorProto.INT64, ["tokens"])
    if isinstance(embedding, FloatWeight):
        table = g.float_weight(f"{prefix}.weight", embedding.w, embedding.storage)
        hidden = g.widen(g.op("Gather", [table, ids], name=f"{prefix}/Gather", axis=0), f"{prefix}/Gather")
    else:
        emb = embedding.with_positive_scales()
        if emb.bits == 4 and arch.hidden_size % 2 == 0:
            hidden = _gathered_int4_rows(g, arch, emb, ids, prefix)
        else:
            packed = pack_codes(emb.q, emb.block)
            if packed is None:
                rows = g.op("Gather", [g.tensor(f"{prefix}.qweight", emb.q.astype(np.int8)), ids],
                            name=f"{prefix}/GatherCodes", axis=0)
            else:
                rows = g.unpacked_codes(f"{prefix}.qweight", packed, ids)
            scales = g.block_table(f"{prefix}.scales", emb.scale, emb.scale_factors, ids)
            hidden = g.op("DequantizeLinear", [rows, scales], name=f"{prefix}/DequantizeLinear",
                          axis=1, block_size=emb.block)
            if emb.offset is not None:
                offsets = g.block_table(f"{prefix}.offsets", emb.offset, emb.offset_factors, ids, scales)
                offsets = g.op("Unsqueeze", [offsets, g.const([-1])], name=f"{prefix}/OffsetUnsqueeze")
                blocks = g.op("Reshape", [hidden, g.const([0, -1, emb.block])], name=f"{prefix}/Blocks")
                blocks = g.op("Add", [blocks, offsets], name=f"{prefix}/OffsetAdd")
                hidden = g.op("Reshape", [blocks, g.const([0, arch.hidden_size])], name=f"{prefix}/Flat")
    g.output(hidden, "hidden", TensorProto.FLOAT, ["tokens", arch.hidden_size])
    return g.build()


def _gathered_int4_rows(g: GraphBuilder, arch: ArchConfig, emb: BlockQuantWeight, ids: str, prefix: str) -> str:
    """Rows of an int4 table stored two codes per byte (Gather has no int4 kernel; one code
    per byte doubled the 1.5B's table to 233 MB): the gathered bytes are split into nibbles,
    and ``(code - 8) * scale + offset`` computed in float32 as DequantizeLinear would."""
    packed = g.tensor(f"{prefix}.qweight_packed", _pack_nibbles(emb.q))
    rows = g.op("Gather", [packed, ids], name=f"{prefix}/GatherCodes", axis=0)  # [T, d/2] uint8
    scales = g.block_table(f"{prefix}.scales", emb.scale, emb.scale_factors, ids)
    pairs = g.nibble_pairs(rows, arch.hidden_size, prefix)
    codes = g.op("Cast", [g.op("Reshape", [pairs, g.const([0, -1, emb.block])], name=f"{prefix}/Blocks")],
                 name=f"{prefix}/Cast", to=TensorProto.FLOAT)
    signed = g.op("Sub", [codes, g.const(8.0, np.float32)], name=f"{prefix}/Center")
    scaled = g.op("Mul", [signed, g.op("Unsqueeze", [scales, g.const([-1])], name=f"{prefix}/ScaleUnsqueeze")],
                  name=f"{prefix}/Scale")
    if emb.offset is not None:
        offsets = g.block_table(f"{prefix}.offsets", emb.offset, emb.offset_factors, ids, scales)
        scaled = g.op("Add", [scaled, g.op("Unsqueeze", [offsets, g.const([-1])], name=f"{prefix}/OffsetUnsqueeze")],
                      name=f"{prefix}/OffsetAdd")
    return g.op("Reshape", [scaled, g.const([0, arch.hidden_size])], name=f"{prefix}/Flat")


def build_head(arch: ArchConfig, final_norm: np.ndarray, lm_head: Linear, weights: WeightFile | None = None,
               activations: str = "float32") -> onnx.ModelProto:
    g = GraphBuilder("head", weights, activations)
    hidden = g.input("hidden", TensorProto.FLOAT, ["tokens", arch.hidden_size])
    normed = g.rms_norm(hidden, final_norm, arch.rms_norm_eps, "/model/norm")
    logits = g.widen(g.linear(normed, lm_head, "/lm_head"), "/lm_head")
    g.output(logits, "logits", TensorProto.FLOAT, ["tokens", lm_head.weight.shape[0]])  # reduced heads: fewer
    return g.build()


GraphSpec = tuple[str, str, "int | None", Callable[["WeightFile | None"], onnx.ModelProto]]


def model_graphs(arch: ArchConfig, weights: ModelWeights,
                 target: Target = TARGETS[DEFAULT_TARGET]) -> Iterator[tuple[str, list[GraphSpec]]]:
    """Groups of (graph name, kind, layer, build(weight_file)); the graphs of one group share
    one external weight file, so a layer's weights are stored once for its graphs. The
    attention graphs come in the target's variants, the first one's beside mlp and kv.

    A generator over the layers as they come: build a group's graphs before asking for the
    next one, and only one layer is ever held."""
    act = target.activations
    first, *others = target.attention_variants

    def attention_specs(i: int, layer: LayerWeights, flavour: str, kv_dtype: str) -> list[GraphSpec]:
        return [(attention_graph_name(kind, i, flavour, kv_dtype), kind, i,
                 lambda w, build=build: build(arch, layer, i, w, flavour, kv_dtype, act))
                for kind, build in (("layer", build_layer), ("attn", build_attention))]

    yield "embed", [("embed", "embed", None, lambda w: build_embed(arch, weights.embedding, w, act))]
    for i, layer in enumerate(weights.layers):
        yield f"layer_{i:03d}", [
            *attention_specs(i, layer, *first),
            *((f"{kind}_{i:03d}", kind, i, lambda w, build=build, i=i, layer=layer: build(arch, layer, i, w, act))
              for kind, build in (("mlp", build_mlp), ("kv", build_kv_fill))),
            *(spec for variant in others for spec in attention_specs(i, layer, *variant))]
    yield "head", [("head", "head", None, lambda w: build_head(arch, weights.final_norm, weights.lm_head, w, act))]
