"""Decoding modes on a tiny fp32 bundle: what must be lossless is exactly `full`'s greedy
output, and layer skipping computes what a torch model taking the same decisions computes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edgeroute.bundle import ATTENTION_VARIANTS
from edgeroute.errors import InputError
from edgeroute.export.reference import ReferenceModel, linear, rms_norm, rope
from edgeroute.export.sources import load_source
from edgeroute.runtime.decoding import DecodeOptions, Decoder, SequenceState
from edgeroute.runtime.drafters import NgramDrafter, draft_lengths
from edgeroute.runtime.layers import DROP, RUN, SKIP, SKIP_MLP
from edgeroute.runtime.policies import FallbackMonitor, FallbackOptions
from tests.conftest import OracleDrafter, record_forward, record_passes, relative_error

PROMPTS = [
    "The capital of France is",
    "Navigate to 12 Baker Street",
    "Navigate to 12 Baker Street. Navigate to 12 Baker Street. Navigate to 12",
    "Set the temperature to 21 degrees",
    '{"destination": "Main Station", "eta": "12:40"} -> {"destination": "Main Station", "eta":',
    "Call Anna Schmidt. Call Anna Schmidt. Call Anna",
    "one two three four one two three four one two",
    "Play the next song",
    "Remind me to buy milk at 6 pm",
    "What is the weather like in Berlin tomorrow?",
    "Turn on the seat heating, then turn on the seat",
    "Summarize: the road is closed between exit 4 and exit 5 due to works.",
]
NEW = 24
# on the 3-layer model: skipping really happens (random scores, half of the layer work allowed)
SKIPPING = dict(scorer="random", importance_threshold=0.6, skip_ratio=0.5, protected_first=1, protected_last=0,
                max_free_layers=1, re_eval_interval=1, fallback=None)


@pytest.fixture(scope="module")
def full(tiny_engine) -> dict[str, list[int]]:
    """`full`'s greedy tokens per prompt."""
    return {p: tiny_engine.generate(p, max_new_tokens=NEW).tokens for p in PROMPTS}


def oracle_session(engine, prompt: str, reference: list[int], right, **options):
    """A session whose light path is an :class:`OracleDrafter` (plugged in as the n-gram path)."""
    session = engine.session(light="ngram", **options)
    session.state.ngram_drafter = OracleDrafter(len(engine.encode_prompt(prompt)), reference, right)
    return session


# -- lossless modes -----------------------------------------------------------------------------

LOSSLESS = {
    "route-always-ngram": dict(mode="route", router="always"),
    "route-always-slm": dict(mode="route", router="always", light="slm"),
    "speculate-ngram": dict(mode="speculate"),
    "speculate-ngram-fixed-8": dict(mode="speculate", draft_tokens=8, adaptive_draft=False),
    "speculate-slm": dict(mode="speculate", light="slm"),
    "speculate-ngram+slm": dict(mode="speculate", light="ngram+slm"),
    "speculate-ngram+slm-long-lookups": dict(mode="speculate", light="ngram+slm", lookup_min_match=1, lookup_tokens=8),
}


@pytest.mark.parametrize("options, label", [
    ({"mode": "full", "light": "slm"}, "full"), ({"mode": "skip"}, "skip"),
    ({"mode": "speculate", "light": "ngram"}, "speculate/ngram"),
    ({"mode": "speculate", "light": "slm", "draft_branches": 2}, "speculate/slm+tree"),
    ({"mode": "route", "light": "slm", "route_check": "verified"}, "route/slm+verified"),
    ({"mode": "route+skip", "light": "ngram"}, "route+skip/ngram")])
def test_options_are_labelled_as_the_calibration_names_its_configurations(options, label):
    assert DecodeOptions(**options).label == label
    assert DecodeOptions(**options).base_mode == options["mode"].partition("+")[0]
    assert DecodeOptions(**options).skips == options["mode"].endswith("skip")


