"""Listen-ahead and barge-in on a chat: the cache computes only what the final transcript does
not share with what was prefilled, and an answer cut off (or forgotten) leaves history and cache
as a chat whose answer ended there (or that never had the exchange)."""

from __future__ import annotations

import pytest

from edgeroute.errors import InputError

SYSTEM = "You are the voice assistant of a car. Answer in one short sentence."
FINAL = "Navigate to 12 Baker Street in London, and avoid the motorway."


@pytest.fixture(scope="module")
def own_engine(tiny_slm_bundle):
    """An engine of this module's own: what a listen computes counts from the system prompt on,
    which a shared prefix another test's app left on the session's engine would take away."""
    from edgeroute.runtime import Engine

    return Engine(tiny_slm_bundle)


@pytest.mark.parametrize("mode", ["full", "speculate"])
def test_listen_ahead_gives_the_answer_of_a_cold_prefill_whatever_the_partials_said(own_engine, mode):
    cold = own_engine.chat(system=SYSTEM, mode=mode, light="slm", max_new_tokens=12).generate(FINAL)
    chat = own_engine.chat(system=SYSTEM, mode=mode, light="slm", max_new_tokens=12)
    first = chat.listen("Navigate to")
    grown = chat.listen("Navigate to 12 Baker")
    assert 0 < grown < first  # the system prompt and the shared words stay cached
    chat.listen("Navigate to 21 Baker Street in Lund")  # an earlier word changes: recomputed from there
    chat.listen("Navigate to 12")  # and the partial shrinks
    chat.listen("Navigate to 12 Baker Street in London, and")
    warm = chat.generate(FINAL)
    assert warm.tokens == cold.tokens and warm.text == cold.text
    assert warm.stats.prompt_tokens < cold.stats.prompt_tokens / 2  # only the words after the shared prefix
    follow = chat.generate("Thanks.")  # and the chat goes on as a cold one would
    again = own_engine.chat(system=SYSTEM, mode=mode, light="slm", max_new_tokens=12)
    again.generate(FINAL)
    assert follow.tokens == again.generate("Thanks.").tokens


def test_listening_to_a_different_message_than_the_final_one_costs_time_not_correctness(tiny_engine):
    cold = tiny_engine.chat(system=SYSTEM, max_new_tokens=8).generate("Call Anna.")
    chat = tiny_engine.chat(system=SYSTEM, max_new_tokens=8)
    chat.listen("Play some jazz on the radio please")
    assert chat.generate("Call Anna.").tokens == cold.tokens


def _cut_after(chat, prompt: str, pieces: int):
    """Stream ``prompt`` and cancel (a barge-in) when ``pieces`` text pieces were said and the
    speech lags the decode by three more."""
    written = []
    for piece in chat.stream(prompt):
        written.append(piece)
        if len(written) == pieces + 3:
            chat.cancel()
    return "".join(written[:pieces])


def test_a_barged_in_answer_keeps_what_was_said_and_the_next_turn_is_a_chat_that_ended_there(tiny_engine):
    chat = tiny_engine.chat(system=SYSTEM, max_new_tokens=40)
    spoken = _cut_after(chat, FINAL, 3)
    assert chat.last.finish_reason == "cancelled"
    chat.barge_in(spoken)
    kept = len(tiny_engine.encode(chat.messages[-1]["content"]))
    assert chat.messages[-1]["content"] == spoken and kept < len(chat.last.tokens)
    after = chat.generate("No, to the station.", max_new_tokens=8)

    reference = tiny_engine.chat(system=SYSTEM, max_new_tokens=kept)
    assert reference.generate(FINAL).text == spoken  # the same answer, ended there by its length
    assert after.tokens == reference.generate("No, to the station.", max_new_tokens=8).tokens
    assert chat.state.tokens == reference.state.tokens and chat.messages == reference.messages


def test_a_forgotten_exchange_leaves_the_chat_as_if_it_never_happened(tiny_engine):
    chat = tiny_engine.chat(system=SYSTEM, max_new_tokens=40)
    chat.generate("Call Anna.", max_new_tokens=6)
    _cut_after(chat, FINAL, 2)
    chat.barge_in(None)
    after = chat.generate("Play some jazz.", max_new_tokens=8)
    reference = tiny_engine.chat(system=SYSTEM, max_new_tokens=40)
    reference.generate("Call Anna.", max_new_tokens=6)
    assert after.tokens == reference.generate("Play some jazz.", max_new_tokens=8).tokens
    assert chat.messages == reference.messages


def test_barge_in_refuses_what_it_cannot_do(tiny_engine):
    with pytest.raises(InputError, match="has none"):
        tiny_engine.chat().barge_in("x")
    chat = tiny_engine.chat(max_new_tokens=6)
    chat.generate("Call Anna.")
    with pytest.raises(InputError, match="start of the last answer"):
        chat.barge_in("something never said")


@pytest.mark.parametrize("mode", ["full", "speculate"])
def test_a_forgotten_message_asked_again_reuses_its_rows_and_answers_as_a_cold_chat(tiny_engine, mode):
    cold = tiny_engine.chat(system=SYSTEM, mode=mode, light="slm", max_new_tokens=12).generate(FINAL)
    chat = tiny_engine.chat(system=SYSTEM, mode=mode, light="slm", max_new_tokens=12)
    first = chat.generate(FINAL)
    chat.barge_in(None)  # an answer begun on a guess of the message, forgotten
    again = chat.generate(FINAL)
    assert again.tokens == cold.tokens == first.tokens
    assert again.stats.prompt_tokens == 1 < first.stats.prompt_tokens  # the message's rows were kept
    chat.barge_in(None)
    other = chat.generate("Call Anna.")  # another message computes from where they part
    assert other.tokens == tiny_engine.chat(system=SYSTEM, mode=mode, light="slm", max_new_tokens=12).generate(
        "Call Anna.").tokens
    assert chat.messages == [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Call Anna."},
                             {"role": "assistant", "content": other.text}]
