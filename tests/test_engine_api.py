"""The embeddable API on a tiny fp32 bundle: chat turns on a kept cache, streaming, sampling,
cancellation, sessions in threads, stop strings, budgets, traces and bad input."""

from __future__ import annotations

import json
import shutil
import threading

import numpy as np
import pytest

from edgeroute.bundle import FORMAT_VERSION, MANIFEST
from edgeroute.errors import BundleError, EdgerouteError, InputError
from edgeroute.runtime import Engine
from edgeroute.runtime.decoding import DecodeOptions
from tests.conftest import OracleDrafter, record_forward, relative_error

PROMPT = "Navigate to 12 Baker Street"
REPEATING = "Call Anna Schmidt. Call Anna Schmidt. Call Anna"
FIRST_USER = "Where is the station?"  # the tiny model's 8-token answer survives a text round trip
SECOND_USER = "And the museum?"


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def greedy(model, tokens: list[int], n: int) -> list[int]:
    """n greedy tokens straight from OrtModel, on a fresh cache."""
    cache = model.new_cache()
    logits, out = model.forward(cache, tokens), []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = model.forward(cache, out[-1:])
    return out


# -- chat sessions ------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["full", "speculate"])
def test_second_chat_turn_prefills_only_new_tokens_and_matches_a_fresh_session(mode, tiny_engine, monkeypatch):
    chat = tiny_engine.chat(mode=mode)
    first = chat.generate(user(FIRST_USER), max_new_tokens=8)
    after_first = list(chat.state.tokens)
    cached = chat.state.llm_cache.length
    assert cached >= len(after_first) - 1  # all but (at most) the last token, never computed yet

    calls = record_forward(monkeypatch, tiny_engine.llm)
    second = chat.generate(user(SECOND_USER), max_new_tokens=16)
    prompt2 = chat.state.tokens[:len(chat.state.tokens) - len(second.tokens)]
    fmt = tiny_engine.chat_format
    new = tiny_engine.encode(fmt["assistant_to_user"] + SECOND_USER + fmt["user_suffix"])
    assert prompt2 == after_first + new
    # the second turn's first pass starts where the first turn's cache ends: only the new tokens
    # (plus the first turn's last token, whose K/V nobody computed) are prefilled
    # (speculate appends its drafts to that pass)
    assert calls[0].start == cached
    assert calls[0].ids[:len(prompt2) - cached] == prompt2[cached:]
    assert len(prompt2) - cached <= len(new) + 1

    fresh = tiny_engine.session(mode=mode)
    conversation = [{"role": "user", "content": FIRST_USER}, {"role": "assistant", "content": first.text},
                    {"role": "user", "content": SECOND_USER}]
    again = fresh.generate(conversation, max_new_tokens=16)
    assert fresh.state.tokens[:len(prompt2)] == prompt2, "precondition: the same conversation tokens"
    assert again.tokens == second.tokens
    assert chat.messages == [*conversation, {"role": "assistant", "content": second.text}]


def test_chat_turn_after_an_accepted_end_of_turn_draft_runs_every_new_token(tiny_engine, monkeypatch):
    """A speculative draft can put the end-of-turn token's K/V in the cache; the next turn
    replaces that token with the template's text, so its K/V must go too."""
    chat = tiny_engine.chat(mode="speculate")
    prompt1 = tiny_engine.encode_prompt([{"role": "user", "content": FIRST_USER}])
    answer = greedy(tiny_engine.llm, prompt1, 4)
    # pretend the model's 2nd answer token ends its turn, and draft the whole answer correctly
    end = answer[1]
    assert end not in answer[:1]
    monkeypatch.setattr(tiny_engine, "eos_ids", {end})
    chat.state.ngram_drafter = OracleDrafter(len(prompt1), answer, right=10**6)
    first = chat.generate(user(FIRST_USER), max_new_tokens=8)
    assert first.tokens == answer[:2] and first.finish_reason == "eos"
    assert first.trace[1].source == "draft:oracle"

    calls = record_forward(monkeypatch, tiny_engine.llm)
    second = chat.generate(SECOND_USER, max_new_tokens=8)  # a follow-up turn may be a plain string
    prompt2 = chat.state.tokens[:len(chat.state.tokens) - len(second.tokens)]
    assert prompt2[:len(prompt1) + 1] == prompt1 + answer[:1]  # the end-of-turn token was replaced
    # the cache keeps at most the first answer token: the rest of the pass is the new turn
    assert calls[0].start <= len(prompt1) + 1
    assert calls[0].ids[:len(prompt2) - calls[0].start] == prompt2[calls[0].start:]
    fresh = tiny_engine.llm.forward(tiny_engine.llm.new_cache(), prompt2)
    assert relative_error(calls[0].logits[len(prompt2) - calls[0].start - 1], fresh) <= 1e-4
    want = greedy(tiny_engine.llm, prompt2, 8)
    assert second.tokens == want[:len(second.tokens)]


