"""The decode loop: a few named steps over one sequence state.

- ``step_llm``: the LLM catches up on every token it has not seen, in one pass, and picks
  the next token (``full``; with a skip plan, ``skip``).
- ``step_route``: a light path proposes the next token, a router scores it, and only above
  the threshold does the LLM step replace it. No rollback (R2R / TokenRouter).
- ``step_speculate``: a light path drafts k tokens; the LLM checks them in the same catch-up
  pass and keeps the longest agreeing prefix plus its own next token. Lossless: greedy, it
  gives ``full``'s tokens bit for bit when the LLM runs exact steps (``OrtModel.exact_steps``;
  without, ``full``'s one-row int4 products round differently from a verification pass).
  With ``draft_branches`` > 1 on a backend with tree forwards (greedy, unconstrained, without
  skipping), the light path drafts a tree and one tree forward checks every branch; the walk
  keeps the path the LLM accepts (greedy: agrees with; sampled: multi-draft rejection sampling).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edgeroute.errors import InputError
from edgeroute.runtime.backend import Cache, ModelBackend, close_cache
from edgeroute.runtime.constraints import Constraint, Draft, ResponseFormat, apply_mask
from edgeroute.runtime.drafters import (
    LONGEST_DRAFT,
    ConfidentSlmDrafts,
    DraftLength,
    LookupThenSlmDrafter,
    NgramDrafter,
    Proposal,
    SlmDrafter,
    draft_lengths,
    draft_source,
    tree_nodes,
)
from edgeroute.runtime.layers import RUN
from edgeroute.runtime.policies import (
    LAYER_LETTERS,
    ROUTERS,
    FallbackMonitor,
    FallbackOptions,
    Router,
    SkipController,
    SkipOptions,
)
from edgeroute.runtime.routers import llm_ratio_score
from edgeroute.runtime.sampling import Sampler, top1_probability
from edgeroute.runtime.vocab import DRAFT_ROWS

DEFAULT_ROUTE_THRESHOLD = 0.5
MODES = ("full", "slm", "route", "speculate", "skip", "route+skip", "speculate+skip")
# route's decisions: "ahead" (R2R) before the LLM runs, from the light path's state; "verified"
# after an LLM pass over the SLM's draft, at each draft token the LLM would not pick
ROUTE_CHECKS = ("ahead", "verified")
VERIFIED_BASELINE = "llm-ratio"  # verified routing's uncalibrated router (routers.llm_ratio_score)
LIGHT_PATHS = ("ngram", "slm", "ngram+slm")  # ngram+slm: speculation only (drafters.LookupThenSlmDrafter)
SLM_LIGHT_PATHS = ("slm", "ngram+slm")


def stop_strings(stop: Any) -> tuple[str, ...]:
    """``stop`` as a tuple: one string (OpenAI's API takes that too) or several. Not a bare
    string's characters, and never an empty string, which would stop nowhere (or everywhere)."""
    if isinstance(stop, str):
        stop = (stop,)
    try:
        stops = tuple(stop or ())
    except TypeError:
        raise InputError(f"stop must be a string or a list of strings (got {stop!r})") from None
    for string in stops:
        if not isinstance(string, str) or not string:
            raise InputError(f"a stop string must be a non-empty string (got {string!r})")
    return stops


def token_ids(tokens: Any, name: str) -> frozenset[int]:
    """``tokens``, any iterable of token ids (a list, a set, a numpy array), as a frozenset of
    ints; an InputError naming ``name`` for anything else (a string's characters are no ids)."""
    try:
        ids = frozenset(tokens)
    except TypeError:
        ids = None
    if ids is None or isinstance(tokens, str) or not all(
            isinstance(t, numbers.Integral) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise InputError(f"{name} must be token ids, whole numbers >= 0, e.g. [1, 2] (got {tokens!r:.80})")
    return frozenset(int(t) for t in ids)


def check_sampling(temperature: Any, top_p: Any, seed: Any = None) -> None:
    """Raise an InputError naming the value and its range unless ``temperature`` is a finite
    number >= 0, ``top_p`` a number within (0, 1] and ``seed`` None or a whole number >= 0. NaN
    passes every ``<`` test (and ended in numpy's "probabilities contain NaN"); an infinite
    temperature samples uniformly random tokens; numpy refuses a negative seed mid-generation."""
    for name, value, fits, allowed in (
            ("temperature", temperature, lambda v: math.isfinite(v) and v >= 0.0, "a finite number >= 0 (0: greedy)"),
            ("top_p", top_p, lambda v: 0.0 < v <= 1.0, "a number within (0, 1] (1: no nucleus cut)")):
        if not isinstance(value, numbers.Real) or isinstance(value, bool) or not fits(value):
            raise InputError(f"{name} must be {allowed} (got {value!r})")
    if seed is not None and (not isinstance(seed, numbers.Integral) or isinstance(seed, bool) or seed < 0):
        raise InputError(f"seed must be a whole number >= 0, or unset for a fresh one each generation (got {seed!r})")


LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range: -100 bans a token, +100 makes it the only choice


def logit_bias_entries(bias: Any) -> dict[int, float] | None:
    """OpenAI's ``logit_bias``: token id -> a number within [-100, 100] added to that token's
    logit before every choice the model makes. Keys may be ids or JSON's strings of digits;
    None or empty: no bias. An InputError names the entry that is neither."""
    if bias is None:
        return None
    if not isinstance(bias, Mapping):
        raise InputError(f'logit_bias maps token ids to numbers, e.g. {{1234: 5.0}} (got {bias!r:.80})')
    entries = {}
    for key, value in bias.items():
        if isinstance(key, str) and key.isdigit():
            key = int(key)
        if isinstance(key, bool) or not isinstance(key, numbers.Integral) or key < 0:
            raise InputError(f"logit_bias: {key!r} is not a token id (a whole number >= 0)")
        if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value)
                or abs(value) > LOGIT_BIAS_LIMIT):
            raise InputError(f"logit_bias: token {key}'s bias must be a number within [-100, 100] (got {value!r})")
        entries[int(key)] = float(value)
    return entries or None


