"""OpenAI's ``logit_bias`` in DecodeOptions: added to the logits of every choice, so speculation
gives exactly the biased model's tokens; bad entries are refused by name."""

from __future__ import annotations

import math

import pytest

from edgeroute.errors import InputError
from edgeroute.runtime import DecodeOptions

PROMPT = "The quick brown fox jumps over the lazy dog and then"


def tokens(engine, **options) -> list[int]:
    return engine.session(max_new_tokens=12, **options).generate(PROMPT).tokens


def test_a_bias_of_100_makes_a_token_the_only_choice_and_minus_100_bans_one(tiny_engine):
    plain = tokens(tiny_engine)
    chosen = (plain[0] + 7) % tiny_engine.bundle.llm.arch.vocab_size
    assert tokens(tiny_engine, logit_bias={chosen: 100}) == [chosen] * 12
    banned = tokens(tiny_engine, logit_bias={plain[0]: -100})
    assert banned[0] != plain[0] and plain[0] not in banned


@pytest.mark.parametrize("mode", [{"mode": "speculate", "light": "slm"}, {"mode": "speculate", "light": "ngram"},
                                  {"mode": "speculate", "light": "slm", "draft_branches": 3}],
                         ids=["speculate-slm", "speculate-ngram", "speculate-tree"])
def test_speculation_gives_exactly_the_biased_models_tokens(tiny_engine, mode):
    plain = tokens(tiny_engine)
    # JSON's string keys are ids too; the bias moves the answer off the plain one at its second token
    bias = {str(plain[1]): -100, (plain[1] + 3) % tiny_engine.bundle.llm.arch.vocab_size: 4.0}
    biased = tokens(tiny_engine, logit_bias=bias)
    assert biased != plain
    assert tokens(tiny_engine, logit_bias=bias, **mode) == biased


@pytest.mark.parametrize(("bias", "message"), [
    ([1, 2], "maps token ids to numbers"),
    ({-1: 1.0}, "is not a token id"),
    ({True: 1.0}, "is not a token id"),
    ({"x": 1.0}, "is not a token id"),
    ({5: 101}, "within [-100, 100]"),
    ({5: math.nan}, "within [-100, 100]"),
    ({5: math.inf}, "within [-100, 100]"),
    ({5: "2"}, "within [-100, 100]"),
])
def test_a_bad_logit_bias_is_refused_naming_the_entry(bias, message):
    with pytest.raises(InputError, match=message.replace("[", r"\[").replace("]", r"\]")):
        DecodeOptions(logit_bias=bias)


def test_a_token_id_outside_the_vocabulary_is_refused_before_decoding(tiny_engine):
    vocab = tiny_engine.bundle.llm.arch.vocab_size
    with pytest.raises(InputError, match=f"token id {vocab}, outside the model's vocabulary of {vocab}"):
        tokens(tiny_engine, logit_bias={vocab: 1.0})
    assert DecodeOptions(logit_bias={"7": 2}).logit_bias == {7: 2.0} and DecodeOptions(logit_bias={}).logit_bias is None