def test_rejected_chat_turn_leaves_the_session_unchanged(tiny_engine):
    chat, clean = tiny_engine.chat(), tiny_engine.chat()
    chat.generate(user(FIRST_USER), max_new_tokens=8)
    clean.generate(user(FIRST_USER), max_new_tokens=8)
    tokens, messages = list(chat.state.tokens), list(chat.messages)
    with pytest.raises(InputError, match="context"):
        chat.generate("word " * 400)
    with pytest.raises(InputError):
        chat.generate("   ")
    assert chat.state.tokens == tokens and chat.messages == messages
    assert chat.generate(SECOND_USER, max_new_tokens=8).tokens == clean.generate(SECOND_USER, max_new_tokens=8).tokens


def test_reset_starts_over(tiny_engine):
    chat = tiny_engine.chat()
    first = chat.generate(user(PROMPT), max_new_tokens=8)
    chat.generate(SECOND_USER, max_new_tokens=4)
    chat.reset()
    assert chat.state.tokens == [] and chat.messages == [] and chat.state.llm_cache.length == 0
    assert chat.generate(user(PROMPT), max_new_tokens=8).tokens == first.tokens


def test_plain_text_continuation_continues_the_sequence(tiny_engine):
    session = tiny_engine.session()
    session.generate(PROMPT, max_new_tokens=6)
    before = list(session.state.tokens)
    more = session.generate(" and then", max_new_tokens=6)
    want = greedy(tiny_engine.llm, before + tiny_engine.encode(" and then"), 6)
    assert more.tokens == want


# -- streaming, sampling, cancellation, threads ---------------------------------------------------

@pytest.mark.parametrize("options", [dict(), dict(mode="speculate"), dict(mode="route", light="slm"),
                                     dict(stop=("xyz",))])
@pytest.mark.parametrize("prompt", ["The capital of France is", PROMPT, REPEATING])
def test_stream_yields_the_same_text_as_generate(prompt, options, tiny_engine):
    pieces = list(tiny_engine.stream(prompt, max_new_tokens=24, **options))
    generation = tiny_engine.generate(prompt, max_new_tokens=24, **options)
    assert len(pieces) > 1 and all(pieces)
    assert "".join(pieces) == generation.text == tiny_engine.decode(generation.tokens)


@pytest.mark.parametrize("mode", ["full", "speculate"])
def test_seeded_sampling_is_reproducible_and_depends_on_the_seed(mode, tiny_engine):
    sampling = dict(mode=mode, temperature=0.8, top_p=0.9, max_new_tokens=24)
    a = tiny_engine.generate(PROMPT, seed=7, **sampling).tokens
    b = tiny_engine.generate(PROMPT, seed=7, **sampling).tokens
    c = tiny_engine.generate(PROMPT, seed=8, **sampling).tokens
    assert a == b
    assert a != c
    assert a != tiny_engine.generate(PROMPT, max_new_tokens=24).tokens  # really sampled


@pytest.mark.parametrize("mode", ["full", "speculate"])
def test_cancel_from_the_token_callback_stops_at_once(mode, tiny_engine):
    session = tiny_engine.session(mode=mode)

    def on_token(trace):
        if trace.position - session.last.stats.prompt_tokens == 4:  # the 5th new token
            session.cancel()

    generation = session.generate(REPEATING, on_token=on_token, max_new_tokens=100)
    assert generation.finish_reason == "cancelled"
    assert len(generation.tokens) == 5
    # the session goes on afterwards
    assert len(session.generate(" again", max_new_tokens=3).tokens) == 3


@pytest.mark.parametrize("mode", ["full", "speculate"])
def test_cancel_from_another_thread_stops_within_one_token(mode, tiny_engine):
    session = tiny_engine.session(mode=mode)
    seen: list[int] = []
    reached, at_cancel = threading.Event(), []

    def on_token(trace):
        seen.append(trace.token)
        if len(seen) == 5:
            reached.set()

    def canceller():
        reached.wait(60)
        session.cancel()
        at_cancel.append(len(seen))

    thread = threading.Thread(target=canceller)
    thread.start()
    generation = session.generate(REPEATING, on_token=on_token, max_new_tokens=200)
    thread.join()
    assert generation.finish_reason == "cancelled"
    assert len(generation.tokens) == len(seen) < 200
    assert len(seen) - at_cancel[0] <= 1


