"""Answer memory: prompt lookup drafting from the engine's earlier answers, exactly."""

from __future__ import annotations

import numpy as np
import pytest

from edgeroute.errors import InputError
from edgeroute.runtime.answer_memory import AnswerMemory
from edgeroute.runtime.drafters import NgramDrafter


def drafter_with(*answers: list[int]) -> NgramDrafter:
    memory = AnswerMemory()
    for answer in answers:
        memory.remember("templated", answer)
    drafter = NgramDrafter()
    drafter.memory = memory.haystack("templated")
    return drafter


def test_lookup_drafts_from_memory_where_it_matched_a_longer_suffix():
    drafter = drafter_with([5, 6, 7, 8, 9, 10])
    proposal = drafter.propose([1, 2, 3, 6, 7], 3)
    assert proposal.tokens == [8, 9, 10]
    assert proposal.match_length == 2


def test_lookup_prefers_the_sequence_on_a_tie_and_memory_alone_changes_nothing_there():
    drafter = drafter_with([6, 7, 40, 41])
    sequence = [6, 7, 30, 31, 6, 7]  # the sequence itself holds "6 7" followed by 30
    assert drafter.propose(sequence, 2).tokens == [30, 31]
    drafter.memory = None
    assert drafter.propose(sequence, 2).tokens == [30, 31]


def test_memory_drafts_the_continuation_most_answers_share():
    drafter = drafter_with([1, 2, 3, 4], [9, 2, 3, 5], [8, 2, 3, 5])
    assert drafter.propose([70, 2, 3], 1).tokens == [5]
    tree = drafter.propose_tree([70, 2, 3], 1, branches=2)
    assert tree.tokens == [5, 4] and tree.parents == [-1, -1]


def test_memory_matches_never_run_across_two_answers():
    drafter = drafter_with([1, 2], [3, 4, 5])
    assert drafter.propose([2, 3], 2).match_length == 1  # "2 3" spans the answers' boundary
    assert drafter.propose([9, 2], 2).tokens == []  # 2 ends an answer: nothing follows it there
    assert drafter.propose([9, 4], 2).tokens == [5]  # a continuation stops at its answer's end


def test_memory_forgets_its_oldest_answers_past_max_tokens():
    memory = AnswerMemory(max_tokens=6)
    for answer in ([1, 2, 3], [4, 5, 6], [7, 8, 9]):
        memory.remember(None, answer)
    assert memory.answers(None) == 2
    assert memory.haystack("default").tolist() == [4, 5, 6, -1, 7, 8, 9, -1]
    assert memory.haystack("json").size == 0


def test_memory_survives_save_and_load(tmp_path):
    memory = AnswerMemory()
    memory.remember("json", [1, 2, 3])
    memory.remember("json", [4, 5])
    memory.remember("voice-command", [6, 7])
    path = tmp_path / "memory.npz"
    memory.save(path)
    loaded = AnswerMemory.load(path)
    assert loaded.haystack("json").tolist() == memory.haystack("json").tolist()
    assert loaded.haystack("voice-command").tolist() == [6, 7, -1]


@pytest.mark.parametrize("damage", ["not a zip", "negative ids", "pickled objects"])
def test_a_damaged_memory_file_is_a_clear_error(tmp_path, damage):
    path = tmp_path / "memory.npz"
    if damage == "not a zip":
        path.write_bytes(b"\x00garbage")
    elif damage == "pickled objects":
        np.save(path, np.asarray([{"a": 1}], dtype=object))
        path = path.with_suffix(".npz.npy")
    else:
        np.savez(path, **{"json/0": np.asarray([1, -5, 2])})
    with pytest.raises(InputError, match="memory") as error:
        AnswerMemory.load(path)
    assert "unsafely" not in str(error.value)  # numpy's advice to unpickle a file it distrusts is not passed on


def test_an_engine_takes_an_answer_memory_or_none(tiny_engine):
    with pytest.raises(InputError, match="answer_memory is an AnswerMemory or None"):
        tiny_engine.answer_memory = "memory.npz"


def test_memory_needs_room_for_a_token():
    with pytest.raises(InputError, match="at least 1"):
        AnswerMemory(max_tokens=0)


PROMPT = [{"role": "user", "content": "Navigate to 221B Baker Street, London."}]


def test_speculation_drafts_an_earlier_answer_from_memory_and_stays_exact(tiny_engine):
    full = tiny_engine.session(max_new_tokens=24).generate(PROMPT).tokens
    tiny_engine.answer_memory = AnswerMemory()
    try:
        first = tiny_engine.session(mode="speculate", light="ngram", max_new_tokens=24)
        first.generate(PROMPT)
        again = tiny_engine.session(mode="speculate", light="ngram", max_new_tokens=24)
        again.generate(PROMPT)
        assert first.last.tokens == again.last.tokens == full
        assert again.last.stats.accepted > first.last.stats.accepted
        assert again.last.stats.llm_calls < first.last.stats.llm_calls
        assert tiny_engine.answer_memory.answers(None) == 2
    finally:
        tiny_engine.answer_memory = None


def test_routing_never_drafts_from_memory(tiny_engine):
    memory = AnswerMemory()
    tiny_engine.answer_memory = memory
    try:
        session = tiny_engine.session(mode="speculate", light="ngram", max_new_tokens=8)
        session.generate(PROMPT)
        assert session.state.ngram_drafter.memory is not None
        routed = tiny_engine.session(mode="route", light="ngram", max_new_tokens=8)
        routed.generate(PROMPT)
        assert routed.state.ngram_drafter.memory is None
    finally:
        tiny_engine.answer_memory = None


def test_memory_that_is_not_learning_keeps_only_what_it_was_given(tiny_engine):
    tiny_engine.answer_memory = AnswerMemory(learning=False)
    try:
        tiny_engine.session(mode="speculate", light="ngram", max_new_tokens=8).generate(PROMPT)
        assert tiny_engine.answer_memory.answers(None) == 0
    finally:
        tiny_engine.answer_memory = None


def test_an_engine_refuses_a_memory_of_another_vocabulary_and_keeps_its_own(tiny_engine):
    vocab = tiny_engine.bundle.llm.arch.vocab_size
    own, foreign = AnswerMemory(), AnswerMemory()
    own.remember("json", [1, vocab - 1])
    foreign.remember("json", [1, vocab])
    assert foreign.largest_id() == vocab and AnswerMemory().largest_id() == -1
    tiny_engine.answer_memory = own
    try:
        with pytest.raises(InputError, match=f"token id {vocab}, outside this bundle's vocabulary of {vocab}"):
            tiny_engine.answer_memory = foreign
        assert tiny_engine.answer_memory is own
    finally:
        tiny_engine.answer_memory = None