def test_unset_draft_lengths_follow_what_one_verification_pass_serves():
    assert draft_lengths(None, None, 4) == (3, 3)  # avx2, Arm, generic: 4 rows a pass
    assert draft_lengths(None, None, 3) == (2, 2)  # avx512-vnni
    assert draft_lengths(None, None, None) == (4, 8)  # a backend that does not say (ONNX Runtime)
    assert draft_lengths(6, None, 4) == (6, 6)  # a first draft asked for raises the longest to it
    assert draft_lengths(None, 2, 4) == (2, 2) and draft_lengths(2, 8, 4) == (2, 8)  # as set
    with pytest.raises(InputError, match="draft_tokens"):
        DecodeOptions(mode="speculate", draft_tokens=9).validate(4, has_slm=False)
    with pytest.raises(InputError, match="max_draft_tokens"):
        DecodeOptions(mode="speculate", max_draft_tokens=0).validate(4, has_slm=False)


@pytest.mark.parametrize("variant", LOSSLESS)
def test_route_with_always_router_and_speculate_give_exactly_fulls_greedy_tokens(variant, tiny_engine, full):
    options = LOSSLESS[variant]
    drafted = accepted = 0
    for prompt in PROMPTS:
        got = tiny_engine.generate(prompt, max_new_tokens=NEW, **options)
        assert got.tokens == full[prompt], (variant, prompt)
        drafted, accepted = drafted + got.stats.drafted, accepted + got.stats.accepted
        if options["mode"] == "route":
            assert got.stats.llm_share == 1.0 and {t.source for t in got.trace} == {"llm"}
    if variant.startswith("speculate"):
        assert drafted > 0
    if variant.startswith("speculate-ngram"):
        assert accepted > 0, "no n-gram draft was ever accepted: the test would prove nothing"


def test_lookup_then_slm_drafts_by_lookup_where_the_match_is_long_and_by_the_slm_elsewhere(tiny_engine, full,
                                                                                         monkeypatch):
    from edgeroute.runtime.drafters import LookupThenSlmDrafter

    proposals = []
    propose = LookupThenSlmDrafter.propose
    monkeypatch.setattr(LookupThenSlmDrafter, "propose",
                        lambda self, tokens, k: proposals.append(propose(self, tokens, k)) or proposals[-1])
    accepted_lookups = 0
    for prompt in PROMPTS:
        got = tiny_engine.generate(prompt, max_new_tokens=NEW, mode="speculate", light="ngram+slm", lookup_min_match=3)
        assert got.tokens == full[prompt], prompt
        accepted_lookups += sum(t.source == "draft:ngram" for t in got.trace)
    assert all(p.match_length >= 3 for p in proposals if p.source == "ngram")
    assert {p.source for p in proposals if p.tokens} == {"ngram", "slm"}
    assert accepted_lookups > 0, "no lookup draft was accepted: the test would prove nothing"


def test_lookup_then_slm_takes_the_lookup_only_from_min_match_on(tiny_engine):
    from edgeroute.runtime.drafters import LookupThenSlmDrafter, SlmDrafter

    slm = SlmDrafter(tiny_engine.slm)
    tokens = [5, 6, 7, 8, 9, 5, 6, 7]  # the suffix [5, 6, 7] matched 3 tokens: the lookup continues [8, 9]
    drafter = LookupThenSlmDrafter(NgramDrafter(), slm, min_match=3, lookup_tokens=2)
    lookup = drafter.propose(tokens, 1)
    assert (lookup.tokens, lookup.source, lookup.match_length) == ([8, 9], "ngram", 3)
    stricter = LookupThenSlmDrafter(NgramDrafter(), slm, min_match=4, lookup_tokens=2).propose(tokens, 1)
    assert stricter.source == "slm" and len(stricter.tokens) == 1
    assert stricter.tokens == slm.propose(tokens, 1).tokens
    with pytest.raises(ValueError, match="min_match"):
        LookupThenSlmDrafter(NgramDrafter(), slm, min_match=0)