def test_two_sessions_on_one_engine_in_two_threads_match_running_alone(tiny_engine):
    jobs = {"full": (PROMPT, dict(max_new_tokens=48)),
            "speculate-slm": (REPEATING, dict(mode="speculate", light="slm", max_new_tokens=48)),
            "sampled": ("The capital of France is", dict(temperature=0.8, top_p=0.9, seed=7, max_new_tokens=48))}
    alone = {name: tiny_engine.generate(prompt, **options).tokens for name, (prompt, options) in jobs.items()}
    for pair in (("full", "speculate-slm"), ("speculate-slm", "sampled")):
        results: dict[str, list[list[int]]] = {name: [] for name in pair}
        start = threading.Barrier(len(pair))

        def run(name, results=results, start=start):
            prompt, options = jobs[name]
            session = tiny_engine.session(**options)
            start.wait()
            for _ in range(2):
                results[name].append(session.generate(prompt).tokens)
                session.reset()

        threads = [threading.Thread(target=run, args=(name,)) for name in pair]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for name in pair:
            assert results[name] == [alone[name]] * 2, name


# -- stop strings, budgets, traces --------------------------------------------------------------

def _stop_cases(engine, prompts):
    """(prompt, stop string, the text before it, tokens generated to complete it): a clean
    piece of the greedy answer spanning two or three tokens, and where the answer has one,
    a word right after an undecodable byte (the text before the stop ends in U+FFFD)."""
    cases = []
    for prompt in prompts:
        tokens = engine.generate(prompt, max_new_tokens=24).tokens
        texts = [engine.decode(tokens[:i]) for i in range(len(tokens) + 1)]
        for first, span in ((6, 3), (2, 2)):
            for i in range(first, len(tokens) - span):
                stop = texts[i + span][len(texts[i]):]
                if (len(stop.strip()) > 3 and "\ufffd" not in stop and texts[i + span].startswith(texts[i])
                        and (span == 3 or texts[i].endswith("\ufffd"))):
                    before = texts[-1][:texts[-1].find(stop)]
                    n = next(j for j in range(len(texts)) if stop in texts[j])
                    cases.append((prompt, stop, before, n))
                    break
    return cases


def test_stop_strings_cut_the_text_and_the_generation(tiny_engine):
    cases = _stop_cases(tiny_engine, ["The capital of France is", PROMPT, "Set the temperature to 21 degrees",
                                      "Play the next song"])
    assert len(cases) >= 4 and any(before.endswith("\ufffd") for _, _, before, _ in cases)
    for prompt, stop, before, n in cases:
        generation = tiny_engine.generate(prompt, max_new_tokens=24, stop=(stop, "never-in-this-text"))
        assert generation.finish_reason == "stop"
        assert generation.text == before, stop
        assert len(generation.tokens) == n
        # no piece of the stop string is streamed before it is complete
        assert "".join(tiny_engine.stream(prompt, max_new_tokens=24, stop=(stop,))) == before


def test_one_stop_string_is_a_stop_string_and_an_empty_one_is_refused(tiny_engine):
    prompt, stop, before, _ = _stop_cases(tiny_engine, ["The capital of France is", PROMPT])[0]
    assert tiny_engine.generate(prompt, max_new_tokens=24, stop=stop).text == before  # not its characters
    assert DecodeOptions(stop="###").stop == ("###",)
    assert DecodeOptions(stop=["a", "b"]).stop == ("a", "b") and DecodeOptions(stop=None).stop == ()
    for bad, said in (("", "non-empty string .got ''"), (["x", ""], "non-empty string"), (5, "a list of strings"),
                      ([5], "non-empty string .got 5")):
        with pytest.raises(InputError, match=said):
            tiny_engine.generate(prompt, max_new_tokens=4, stop=bad)


@pytest.mark.parametrize("options", [dict(), dict(mode="speculate"), dict(mode="route"), dict(mode="slm"),
                                     dict(mode="skip", scorer="random", skip_ratio=0.5, protected_first=1,
                                          protected_last=0, max_free_layers=1, re_eval_interval=1)])
