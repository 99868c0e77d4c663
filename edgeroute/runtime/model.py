"""One model of a bundle (LLM or SLM) on ONNX Runtime, driven layer by layer.

The sessions are loaded once and shared; each sequence owns a :class:`KVCache` of fixed
capacity, allocated once. A forward step over T tokens starting at cache position P runs
``embed``, then per layer either ``attn_i`` + ``mlp_i`` or, for a skipped layer, ``kv_i``
(its K/V projections of the current hidden state, so later tokens see an aligned cache),
then ``head``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from edgeroute.bundle import Bundle, ModelEntry
from edgeroute.errors import InputError
from edgeroute.rope import rope_tables

ATTENTION_OUTPUTS = ["hidden_out", "key", "value"]
KV_OUTPUTS = ["key", "value"]
_pool_lock = threading.Lock()
_global_pool: bool | None = None


def _shared_thread_pool() -> bool:
    """One intra-op pool for every session in the process: with a pool per session, dozens
    of per-layer sessions fight over the cores (measured: 3-8 vs ~160 tok/s on 2 cores)."""
    global _global_pool
    with _pool_lock:
        if _global_pool is None:
            threads = int(os.environ.get("EDGEROUTE_THREADS", 0)) or (os.cpu_count() or 1)
            try:
                ort.set_global_thread_pool_sizes(threads, 1)
                _global_pool = True
            except (RuntimeError, ort.capi.onnxruntime_pybind11_state.Fail):
                _global_pool = False  # ORT's environment already exists: fall back to per-session pools
        return _global_pool


# ONNX Runtime's fused int4 kernel (MatMulNBits) quantizes activations to int8 at accuracy
# level 4 (fast; llama.cpp's Q4 x Q8 dot products do the same) and keeps them fp32 at level 1
# (measured ~2.7x slower per MLP on 2 cores, but rounding stays at fp32 scale: int8 activations
# turn 1e-7 differences between a one-token step and a multi-token pass into ~2% logit changes).
ACTIVATION_PRECISION = {"int8": "4", "fp32": "1"}


def session_options(activations: str = "int8") -> ort.SessionOptions:
    if activations not in ACTIVATION_PRECISION:
        raise InputError(f"activation precision {activations!r} is not one of {', '.join(ACTIVATION_PRECISION)}")
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", ACTIVATION_PRECISION[activations])
    # Without the CPU arena, a long prompt's transient activations go back to the system after
    # the pass; each session's arena would keep its peak for the life of the process (measured:
    # RSS 1,197 vs 430 MiB after a 500-token prompt on the SmolLM2 demo, 242 MiB after load).
    options.enable_cpu_mem_arena = False
    if _shared_thread_pool():
        options.use_per_session_threads = False
    return options


RUN, SKIP_MLP, SKIP, DROP = "run", "skip_mlp", "skip", "drop"
LayerPlan = Callable[[int, np.ndarray], str]


def plan_action(plan: Sequence[bool] | LayerPlan | None, layer: int, hidden: np.ndarray) -> str:
    """What a forward plan says for ``layer``: RUN without a plan, SKIP for a False entry."""
    if plan is None:
        return RUN
    if callable(plan):
        return plan(layer, hidden)
    return RUN if plan[layer] else SKIP


@dataclass
class KVCache:
    keys: np.ndarray  # [layers, capacity, kv_heads, head_dim]
    values: np.ndarray
    length: int = 0
    dropped: np.ndarray | None = None  # [layers, capacity] bool, only once a layer was dropped

    def drop(self, layer: int, start: int, count: int) -> None:
        if self.dropped is None:
            self.dropped = np.zeros(self.keys.shape[:2], bool)
        self.dropped[layer, start:start + count] = True

    @property
    def capacity(self) -> int:
        return self.keys.shape[1]

    def truncate(self, length: int) -> None:
        """Forget positions >= length (rejected speculative tokens)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} tokens to {length}")
        if self.dropped is not None:
            self.dropped[:, length:] = False
        self.length = length

    def clone(self) -> KVCache:
        """A compact copy of the cached positions (capacity = length), e.g. a shared prompt
        prefix (computed with every layer run: no dropped positions to carry)."""
        n = self.length
        return KVCache(self.keys[:, :n].copy(), self.values[:, :n].copy(), n)

    def copy_from(self, source: KVCache) -> None:
        """Become a copy of ``source``'s cached positions (a session starting from a shared prefix)."""
        n = source.length
        if n > self.capacity:
            raise ValueError(f"a cache of {n} tokens does not fit a capacity of {self.capacity}")
        self.keys[:, :n] = source.keys[:, :n]
        self.values[:, :n] = source.values[:, :n]
        self.truncate(0)  # clears any dropped-position mask
        self.length = n


