"""What every backend shares: the layer actions a forward plan names (run, attention only,
skipped with its K/V filled, dropped), the plan type, and :class:`LayerwiseModel`, the forward
contract over passes of at most ``chunk_tokens`` tokens that each backend (ONNX Runtime, native,
TensorRT: :mod:`edgeroute.runtime.backends`) implements with a ``_pass`` and a ``head``."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from edgeroute.bundle import ModelEntry
from edgeroute.errors import InputError
from edgeroute.runtime.attention import KVCache
from edgeroute.runtime.memory import PREFILL_CHUNK

RUN, SKIP_MLP, SKIP, DROP = "run", "skip_mlp", "skip", "drop"
LayerPlan = Callable[[int, np.ndarray], str]


def plan_action(plan: Sequence[bool] | LayerPlan | None, layer: int, hidden: np.ndarray | None) -> str:
    """What a forward plan says for ``layer``: RUN without a plan, SKIP for a False entry
    (``hidden``, the current hidden states, is read by a callable plan only)."""
    if plan is None:
        return RUN
    if callable(plan):
        return plan(layer, hidden)
    return RUN if plan[layer] else SKIP


def no_graphs(entry: ModelEntry, backend: str) -> InputError:
    """The error for ONNX Runtime or TensorRT asked to run a model of a bundle without graphs."""
    return InputError(f"backend={backend!r} runs ONNX graphs, and this bundle was exported with --target "
                      f"{entry.target.name}: the GGUF blocks for the native backend only, no graphs; use "
                      "backend='native' (or 'auto'), or export again without --target (both, the default)")


class LayerwiseModel(ABC):
    """What every backend's model shares: the forward contract of
    :class:`edgeroute.runtime.backend.ModelBackend` over a ``_pass`` of at most ``chunk_tokens``
    tokens through the layers and a ``head``; the profiling hook."""

    arch: Any
    chunk_tokens = PREFILL_CHUNK  # the most tokens a pass runs (a TensorRT model: its engines' prefill limit)
    # tokens one pass over the weights serves (the native kernels' tile); None: the backend names
    # none (ONNX Runtime, TensorRT), its cost per extra row unknown here
    pass_rows: int | None = None
    # runs forward_tree / keep_path (the native backend); the others verify drafts as linear chains
    tree_forwards = False
    kernels: str | None = None  # the native library's kernel set ("avx2", "dotprod", ...); None: not native
    # profiling hook: when set, called as timings(kind, seconds) after every graph or kernel
    # call (kind: embed, layer, attn, mlp, kv, head); None costs nothing on the hot path
    timings: Callable[[str, float], None] | None = None

    @property
    def num_layers(self) -> int:
        return self.arch.num_layers

    def _timed(self, kind: str, call: Callable[[], Any]) -> Any:
        if self.timings is None:
            return call()
        start = time.perf_counter()
        try:
            return call()
        finally:
            self.timings(kind, time.perf_counter() - start)

    @abstractmethod
    def head(self, hidden: np.ndarray) -> np.ndarray:
        """Hidden states [T, d] -> logits [T, vocab]."""

    def forward_tree(self, cache: KVCache, ids: Sequence[int] | np.ndarray,
                     parents: Sequence[int] | np.ndarray) -> np.ndarray:
        """A tree of new tokens in one pass (see ``NativeModel.forward_tree``): only where ``tree_forwards``."""
        raise InputError(f"the {self.flavour} backend runs no tree forwards (tree_forwards is False): verify drafts "
                         "as linear chains")

    def keep_path(self, cache: KVCache, path: Sequence[int] | np.ndarray) -> None:
        """Keeps one path of a tree forward (see ``NativeModel.keep_path``): only where ``tree_forwards``."""
        raise InputError(f"the {self.flavour} backend runs no tree forwards (tree_forwards is False)")

    @abstractmethod
    def _pass(self, cache: KVCache, ids: np.ndarray, plan: Sequence[bool] | LayerPlan | None) -> np.ndarray:
        """One pass of at most ``chunk_tokens`` tokens through the layers: the last hidden states."""

    def _after_tokens(self, count: int) -> None:  # noqa: B027 - a hook: nothing to do by default
        """Called after each pass with its token count."""

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
        of the last token. More than ``chunk_tokens`` tokens run as several passes (a callable
        plan then decides per pass)."""
        t = len(ids)
        wanted = t if all_logits else (tail or 1)
        logits, hiddens = [], []
        for offset, hidden in self._passes(cache, ids, plan):
            if all_logits:
                logits.append(self.head(hidden))
            elif offset + len(hidden) > t - wanted:
                hiddens.append(hidden[max(0, t - wanted - offset):])
        if all_logits:
            return np.concatenate(logits) if len(logits) > 1 else logits[0]
        out = self.head(np.concatenate(hiddens) if len(hiddens) > 1 else hiddens[0])
        return out if tail is not None else out[0]

    def hidden_states(self, cache: KVCache, ids: Sequence[int] | np.ndarray,
                      plan: Sequence[bool] | LayerPlan | None = None) -> np.ndarray:
        """``forward`` without the LM head: the last layer's hidden states [T, d] (a trained
        router reads the SLM's)."""
        hiddens = [hidden for _, hidden in self._passes(cache, ids, plan)]
        return np.concatenate(hiddens) if len(hiddens) > 1 else hiddens[0]

    @staticmethod
    def check_room(cache: Any, t: int) -> None:
        """Refuses a pass of ``t`` tokens that is empty or does not fit the cache."""
        if t == 0:
            raise InputError("nothing to run: the token list is empty")
        if cache.length + t > cache.capacity:
            raise InputError(f"{cache.length + t} tokens exceed the context of {cache.capacity}: shorten the prompt "
                             "or export with a larger context")

    def _passes(self, cache: KVCache, ids: Sequence[int] | np.ndarray,
                plan: Sequence[bool] | LayerPlan | None) -> Iterator[tuple[int, np.ndarray]]:
        """(offset, last hidden states) of each pass of at most ``chunk_tokens`` tokens."""
        ids = np.asarray(ids, np.int64).reshape(-1)
        t = ids.shape[0]
        self.check_room(cache, t)
        for offset in range(0, t, self.chunk_tokens):
            chunk = ids[offset:offset + self.chunk_tokens]
            hidden = self._pass(cache, chunk, plan)
            self._after_tokens(len(chunk))
            yield offset, hidden