def test_max_new_tokens_is_respected(options, tiny_engine):
    for n in (1, 5, 17):
        generation = tiny_engine.generate(REPEATING, max_new_tokens=n, **options)
        assert len(generation.tokens) == n and generation.finish_reason == "length"
        assert generation.stats.new_tokens == n


def test_max_new_tokens_is_respected_when_drafts_run_past_it(tiny_engine):
    reference = tiny_engine.generate(PROMPT, max_new_tokens=12).tokens
    session = tiny_engine.session(mode="speculate", draft_tokens=8, adaptive_draft=False)
    session.state.ngram_drafter = OracleDrafter(len(tiny_engine.encode_prompt(PROMPT)), reference, right=10**6)
    generation = session.generate(PROMPT, max_new_tokens=5)
    assert generation.tokens == reference[:5]
    assert session.state.llm_cache.length <= len(session.state.tokens)


@pytest.mark.parametrize("prompt, options, sources", [
    (REPEATING, dict(), {"llm"}),
    (REPEATING, dict(mode="speculate"), {"llm", "draft:ngram"}),
    (PROMPT, dict(mode="route", fallback=None), {"llm", "ngram"}),
    (REPEATING, dict(mode="slm"), {"slm"}),
])
def test_trace_has_one_record_per_token(prompt, options, sources, tiny_engine):
    generation = tiny_engine.generate(prompt, max_new_tokens=20, **options)
    trace = generation.trace
    prompt_length = generation.stats.prompt_tokens
    assert [t.token for t in trace] == generation.tokens
    assert [t.position for t in trace] == list(range(prompt_length, prompt_length + 20))
    assert {t.source for t in trace} == sources
    assert all(t.seconds >= 0 for t in trace)
    for t in trace:
        if t.source == "llm":
            assert t.layers_run == 3 and t.layers_skipped == 0
        else:
            assert t.layers_run is None
    assert "".join(t.text for t in trace) == tiny_engine.decode(generation.tokens)
    json.dumps([t.to_dict() for t in trace])  # what `edgeroute run --trace` writes


def test_per_call_overrides_apply_to_one_call_only(tiny_engine):
    session = tiny_engine.session()
    reference = tiny_engine.generate(PROMPT, max_new_tokens=12).tokens
    speculated = session.generate(PROMPT, mode="speculate", light="slm", max_new_tokens=12)
    assert speculated.tokens == reference and speculated.stats.drafted > 0
    assert session.options.mode == "full" and session.options.light == "ngram"
    session.reset()
    assert session.generate(PROMPT, max_new_tokens=12).stats.drafted == 0


# -- bad input ----------------------------------------------------------------------------------

SKIP_OK = dict(mode="skip", protected_first=1, protected_last=1, max_free_layers=1)


@pytest.mark.parametrize("prompt", ["", "   \n", [], [{"role": "user", "content": " "}]])
def test_empty_prompt_is_an_input_error(prompt, tiny_engine):
    with pytest.raises(InputError, match="empty"):
        tiny_engine.generate(prompt, max_new_tokens=4)


def test_prompt_over_the_context_is_an_input_error_naming_the_sizes(tiny_engine):
    with pytest.raises(InputError, match="context of 256") as err:
        tiny_engine.generate("word " * 300, max_new_tokens=4)
    assert "tokens" in str(err.value) and "shorten" in str(err.value)