@pytest.mark.parametrize("options, match", [
    (dict(mode="route", light="ngram+slm"), "speculate only"),
    (dict(mode="speculate", light="ngram+slm", lookup_tokens=0), "lookup_tokens"),
    (dict(mode="speculate", light="ngram+slm", lookup_min_match=0), "lookup_min_match"),
])
def test_lookup_then_slm_refuses_what_it_cannot_do(tiny_engine, options, match):
    with pytest.raises(InputError, match=match):
        tiny_engine.generate("hi", max_new_tokens=2, **options)


@pytest.mark.parametrize("right", ["all wrong", "partly right", "all right"])
def test_speculate_with_oracle_drafts_right_or_wrong_gives_fulls_tokens(right, tiny_engine, full):
    """Drafts that are all wrong, right for a varying prefix then wrong (rejected K/V must be
    forgotten), or all right (the bonus token and the budget cut)."""
    rule = {"all wrong": 0, "partly right": lambda done: done % 4, "all right": 10**6}[right]
    drafted = accepted = 0
    for prompt in PROMPTS:
        session = oracle_session(tiny_engine, prompt, full[prompt], rule, mode="speculate")
        got = session.generate(prompt, max_new_tokens=NEW)
        assert got.tokens == full[prompt], (right, prompt)
        assert session.state.llm_cache.length <= len(session.state.tokens)
        drafted, accepted = drafted + got.stats.drafted, accepted + got.stats.accepted
        if right == "all right":
            assert got.stats.llm_calls < NEW / 2
    assert drafted > 0
    if right == "all wrong":
        assert accepted == 0
    else:
        assert 0 < accepted < drafted if right == "partly right" else accepted > 0


@pytest.mark.parametrize("listened", [False, True])
@pytest.mark.parametrize("light", ["slm", "ngram+slm"])
def test_speculation_takes_its_first_token_from_the_llm_prefill_alone(light, listened, tiny_engine, full, monkeypatch):
    prompt = PROMPTS[0]
    chat = tiny_engine.session(mode="speculate", light=light, max_new_tokens=NEW)
    if listened:
        chat.listen(prompt)  # the SLM has read the prompt: still no draft step before the first pick
    slm_passes, before_first = record_passes(monkeypatch, tiny_engine.slm), []
    text = "".join(chat.stream(prompt, on_token=lambda trace: before_first or before_first.append(len(slm_passes))))
    assert chat.last.tokens == full[prompt] and text == chat.last.text
    assert before_first == [0] and chat.last.stats.drafted > 0  # the SLM drafted from the second step on


def test_speculation_after_tokens_a_grammar_forces_still_takes_the_first_pick_from_the_llm_prefill(tiny_engine,
                                                                                                   monkeypatch):
    fmt = {"type": "regex", "regex": "The answer is [a-z ]{3,30}"}  # a tool call's opening is forced likewise
    want = tiny_engine.generate(PROMPTS[1], max_new_tokens=NEW, response_format=fmt)
    chat = tiny_engine.session(mode="speculate", light="slm", max_new_tokens=NEW, response_format=fmt)
    slm_passes, before_pick = record_passes(monkeypatch, tiny_engine.slm), []

    def first_pick(trace) -> None:
        if trace.source != "grammar" and not before_pick:
            before_pick.append(len(slm_passes))

    text = "".join(chat.stream(PROMPTS[1], on_token=first_pick))
    assert chat.last.tokens == want.tokens and text == want.text and chat.last.stats.forced > 0
    assert before_pick == [0]


@pytest.mark.parametrize("nothing", [dict(importance_threshold=0.0), dict(skip_ratio=0.0)])
@pytest.mark.parametrize("granularity", ["layer", "mlp"])
def test_skip_with_nothing_skipped_gives_exactly_fulls_tokens(nothing, granularity, tiny_engine, full):
    options = {**SKIPPING, **nothing, "granularity": granularity, "protected_first": 0}
    for prompt in PROMPTS:
        got = tiny_engine.generate(prompt, mode="skip", max_new_tokens=NEW, **options)
        assert got.tokens == full[prompt], prompt
        assert all(t.layers_skipped == 0 and t.layers_run == 3 and t.layers == "rrr" for t in got.trace)