class OrtModel:
    def __init__(self, bundle: Bundle, role: str = "llm", providers: Sequence[str] | None = None,
                 activations: str = "int8") -> None:
        if role not in bundle.models:
            raise InputError(f"bundle {bundle.path} has no {role!r} model (it has: {', '.join(bundle.models)})")
        self.entry: ModelEntry = bundle.models[role]
        self.arch = self.entry.arch
        self.capacity = int(bundle.generation["context_length"])
        self.providers = list(providers or ["CPUExecutionProvider"])
        self._options = session_options(activations)
        self._bundle = bundle
        self._lock = threading.Lock()
        layers = range(self.arch.num_layers)
        self.embed_session = self._load("embed")
        self.layer_sessions = [self._load("layer", i) for i in layers]
        self.kv_sessions = [self._load("kv", i) for i in layers]
        self.head_session = self._load("head")
        # sub-layer graphs only serve MLP-only skipping and tests: loaded on first use
        self._attn_sessions: list[ort.InferenceSession | None] = [None] * self.arch.num_layers
        self._mlp_sessions: list[ort.InferenceSession | None] = [None] * self.arch.num_layers
        self._zero_row = np.zeros((1, self.capacity), np.float32)
        self.cos, self.sin = rope_tables(self.capacity, self.arch.head_dim, self.arch.rope_theta,
                                         self.arch.rope_scaling)

    def _load(self, kind: str, layer: int | None = None) -> ort.InferenceSession:
        path = self._bundle.file(self.entry.graph(kind, layer).file)
        return ort.InferenceSession(str(path), self._options, providers=self.providers)

    def _lazy(self, sessions: list[ort.InferenceSession | None], kind: str, layer: int) -> ort.InferenceSession:
        if sessions[layer] is None:
            with self._lock:
                if sessions[layer] is None:
                    sessions[layer] = self._load(kind, layer)
        return sessions[layer]

    @property
    def num_layers(self) -> int:
        return self.arch.num_layers

    def new_cache(self, capacity: int | None = None) -> KVCache:
        capacity = capacity or self.capacity
        shape = (self.num_layers, capacity, self.arch.num_kv_heads, self.arch.head_dim)
        return KVCache(np.zeros(shape, np.float32), np.zeros(shape, np.float32))

    # -- graph calls ----------------------------------------------------------------------------

    def embed(self, ids: np.ndarray) -> np.ndarray:
        return self.embed_session.run(None, {"input_ids": np.asarray(ids, np.int64).reshape(-1)})[0]

    def layer(self, layer: int, hidden: np.ndarray, cache: KVCache, start: int, bias: np.ndarray) -> np.ndarray:
        """The whole decoder layer (attention + MLP) in one call."""
        return self._attend(self.layer_sessions[layer], layer, hidden, cache, start, bias)

    def attention(self, layer: int, hidden: np.ndarray, cache: KVCache, start: int, bias: np.ndarray) -> np.ndarray:
        """The attention sub-layer alone (its residual included)."""
        return self._attend(self._lazy(self._attn_sessions, "attn", layer), layer, hidden, cache, start, bias)

    def _attend(self, session: ort.InferenceSession, layer: int, hidden: np.ndarray, cache: KVCache, start: int,
                bias: np.ndarray) -> np.ndarray:
        t = hidden.shape[0]
        out, key, value = session.run(ATTENTION_OUTPUTS, {
            "hidden": hidden, "cos": self.cos[start:start + t], "sin": self.sin[start:start + t],
            "attn_bias": bias, "past_key": cache.keys[layer, :start], "past_value": cache.values[layer, :start],
        })
        cache.keys[layer, start:start + t] = key
        cache.values[layer, start:start + t] = value
        return out

    def mlp(self, layer: int, hidden: np.ndarray) -> np.ndarray:
        return self._lazy(self._mlp_sessions, "mlp", layer).run(None, {"hidden": hidden})[0]

    def kv_fill(self, layer: int, hidden: np.ndarray, cache: KVCache, start: int) -> None:
        t = hidden.shape[0]
        key, value = self.kv_sessions[layer].run(KV_OUTPUTS, {
            "hidden": hidden, "cos": self.cos[start:start + t], "sin": self.sin[start:start + t]})
        cache.keys[layer, start:start + t] = key
        cache.values[layer, start:start + t] = value

    def head(self, hidden: np.ndarray) -> np.ndarray:
        return self.head_session.run(None, {"hidden": np.ascontiguousarray(hidden)})[0]

    # -- steps ----------------------------------------------------------------------------------

    def causal_bias(self, start: int, t: int) -> np.ndarray:
        """Additive mask [t, start + t]: every cached position, and the new ones causally. A
        one-token step (the decode hot path) gets a view of a preallocated zero row: nothing
        allocated per token that grows with the context."""
        if t == 1 and start < self.capacity:
            return self._zero_row[:, :start + 1]
        bias = np.zeros((t, start + t), np.float32)
        bias[:, start:] = np.triu(np.full((t, t), np.finfo(np.float32).min, np.float32), k=1)
        return bias

    def layer_bias(self, cache: KVCache, layer: int, bias: np.ndarray) -> np.ndarray:
        """The step's mask plus, under kv_cache_reduction, the positions this layer skipped."""
        if cache.dropped is None:
            return bias
        dropped = cache.dropped[layer, :bias.shape[1]]
        return bias + np.where(dropped, np.finfo(np.float32).min, 0).astype(np.float32) if dropped.any() else bias

    def forward(self, cache: KVCache, ids: Sequence[int] | np.ndarray,
                plan: Sequence[bool] | LayerPlan | None = None, all_logits: bool = False,
                tail: int | None = None) -> np.ndarray:
        """Run T new tokens over the cache (prefill, decode, or catch-up of pending tokens).

        ``plan`` says per layer what the tokens do: a list of booleans (False: skip the layer,
        filling its K/V from the current hidden state) or a callable ``plan(layer, hidden)``
        returning RUN, SKIP_MLP (attention runs, so the cache stays exact; the MLP is
        skipped), SKIP (K/V filled CALM-style) or DROP (skipped, and its cache entries
        masked for later tokens: kv_cache_reduction). Returns logits [T, vocab] with
        ``all_logits``, [tail, vocab] for the last ``tail`` tokens (the LM head is costly: a
        verification pass needs it only where drafts are checked), or by default [vocab]
        of the last token."""
        ids = np.asarray(ids, np.int64).reshape(-1)
        t, start = ids.shape[0], cache.length
        if t == 0:
            raise InputError("nothing to run: the token list is empty")
        if start + t > cache.capacity:
            raise InputError(f"{start + t} tokens exceed the context of {cache.capacity}: shorten the prompt "
                             "or export with a larger context")
        bias = self.causal_bias(start, t)
        hidden = self.embed(ids)
        for layer in range(self.num_layers):
            action = plan_action(plan, layer, hidden)
            if action == RUN:
                hidden = self.layer(layer, hidden, cache, start, self.layer_bias(cache, layer, bias))
            elif action == SKIP_MLP:
                hidden = self.attention(layer, hidden, cache, start, self.layer_bias(cache, layer, bias))
            elif action == SKIP:
                self.kv_fill(layer, hidden, cache, start)
            else:  # DROP
                cache.drop(layer, start, t)
        cache.length = start + t
        if all_logits:
            return self.head(hidden)
        if tail is not None:
            return self.head(hidden[-tail:])
        return self.head(hidden[-1:])[0]
