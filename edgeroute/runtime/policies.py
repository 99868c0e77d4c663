"""Decisions taken per token: routers (call the LLM?), importance scorers and the skip
controller (which layers may a token skip?), and the fallback monitor (stop taking risks).

Every score is in [0, 1] with "higher = needs the full model"; thresholds compare against
it. The baseline signals are uncalibrated heuristics: `edgeroute calibrate` fits thresholds on
the quantized model, and a trained router or scorer drops in behind the same call.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from edgeroute.runtime.drafters import Proposal
from edgeroute.runtime.layers import DROP, RUN, SKIP, SKIP_MLP
from edgeroute.skip_options import SKIP_SCORERS, SkipOptions

# -- routers ------------------------------------------------------------------------------------

Router = Callable[[Proposal, int], float]  # (light proposal, index in it) -> score


def entropy_router(proposal: Proposal, i: int) -> float:
    """SLM predictive entropy, normalised by log(vocab)."""
    p = proposal.probabilities[i]
    if p is None:
        return 1.0
    nz = p[p > 0]
    return float(-(nz * np.log(nz)).sum() / math.log(p.shape[0]))


def top1_router(proposal: Proposal, i: int) -> float:
    """1 - the SLM's probability of its own token."""
    p = proposal.probabilities[i]
    return 1.0 if p is None else float(1.0 - p.max())


def margin_router(proposal: Proposal, i: int) -> float:
    """1 - (top-1 minus top-2 probability) of the SLM."""
    p = proposal.probabilities[i]
    if p is None:
        return 1.0
    top2 = np.partition(p, -2)[-2:]
    return float(1.0 - (top2[1] - top2[0]))


def ngram_router(proposal: Proposal, i: int, min_match: int = 3) -> float:
    """1 for matches shorter than ``min_match`` tokens (short n-grams recur by chance), then
    exp(-(length - min_match + 1) / 2): a 4-token match scores 0.37, an 8-token one 0.05.
    The i-th token of a continuation is trusted less the further it runs."""
    if i >= len(proposal.tokens) or proposal.match_length < min_match:
        return 1.0
    return float(math.exp(-(proposal.match_length - min_match + 1) / (2.0 * (1 + i))))


def always_router(proposal: Proposal, i: int) -> float:
    return 1.0


ROUTERS: dict[str, Router] = {"entropy": entropy_router, "top1": top1_router, "margin": margin_router,
                              "ngram": ngram_router, "always": always_router}

# -- layer skipping -----------------------------------------------------------------------------


def _robust(h: np.ndarray) -> np.ndarray:
    """Clip each row at 8x its mean magnitude: a few massive-activation dimensions (~263 vs
    ~4 typical in SmolLM2) would otherwise decide every cosine and norm on their own. (The
    mean, not the median: a partition per decision costs more than the decision is worth.)"""
    limit = 8.0 * np.abs(h).mean(axis=-1, keepdims=True) + 1e-6
    return np.clip(h, -limit, limit)


def update_importance(before: np.ndarray, now: np.ndarray, reference: float = 0.05) -> float:
    """Relative size of the last layers' update, u / (u + reference): a token whose hidden
    state barely moves (u << 5%) has saturated and may skip."""
    b, n = _robust(before), _robust(now)
    u = float((np.linalg.norm(n - b, axis=-1) / (np.linalg.norm(b, axis=-1) + 1e-6)).max())
    return u / (u + reference)


def cosine_importance(before: np.ndarray, now: np.ndarray, reference: float = 0.01) -> float:
    b, n = _robust(before), _robust(now)
    cos = (b * n).sum(-1) / (np.linalg.norm(b, axis=-1) * np.linalg.norm(n, axis=-1) + 1e-6)
    change = float((1.0 - cos).max())
    return change / (change + reference)