def check_field_types(options: Any) -> None:
    """An InputError naming the field unless every number and flag of the dataclass ``options``
    holds one (None where the field allows it): the range checks compare them, and a string
    (from a config file or an environment variable) failed there with a TypeError, or, as a
    flag, counted as true."""
    for f in dataclasses.fields(options):
        kind, value = f.type.split(" | ")[0], getattr(options, f.name)  # annotations are text here
        if kind not in ("int", "float", "bool") or (value is None and f.type.endswith("| None")):
            continue
        if kind == "bool":
            fits, wanted = isinstance(value, bool), "True or False"
        else:
            fits = not isinstance(value, bool) and isinstance(value, numbers.Integral if kind == "int" else numbers.Real)
            wanted = "a whole number" if kind == "int" else "a number"
        if not fits:
            raise InputError(f"{f.name} must be {wanted} (got {value!r})")


@dataclass
class DecodeOptions:
    mode: str = "full"
    light: str = "ngram"  # the light path of route / speculate
    max_new_tokens: int | None = None  # None: the bundle's default
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    # token id -> added to its logit before each choice (OpenAI's logit_bias; logit_bias_entries)
    logit_bias: dict[int, float] | None = None
    # a baseline's name or a router object; None: the bundle's calibrated router for the light
    # path, else "ngram" for the n-gram path and "entropy" for the SLM
    router: str | Router | None = None
    route_threshold: float | None = None  # call the LLM above this score; None: calibrated, else 0.5
    route_check: str = "ahead"  # one of ROUTE_CHECKS
    # a task's name, a task profile's (voice-command, templated, json, ...) or the app's own: what
    # mode auto takes the bundle's calibration for, and where the answer memory keeps the answers
    task: str | None = None
    protect_format: bool = False  # never route a format-critical token (JSON brackets, quotes, ...)
    # the token ids route never takes from the light path: any iterable of ids, kept as a
    # frozenset; under protect_format, filled by the engine from its tokenizer where left empty
    protected_tokens: frozenset[int] = frozenset()
    # the first draft's length and the longest (the length adapts to the acceptance rate between 1
    # and that); None: 4, and what one verification pass of the LLM serves (drafters.draft_lengths)
    draft_tokens: int | None = None
    max_draft_tokens: int | None = None
    adaptive_draft: bool = True
    # the SLM's draft ends before a token it gives less probability than this (0: never; None:
    # the bundle's calibrated value, else 0), fitted from the cost of an SLM step and an LLM row
    draft_confidence: float | None = None
    # speculate --light ngram+slm: the lookup drafts where the sequence's suffix matched at least
    # lookup_min_match earlier tokens, lookup_tokens at a time; the SLM drafts elsewhere
    lookup_min_match: int = 3
    lookup_tokens: int = 4
    # speculate: drafts as a tree verified in one pass where > 1: up to this many lookup continuations
    # where earlier matches disagree, up to this many SLM candidates where the SLM is unsure; at most
    # draft_tree_nodes tokens in a tree (None: one pass's rows, drafters.tree_nodes). Unconstrained,
    # without skipping, on a backend with tree_forwards; elsewhere linear drafts (a grammar's drafts
    # stay linear chains)
    draft_branches: int = 1
    draft_tree_nodes: int | None = None
    # speculate --light slm / ngram+slm on the native backend: the SLM drafts from its head's rows of
    # the draft_rows lowest ids (and the added tokens) and of the sequence's own ids, where its
    # vocabulary is larger (drafters.DraftVocabulary); 0: from its whole head
    draft_rows: int = DRAFT_ROWS
    skip: SkipOptions = field(default_factory=SkipOptions)
    fallback: FallbackOptions | None = field(default_factory=FallbackOptions)
    # structured output: a JSON schema, regex or grammar every token must fit (see constraints.py)
    response_format: ResponseFormat | dict[str, Any] | None = None

    def __post_init__(self) -> None:
        # at once, so a profile's or a flag's bad value fails before any model loads (validate()
        # checks again: the fields may be set after construction)
        check_sampling(self.temperature, self.top_p, self.seed)
        for name in ("mode", "light"):
            if not isinstance(getattr(self, name), str):
                raise InputError(f"{name} must be a string, e.g. {getattr(DecodeOptions, name)!r} "
                                 f"(got {getattr(self, name)!r})")
        check_field_types(self)
        self.stop = stop_strings(self.stop)
        self.logit_bias = logit_bias_entries(self.logit_bias)
        if self.task is not None and not isinstance(self.task, str):  # a number names no profile, and 0 kept as 'default'
            raise InputError(f"task must be a task's name, a task profile's (e.g. 'json') or your own, or None "
                             f"(got {self.task!r})")
        self.protected_tokens = token_ids(self.protected_tokens, "protected_tokens")

    def updated(self, **overrides: Any) -> DecodeOptions:
        """A copy with overrides; skip options may be given flat (``skip_ratio=0.2``)."""
        skip_fields = {f.name for f in dataclasses.fields(SkipOptions)}
        fallback_fields = {f.name for f in dataclasses.fields(FallbackOptions)}
        unknown = set(overrides) - {f.name for f in dataclasses.fields(self)} - skip_fields - fallback_fields
        if unknown:
            raise InputError(f"unknown decoding option(s): {', '.join(sorted(unknown))}")
        own = {k: v for k, v in overrides.items() if k not in skip_fields | fallback_fields}
        skip = dataclasses.replace(self.skip, **{k: v for k, v in overrides.items() if k in skip_fields})
        fallback = self.fallback
        fallback_overrides = {k: v for k, v in overrides.items() if k in fallback_fields}
        if fallback_overrides:
            fallback = dataclasses.replace(fallback or FallbackOptions(), **fallback_overrides)
        return dataclasses.replace(self, **{"skip": skip, "fallback": fallback, **own})

    @property
    def base_mode(self) -> str:
        """The mode a combined one builds on: ``route`` of ``route+skip``."""
        return self.mode.partition("+")[0]

    @property
    def skips(self) -> bool:
        """Whether the mode skips layers: ``skip``, ``route+skip``, ``speculate+skip``."""
        return "skip" in self.mode.split("+")

    @property
    def label(self) -> str:
        """What decodes, as the calibration names its configurations: ``full``,
        ``speculate/ngram``, ``speculate/slm+tree``, ``route/slm+verified``."""
        if self.base_mode not in ("route", "speculate"):
            return self.mode
        verified = "+verified" if self.base_mode == "route" and self.route_check == "verified" else ""
        tree = "+tree" if self.base_mode == "speculate" and self.draft_branches > 1 else ""
        return f"{self.mode}/{self.light}{verified}{tree}"

    @property
    def uses_slm(self) -> bool:
        """Whether decoding runs the SLM: mode slm, or route / speculate with a light path
        through it (``full`` and ``skip`` never do, whatever ``light`` says)."""
        return self.mode == "slm" or (self.light in SLM_LIGHT_PATHS and self.base_mode in ("route", "speculate"))

    def validate(self, num_layers: int, has_slm: bool, slm_off: bool = False) -> None:
        """:meth:`check`, then what the bundle decides: mode auto resolved (the engine does it
        from the calibration), the SLM there where decoding runs it, the skip options' layers.
        ``slm_off``: the engine was told not to load the SLM (``slm=False``, ``--no-slm``)."""
        self.check()
        if self.mode == "auto":
            raise InputError("mode auto is resolved by the engine from the bundle's calibration")
        if self.uses_slm and not has_slm:
            if slm_off:  # exporting again would not help: the bundle may well have one
                raise InputError(f"{self.label} runs the SLM, which this engine does not load (slm=False, --no-slm): "
                                 "use --light ngram (light='ngram'), or load the SLM")
            raise InputError("this bundle has no SLM: use --light ngram, or export with --slm")
        if self.skips:
            self.skip.validate(num_layers)

    def check(self) -> None:
        """Every check that needs no bundle: types, names, ranges and combinations (mode auto
        allowed), so a profile's decoding is checked when the profile loads, naming its file."""
        if not isinstance(self.skip, SkipOptions) or not isinstance(self.fallback, FallbackOptions | None):
            raise InputError("skip and fallback take SkipOptions and FallbackOptions; their fields may be given flat "
                             f"(skip_ratio=0.2, window=8) (got {self.skip!r:.60}, {self.fallback!r:.60})")
        if not (self.router is None or isinstance(self.router, str) or callable(self.router)
                or callable(getattr(self.router, "difference", None))):
            raise InputError(f"router must be a router's name, a function scoring a token, or (verified routing) an "
                             f"object whose difference() scores one (got {self.router!r})")
        for options in (self, self.skip, self.fallback or FallbackOptions()):
            check_field_types(options)
        if self.mode not in (*MODES, "auto"):
            raise InputError(f"mode {self.mode!r} is not one of {', '.join(MODES)}, auto")
        if self.light not in LIGHT_PATHS:
            raise InputError(f"light path {self.light!r} is not one of {', '.join(LIGHT_PATHS)}")
        base = self.base_mode
        if self.route_check not in ROUTE_CHECKS:
            raise InputError(f"route_check {self.route_check!r} is not one of {', '.join(ROUTE_CHECKS)}")
        if self.route_check == "verified" and base == "route" and self.light != "slm":
            raise InputError("verified routing judges the SLM's drafts against the LLM's pass: use --light slm "
                             f"(got {self.light})")
        if self.light == "ngram+slm" and base == "route":
            raise InputError("light path ngram+slm drafts for speculate only: route scores one light path with "
                             "that path's router (use --light slm or --light ngram)")
        if self.draft_branches < 1:
            raise InputError(f"draft_branches must be >= 1 (got {self.draft_branches})")
        if self.draft_tree_nodes is not None and self.draft_tree_nodes < 1:
            raise InputError(f"draft_tree_nodes must be >= 1 (got {self.draft_tree_nodes})")
        if self.lookup_min_match < 1 or self.lookup_tokens < 1:
            raise InputError(f"lookup_min_match and lookup_tokens must be >= 1 "
                             f"(got {self.lookup_min_match}, {self.lookup_tokens})")
        if isinstance(self.router, str) and self.router not in (*ROUTERS, VERIFIED_BASELINE):
            raise InputError(f"router {self.router!r} is not one of {', '.join(ROUTERS)}, {VERIFIED_BASELINE}")
        if base == "route" and isinstance(self.router, str) and \
                (self.router == VERIFIED_BASELINE) != (self.route_check == "verified"):
            raise InputError(f"router {self.router!r} does not score {self.route_check} routing: "
                             f"{VERIFIED_BASELINE} scores verified routing, {', '.join(ROUTERS)} routing ahead")
        if self.route_threshold is not None and not 0.0 <= self.route_threshold <= 1.0:
            raise InputError(f"route_threshold must be within [0, 1] (got {self.route_threshold})")
        check_sampling(self.temperature, self.top_p, self.seed)
        if self.draft_confidence is not None and not 0.0 <= self.draft_confidence < 1.0:
            raise InputError(f"draft_confidence must be within [0, 1) (got {self.draft_confidence})")
        if isinstance(self.draft_rows, bool) or not isinstance(self.draft_rows, int) or self.draft_rows < 0:
            raise InputError(f"draft_rows must be a whole number >= 0 (0: the SLM drafts from its whole head; got "
                             f"{self.draft_rows!r})")
        if self.max_draft_tokens is not None and self.max_draft_tokens < 1:
            raise InputError(f"max_draft_tokens must be >= 1 (got {self.max_draft_tokens})")
        longest = self.max_draft_tokens or LONGEST_DRAFT
        if self.draft_tokens is not None and not 1 <= self.draft_tokens <= longest:
            raise InputError(f"draft_tokens must be between 1 and max_draft_tokens ({longest})")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be >= 1 (got {self.max_new_tokens})")
        if ResponseFormat.parse(self.response_format) is not None and self.stop:
            raise InputError("stop strings would cut a response_format's structure where it may be incomplete: "
                             "drop the stop strings (the structure's end ends the generation)")
        # ranges also outside skip modes (a bad value is a mistake either way); layer counts: validate()
        self.skip.validate(None)
        if self.fallback is not None:
            self.fallback.validate()