@pytest.mark.parametrize("options, message", [
    (dict(mode="turbo"), "mode 'turbo'"),
    (dict(temprature=0.5), "unknown decoding option.*temprature"),
    (dict(light="oracle"), "light path 'oracle'"),
    (dict(mode="route", router="psychic"), "router 'psychic'"),
    (dict(mode="route", route_threshold=-0.1), r"route_threshold.*\[0, 1\]"),
    (dict(mode="route", route_threshold=1.5), r"route_threshold.*\[0, 1\]"),
    (dict(SKIP_OK, importance_threshold=-0.1), r"importance_threshold.*\[0, 1\]"),
    (dict(SKIP_OK, importance_threshold=1.01), r"importance_threshold.*\[0, 1\]"),
    (dict(SKIP_OK, skip_ratio=-0.5), r"skip_ratio.*\[0, 1\]"),
    (dict(SKIP_OK, skip_ratio=2.0), r"skip_ratio.*\[0, 1\]"),
    (dict(SKIP_OK, max_free_layers=4), "max_free_layers.*3 layers"),
    (dict(SKIP_OK, max_free_layers=0), "max_free_layers"),
    (dict(SKIP_OK, re_eval_interval=0), "re_eval_interval"),
    (dict(SKIP_OK, protected_first=3), "protected_first"),
    (dict(SKIP_OK, granularity="head"), "granularity"),
    (dict(SKIP_OK, scorer="oracle"), "scorer 'oracle'"),
    (dict(min_confidence=1.5), r"min_confidence.*\[0, 1\]"),
    (dict(max_llm_share=0.0), r"max_llm_share.*\(0, 1\]"),
    (dict(window=0), "window"),
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(temperature=float("nan")), r"temperature must be a finite number >= 0 .*\(got nan\)"),
    (dict(temperature=float("inf")), r"temperature must be a finite number >= 0 .*\(got inf\)"),
    (dict(top_p=float("nan")), r"top_p must be a number within \(0, 1\] .*\(got nan\)"),
    (dict(temperature=0.7, seed=-1), r"seed must be a whole number >= 0.*\(got -1\)"),
    (dict(temperature=0.7, seed=1.5), r"seed must be a whole number >= 0.*\(got 1.5\)"),
    (dict(mode="speculate", draft_tokens=9), "draft_tokens"),
    (dict(max_new_tokens=0), "max_new_tokens"),
])
def test_invalid_options_are_input_errors_for_the_session_and_per_call(options, message, tiny_engine):
    with pytest.raises(InputError, match=message):
        tiny_engine.session(**options)
    session = tiny_engine.session()
    with pytest.raises(InputError, match=message):
        session.generate(PROMPT, **options)
    assert session.state.tokens == []
    assert len(session.generate(PROMPT, max_new_tokens=2).tokens) == 2  # no harm done


@pytest.mark.parametrize("options", [dict(mode="slm"), dict(mode="speculate", light="slm"),
                                     dict(mode="route", light="slm")])
def test_slm_light_path_on_a_bundle_without_slm_is_an_input_error(options, tiny_bundles):
    engine = Engine(tiny_bundles["llama"])
    assert engine.slm is None
    with pytest.raises(InputError, match="no SLM"):
        engine.session(**options)
    with pytest.raises(InputError, match="no SLM"):
        engine.session().generate(PROMPT, **options)


@pytest.mark.parametrize("options", [dict(mode="slm"), dict(mode="speculate", light="slm")])
def test_slm_light_path_with_the_slm_turned_off_says_it_is_off_not_that_the_bundle_has_none(options, tiny_slm_bundle):
    engine = Engine(tiny_slm_bundle, slm=False)
    for refuse in (lambda: engine.session(**options), lambda: engine.session().generate(PROMPT, **options),
                   lambda: Engine(tiny_slm_bundle, slm=False, decoding=options)):
        with pytest.raises(InputError, match="slm=False") as refused:
            refuse()
        assert "no SLM" not in str(refused.value) and "export" not in str(refused.value)


def test_bundle_from_a_newer_format_version_is_a_bundle_error(tiny_bundles, tmp_path):
    bundle = shutil.copytree(tiny_bundles["llama"], tmp_path / "bundle")
    manifest = json.loads((bundle / MANIFEST).read_text())
    manifest["format_version"] = FORMAT_VERSION + 1
    (bundle / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="newer than this runtime") as err:
        Engine(bundle)
    assert isinstance(err.value, EdgerouteError) and "upgrade edgeroute" in str(err.value)


@pytest.mark.parametrize(("prompt", "message"), [
    (123, "a prompt is a string or a list of messages"),
    ([{"role": "user"}], r"message 0 \(user\) has no content"),
    (["hi"], "message 0 is a str, not a"),
    ([{"role": "user", "content": 5}], "message 0: content must be text"),
    ([{"content": "Hi"}], "message 0 has role None: one of system, user, assistant, tool"),
    ([{"role": "user", "content": "Hi"}, {"role": "driver", "content": "Hi"}], "message 1 has role 'driver'"),
    ("a\ud800b", "the prompt is not valid Unicode text: surrogates not allowed at character 1"),
    ([{"role": "user", "content": "\udc80"}], "message 0 is not valid Unicode text"),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}, {"role": "user", "content": "Hi"}],
     "message 2 has role 'user'; expected 'assistant'"),  # numbered as given, as the checks above number them
])
def test_a_prompt_that_is_not_text_or_messages_is_an_input_error_naming_it(prompt, message, tiny_engine):
    session = tiny_engine.session()
    with pytest.raises(InputError, match=message):
        session.generate(prompt)
    with pytest.raises(InputError, match=message):
        tiny_engine.encode_prompt(prompt)
    assert session.state.tokens == []


