"""Sessions over long conversations: incremental text, the drop_oldest context policy, a
shared system-prompt prefix, and one call at a time (SessionBusy, cancel semantics)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models

from edgeroute.errors import InputError, SessionBusy
from edgeroute.runtime import Engine
from edgeroute.runtime.text_stream import IncrementalDetokenizer, StopFilter
from tests.conftest import record_forward, record_passes, relative_error

SYSTEM = ("You are the voice assistant of a car. Answer in one short sentence. You can navigate, call contacts, "
          "play music and set the climate. The driver is Anna; home is 12 Baker Street; the car is electric, "
          "battery at 64 percent, range 210 kilometres. Never read out long lists while driving.")
TURNS = [f"Where is charging station number {i}?" for i in range(40)]


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


# -- incremental text -----------------------------------------------------------------------------

def _pieces(decode, tokens: list[int]) -> list[str]:
    detokenizer = IncrementalDetokenizer(decode)
    return [detokenizer.add(t) for t in tokens] + [detokenizer.flush()]


def test_incremental_detokenizer_equals_decoding_the_whole_text(tiny_engine):
    text = "Grüße aus München 🚗 naïve 東京 — 21.5 °C, ok?"
    tokens = tiny_engine.encode(text)
    pieces = _pieces(tiny_engine.decode, tokens)
    assert "".join(pieces) == tiny_engine.decode(tokens) == text
    assert not any("\ufffd" in p for p in pieces)  # a character is released once its bytes are complete
    rng = np.random.default_rng(0)
    for _ in range(20):  # random tokens: stray bytes that never complete stay U+FFFD, as in a whole decode
        tokens = [int(t) for t in rng.integers(0, 49152, 40)]
        assert "".join(_pieces(tiny_engine.decode, tokens)) == tiny_engine.decode(tokens)


def test_incremental_detokenizer_keeps_spaces_a_sentencepiece_decoder_drops_at_the_start():
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3, "<0xC3>": 4, "<0xA9>": 5, "▁caf": 6}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])

    def decode(ids):
        return tokenizer.decode(ids)

    tokens = [1, 2, 3, 6, 4, 5, 2]
    assert decode([2]) == "world"  # alone, the leading space is gone
    pieces = _pieces(decode, tokens)
    assert "".join(pieces) == decode(tokens) == "Hello world! café world"
    assert pieces[1] == " world" and pieces[4] == "" and pieces[5] == "é"


def test_stream_decodes_a_short_window_per_token(tiny_engine, monkeypatch):
    decoded: list[int] = []
    original = tiny_engine.decode

    def counting(ids):
        decoded.append(len(ids))
        return original(ids)

    monkeypatch.setattr(tiny_engine, "decode", counting)
    generation = tiny_engine.session().generate("The capital of France is", max_new_tokens=200)
    assert len(generation.tokens) == 200
    assert max(decoded) < 20 and sum(decoded) < 10 * 200  # the whole answer every step: ~20,000
    assert generation.text == original(generation.tokens)


def test_stop_filter_holds_back_a_possible_stop_string_and_cuts_at_it():
    stops = StopFilter(["</end>", "STOP"])
    assert stops.push("Turn left </e") == "Turn left "
    assert stops.push("nd> is not spoken") == ""
    assert stops.stopped and stops.flush() == ""
    stops = StopFilter(["</end>"])
    assert stops.push("a </e") == "a "
    assert stops.push("x>") == "</ex>" and not stops.stopped
    assert stops.push("tail <") == "tail " and stops.flush() == "<"


# -- long conversations: the drop_oldest context policy --------------------------------------------

def _converse(chat, turns, **options):
    """Run turns until one raises; return the generations (and the error, if any)."""
    generations = []
    for text in turns:
        try:
            generations.append(chat.generate(text, **options))
        except InputError as err:
            return generations, err
    return generations, None


def test_default_context_policy_is_a_clear_error_when_the_context_fills(tiny_engine):
    generations, err = _converse(tiny_engine.chat(system=SYSTEM), TURNS, max_new_tokens=24)
    assert err is not None and "context" in str(err) and "drop_oldest" in str(err)
    assert len(generations) >= 1


def test_drop_oldest_keeps_a_conversation_going_and_equals_a_fresh_session_fed_the_kept_turns(tiny_engine, monkeypatch):
    chat = tiny_engine.chat(system=SYSTEM, context_policy="drop_oldest")
    prefix = len(tiny_engine.encode_prompt([{"role": "system", "content": SYSTEM}]))
    calls = record_forward(monkeypatch, tiny_engine.llm)
    dropped = 0
    for i, text in enumerate(TURNS[:24]):
        before = len(chat.messages)
        first_call = len(calls)
        answer = chat.generate(text, max_new_tokens=24)
        assert len(answer.tokens) == 24 or answer.finish_reason == "eos"
        assert chat.messages[0] == {"role": "system", "content": SYSTEM}
        assert chat.messages[-2:] == [{"role": "user", "content": text}, {"role": "assistant", "content": answer.text}]
        if len(chat.messages) == before + 2:  # nothing dropped
            continue
        dropped += 1
        # the cache kept the system prompt: the turn recomputed from the first changed token on
        assert prefix <= calls[first_call].start < prefix + 40
        kept = chat.messages[1:-1]
        fresh = tiny_engine.chat(system=SYSTEM)
        again = fresh.generate(kept, max_new_tokens=24)
        assert fresh.state.tokens == chat.state.tokens, f"turn {i}"
        assert again.tokens == answer.tokens
        assert len(chat.state.tokens) - len(answer.tokens) + 24 + 9 <= chat.state.capacity // 2  # down to half
    assert dropped >= 3
    assert len(chat.state.tokens) <= chat.state.capacity


def test_drop_oldest_still_refuses_a_turn_that_cannot_fit_alone(tiny_engine):
    chat = tiny_engine.chat(context_policy="drop_oldest")
    chat.generate(TURNS[0], max_new_tokens=8)
    with pytest.raises(InputError, match="context"):
        chat.generate("word " * 300, max_new_tokens=8)
    assert len(chat.messages) == 2


def test_drop_oldest_refuses_a_first_turn_that_cannot_fit_with_the_usual_error_without_a_system_prompt(tiny_engine):
    chat = tiny_engine.chat(context_policy="drop_oldest")
    with pytest.raises(InputError, match="context") as refused:
        chat.generate("word " * 300, max_new_tokens=8)
    assert "drop_oldest" not in str(refused.value)  # the policy it already runs is no advice
    assert chat.messages == []
    assert chat.generate(TURNS[0], max_new_tokens=8).tokens


def test_unknown_context_policy_and_empty_system_prompt_are_input_errors(tiny_engine):
    with pytest.raises(InputError, match="context policy 'forget'.*drop_oldest"):
        tiny_engine.chat(context_policy="forget")
    with pytest.raises(InputError, match="system prompt is empty"):
        tiny_engine.chat(system="  ")


# -- a shared system-prompt prefix ----------------------------------------------------------------

def test_a_session_from_the_shared_prefix_equals_one_that_prefilled_it(tiny_slm_bundle, monkeypatch):
    engine = Engine(tiny_slm_bundle)
    calls = record_forward(monkeypatch, engine.llm)
    prefilled = engine.chat(system=SYSTEM)
    want = prefilled.generate(TURNS[0], max_new_tokens=16)
    want_first = calls[0]
    assert want_first.start == 0

    n = engine.share_prefix(SYSTEM)
    assert n == len(engine.encode_prompt([{"role": "system", "content": SYSTEM}])) > 40
    for _ in range(2):  # a second session gets a clean copy, untouched by the first
        calls.clear()
        shared = engine.chat(system=SYSTEM)
        got = shared.generate(TURNS[0], max_new_tokens=16)
        assert calls[0].start == n  # only the user turn is prefilled
        assert calls[0].ids == shared.state.tokens[n:n + len(calls[0].ids)]
        assert got.tokens == want.tokens and got.text == want.text
        assert relative_error(calls[0].logits[-1], want_first.logits[-1]) <= 1e-4
        cache, reference = shared.state.llm_cache, prefilled.state.llm_cache
        np.testing.assert_allclose(cache.keys[:, :n], reference.keys[:, :n], rtol=1e-4, atol=1e-5)
        shared.generate(TURNS[1], max_new_tokens=8)  # writes past the prefix in its own copy


def test_the_slm_starts_from_the_shared_prefix_too(tiny_slm_bundle, monkeypatch):
    engine = Engine(tiny_slm_bundle)
    want = engine.chat(system=SYSTEM, mode="speculate", light="slm").generate(TURNS[0], max_new_tokens=16)
    n = engine.share_prefix(SYSTEM)
    calls = record_passes(monkeypatch, engine.slm)
    for first in (True, False):
        calls.clear()
        chat = engine.chat(system=SYSTEM, mode="speculate", light="slm")
        got = chat.generate(TURNS[0], max_new_tokens=16)
        assert got.tokens == want.tokens and got.stats.drafted > 0
        if first:  # the SLM's K/V of the prefix, computed once, for the first session that needs it
            prefill = calls.pop(0)
            assert prefill.start == 0 and len(prefill.ids) == n
        assert calls[0].start == n and chat.state.slm_drafter.seen[:n] == chat.state.tokens[:n]


def test_shared_prefix_serves_only_sessions_that_start_with_it(tiny_slm_bundle, monkeypatch):
    engine = Engine(tiny_slm_bundle)
    engine.share_prefix(SYSTEM)
    calls = record_forward(monkeypatch, engine.llm)
    engine.chat(system=SYSTEM[:-20]).generate(TURNS[0], max_new_tokens=2)
    engine.chat().generate(TURNS[0], max_new_tokens=2)
    assert [c.start for c in calls if len(c.ids) > 1] == [0, 0]


# -- one call at a time ---------------------------------------------------------------------------

def test_a_second_thread_on_a_busy_session_gets_a_clear_error_and_changes_nothing(tiny_engine):
    chat, alone = tiny_engine.chat(), tiny_engine.chat()
    want = [alone.generate(TURNS[0], max_new_tokens=16).tokens, alone.generate(TURNS[1], max_new_tokens=8).tokens]
    inside, release, errors = threading.Event(), threading.Event(), []

    def on_token(trace):
        if len(chat.last.tokens) == 3:
            inside.set()
            release.wait(60)

    def intruder():
        inside.wait(60)
        for call in (lambda: chat.generate(TURNS[5], max_new_tokens=4), chat.reset,
                     lambda: list(chat.stream(TURNS[5])), lambda: list(chat.generate_tokens(TURNS[5]))):
            try:
                call()
            except SessionBusy as err:
                errors.append(str(err))
        release.set()

    thread = threading.Thread(target=intruder)
    thread.start()
    first = chat.generate(TURNS[0], on_token=on_token, max_new_tokens=16)
    thread.join()
    assert len(errors) == 4 and all("already generating" in e and "engine.session()" in e for e in errors)
    assert first.tokens == want[0]
    assert chat.generate(TURNS[1], max_new_tokens=8).tokens == want[1]
    assert chat.messages == alone.messages


def test_generate_tokens_records_the_answer_so_the_conversation_goes_on(tiny_engine):
    chat = tiny_engine.chat()
    tokens = [t.token for t in chat.generate_tokens(TURNS[0], max_new_tokens=6)]
    assert chat.messages == [*user(TURNS[0]), {"role": "assistant", "content": tiny_engine.decode(tokens)}]
    assert chat.last.tokens == tokens
    chat.generate(TURNS[1], max_new_tokens=4)
    assert [m["role"] for m in chat.messages] == ["user", "assistant"] * 2


def test_a_call_from_its_own_token_callback_is_refused(tiny_engine):
    session, refused = tiny_engine.session(), []

    def on_token(trace):
        with pytest.raises(SessionBusy):
            session.generate("again", max_new_tokens=2)
        refused.append(trace.token)

    generation = session.generate("The capital of France is", on_token=on_token, max_new_tokens=4)
    assert len(refused) == 4 and generation.finish_reason == "length"


def test_a_call_from_its_own_token_callback_after_a_cancel_is_refused_at_once(tiny_engine):
    """Another thread's call waits for a cancelled generation to stop; its own callback's call
    would wait for itself, so it is refused as before."""
    session = tiny_engine.session()

    def on_token(trace):
        session.cancel()
        with pytest.raises(SessionBusy):
            session.generate("again", max_new_tokens=2)

    assert session.generate("The capital of France is", on_token=on_token, max_new_tokens=4).finish_reason == "cancelled"


def test_a_call_after_a_cancel_from_another_thread_waits_for_the_generation_to_stop(tiny_engine):
    chat, started = tiny_engine.chat(), threading.Event()

    def speak():
        for _ in chat.stream(TURNS[0], on_token=lambda trace: (started.set(), time.sleep(0.02)), max_new_tokens=200):
            pass

    thread = threading.Thread(target=speak)
    thread.start()
    started.wait(60)
    chat.cancel()
    chat.barge_in(None)  # the barge-in right after the cancel: no SessionBusy
    thread.join()
    assert chat.last.finish_reason == "cancelled" and chat.messages == []
    assert chat.generate(TURNS[1], max_new_tokens=2).finish_reason in ("length", "eos")


def test_cancel_while_idle_does_nothing_and_cancel_before_the_first_token_yields_none(tiny_engine, monkeypatch):
    session = tiny_engine.session()
    session.cancel()  # idle: forgotten, never cancels a later call
    stream = session.stream("The capital of France is", max_new_tokens=6)
    session.cancel()  # a stream not yet iterated has not started either
    assert len("".join(stream)) > 0 and session.last.finish_reason == "length"

    original = tiny_engine._encode_checked_prompt

    def cancel_while_starting(prompt, tools):  # runs inside the call, before any token
        session.cancel()
        return original(prompt, tools)

    session.reset()
    monkeypatch.setattr(tiny_engine, "_encode_checked_prompt", cancel_while_starting)
    generation = session.generate("The capital of France is", max_new_tokens=6)
    assert generation.tokens == [] and generation.text == "" and generation.finish_reason == "cancelled"
    monkeypatch.setattr(tiny_engine, "_encode_checked_prompt", original)
    session.reset()
    assert len(session.generate("The capital of France is", max_new_tokens=6).tokens) == 6


def test_a_long_prompt_hands_freed_memory_back_and_a_short_one_does_not(tiny_engine, monkeypatch):
    trims = []
    monkeypatch.setattr("edgeroute.runtime.backends.onnxruntime.release_freed_memory", lambda: trims.append(1))
    session = tiny_engine.session()
    session.generate("word " * 80, max_new_tokens=2)
    assert trims == [1]
    session.generate(" and more", max_new_tokens=2)
    assert trims == [1]
    session.reset()
    session.generate("a b", max_new_tokens=70)  # a short prompt, then 64 one-token steps add up
    assert trims == [1, 1]


@pytest.mark.slow
def test_decoding_does_not_grow_memory_token_by_token(smollm2_bundles):
    """ONNX Runtime's memory patterns (one per set of input shapes, and the past grows every
    step) are off: 300 more one-token steps of SmolLM2 leave RSS where it was (with them on it
    grew ~85 KB per token, ~29 MB here). In a fresh process: this one's heap holds the rest of
    the suite's history."""
    import subprocess
    import sys

    script = f"""if True:
        from edgeroute.runtime import Engine
        def rss():
            return int(open("/proc/self/statm").read().split()[1]) * 4096
        engine = Engine({str(smollm2_bundles["int4"][0])!r}, slm=False)
        engine.eos_ids = set()  # run to the budget
        session = engine.session()
        session.generate("Tell me a story about a lighthouse.", max_new_tokens=64)  # warm-up
        before = rss()
        print(len(session.generate(" Go on.", max_new_tokens=300).tokens), rss() - before)
    """
    if sys.platform != "linux":
        pytest.skip("/proc only on Linux")
    tokens, grown = map(int, subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                                            check=True).stdout.split())
    assert tokens == 300
    assert grown < 12 << 20