@dataclass
class TokenTrace:
    position: int
    token: int
    source: str  # llm | slm | ngram | draft:ngram | draft:slm | grammar (forced: no model step)
    seconds: float  # wall time since the previous token
    router_score: float | None = None
    layers_run: int | None = None  # LLM layers this token's pass ran (None: no LLM pass)
    layers_skipped: int | None = None
    # what each LLM layer did in this token's pass, one letter per layer: r run, m attention
    # only (MLP skipped), s skipped (K/V filled), d dropped; "" without an LLM pass
    layers: str = ""
    importance: list[float] = field(default_factory=list)
    fallback: bool = False
    text: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    time_to_first_token: float = 0.0
    decode_seconds: float = 0.0
    llm_tokens: int = 0  # generated tokens chosen by the LLM
    llm_calls: int = 0
    llm_layers_run: int = 0  # summed over LLM-produced tokens
    drafted: int = 0
    accepted: int = 0
    fallbacks: int = 0
    forced: int = 0  # tokens the response_format's grammar forced (no model step)
    kept_differences: int = 0  # verified routing: SLM tokens kept where the LLM would have chosen another
    grammar_seconds: float = 0.0  # time in the grammar: masks, forced tokens, checking drafts

    @property
    def decode_tokens_per_second(self) -> float:
        steps = self.new_tokens - 1  # the first token comes with the prefill
        return steps / self.decode_seconds if steps > 0 and self.decode_seconds > 0 else 0.0

    @property
    def llm_share(self) -> float:
        return self.llm_tokens / self.new_tokens if self.new_tokens else 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def summary(self, mode: str, num_layers: int) -> str:
        layers = self.llm_layers_run / self.llm_tokens if self.llm_tokens else 0.0
        line = (f"{self.new_tokens} tokens, {self.decode_tokens_per_second:.1f} tok/s decode, "
                f"TTFT {self.time_to_first_token * 1000:.0f} ms, LLM share {self.llm_share:.0%}, "
                f"{layers:.1f}/{num_layers} layers per LLM token")
        if self.drafted:
            line += f", draft acceptance {self.acceptance:.0%}"
        if self.fallbacks:
            line += f", {self.fallbacks} fallback(s)"
        if self.forced:
            line += f", {self.forced} forced by the grammar"
        return f"{line} (mode {mode})"