@pytest.mark.parametrize("system", ["Answer\ud800 briefly.", 7])
def test_a_system_prompt_that_is_not_text_is_refused_before_the_chat_opens(system, tiny_engine):
    with pytest.raises(InputError, match="the system prompt (is not valid Unicode text|must be text)"):
        tiny_engine.chat(system=system)
    with pytest.raises(InputError, match="the system prompt (is not valid Unicode text|must be text)"):
        tiny_engine.share_prefix(system)


@pytest.mark.parametrize("messages", [
    [{"role": "system", "content": "Answer briefly."}],
    [{"role": "user", "content": FIRST_USER}, {"role": "assistant", "content": "At the square."}],
])
def test_messages_that_end_without_a_user_message_are_refused_not_answered_as_the_user(messages, tiny_engine):
    """The template opens the user's next turn after a system or assistant message: the model
    would write the user's words."""
    chat = tiny_engine.chat()
    with pytest.raises(InputError, match="the messages end with a message of role .*add the user's message"):
        chat.generate(messages, max_new_tokens=2)
    with pytest.raises(InputError, match="the messages end with"):
        tiny_engine.generate(messages, max_new_tokens=2)
    assert chat.state.tokens == [] and chat.messages == []
    assert len(chat.generate([*messages, *user(SECOND_USER)], max_new_tokens=2).tokens) == 2


@pytest.mark.parametrize(("options", "message"), [
    (dict(mode=None), "mode must be a string"),
    (dict(light=3), "light must be a string"),
    (dict(max_new_tokens=True), "max_new_tokens must be a whole number"),
    (dict(max_new_tokens=2.5), "max_new_tokens must be a whole number"),
    (dict(mode="speculate", draft_tokens="3"), r"draft_tokens must be a whole number \(got '3'\)"),
    (dict(mode="speculate", draft_branches=2.0), "draft_branches must be a whole number"),
    (dict(mode="route", route_threshold="0.3"), "route_threshold must be a number"),
    (dict(mode="speculate", light="slm", draft_confidence="high"), "draft_confidence must be a number"),
    (dict(skip_ratio="0.2"), "skip_ratio must be a number"),
    (dict(window="8"), "window must be a whole number"),
    (dict(adaptive_draft="no"), "adaptive_draft must be True or False"),
    (dict(skip="layer"), "skip and fallback take SkipOptions"),
    (dict(mode="route", router=5), "router must be a router's name, a function scoring a token"),
    (dict(task=3), r"task must be a task's name, a task profile's \(e.g. 'json'\) or your own, or None \(got 3\)"),
    (dict(protected_tokens="{}"), r"protected_tokens must be token ids, whole numbers >= 0, e.g. \[1, 2\]"),
    (dict(protected_tokens=[1, "2"]), "protected_tokens must be token ids"),
    (dict(protected_tokens=5), "protected_tokens must be token ids"),
])
def test_options_of_the_wrong_type_are_input_errors(options, message, tiny_engine):
    with pytest.raises(InputError, match=message):
        tiny_engine.session(**options)
    chat = tiny_engine.chat()
    chat.generate(FIRST_USER, max_new_tokens=2)
    before = (list(chat.state.tokens), list(chat.messages))
    with pytest.raises(InputError, match=message):  # per call too, before the turn changes anything
        chat.generate(SECOND_USER, **options)
    assert (chat.state.tokens, chat.messages) == before


def test_protected_tokens_take_any_iterable_of_ids_and_keep_them_as_a_frozenset(tiny_engine):
    for given in ([5, 7, 5], (7, 5), np.array([5, 7]), range(5, 8, 2)):
        ids = tiny_engine.session(protected_tokens=given).options.protected_tokens
        assert ids == frozenset({5, 7}) and all(type(t) is int for t in ids), given


def test_a_system_prompt_that_is_not_text_is_an_input_error(tiny_engine):
    with pytest.raises(InputError, match="the system prompt must be text"):
        tiny_engine.chat(system=5)
    with pytest.raises(InputError, match="the system prompt must be text"):
        tiny_engine.share_prefix(5)


def test_an_engine_refuses_bad_default_decoding_before_it_loads_the_models(tiny_slm_bundle):
    with pytest.raises(InputError, match="mode 'warp' is not one of"):
        Engine(tiny_slm_bundle, decoding={"mode": "warp"})