class RandomImportance:
    """A baseline: any useful scorer has to beat skipping random tokens."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)

    def __call__(self, before: np.ndarray, now: np.ndarray) -> float:
        return float(self.rng.random())


def make_scorer(name: str) -> Callable[[np.ndarray, np.ndarray], float]:
    """The importance scorer of ``name`` (one of ``SKIP_SCORERS``)."""
    if name == "update":
        return update_importance
    if name == "cosine":
        return cosine_importance
    if name == "random":
        return RandomImportance()
    raise ValueError(f"importance scorer {name!r} is not one of: {', '.join(SKIP_SCORERS)}")


# one letter per layer action in traces (TokenTrace.layers)
LAYER_LETTERS = {RUN: "r", SKIP_MLP: "m", SKIP: "s", DROP: "d"}


@dataclass
class PassRecord:
    actions: list[str] = field(default_factory=list)
    importance: list[float] = field(default_factory=list)

    @property
    def layers_run(self) -> int:
        return sum(a == RUN for a in self.actions)


class SkipController:
    """FreeToken-style per-token depth: a layer plan for ``OrtModel.forward``.

    Past the protected first layers, every ``re_eval_interval`` layers the scorer compares
    the hidden state with the one at the previous checkpoint; below the threshold the token
    takes the light path for up to ``max_free_layers`` layers, as long as the sequence's
    skipped share stays under ``skip_ratio``. A multi-token pass (catch-up, verification)
    skips a layer only when every token in it may (the scorer takes the row maximum)."""

    def __init__(self, options: SkipOptions, num_layers: int) -> None:
        options.validate(num_layers)
        self.options, self.num_layers = options, num_layers
        self.scorer = make_scorer(options.scorer)
        self.enabled = True
        self.slots = 0  # layer x token work seen so far in this sequence
        self.skipped = 0
        self.last = PassRecord()
        self._free = 0
        self._checkpoint: np.ndarray | None = None

    @property
    def skip_action(self) -> str:
        if self.options.granularity == "mlp":
            return SKIP_MLP
        return DROP if self.options.kv_cache_reduction else SKIP

    def __call__(self, layer: int, hidden: np.ndarray) -> str:
        o, tokens = self.options, hidden.shape[0]
        if layer == 0:
            self.last = PassRecord()
            self.slots += tokens * self.num_layers
            self._free, self._checkpoint = 0, hidden
        action = RUN
        protected = layer < o.protected_first or layer >= self.num_layers - o.protected_last
        if self.enabled and not protected:
            budget_ok = self.skipped + tokens <= o.skip_ratio * self.slots
            if self._free > 0:
                self._free -= 1
                action = self.skip_action if budget_ok else RUN
            elif (layer - o.protected_first) % o.re_eval_interval == 0:
                importance = self.scorer(self._checkpoint, hidden)
                self.last.importance.append(importance)
                self._checkpoint = hidden
                if importance < o.importance_threshold and budget_ok:
                    self._free = o.free_layers(self.num_layers) - 1
                    action = self.skip_action
        if action != RUN:
            self.skipped += tokens
        self.last.actions.append(action)
        return action


# -- fallback -----------------------------------------------------------------------------------


@dataclass
class FallbackOptions:
    window: int = 8  # LLM calls whose confidence is averaged; routed tokens whose calls are counted
    min_confidence: float = 0.35  # mean LLM top-1 probability below this -> fall back
    # the router called the LLM for this share of the last `window` tokens or more -> fall back:
    # a stretch routed that densely costs more than `full` (an SLM step and a catch-up row on
    # top of each LLM pass). 0.75, not the pair's average break-even near 45%: on 26 held-out
    # pair prompts, route/slm ran 52.9 tok/s at 0.75 and at 1.0, 50.7 at 0.5 (a half-dense window
    # is often a short hard spot, and holding the LLM after it gives up the easy tokens that follow)
    max_llm_share: float = 0.75
    hold_tokens: int = 16  # tokens generated with routing and skipping off after a fallback

    def validate(self) -> None:
        from edgeroute.errors import InputError

        if self.window < 1:
            raise InputError(f"the fallback window must be >= 1 LLM call (got {self.window})")
        if not 0.0 <= self.min_confidence <= 1.0:
            raise InputError(f"min_confidence must be within [0, 1] (got {self.min_confidence})")
        if not 0.0 < self.max_llm_share <= 1.0:
            raise InputError(f"max_llm_share must be within (0, 1] (got {self.max_llm_share})")
        if self.hold_tokens < 0:
            raise InputError(f"hold_tokens must be >= 0 (got {self.hold_tokens})")


class FallbackMonitor:
    """Turns routing and skipping off for ``hold_tokens`` tokens when, over a full window, the
    LLM's own top-1 confidence stays low (a single uncertain token cannot trigger it) or the
    router sends most tokens to the LLM anyway. While it holds, the LLM writes every token and
    the light path is not asked (the SLM catches up on those tokens in one pass later). A
    fallback that fires again on the first window after a hold holds twice as long as the one
    before (a long hard stretch is then routed one window in every few holds, not every other)."""

    def __init__(self, options: FallbackOptions | None = None) -> None:
        self.options = options or FallbackOptions()
        self.confidence: deque[float] = deque(maxlen=self.options.window)
        self.routed: deque[bool] = deque(maxlen=self.options.window)  # the LLM was called for the token
        self.hold = 0
        self.last_hold = 0  # the length of the latest hold
        self.since_hold = 0  # tokens since it ended
        self.events: list[int] = []  # token positions where a fallback began

    @property
    def active(self) -> bool:
        return self.hold > 0

    def observe_llm(self, top1_probability: float) -> None:
        self.confidence.append(top1_probability)

    def observe_route(self, llm_called: bool) -> None:
        self.routed.append(llm_called)

    def _triggered(self) -> bool:
        o, confidence, routed = self.options, self.confidence, self.routed
        unsure = len(confidence) == confidence.maxlen and sum(confidence) / len(confidence) < o.min_confidence
        dense = len(routed) == routed.maxlen and sum(routed) >= o.max_llm_share * len(routed)
        return unsure or dense

    def step(self, position: int) -> None:
        """Called once per generated token."""
        if self.hold > 0:
            self.hold -= 1
            if self.hold == 0:  # judge the next window on fresh tokens only
                self.confidence.clear()
                self.routed.clear()
                self.since_hold = 0
            return
        self.since_hold += 1
        if self._triggered():
            again = self.last_hold and self.since_hold <= self.options.window
            self.hold = self.last_hold = 2 * self.last_hold if again else self.options.hold_tokens
            self.events.append(position)
            self.confidence.clear()
            self.routed.clear()