def test_traces_say_what_each_layer_did(tiny_engine):
    for granularity, skipped in (("layer", "s"), ("mlp", "m")):
        got = tiny_engine.generate(PROMPTS[0], mode="skip", max_new_tokens=NEW, **{**SKIPPING,
                                                                                  "granularity": granularity})
        assert all(len(t.layers) == 3 and t.layers.count("r") == t.layers_run for t in got.trace)
        assert any(skipped in t.layers for t in got.trace), "nothing was skipped: the test would prove nothing"


def test_draft_confidence_ends_slm_drafts_before_unsure_tokens_and_stays_lossless(tiny_engine, full, monkeypatch):
    from edgeroute.runtime.drafters import SlmDrafter

    proposals = []
    propose = SlmDrafter.propose
    monkeypatch.setattr(SlmDrafter, "propose", lambda self, tokens, k, min_confidence=0.0:
                        proposals.append(propose(self, tokens, k, min_confidence)) or proposals[-1])
    drafted, confidence = {}, 0.0
    for run in ("all", "confident"):
        proposals.clear()
        for prompt in PROMPTS:
            got = tiny_engine.generate(prompt, max_new_tokens=NEW, mode="speculate", light="slm",
                                       draft_confidence=confidence)
            assert got.tokens == full[prompt], (confidence, prompt)
        chosen = [float(max(p)) for proposal in proposals for p in proposal.probabilities]
        assert all(p >= confidence for p in chosen)
        drafted[run] = len(chosen)
        confidence = float(np.median(chosen))  # the random tiny SLM is never sure: half its guesses go
    assert 0 < drafted["confident"] < drafted["all"], drafted


def test_draft_confidence_outside_0_1_is_an_input_error(tiny_engine):
    with pytest.raises(InputError, match="draft_confidence"):
        tiny_engine.generate("hi", mode="speculate", light="slm", draft_confidence=1.0)


# -- skipping against a torch reference taking the same decisions -------------------------------

class CachedTorchModel:
    """The model in torch with an explicit KV cache, taking a given action per layer: RUN;
    SKIP_MLP (attention runs, the MLP not); SKIP (the layer's K/V projections of the current
    hidden state fill its cache, the hidden state passes unchanged); DROP (skipped, and these
    positions are left out of the layer's attention for every later token)."""

    def __init__(self, source, mask_dropped: bool = True) -> None:
        self.arch, self.weights = source.arch, source.weights
        self.ref = ReferenceModel(source.arch, source.weights)
        shape = (0, self.arch.num_kv_heads, self.arch.head_dim)
        layers = range(self.arch.num_layers)
        self.keys = [torch.zeros(shape) for _ in layers]
        self.values = [torch.zeros(shape) for _ in layers]
        self.masked = [torch.zeros(0, dtype=torch.bool) for _ in layers]
        self.mask_dropped = mask_dropped
        self.excluded = 0  # cached positions some attention left out

    @torch.no_grad()
    def forward(self, ids: list[int], start: int, actions: list[str]) -> np.ndarray:
        a, t = self.arch, len(ids)
        eps = a.rms_norm_eps
        cos, sin = self.ref.cos[start:start + t], self.ref.sin[start:start + t]
        x = self.ref.embed(np.asarray(ids))
        for i, action in enumerate(actions):
            w = self.weights.layers[i]
            h = rms_norm(x, w.attn_norm, eps)
            k = linear(h, w.k_proj).view(t, a.num_kv_heads, a.head_dim)
            v = linear(h, w.v_proj).view(t, a.num_kv_heads, a.head_dim)
            if w.k_norm is not None:
                k = rms_norm(k, w.k_norm, eps)
            k = rope(k, cos, sin)
            # the cache holds exactly the first `start` positions (rejected drafts forgotten)
            self.keys[i] = torch.cat([self.keys[i][:start], k])
            self.values[i] = torch.cat([self.values[i][:start], v])
            dropped = torch.full((t,), action == DROP and self.mask_dropped)
            self.masked[i] = torch.cat([self.masked[i][:start], dropped])
            if action in (SKIP, DROP):
                continue
            q = linear(h, w.q_proj).view(t, a.num_heads, a.head_dim)
            if w.q_norm is not None:
                q = rms_norm(q, w.q_norm, eps)
            q = rope(q, cos, sin)
            allowed = torch.ones(t, start + t, dtype=torch.bool)
            allowed[:, start:] = torch.tril(torch.ones(t, t, dtype=torch.bool))
            allowed &= ~self.masked[i]
            self.excluded += int(self.masked[i].sum())
            group = a.num_heads // a.num_kv_heads
            keys, values = self.keys[i].repeat_interleave(group, 1), self.values[i].repeat_interleave(group, 1)
            ctx = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), attn_mask=allowed)
            x = x + linear(ctx.transpose(0, 1).reshape(t, -1), w.o_proj)
            if action == RUN:
                h = rms_norm(x, w.mlp_norm, eps)
                x = x + linear(torch.nn.functional.silu(linear(h, w.gate_proj)) * linear(h, w.up_proj), w.down_proj)
        return self.ref.head(x).numpy()