class SequenceState:
    """What one conversation keeps between calls: its tokens and the models' caches."""

    def __init__(self, llm: ModelBackend, capacity: int | None = None) -> None:
        self.llm = llm
        self.tokens: list[int] = []
        self.llm_cache: Cache = llm.new_cache(capacity)
        self.slm_drafter: SlmDrafter | None = None  # attach_slm() when a mode needs it
        self.ngram_drafter = NgramDrafter()

    def attach_slm(self, slm: ModelBackend) -> None:
        """Give the sequence an SLM light path (it catches up on the tokens so far on first use)."""
        self.slm_drafter = SlmDrafter(slm, self.llm_cache.capacity)

    def reset(self) -> None:
        self.tokens = []
        self.llm_cache.reset()
        if self.slm_drafter is not None:
            self.slm_drafter.reset()

    def close(self) -> None:
        """Free the caches now (their engine closing); nothing runs on this state after."""
        close_cache(self.llm_cache)
        if self.slm_drafter is not None:
            close_cache(self.slm_drafter.cache)
            self.slm_drafter.close_rows()

    @property
    def capacity(self) -> int:
        return self.llm_cache.capacity


Judge = Callable[[np.ndarray, np.ndarray, int, int], float]  # (LLM logits, SLM p, token, position) -> score


