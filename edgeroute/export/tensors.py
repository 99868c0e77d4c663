"""Weight representations handed from model sources to the graph builder.

A linear layer computes ``y = x @ W.T (+ bias)`` with ``W`` of shape ``[out, in]``.
``W`` is either a float matrix or a *block-quantized* matrix::

    W[o, i] = scale[o, i // block] * q[o, i] + offset[o, i // block]

``q`` holds signed integers of ``bits`` bits (4: -8..7, 8: -128..127). Without ``offset``
this is exactly ONNX ``DequantizeLinear`` (symmetric, blocked along the input axis), which
both ONNX Runtime and TensorRT 10 run. The per-block ``offset`` is how asymmetric formats
(GGUF Q4_1 / Q4_K, asymmetric GPTQ) are carried over *exactly*: it contributes
``blocksum(x) @ offset.T``, a small extra MatMul on the activations' block sums.

K-quant scales and offsets are themselves small integers times a per-super-block fp16 step
(:class:`BlockFactors`); a weight that keeps them stores the tables that way on disk, a
quarter of the fp32 bytes, and the graph multiplies them out once when the session loads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar, overload

import numpy as np

QUANT_RANGES = {4: (-8, 7), 8: (-128, 127)}


@dataclass(frozen=True)
class BlockFactors:
    """A per-block table written as integer codes times a per-group step::

        table[o, b] = step[o, b // group] * codes[o, b]  (+ scale_multiple * scale[o, b])

    The K-quant formats store exactly this: 6- or 8-bit sub-block scales (and mins) times the
    super-block's fp16 ``d`` (``dmin``), and a Q4_K/Q5_K offset is ``zero * scale - dmin * m``.
    Every product is exact in float32 (an 11-bit significand times an integer under 256), so
    the graph's float32 ``Mul``/``Add`` reproduce the table bit for bit."""

    codes: np.ndarray  # int16 [out, n_blocks], values inside int8 or uint8
    step: np.ndarray  # float32 [out, n_blocks // group]
    group: int
    scale_multiple: int = 0

    def table(self, scale: np.ndarray) -> np.ndarray:
        step = np.repeat(self.step, self.group, axis=1)
        table = step * self.codes.astype(np.float32)
        if self.scale_multiple:
            table = np.float32(self.scale_multiple) * scale + table
        return table.astype(np.float32)

    def take_rows(self, rows: np.ndarray) -> BlockFactors:
        return BlockFactors(self.codes[rows], self.step[rows], self.group, self.scale_multiple)

    def times(self, factor: float) -> BlockFactors | None:
        """The table times ``factor``, still exact when ``factor`` is a power of two (else None)."""
        if np.frexp(np.float32(abs(factor)))[0] != 0.5:
            return None
        return BlockFactors(self.codes, self.step * np.float32(factor), self.group, self.scale_multiple)

    @staticmethod
    def stacked(parts: Sequence[BlockFactors | None]) -> BlockFactors | None:
        """Factors of row-stacked tables, when every part has compatible ones."""
        if any(p is None for p in parts) or len({(p.group, p.scale_multiple) for p in parts}) != 1:
            return None
        return BlockFactors(np.concatenate([p.codes for p in parts]), np.concatenate([p.step for p in parts]),
                            parts[0].group, parts[0].scale_multiple)


@dataclass
class BlockQuantWeight:
    q: np.ndarray  # int8 [out, in], values inside QUANT_RANGES[bits]
    scale: np.ndarray  # float32 [out, ceil(in / block)]
    bits: int
    block: int
    offset: np.ndarray | None = None  # float32 [out, in // block]
    origin: str = "rtn"  # how it was made: rtn, gptq, gguf:Q4_1, gptq-checkpoint, ...
    # how ``scale`` / ``offset`` are stored when they factor exactly (K-quants); None: as floats
    scale_factors: BlockFactors | None = None
    offset_factors: BlockFactors | None = None

    def __post_init__(self) -> None:
        lo, hi = QUANT_RANGES[self.bits]
        out, inp = self.q.shape
        n_blocks = -(-inp // self.block)
        if self.scale.shape != (out, n_blocks):
            raise ValueError(f"scale shape {self.scale.shape} != {(out, n_blocks)}")
        if self.offset is not None:
            if inp % self.block:
                raise ValueError("a per-block offset needs the input size to be a multiple of the block")
            if self.offset.shape != (out, n_blocks):
                raise ValueError(f"offset shape {self.offset.shape} != {(out, n_blocks)}")
        if self.q.size and (self.q.min() < lo or self.q.max() > hi):
            raise ValueError(f"int{self.bits} values out of range [{lo}, {hi}]")
        if self.scale_factors is not None and not np.array_equal(self.scale_factors.table(self.scale), self.scale):
            raise ValueError("scale_factors do not reproduce the scales")
        if self.offset_factors is not None and (
                self.offset is None or not np.array_equal(self.offset_factors.table(self.scale), self.offset)):
            raise ValueError("offset_factors do not reproduce the offsets")

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape

    def dequantize(self) -> np.ndarray:
        out, inp = self.q.shape
        scale = np.repeat(self.scale, self.block, axis=1)[:, :inp]
        w = self.q.astype(np.float32) * scale
        if self.offset is not None:
            w += np.repeat(self.offset, self.block, axis=1)
        return w.astype(np.float32)

    def take_rows(self, rows: np.ndarray) -> BlockQuantWeight:
        """The same weight with output rows reordered (exact: blocks run along the input)."""
        return BlockQuantWeight(
            self.q[rows], self.scale[rows], self.bits, self.block,
            None if self.offset is None else self.offset[rows], self.origin,
            *(None if f is None else f.take_rows(rows) for f in (self.scale_factors, self.offset_factors)),
        )

    def with_positive_scales(self) -> BlockQuantWeight:
        """The same matrix with every scale >= 0 (TensorRT rejects negative Q/DQ scales).

        A block with scale s < 0 becomes |s| * (-q) when no code is the range's minimum (5/6/8
        -bit GGUF codes sit in int8 with room to spare, so this is the usual case; no offset,
        none to read per token), else |s| * (-q - 1) + |s|: the flipped codes stay inside the
        signed range and the per-block offset absorbs the shift."""
        negative = self.scale < 0
        if not negative.any():
            return self
        if self.q.shape[1] % self.block:
            raise ValueError("negative scales need the input size to be a multiple of the block")
        q = self.q.copy()
        blocks = q.reshape(q.shape[0], -1, self.block)
        shifted = negative & (blocks == QUANT_RANGES[self.bits][0]).any(axis=2)
        np.negative(blocks, out=blocks, where=(negative & ~shifted)[..., None])
        np.invert(blocks, out=blocks, where=shifted[..., None])  # ~q == -q - 1 in two's complement
        scale = np.abs(self.scale)
        offset = self.offset
        if shifted.any():
            offset = np.zeros_like(scale) if offset is None else offset.copy()
            offset[shifted] += scale[shifted]
        # |step * code| == |step| * |code|; an offset tied to the flipped scales no longer factors
        factors = self.scale_factors
        if factors is not None:
            factors = BlockFactors(np.abs(factors.codes), np.abs(factors.step), factors.group)
        return BlockQuantWeight(q, scale, self.bits, self.block, offset, self.origin, factors)

    def times(self, factor: float) -> BlockQuantWeight:
        """The matrix times a constant, exactly on the quantized grid (only scales move)."""
        f = np.float32(factor)
        return BlockQuantWeight(self.q, self.scale * f, self.bits, self.block,
                                None if self.offset is None else self.offset * f, self.origin,
                                *(None if x is None else x.times(factor)
                                  for x in (self.scale_factors, self.offset_factors)))


@dataclass
class FloatWeight:
    w: np.ndarray  # float32 [out, in] (or [rows, cols] for the embedding table)
    storage: str = "fp32"  # fp32 | fp16: how the graph stores it

    @property
    def shape(self) -> tuple[int, int]:
        return self.w.shape

    def dequantize(self) -> np.ndarray:
        return self.w

    def take_rows(self, rows: np.ndarray) -> FloatWeight:
        return FloatWeight(self.w[rows], self.storage)


Weight = BlockQuantWeight | FloatWeight


@dataclass
class Linear:
    weight: Weight
    bias: np.ndarray | None = None  # float32 [out]
    # Input channels in the order the quantized columns are stored (GPTQ act-order
    # checkpoints): the graph gathers x[..., input_order] before the MatMul.
    input_order: np.ndarray | None = None

    def dequantize(self) -> np.ndarray:
        """The float [out, in] matrix in the model's own input order."""
        w = self.weight.dequantize()
        if self.input_order is None:
            return w
        full = np.empty_like(w)
        full[:, self.input_order] = w
        return full


@dataclass
class LayerWeights:
    attn_norm: np.ndarray
    q_proj: Linear
    k_proj: Linear
    v_proj: Linear
    o_proj: Linear
    mlp_norm: np.ndarray
    gate_proj: Linear
    up_proj: Linear
    down_proj: Linear
    q_norm: np.ndarray | None = None  # Qwen3: RMSNorm over each head, before RoPE
    k_norm: np.ndarray | None = None

    LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

    def linears(self) -> dict[str, Linear]:
        return {name: getattr(self, name) for name in self.LINEARS}


class LazyLayers(Sequence[LayerWeights]):
    """Decoder layers made on access (read from the source, quantized, ...) and never kept.

    A model streams through export one layer at a time: a 7B model's layers in float32 alone
    would take 26 GB, one of them 0.9 GB."""

    def __init__(self, make: Callable[[int], LayerWeights], indices: range) -> None:
        self._make, self._indices = make, indices

    def __len__(self) -> int:
        return len(self._indices)

    @overload
    def __getitem__(self, index: int) -> LayerWeights: ...
    @overload
    def __getitem__(self, index: slice) -> LazyLayers: ...
    def __getitem__(self, index):
        if isinstance(index, slice):
            return LazyLayers(self._make, self._indices[index])
        return self._make(self._indices[index])


def lazy_map(layers: Sequence[LayerWeights], transform: Callable[[LayerWeights], LayerWeights]) -> LazyLayers:
    """``transform`` applied to each layer when that layer is asked for."""
    return LazyLayers(lambda i: transform(layers[i]), range(len(layers)))


T = TypeVar("T")


def _loaded(value: T | Callable[[], T]) -> T:
    return value() if callable(value) else value


@dataclass
class ModelWeights:
    """A model's weights. The embedding and the head may be given as loaders (called on each
    access, nothing kept) and the layers as a :class:`LazyLayers` or a one-pass iterable
    (GPTQ's quantized layers, which depend on the ones before), so no more than one layer,
    the embedding or the head need to be in memory at once."""

    embedding_source: Weight | Callable[[], Weight]  # [vocab, hidden]; gathered by token id
    layers: Sequence[LayerWeights] | Iterable[LayerWeights]
    final_norm: np.ndarray
    lm_head_source: Linear | Callable[[], Linear]  # [vocab, hidden]
    notes: list[str] = field(default_factory=list)

    @property
    def embedding(self) -> Weight:
        return _loaded(self.embedding_source)

    @property
    def lm_head(self) -> Linear:
        return _loaded(self.lm_head_source)

    def truncated(self, n_layers: int) -> ModelWeights:
        """The first ``n_layers`` decoder layers with the same embedding, norm and head."""
        return ModelWeights(self.embedding_source, self.layers[:n_layers], self.final_norm, self.lm_head_source,
                            [*self.notes, f"truncated to the first {n_layers} layers"])


def scale_linear(linear: Linear, factor: float) -> Linear:
    """The linear times a constant, exactly on the quantized grid (only scales move)."""
    w = linear.weight
    if isinstance(w, FloatWeight):
        scaled: Weight = FloatWeight(w.w * np.float32(factor), w.storage)
    else:
        scaled = w.times(factor)
    bias = None if linear.bias is None else linear.bias * np.float32(factor)
    return Linear(scaled, bias, linear.input_order)


def fuse_linears(linears: list[Linear]) -> Linear | None:
    """Linears on the same input stacked along their outputs, or None when their formats
    differ (then the graph keeps them apart)."""
    weights = [lin.weight for lin in linears]
    if any(lin.input_order is not None for lin in linears):
        return None
    if all(isinstance(w, FloatWeight) for w in weights) and len({w.storage for w in weights}) == 1:
        fused: Weight = FloatWeight(np.concatenate([w.w for w in weights]), weights[0].storage)
    elif all(isinstance(w, BlockQuantWeight) for w in weights) and len({(w.bits, w.block) for w in weights}) == 1:
        weights = [w.with_positive_scales() for w in weights]
        offsets = None
        if any(w.offset is not None for w in weights):
            offsets = np.concatenate([np.zeros_like(w.scale) if w.offset is None else w.offset for w in weights])
        fused = BlockQuantWeight(np.concatenate([w.q for w in weights]), np.concatenate([w.scale for w in weights]),
                                 weights[0].bits, weights[0].block, offsets, weights[0].origin,
                                 BlockFactors.stacked([w.scale_factors for w in weights]),
                                 BlockFactors.stacked([w.offset_factors for w in weights]))
    else:
        return None
    biases = None
    if any(lin.bias is not None for lin in linears):
        biases = np.concatenate([np.zeros(lin.weight.shape[0], np.float32) if lin.bias is None else lin.bias
                                 for lin in linears])
    return Linear(fused, biases)