def test_freed_large_blocks_go_back_to_the_os_after_malloc_is_tuned():
    """glibc raises its mmap threshold to the size of a freed mapped block, after which a
    block of nearly that size comes from the heap and stays resident once freed; with the
    thresholds fixed (tune_malloc, done by every OrtModel) it is unmapped at once."""
    import subprocess
    import sys

    script = """if True:
        import os
        import numpy as np
        from edgeroute.runtime.backends.onnxruntime import tune_malloc
        def rss():
            return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20
        tune_malloc()
        first = np.ones(20 << 18, np.float32); del first  # 20 MiB, mapped and freed
        before = rss()
        second = np.ones(16 << 18, np.float32); during = rss(); del second
        print(before, during, rss())
    """
    if sys.platform != "linux":
        pytest.skip("glibc and /proc only on Linux")
    before, during, after = map(int, subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                                                    check=True).stdout.split())
    assert during - before >= 15, "the 16 MiB block was never resident: the test would prove nothing"
    assert after - before <= 1


def test_a_kv_cache_is_resident_from_its_allocation():
    """A cache's memory is all taken when it is allocated, not page by page as positions fill
    (in a fresh process: this one's heap may already hold freed, resident pages)."""
    import subprocess
    import sys

    script = """if True:
        from edgeroute.runtime.attention import KVCache
        def rss():
            return int(open("/proc/self/statm").read().split()[1]) * 4096
        before = rss()
        cache = KVCache.allocate(layers=8, capacity=4096, kv_heads=4, head_dim=64, heads_first=False)
        print(cache.keys.nbytes + cache.values.nbytes, rss() - before)
    """
    if sys.platform != "linux":
        pytest.skip("/proc only on Linux")
    size, grown = map(int, subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                                          check=True).stdout.split())
    assert size == 64 << 20
    assert grown >= 60 << 20


def test_a_shared_prefix_the_context_cannot_hold_is_refused_with_the_sizes(tiny_engine):
    before = dict(tiny_engine._prefixes)
    with pytest.raises(InputError, match=rf"needs \d+ tokens .* the context holds {tiny_engine.context_length}"):
        tiny_engine.share_prefix("word " * tiny_engine.context_length)
    assert tiny_engine._prefixes == before  # nothing was computed
