"""A plain torch forward pass over :class:`ModelWeights` (dequantized), the export side's
reference: it feeds GPTQ its calibration activations and gives the parity figures.

It follows the same math as the ONNX graphs (and transformers' Llama/Qwen2/Qwen3), one
layer at a time, so GPTQ can quantize layer i and feed the quantized outputs to layer i+1.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from edgeroute.arch import ArchConfig
from edgeroute.export.tensors import LayerWeights, Linear, ModelWeights
from edgeroute.rope import rope_tables

Capture = Callable[[str, torch.Tensor], None]
HEAD_ROWS = 16384  # vocabulary rows of the head dequantized at once


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, np.float32))


def rms_norm(x: torch.Tensor, w: np.ndarray, eps: float) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * _t(w)


def linear(x: torch.Tensor, lin: Linear) -> torch.Tensor:
    y = x @ _t(lin.dequantize()).T
    return y if lin.bias is None else y + _t(lin.bias)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class ReferenceModel:
    """Full-sequence forward (no cache) over one token sequence; activations [T, d]."""

    def __init__(self, arch: ArchConfig, weights: ModelWeights) -> None:
        self.arch, self.weights = arch, weights
        cos, sin = rope_tables(arch.max_position_embeddings, arch.head_dim, arch.rope_theta, arch.rope_scaling)
        self.cos, self.sin = torch.from_numpy(cos), torch.from_numpy(sin)

    def embed(self, ids: np.ndarray) -> torch.Tensor:
        return _t(self.weights.embedding.take_rows(np.asarray(ids)).dequantize())

    def layer(self, i: int, x: torch.Tensor, layer: LayerWeights | None = None,
              capture: Capture | None = None) -> torch.Tensor:
        a, w = self.arch, layer or self.weights.layers[i]
        note = capture or (lambda name, value: None)
        t = x.shape[0]
        cos, sin = self.cos[:t], self.sin[:t]
        h = rms_norm(x, w.attn_norm, a.rms_norm_eps)
        note("attn_in", h)
        q = linear(h, w.q_proj).view(t, a.num_heads, a.head_dim)
        k = linear(h, w.k_proj).view(t, a.num_kv_heads, a.head_dim)
        v = linear(h, w.v_proj).view(t, a.num_kv_heads, a.head_dim)
        if w.q_norm is not None:
            q, k = rms_norm(q, w.q_norm, a.rms_norm_eps), rms_norm(k, w.k_norm, a.rms_norm_eps)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        group = a.num_heads // a.num_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        ctx = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
        ctx = ctx.transpose(0, 1).reshape(t, a.num_heads * a.head_dim)
        note("o_in", ctx)
        x = x + linear(ctx, w.o_proj)
        h = rms_norm(x, w.mlp_norm, a.rms_norm_eps)
        note("mlp_in", h)
        act = torch.nn.functional.silu(linear(h, w.gate_proj)) * linear(h, w.up_proj)
        note("down_in", act)
        return x + linear(act, w.down_proj)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Logits, the vocabulary dequantized a slice at a time (a 150k-token head is 0.9 GB
        in float32 for a 1.5B model, 2.2 GB for a 7B one)."""
        h, head = rms_norm(x, self.weights.final_norm, self.arch.rms_norm_eps), self.weights.lm_head
        vocab = head.weight.shape[0]
        return torch.cat([linear(h, Linear(head.weight.take_rows(np.arange(start, min(start + HEAD_ROWS, vocab))),
                                           None if head.bias is None else head.bias[start:start + HEAD_ROWS],
                                           head.input_order))
                          for start in range(0, vocab, HEAD_ROWS)], dim=-1)

    @torch.no_grad()
    def logits(self, ids: np.ndarray) -> np.ndarray:
        x = self.embed(ids)
        for i in range(len(self.weights.layers)):
            x = self.layer(i, x)
        return self.head(x).numpy()