@pytest.fixture(scope="module")
def tiny_llama_source(tiny_models):
    return load_source(tiny_models["llama"][0])


@pytest.fixture
def one_torch_thread():
    """torch's pool fights ONNX Runtime's for the cores: one thread is ~10x faster here."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


SKIP_CASES = {
    "skip-layer": dict(mode="skip"),
    "skip-mlp": dict(mode="skip", granularity="mlp", protected_first=0),
    "skip-kv-reduction": dict(mode="skip", kv_cache_reduction=True, protected_first=0),
    "speculate+skip-layer": dict(mode="speculate+skip"),
    "speculate+skip-kv-reduction": dict(mode="speculate+skip", kv_cache_reduction=True),
}


@pytest.fixture(scope="module", params=ATTENTION_VARIANTS, ids=["-".join(v) for v in ATTENTION_VARIANTS])
def flavoured_engine(request, tiny_slm_bundle):
    """The tiny engine in each attention variant the bundle carries (flavour x KV dtype)."""
    from edgeroute.runtime import Engine

    flavour, kv_dtype = request.param
    engine = Engine(tiny_slm_bundle, attention=flavour, kv_dtype=kv_dtype)
    assert (engine.llm.flavour, engine.llm.kv_dtype) == request.param
    return engine


@pytest.mark.parametrize("case", SKIP_CASES)
def test_skipping_runtime_logits_match_a_torch_reference_taking_the_same_decisions(
        case, flavoured_engine, tiny_llama_source, monkeypatch, one_torch_thread):
    """32 tokens with layers really skipped: every LLM pass's logits (prefill, decode steps,
    draft verification) within 1e-3 of torch replaying the runtime's own per-layer decisions
    over its own cache, so the K/V fill (or the mask) keeps the caches aligned."""
    tiny_engine = flavoured_engine
    options = {**SKIPPING, **SKIP_CASES[case]}
    skipped_action = {"skip-mlp": SKIP_MLP}.get(case, DROP if options.get("kv_cache_reduction") else SKIP)
    calls = record_forward(monkeypatch, tiny_engine.llm)
    got = tiny_engine.generate(PROMPTS[2], max_new_tokens=32, **options)
    assert len(got.tokens) == 32

    assert all(set(c.actions) <= {RUN, skipped_action} for c in calls)
    decode_skips = sum(a == skipped_action for c in calls[1:] for a in c.actions)
    assert decode_skips >= 5, "too few layers skipped for the test to mean anything"
    if options["mode"] == "skip":  # one pass per token: the trace reports each pass's layers
        assert len(calls) == 32
        assert [t.layers_skipped for t in got.trace] == [sum(a != RUN for a in c.actions) for c in calls]
        assert [t.layers_run for t in got.trace] == [c.actions.count(RUN) for c in calls]
    else:  # verification passes over drafts, and rejected drafts' K/V forgotten
        assert got.stats.drafted > 0 and any(len(c.ids) > 1 for c in calls[1:])
        assert any(c.start < p.start + len(p.ids) for p, c in zip(calls, calls[1:], strict=False))

    reference = CachedTorchModel(tiny_llama_source)
    tolerance = 1e-3 if tiny_engine.kv_dtype == "float32" else 5e-3  # the reference keeps an fp32 cache
    for n, call in enumerate(calls):
        want = reference.forward(call.ids, call.start, call.actions)
        assert relative_error(call.logits, want) <= tolerance, (case, n, call.actions)
    if skipped_action == DROP:
        assert reference.excluded > 0, "no later token ever attended past a dropped position"
        # and leaving the dropped positions in (as if their K/V had been filled) is detectably wrong
        unmasked = CachedTorchModel(tiny_llama_source, mask_dropped=False)
        errors = [relative_error(c.logits, unmasked.forward(c.ids, c.start, c.actions)) for c in calls]
        assert max(errors) > 1e-2


def test_skip_mode_trace_and_stats_report_the_layers_run(tiny_engine):
    got = tiny_engine.generate(PROMPTS[1], mode="skip", max_new_tokens=16, **SKIPPING)
    assert sum(t.layers_skipped for t in got.trace) > 0
    assert all(t.layers_run + t.layers_skipped == 3 and t.source == "llm" for t in got.trace)
    assert got.stats.llm_layers_run == sum(t.layers_run for t in got.trace)
    assert all(len(t.importance) >= 1 for t in got.trace)


# -- fallback -----------------------------------------------------------------------------------

def monitor(window: int = 4, min_confidence: float = 0.5, hold_tokens: int = 3) -> FallbackMonitor:
    return FallbackMonitor(FallbackOptions(window=window, min_confidence=min_confidence, hold_tokens=hold_tokens))


def feed(m: FallbackMonitor, observations: list, start: int = 0, routed: bool = False) -> list[bool]:
    """One token per observation (the LLM's confidence, or with ``routed`` whether the router
    called the LLM); whether the fallback is active after each."""
    states = []
    for i, observation in enumerate(observations):
        (m.observe_route if routed else m.observe_llm)(observation)
        m.step(start + i)
        states.append(m.active)
    return states


def test_fallback_one_low_confidence_token_does_not_trigger():
    m = monitor()
    assert feed(m, [0.9, 0.9, 0.9, 0.01, 0.9, 0.9, 0.9, 0.9]) == [False] * 8  # every window's mean: 0.68
    assert m.events == []


def test_fallback_not_before_the_window_is_full():
    m = monitor(window=4)
    assert feed(m, [0.0, 0.0, 0.0]) == [False] * 3
    assert feed(m, [0.0], start=3) == [True]
    assert m.events == [3]


def test_fallback_full_low_window_triggers_and_holds_for_hold_tokens():
    m = monitor(window=4, min_confidence=0.5, hold_tokens=3)
    states = feed(m, [0.9, 0.9, 0.3, 0.2, 0.1])  # window means: 0.575, then 0.375
    assert states == [False, False, False, False, True]
    assert m.events == [4]
    # held for exactly 3 more tokens, whatever the confidence, then re-armed with an empty window
    assert feed(m, [0.9, 0.9, 0.9], start=5) == [True, True, False]
    assert feed(m, [0.9, 0.9, 0.9, 0.9, 0.9], start=8) == [False] * 5
    assert m.events == [4]
    # a second low stretch is a second recorded event
    assert feed(m, [0.1] * 4, start=13) == [False, False, True, True]
    assert m.events == [4, 15]


def test_fallback_when_the_router_sends_most_tokens_to_the_llm():
    m = FallbackMonitor(FallbackOptions(window=4, max_llm_share=0.5, hold_tokens=3))
    sparse = [True, False, False, False, True, False, False, False]
    assert feed(m, sparse, 0, routed=True) == [False] * 8  # 25%: routing pays
    # the window is then [F, F, F, T], [F, F, T, T]: half of it went to the LLM
    assert feed(m, [True, True, False, False], 8, routed=True) == [False, True, True, True]
    assert m.events == [9]


def test_route_hands_dense_stretches_to_the_llm_without_asking_the_light_path(tiny_engine):
    """A router that sends every token to the LLM: after each window of 2 routed tokens the LLM
    writes the next 3 on its own (router not consulted)."""
    got = tiny_engine.generate(PROMPTS[1], mode="route", max_new_tokens=15, router=lambda proposal, i: 1.0,
                               window=2, min_confidence=0.0, max_llm_share=1.0, hold_tokens=3)
    assert all(t.source == "llm" for t in got.trace)
    assert [t.fallback for t in got.trace[:6]] == [False, False, True, True, True, False]
    assert all(t.router_score is None for t in got.trace if t.fallback)
    assert all(t.router_score is not None for t in got.trace if not t.fallback)
    assert got.stats.fallbacks == 3


def test_a_fallback_right_after_a_hold_holds_twice_as_long():
    m = monitor(window=2, min_confidence=0.5, hold_tokens=2)
    # fires at 1, holds 2 and 3; fires at 5 on the first window after, holds 4 (6..9); once a
    # window passes without firing, the next fallback holds the base 2 again
    states = feed(m, [0.1, 0.1, 0.9, 0.9, 0.1, 0.1, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.1, 0.1, 0.9, 0.9])
    assert states == [False, True, True, False, False, True, True, True, True, False, False, False, False, False, True,
                      True, False]
    assert m.events == [1, 5, 14]


def test_fallback_in_skip_mode_turns_skipping_off_for_hold_tokens(tiny_engine):
    """min_confidence 1.0: every window is "low", so the fallback fires as soon as a window of
    2 LLM tokens is full, holds 3 tokens with no layer skipped, and fires again once a window
    of 2 fresh tokens (none from the hold) is full, holding twice as long right after a hold."""
    options = {**SKIPPING, "skip_ratio": 1.0, "importance_threshold": 1.0}
    got = tiny_engine.generate(PROMPTS[0], mode="skip", max_new_tokens=12, window=2, min_confidence=1.0,
                               hold_tokens=3, **{k: v for k, v in options.items() if k != "fallback"})
    flags = [t.fallback for t in got.trace]
    assert flags == [False, False, True, True, True, False, False, True, True, True, True, True]
    assert got.stats.fallbacks == 2
    assert all(t.layers_skipped == 0 for t in got.trace if t.fallback)
    assert all(t.layers_skipped > 0 for t in got.trace if not t.fallback)


def test_route_records_fallback_and_calls_the_llm_while_it_holds(tiny_engine):
    """A window of one LLM token whose confidence is always "low": after each LLM token the
    next 4 tokens are the LLM's, whatever the n-gram path proposes."""
    got = tiny_engine.generate(PROMPTS[1], mode="route", max_new_tokens=24, window=1, min_confidence=1.0,
                               hold_tokens=4)
    assert got.stats.fallbacks >= 2
    assert [t.fallback for t in got.trace[:6]] == [False, True, True, True, True, False]
    assert all(t.source == "llm" for t in got.trace if t.fallback)
    free = tiny_engine.generate(PROMPTS[1], mode="route", max_new_tokens=24, fallback=None)
    assert any(t.source == "ngram" for t in free.trace), "nothing for the fallback to turn off"
    assert not any(t.fallback for t in free.trace)