def verified_judge(router: str | Router | None) -> Judge:
    """The score verified routing gives a draft token the LLM does not pick: a calibrated
    ``verify-v1`` graph, or uncalibrated (None / "llm-ratio") 1 - p_LLM(token) / p_LLM(choice)."""
    if router is None or router == VERIFIED_BASELINE:
        return lambda logits, p, token, position: llm_ratio_score(logits, token)
    difference = getattr(router, "difference", None)
    if difference is None:
        raise InputError(f"verified routing scores differences with both models' distributions: router "
                         f"{getattr(router, 'name', router)!r} reads the light path alone (use {VERIFIED_BASELINE} or "
                         "a calibrated verified router)")
    return difference


def walk_tree(sampler: Sampler, logits: np.ndarray, ids: list[int], parents: list[int]) -> tuple[list[int], int]:
    """The accepted path of a verified draft tree (node indices from the root, 0, whose parent is
    -1) and the LLM's token after it: at each node, the node's children are checked in order
    against its logits (``Sampler.verify_candidates``); the walk descends into the accepted one,
    and ends with the token chosen where none is (or after a leaf, sampled from its logits).
    Drafts are deterministic given the sequence (lookup continuations, the SLM's likeliest
    tokens), so every emitted token is distributed as sampling from the LLM's logits there."""
    path = [0]
    while True:
        children = [i for i in range(1, len(ids)) if parents[i] == path[-1]]
        index, chosen = sampler.verify_candidates(logits[path[-1]], [ids[i] for i in children])
        if index is None:
            return path, chosen
        path.append(children[index])


