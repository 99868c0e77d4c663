"""The ONNX Runtime backend: one model of a bundle (LLM or SLM), driven layer by layer.

The sessions are loaded once and shared; each sequence owns a :class:`KVCache` of fixed
capacity, allocated once. A forward step over T tokens starting at cache position P runs
``embed``, then per layer either ``layer_i`` (or ``attn_i`` + an MLP skip) or, for a skipped
layer, ``kv_i`` (its K/V projections of the current hidden state, so later tokens see an
aligned cache), then ``head``. The attention graphs come in the bundle's flavours (see
:mod:`edgeroute.runtime.attention`); the model runs one of them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from collections.abc import Sequence

import numpy as np
import onnxruntime as ort

from edgeroute.bundle import ATTENTION_VARIANTS, Bundle, ModelEntry
from edgeroute.cpu import thread_count
from edgeroute.errors import InputError
from edgeroute.kv_formats import GRAPH_KV_DTYPES, check_kv_dtype
from edgeroute.rope import rope_tables
from edgeroute.runtime.attention import ATTENTION_CHOICES, FLAVOURS, KVCache
from edgeroute.runtime.layers import RUN, SKIP, SKIP_MLP, LayerPlan, LayerwiseModel, no_graphs, plan_action
from edgeroute.runtime.vocab import HeadVocabulary

KV_OUTPUTS = ["key", "value"]
# After every this many tokens run (one long pass, or many one-token steps), freed memory goes
# back to the OS: 25-80 ms after a 256-token chunk of a long prompt, ~1 ms during decode
# (one-token steps allocate blocks that grow with the context, which the heap cannot reuse).
TRIM_AFTER_TOKENS = 64
_pool_lock = threading.Lock()
_global_pool: bool | None = None


def _shared_thread_pool(threads: int | None = None) -> bool:
    """One intra-op pool for every session in the process: with a pool per session, dozens
    of per-layer sessions fight over the cores (measured: 3-8 vs ~160 tok/s on 2 cores). The
    first model opened sizes it: ``threads``, else $EDGEROUTE_THREADS, else every core."""
    global _global_pool
    with _pool_lock:
        if _global_pool is None:
            threads = thread_count(threads)
            try:
                ort.set_global_thread_pool_sizes(threads, 1)
                _global_pool = True
            except (RuntimeError, ort.capi.onnxruntime_pybind11_state.Fail):
                _global_pool = False  # ORT's environment already exists: fall back to per-session pools
        return _global_pool


# glibc's malloc thresholds, fixed per process (EDGEROUTE_MALLOC_TUNING=0 keeps glibc's
# defaults): blocks of the mmap threshold and more are mapped, and unmapped when freed (a long
# pass's attention scores, tens of MB, go straight back to the OS); smaller ones are reused
# from the heap, whose free top goes back above twice the threshold. The threshold sits above
# the largest block a decode step allocates (the portable attention's past K or V with the new
# row, capacity x kv x head_dim floats), because a mapped block is page-faulted in afresh on
# every step (measured: SmolLM2 decode at 5.5-6k tokens of context fell from ~25 to 6.7 tok/s
# once those blocks crossed a 4 MB threshold). glibc's defaults move instead: freeing one large
# mapped block raises both to its size (up to 32 / 64 MB), and from then on freed memory stays.
MMAP_THRESHOLD = 4 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)


def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    return libc if libc is not None and hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None


_libc = _glibc()


def release_freed_memory() -> None:
    """glibc's ``malloc_trim`` (a no-op elsewhere). With the arena off, ONNX Runtime's large
    transient tensors come from malloc, and glibc keeps what a long prefill freed (measured:
    RSS 842 MiB after an 1800-token SmolLM2 prompt without trimming, 324 MiB with)."""
    if _libc is not None:
        _libc.malloc_trim(0)


_mmap_threshold = 0


def tune_malloc(largest_step_block: int = 0) -> None:
    """Fix glibc's thresholds above ``largest_step_block`` bytes (see MMAP_THRESHOLD); a
    later model with larger blocks raises them, nothing lowers them."""
    global _mmap_threshold
    threshold = max(MMAP_THRESHOLD, 2 * largest_step_block)
    with _pool_lock:
        if threshold <= _mmap_threshold or _libc is None or os.environ.get("EDGEROUTE_MALLOC_TUNING", "1") == "0":
            return
        _libc.mallopt(_M_MMAP_THRESHOLD, threshold)
        _libc.mallopt(_M_TRIM_THRESHOLD, 2 * threshold)
        _mmap_threshold = threshold


# ONNX Runtime's fused int4 kernel (MatMulNBits) quantizes activations to int8 at accuracy
# level 4 (fast; llama.cpp's Q4 x Q8 dot products do the same) and keeps them fp32 at level 1
# (measured ~2.7x slower per MLP on 2 cores, but rounding stays at fp32 scale: int8 activations
# turn 1e-7 differences between a one-token step and a multi-token pass into ~2% logit changes).
ACTIVATION_PRECISION = {"int8": "4", "fp32": "1"}


def session_options(activations: str = "int8", threads: int | None = None) -> ort.SessionOptions:
    if activations not in ACTIVATION_PRECISION:
        raise InputError(f"activation precision {activations!r} is not one of {', '.join(ACTIVATION_PRECISION)}")
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # No CPU arena: an arena per session keeps its peak for the life of the process (dozens
    # of per-layer sessions once held 10 GB after one long prompt; measured RSS 1,197 vs 430 MiB
    # after a 500-token prompt on the SmolLM2 demo, 242 MiB after load); plain allocations
    # return a prefill's transient memory at once, and decode allocates only a few small tensors.
    options.enable_cpu_mem_arena = False
    # nor memory patterns: ONNX Runtime keeps one per distinct set of input shapes, and the past
    # grows by a token per step (measured: +85 KB of RSS per decoded token, for good)
    options.enable_mem_pattern = False
    options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", ACTIVATION_PRECISION[activations])
    if _shared_thread_pool(threads):
        options.use_per_session_threads = False
    elif threads:
        options.intra_op_num_threads = threads
    return options


def choose_flavour(entry: ModelEntry, requested: str = "auto", kv_dtype: str = "float32") -> str:
    """The attention flavour to run. ``auto`` is ``portable``: on the CPU provider ONNX
    Runtime's GroupQueryAttention kernel (the ort flavour) measured no faster than the
    portable graphs for SmolLM2 (it reads K/V once per query head; the portable graph's
    batched MatMuls read them once per KV head), and other providers run the portable graphs
    anyway (the CUDA kernel wants fp16). ``ort`` stays available where it pays. An fp16 KV
    cache (``kv_dtype``) has portable graphs only, an int8 one none (the native backend's)."""
    if requested not in ATTENTION_CHOICES:
        raise InputError(f"attention {requested!r} is not one of {', '.join(ATTENTION_CHOICES)}")
    if check_kv_dtype(kv_dtype) not in GRAPH_KV_DTYPES:
        raise InputError(f"a {kv_dtype} KV cache runs on the native backend only (no graphs keep one): use "
                         "backend='native' on a model with native weights, or kv_dtype='float16'")
    flavour = "portable" if requested == "auto" else requested
    target = entry.target
    if not target.graphs:
        raise no_graphs(entry, "onnxruntime")
    if (flavour, kv_dtype) not in target.attention_variants and target.attention_variants != ATTENTION_VARIANTS:
        kept = ", ".join(f"{f} attention with a {d} KV cache" for f, d in target.attention_variants)
        raise InputError(f"the bundle was exported for --target {target.name}, whose graphs keep {kept} only "
                         f"(asked: {flavour} attention, a {kv_dtype} cache): use attention='auto' and "
                         "kv_dtype='auto', or re-export without --target")
    if (flavour, kv_dtype) not in ATTENTION_VARIANTS:
        raise InputError(f"the {flavour} attention keeps a float32 KV cache only: use attention='portable' for a "
                         f"{kv_dtype} one")
    if not entry.has_attention(flavour, kv_dtype):
        raise InputError(f"the {entry.role} model has no {flavour!r} attention graphs for a {kv_dtype} KV cache (the "
                         "bundle predates them): re-export it, or use the defaults (attention='auto', kv_dtype="
                         "'float32')")
    return flavour

class OrtModel(LayerwiseModel):
    """A model on ONNX Runtime; implements :class:`edgeroute.runtime.backend.ModelBackend`."""

    def __init__(self, bundle: Bundle, role: str = "llm", providers: Sequence[str] | None = None,
                 activations: str = "int8", attention: str = "auto", exact_steps: bool = False,
                 kv_dtype: str = "float32", threads: int | None = None) -> None:
        if role not in bundle.models:
            raise InputError(f"bundle {bundle.path} has no {role!r} model (it has: {', '.join(bundle.models)})")
        self.entry: ModelEntry = bundle.models[role]
        self.arch = self.entry.arch
        self.capacity = int(bundle.generation["context_length"])
        self.providers = list(providers or ["CPUExecutionProvider"])
        tune_malloc(self.capacity * self.arch.num_kv_heads * self.arch.head_dim * 4)
        self._tokens_since_trim = 0
        self.flavour = choose_flavour(self.entry, attention, kv_dtype)
        self.kv_dtype = kv_dtype
        self._attention = FLAVOURS[self.flavour](self.capacity)
        self._options = session_options(activations, threads)
        # one-token steps run as two rows (see _pass): they then round like a multi-token pass
        self.exact_steps = exact_steps
        self._bundle = bundle
        self._lock = threading.Lock()
        self._closed = False
        layers = range(self.arch.num_layers)
        self.embed_session = self._load("embed")
        self.layer_sessions = [self._load("layer", i, attention=True) for i in layers]
        self.kv_sessions = [self._load("kv", i) for i in layers]
        self.head_session = self._load("head")
        # loading folds constants (factored block tables) and prepacks weights: the freed
        # intermediates go back to the OS (measured on the 1.5B: +2,065 MB after load without)
        release_freed_memory()
        self.head_vocab = HeadVocabulary.load(bundle, role)  # None: the head covers the whole vocabulary
        # sub-layer graphs only serve MLP-only skipping and tests: loaded on first use
        self._attn_sessions: list[ort.InferenceSession | None] = [None] * self.arch.num_layers
        self._mlp_sessions: list[ort.InferenceSession | None] = [None] * self.arch.num_layers
        self.cos, self.sin = rope_tables(self.capacity, self.arch.head_dim, self.arch.rope_theta,
                                         self.arch.rope_scaling)

    def close(self) -> None:
        """Lets go of every ONNX Runtime session now (otherwise when the model is collected) and
        hands the freed memory back to the OS. The model runs nothing after: a graph call is an
        InputError saying so (the caches are host arrays, freed with their last reference)."""
        with self._lock:
            self._closed = True
            self.embed_session = self.head_session = None
            count = self.arch.num_layers
            self.layer_sessions, self.kv_sessions = [None] * count, [None] * count
            self._attn_sessions, self._mlp_sessions = [None] * count, [None] * count
        release_freed_memory()

    def _live(self, session: ort.InferenceSession | None) -> ort.InferenceSession:
        if session is None:
            raise InputError(f"the {self.entry.role} model was closed (its engine closed): open the bundle again")
        return session

    def _load(self, kind: str, layer: int | None = None, attention: bool = False) -> ort.InferenceSession:
        """A graph's session; an ``attention`` graph in this model's flavour and KV dtype."""
        graph = self.entry.graph(kind, layer, self.flavour, self.kv_dtype) if attention else self.entry.graph(kind, layer)
        return ort.InferenceSession(str(self._bundle.file(graph.file)), self._options, providers=self.providers)

    def _lazy(self, sessions: list[ort.InferenceSession | None], kind: str, layer: int,
              attention: bool = False) -> ort.InferenceSession:
        if sessions[layer] is None:
            with self._lock:
                if self._closed:
                    self._live(None)
                if sessions[layer] is None:
                    sessions[layer] = self._load(kind, layer, attention)
        return sessions[layer]

    def new_cache(self, capacity: int | None = None) -> KVCache:
        return KVCache.allocate(self.num_layers, capacity or self.capacity, self.arch.num_kv_heads,
                                self.arch.head_dim, self._attention.heads_first, self.kv_dtype)

    # -- graph calls ----------------------------------------------------------------------------

    def _run(self, session: ort.InferenceSession, kind: str, feeds: dict[str, np.ndarray],
             outputs: list[str] | None = None) -> list[np.ndarray]:
        session = self._live(session)
        return self._timed(kind, lambda: session.run(outputs, feeds))

    def embed(self, ids: np.ndarray) -> np.ndarray:
        return self._run(self.embed_session, "embed", {"input_ids": np.asarray(ids, np.int64).reshape(-1)})[0]

    def _rope(self, start: int, t: int) -> dict[str, np.ndarray]:
        return {"cos": self.cos[start:start + t], "sin": self.sin[start:start + t]}

    def layer(self, layer: int, hidden: np.ndarray, cache: KVCache, start: int) -> np.ndarray:
        """The whole decoder layer (attention + MLP) in one call."""
        return self._attend(self.layer_sessions[layer], "layer", layer, hidden, cache, start)

    def attention(self, layer: int, hidden: np.ndarray, cache: KVCache, start: int) -> np.ndarray:
        """The attention sub-layer alone (its residual included)."""
        return self._attend(self._lazy(self._attn_sessions, "attn", layer, attention=True), "attn", layer, hidden,
                            cache, start)

    def _attend(self, session: ort.InferenceSession, kind: str, layer: int, hidden: np.ndarray, cache: KVCache,
                start: int) -> np.ndarray:
        session = self._live(session)
        feeds = {"hidden": hidden, **self._rope(start, hidden.shape[0])}
        return self._timed(kind, lambda: self._attention.run(session, kind, layer, cache, start, feeds))

    def mlp(self, layer: int, hidden: np.ndarray) -> np.ndarray:
        return self._run(self._lazy(self._mlp_sessions, "mlp", layer), "mlp", {"hidden": hidden})[0]

    def kv_fill(self, layer: int, hidden: np.ndarray, cache: KVCache, start: int) -> None:
        key, value = self._run(self.kv_sessions[layer], "kv", {"hidden": hidden, **self._rope(start, hidden.shape[0])},
                               KV_OUTPUTS)
        cache.write(layer, start, key, value)

    def head(self, hidden: np.ndarray) -> np.ndarray:
        return self._run(self.head_session, "head", {"hidden": np.ascontiguousarray(hidden)})[0]

    # -- steps ----------------------------------------------------------------------------------

    def _after_tokens(self, count: int) -> None:
        self._tokens_since_trim += count
        if self._tokens_since_trim >= TRIM_AFTER_TOKENS:
            release_freed_memory()
            self._tokens_since_trim = 0

    def _pass(self, cache: KVCache, ids: np.ndarray, plan: Sequence[bool] | LayerPlan | None) -> np.ndarray:
        """One pass of the tokens through every layer; returns the last hidden states.

        With ``exact_steps``, a one-token step without a plan runs as two rows, the token
        twice; the second row's K/V lands beyond the cache's length (overwritten by the next
        token) and its output is dropped. Why: ONNX Runtime's int4 kernel (MatMulNBits with
        int8 activations) takes a GEMV path at M = 1 that rounds differently from M >= 2,
        where every row gets the same bits whatever M is; a speculative verification pass
        (M >= 2) then reproduces these steps bit for bit. The price is the second row's work
        (docs/measured/2026-11-30-kv-fp16-ort-exact-steps.md); at the context's last position the step
        runs as one row."""
        start, t = cache.length, ids.shape[0]
        if self.exact_steps and t == 1 and plan is None and start + 2 <= cache.capacity:
            hidden = self._pass(cache, np.repeat(ids, 2), None)[:1]
            cache.length = start + 1
            return hidden
        hidden = self.embed(ids)
        for layer in range(self.num_layers):
            action = plan_action(plan, layer, hidden)
            if action == RUN:
                hidden = self.layer(layer, hidden, cache, start)
            elif action == SKIP_MLP:
                hidden = self.attention(layer, hidden, cache, start)
            elif action == SKIP:
                self.kv_fill(layer, hidden, cache, start)
            else:  # DROP
                cache.drop(layer, start, t)
        cache.length = start + t
        return hidden