# -- the n-gram light path ----------------------------------------------------------------------

def test_ngram_drafter_proposes_the_continuation_of_the_longest_earlier_match():
    drafter = NgramDrafter()
    # suffix [1, 2, 3] occurred at 1 (followed by 8 ...); the shorter [2, 3] occurs later (then 9)
    tokens = [7, 1, 2, 3, 8, 5, 2, 3, 9, 4, 1, 2, 3]
    proposal = drafter.propose(tokens, 3)
    assert proposal.tokens == [8, 5, 2]
    assert proposal.match_length == 3 and proposal.match_count == 1
    assert proposal.probabilities == [None] * 3


def test_ngram_drafter_prefers_the_most_recent_of_equal_matches_and_stops_at_the_end():
    drafter = NgramDrafter()
    proposal = drafter.propose([1, 2, 5, 1, 2, 6, 1, 2], 2)
    assert proposal.tokens == [6, 1] and proposal.match_length == 2 and proposal.match_count == 2
    assert drafter.propose([4, 5, 6, 4, 5], 8).tokens == [6, 4, 5]  # only what the history holds


def test_ngram_drafter_proposes_nothing_without_a_match():
    drafter = NgramDrafter()
    assert drafter.propose([1, 2, 3, 4], 4).tokens == []
    assert drafter.propose([5], 4).tokens == []
    assert drafter.propose([], 4).tokens == []
    assert NgramDrafter(min_ngram=2).propose([1, 2, 9, 2], 3).tokens == []  # [2] alone is too short