class Decoder:
    """One generation over a :class:`SequenceState`."""

    def __init__(self, state: SequenceState, options: DecodeOptions, cancel: threading.Event | None = None,
                 constraint: Constraint | None = None) -> None:
        self.state, self.options, self.constraint = state, options, constraint
        self.llm = state.llm
        if options.logit_bias and (largest := max(options.logit_bias)) >= self.llm.arch.vocab_size:
            raise InputError(f"logit_bias names token id {largest}, outside the model's vocabulary of "
                             f"{self.llm.arch.vocab_size}")
        self.sampler = Sampler(options.temperature, options.top_p, options.seed, options.logit_bias)
        self.cancel = cancel or threading.Event()
        self.stats = GenerationStats()
        base = self.base_mode = options.base_mode
        self.skipper = SkipController(options.skip, self.llm.num_layers) if options.skips else None
        self.verified = base == "route" and options.route_check == "verified"
        # speculation is lossless, and verified routing has the LLM's pass on every token: nothing to guard
        risky = (base == "route" and not self.verified) or self.skipper is not None
        self.monitor = FallbackMonitor(options.fallback) if options.fallback and risky else None
        slm = state.slm_drafter
        confidence = options.draft_confidence if base == "speculate" or self.verified else None
        if slm is not None and confidence:
            slm = ConfidentSlmDrafts(slm, confidence)
        light = {"slm": slm, "ngram": state.ngram_drafter}.get(options.light)
        if options.light == "ngram+slm":
            light = LookupThenSlmDrafter(state.ngram_drafter, slm, options.lookup_min_match, options.lookup_tokens)
        self.light = state.slm_drafter if base == "slm" else light
        # the drafts whose acceptance the draft length follows (ngram+slm: the SLM's; the lookup's
        # have their own length); full and skip have no light path (a light "slm" loads no SLM for them)
        source = getattr(self.light, "adaptive_source", None) or getattr(self.light, "name", options.light)
        self.adaptive_source = f"draft:{source}"
        router = options.router or ("entropy" if options.light == "slm" else "ngram")
        if self.verified:
            self.judge = verified_judge(options.router)
        else:
            self.router: Router = ROUTERS[router] if isinstance(router, str) else router
        self.route_threshold = DEFAULT_ROUTE_THRESHOLD if options.route_threshold is None else options.route_threshold
        first, longest = draft_lengths(options.draft_tokens, options.max_draft_tokens, self.llm.pass_rows)
        self.draft_length = DraftLength(first, longest, options.adaptive_draft)
        # a tree's walk is exact where each token's logits are its path's: the native backend's
        # tree forwards; grammars (masks per position, forced tokens) and skipping keep linear drafts
        self.tree_branches = options.draft_branches if (
            base == "speculate" and self.llm.tree_forwards and constraint is None and self.skipper is None) else 1
        self.tree_nodes = tree_nodes(options.draft_tree_nodes, self.llm.pass_rows)

    # -- the steps ------------------------------------------------------------------------------

    def _fallback_active(self) -> bool:
        return self.monitor is not None and self.monitor.active

    def _llm_pass(self, extra: list[int]) -> tuple[np.ndarray, TokenTrace]:
        """LLM over its pending tokens plus ``extra`` (drafts), logits for each position from
        the last pending token on."""
        cache, tokens = self.state.llm_cache, self.state.tokens
        pending = tokens[cache.length:]
        plan = None
        if self.skipper is not None:
            self.skipper.enabled = not self._fallback_active()
            plan = self.skipper
        logits = self.llm.forward(cache, pending + extra, plan=plan, tail=len(extra) + 1)
        return logits, self._llm_trace(plan)

    def _llm_trace(self, plan: SkipController | None) -> TokenTrace:
        """Counts an LLM pass; the trace of the token it chooses (its layers as the plan ran them)."""
        trace = TokenTrace(-1, -1, "llm", 0.0, fallback=self._fallback_active())
        n = self.llm.num_layers
        if plan is not None:
            record = self.skipper.last
            trace.layers_run, trace.layers_skipped = record.layers_run, n - record.layers_run
            trace.layers = "".join(LAYER_LETTERS[action] for action in record.actions)
            trace.importance = list(record.importance)
        else:
            trace.layers_run, trace.layers_skipped = n, 0
            trace.layers = LAYER_LETTERS[RUN] * n
        self.stats.llm_calls += 1
        return trace

    def _observe_llm(self, logits: np.ndarray) -> None:
        if self.monitor is not None:
            self.monitor.observe_llm(top1_probability(logits))

    def _allowed(self) -> np.ndarray | None:
        return None if self.constraint is None else self.constraint.allowed()

    def _draft(self) -> Draft:
        """The light path's draft; under a grammar, checked token by token, with the tokens
        the grammar forces in between."""
        if self.constraint is None:
            proposal = self.light.propose(self.state.tokens, self.draft_length.current)
            return Draft.unconstrained(proposal, draft_source(proposal, self.light))
        return self.constraint.draft(self.light, self.state.tokens, self.draft_length.current,
                                     self.draft_length.longest)

    def step_llm(self) -> list[TokenTrace]:
        logits, trace = self._llm_pass([])
        logits = apply_mask(logits[0], self._allowed())
        self._observe_llm(logits)
        trace.token = self.sampler.sample(logits)
        return [trace]

    def step_slm(self) -> list[TokenTrace]:
        logits = apply_mask(self.state.slm_drafter.next_logits(self.state.tokens), self._allowed())
        return [TokenTrace(-1, self.sampler.sample(logits), "slm", 0.0)]

    def step_forced(self) -> list[TokenTrace]:
        """The token the grammar forces, if it forces one: no model step (the LLM and the SLM
        catch up on it in their next pass, as on light-path tokens)."""
        token = None if self.constraint is None else self.constraint.forced()
        return [] if token is None else [TokenTrace(-1, token, "grammar", 0.0)]

    def step_route(self) -> list[TokenTrace]:
        if self._fallback_active():  # the LLM writes; no light-path step to pay for
            return self.step_llm()
        proposal: Proposal = self.light.propose(self.state.tokens, 1)
        proposal.answer_position = self.stats.new_tokens
        if self.constraint is not None:
            proposal = self.constraint.constrain(proposal)
        score = self.router(proposal, 0) if proposal.tokens else 1.0
        format_critical = bool(proposal.tokens) and proposal.tokens[0] in self.options.protected_tokens
        llm_called = not proposal.tokens or format_critical or score > self.route_threshold
        if self.monitor is not None:
            self.monitor.observe_route(llm_called)
        if llm_called:
            traces = self.step_llm()
        else:
            token, p = proposal.tokens[0], proposal.probabilities[0]
            if not self.sampler.greedy and p is not None:
                token = self.sampler.choose(self.sampler.probabilities(np.log(p + 1e-30)))
            traces = [TokenTrace(-1, token, self.light.name, 0.0, fallback=False)]
        traces[0].router_score = score
        return traces

    def step_speculate(self) -> list[TokenTrace]:
        if self._first_pick():
            return self.step_llm()
        if self.tree_branches > 1:
            return self._verify_tree()
        return self._verify_draft()

    def _first_pick(self) -> bool:
        """The generation's first LLM pass (after any tokens a grammar forced at its start) takes
        no SLM draft: its token comes from the LLM's prefill alone, as ``full``'s does, instead
        of waiting for the SLM to read the prompt (or, after listen-ahead, to draft); the SLM
        drafts from the next step on. Time to first token is what a voice app waits for."""
        return self.stats.llm_calls == 0 and self.options.uses_slm

    def step_route_verified(self) -> list[TokenTrace]:
        return self._verify_draft(self.judge)

    def _verify_draft(self, judge: Judge | None = None, draft: Draft | None = None) -> list[TokenTrace]:
        """Draft (unless given one), one LLM pass over the draft, keep its tokens up to the first
        the LLM rejects (exact speculation). With ``judge`` (verified routing) a rejected SLM token
        stays where the judge scores the difference at or below the route threshold (neutral), and
        the walk goes on; a format-critical token is never kept against the LLM."""
        draft = self._draft() if draft is None else draft
        if not draft.tokens:
            return self.step_llm()
        start = self.state.llm_cache.length
        pending = len(self.state.tokens) - start
        logits, trace = self._llm_pass(draft.tokens)
        traces = []
        for i, token in enumerate(draft.tokens):
            masked = apply_mask(logits[i], draft.masks[i])
            accepted, chosen = self.sampler.verify_draft(masked, token)
            if not accepted:
                p = draft.probabilities[i] if i < len(draft.probabilities) else None
                if judge is None or p is None or token in self.options.protected_tokens:
                    break
                score = judge(masked, p, token, self.stats.new_tokens + i)
                if score > self.route_threshold:
                    break
                self.stats.kept_differences += 1
            traces.append(TokenTrace(-1, token, draft.sources[i], 0.0, router_score=None if accepted else score))
        else:
            chosen = self.sampler.sample(apply_mask(logits[len(draft.tokens)], draft.masks[-1]))
        n = len(traces)
        self._observe_llm(apply_mask(logits[n], draft.masks[n]))
        self.state.llm_cache.truncate(start + pending + n)  # forget the rejected drafts' K/V
        # forced tokens in a draft are certain: acceptance counts the light path's guesses only
        light = [source != "grammar" for source in draft.sources]
        drafted, accepted = sum(light), sum(light[:n])
        self.stats.drafted += drafted
        self.stats.accepted += accepted
        trace.token = chosen
        traces.append(trace)
        if self.adaptive_source in draft.sources:
            self.draft_length.update(drafted, accepted)
        return traces

    def _verify_tree(self) -> list[TokenTrace]:
        """Speculation over a tree of drafts in one tree forward (:func:`walk_tree`); the cache
        keeps the accepted path. Each token's logits are its path's bit for bit, so greedy the
        tokens are ``full``'s, and sampled they are distributed as ``full``'s."""
        tree = self.light.propose_tree(self.state.tokens, self.draft_length.current, self.tree_branches,
                                       self.tree_nodes)
        source = f"draft:{tree.source or self.light.name}"
        cache, tokens = self.state.llm_cache, self.state.tokens
        pending = tokens[cache.length:]
        # One continuation (or none), or tokens the LLM has not seen before the last (a prompt,
        # forced tokens): the linear draft, in the pass that catches up on them (a tree hangs from
        # the cache's last token, so they would cost a pass of their own, and their rows' logits)
        if tree.branches < 2 or len(pending) > 1:
            chain = tree.first_branch()
            return self._verify_draft(draft=Draft(chain, [source] * len(chain), [None] * (len(chain) + 1)))
        ids = [pending[-1], *tree.tokens]
        parents = [-1, *(parent + 1 for parent in tree.parents)]
        logits = self.llm.forward_tree(cache, ids, parents)
        trace = self._llm_trace(None)
        path, chosen = walk_tree(self.sampler, logits, ids, parents)
        traces = [TokenTrace(-1, ids[node], source, 0.0) for node in path[1:]]
        self._observe_llm(logits[path[-1]])
        self.llm.keep_path(cache, path)
        drafted, accepted = tree.depth, len(path) - 1
        self.stats.drafted += drafted
        self.stats.accepted += accepted
        trace.token = chosen
        traces.append(trace)
        if source == self.adaptive_source:
            self.draft_length.update(drafted, accepted)
        return traces

    # -- the loop -------------------------------------------------------------------------------

    def run(self, new_tokens: list[int], budget: int, eos_ids: set[int]) -> Iterator[TokenTrace]:
        state = self.state
        state.tokens.extend(new_tokens)
        self.stats.prompt_tokens = len(new_tokens)
        step = {"full": self.step_llm, "skip": self.step_llm, "slm": self.step_slm,
                "route": self.step_route_verified if self.verified else self.step_route,
                "speculate": self.step_speculate}[self.base_mode]
        try:
            yield from self._loop(step, budget, eos_ids)
        finally:  # drafts verified past a stop (eos, budget, cancel) must not stay cached
            state.llm_cache.truncate(min(state.llm_cache.length, len(state.tokens)))

    def _loop(self, step, budget: int, eos_ids: set[int]) -> Iterator[TokenTrace]:
        state = self.state
        start = last = time.perf_counter()
        while self.stats.new_tokens < budget and not self.cancel.is_set():
            for trace in self.step_forced() or step():
                now = time.perf_counter()
                trace.position, trace.seconds, last = len(state.tokens), now - last, now
                if self.stats.new_tokens == 0:
                    self.stats.time_to_first_token = now - start
                    decode_start = now
                self.stats.decode_seconds = now - decode_start
                state.tokens.append(trace.token)
                self.stats.new_tokens += 1
                if self.constraint is not None:
                    self.constraint.advance(trace.token)
                    self.stats.forced += trace.source == "grammar"
                    self.stats.grammar_seconds = self.constraint.seconds
                if trace.source == "llm":
                    self.stats.llm_tokens += 1
                    self.stats.llm_layers_run += trace.layers_run or 0
                if self.monitor is not None:
                    before = len(self.monitor.events)
                    self.monitor.step(trace.position)
                    self.stats.fallbacks += len(self.monitor.events) - before
                yield trace
                if trace.token in eos_ids or self.stats.new_tokens >= budget or self.cancel.is_set():
                    return