def _longest_earlier_match(tokens: list[int], k: int, max_ngram: int = 8, min_ngram: int = 1):
    """The n-gram lookup spelled out: every window of every length, longest first."""
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        suffix = tokens[len(tokens) - n:]
        starts = [s for s in range(len(tokens) - n) if tokens[s:s + n] == suffix]
        if starts:
            return tokens[starts[-1] + n:starts[-1] + n + k], n, len(starts)
    return [], 0, 0


@pytest.mark.parametrize("vocab", [2, 3, 8])
def test_ngram_drafter_equals_the_exhaustive_lookup(vocab):
    rng = np.random.default_rng(vocab)
    drafter, narrow = NgramDrafter(), NgramDrafter(max_ngram=3, min_ngram=2)
    for _ in range(300):
        tokens = rng.integers(0, vocab, int(rng.integers(0, 40))).tolist()
        got = drafter.propose(tokens, 4)
        assert (got.tokens, got.match_length, got.match_count) == _longest_earlier_match(tokens, 4)
        got = narrow.propose(tokens, 2)
        assert (got.tokens, got.match_length, got.match_count) == _longest_earlier_match(tokens, 2, 3, 2)


def test_route_with_the_ngram_router_takes_light_tokens_on_repetition(tiny_engine):
    got = tiny_engine.generate(PROMPTS[2], mode="route", max_new_tokens=NEW)
    light = [t for t in got.trace if t.source == "ngram"]
    assert light, "the n-gram path never wrote a token on a repetitive prompt"
    assert all(t.layers_run is None and t.router_score <= 0.5 for t in light)
    assert all(t.layers_run == 3 and t.router_score is not None for t in got.trace if t.source == "llm")
    assert got.stats.llm_tokens == len(got.trace) - len(light)


def test_a_decoder_with_draft_confidence_leaves_the_drafter_it_was_handed_as_it_was(tiny_engine):
    """The session's SLM drafter outlives a generation: one generation's draft_confidence must
    not end the drafts of the next (a route or a plain speculate on the same session)."""
    state = SequenceState(tiny_engine.llm, 64)
    state.attach_slm(tiny_engine.slm)
    tokens = tiny_engine.encode("one two three four")
    plain = state.slm_drafter.propose(tokens, 4).tokens
    assert len(plain) == 4
    sure_only = Decoder(state, DecodeOptions(mode="speculate", light="slm", draft_confidence=0.999))
    assert len(sure_only.light.propose(tokens, 4).tokens) < 4  # the tiny random model is never that sure
    assert state.slm_drafter.propose(tokens, 4).tokens == plain
    assert Decoder(state, DecodeOptions(mode="speculate", light="slm")).light.propose(tokens, 4).tokens == plain
