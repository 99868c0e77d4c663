"""The SLM's reduced-vocabulary head: chosen from the calibration text, stored and verified in
the bundle, never drafting a token outside its set, and stopping drafts at its rest column."""

from __future__ import annotations

import json

import numpy as np
import pytest

from edgeroute.bundle import Bundle
from edgeroute.errors import BundleError, EdgerouteError
from edgeroute.export.vocab import select_vocabulary
from edgeroute.runtime import Engine
from edgeroute.runtime.backends.onnxruntime import OrtModel
from edgeroute.runtime.vocab import HeadVocabulary
from tests.conftest import export_tiny, make_tiny_model

SIZE = 600
PROMPTS = ["Navigate to 12 Baker Street", "Set the temperature to 21 degrees", "Play the next song",
           "Call Anna Schmidt. Call Anna Schmidt. Call Anna", "What is the weather like in Berlin tomorrow?"]
NEW = 20


@pytest.fixture(scope="module")
def confident_model(tmp_path_factory, smollm2_tokenizer_dir):
    """A tiny Llama whose head is scaled up: logits as peaked as a trained model's, so its SLM is
    sometimes sure of a token inside a reduced head and sometimes not (random tiny heads never are)."""
    import torch

    directory = tmp_path_factory.mktemp("confident") / "llama"
    model = make_tiny_model("llama", directory, smollm2_tokenizer_dir, seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(5.0)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def reduced_bundle(tmp_path_factory, confident_model):
    """That model with its one-layer SLM, the SLM's head cut to SIZE ids (+ rest)."""
    out = tmp_path_factory.mktemp("reduced") / "llama"
    export_tiny(confident_model, out, slm=str(confident_model), slm_layers=1, slm_vocab=SIZE)
    return out


@pytest.fixture(scope="module")
def full_vocab_bundle(tmp_path_factory, confident_model):
    out = tmp_path_factory.mktemp("full-vocab") / "llama"
    export_tiny(confident_model, out, slm=str(confident_model), slm_layers=1)
    return out


@pytest.fixture(scope="module")
def reduced_engine(reduced_bundle):
    return Engine(reduced_bundle)


def test_vocabulary_keeps_required_ids_then_the_most_frequent_and_is_deterministic(smollm2_tokenizer_dir):
    tokenizer_json = (smollm2_tokenizer_dir / "tokenizer.json").read_text()
    text = "the cat " * 50 + "a dog " * 10 + "zebra"
    first = select_vocabulary(tokenizer_json, 40, text, {0, 1, 2}, 49152)
    assert len(first) == 40 and {0, 1, 2} <= set(first.tolist())
    from tokenizers import Tokenizer

    frequent = Tokenizer.from_str(tokenizer_json).encode("the cat a dog", add_special_tokens=False).ids
    assert set(frequent) <= set(first.tolist())
    assert np.array_equal(first, select_vocabulary(tokenizer_json, 40, text, {0, 1, 2}, 49152))


def test_vocabulary_size_below_the_required_ids_is_a_clear_error(smollm2_tokenizer_dir):
    tokenizer_json = (smollm2_tokenizer_dir / "tokenizer.json").read_text()
    with pytest.raises(EdgerouteError, match="--slm-vocab 2 must be at least 3"):
        select_vocabulary(tokenizer_json, 2, "text", {0, 1, 2}, 49152)


def test_manifest_records_the_head_vocabulary_as_a_checksummed_file(reduced_bundle):
    bundle = Bundle.open(reduced_bundle)
    entry = bundle.manifest["models"]["slm"]["head_vocab"]
    assert entry["size"] == SIZE and entry["file"] in bundle.manifest["files"]
    assert "head_vocab" not in bundle.manifest["models"]["llm"]
    head = bundle.slm.graph("head")
    assert head.outputs[0]["shape"][-1] == SIZE + 1
    ids = json.loads(bundle.file(entry["file"]).read_text())
    chat_ids = Engine(reduced_bundle).encode_prompt([{"role": "user", "content": "x"}])
    assert set(chat_ids) - {Engine(reduced_bundle).encode("x")[0]} <= set(ids)  # the template's tokens


def test_a_damaged_vocabulary_file_is_a_clear_error(reduced_bundle, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(reduced_bundle, copy)
    damaged = copy / "slm" / "head_vocab.json"
    damaged.write_text(damaged.read_text()[:-1] + ",")  # same size, no longer JSON
    with pytest.raises(BundleError, match="head_vocab.json"):
        Bundle.open(copy)
    with pytest.raises(BundleError, match="head vocabulary cannot be read"):
        HeadVocabulary.load(Bundle.open(copy, verify=False), "slm")


def test_reduced_head_columns_equal_the_full_heads_logits_at_their_ids(reduced_bundle, full_vocab_bundle):
    reduced, full = OrtModel(Bundle.open(reduced_bundle), "slm"), OrtModel(Bundle.open(full_vocab_bundle), "slm")
    ids = np.arange(5, 60)
    got = reduced.forward(reduced.new_cache(), ids, all_logits=True)
    want = full.forward(full.new_cache(), ids, all_logits=True)
    vocab = reduced.head_vocab
    assert got.shape == (len(ids), SIZE + 1)
    np.testing.assert_allclose(got[:, :SIZE], want[:, vocab.ids], rtol=1e-5, atol=1e-5)
    rest = np.setdiff1d(np.arange(want.shape[1]), vocab.ids)
    # the rest column is Jensen's lower bound of the rest's log-sum-exp
    exact = np.log(np.exp(want[:, rest] - want.max(1, keepdims=True)).sum(1)) + want.max(1)
    assert (got[:, SIZE] <= exact + 1e-4).all()


def _recorded_proposals(engine, monkeypatch):
    """Run the SLM drafter as usual but keep (sequence, proposal) of every call."""
    from edgeroute.runtime.drafters import SlmDrafter

    calls = []
    original = SlmDrafter.propose

    def propose(self, tokens, k, min_confidence=0.0):
        proposal = original(self, tokens, k, min_confidence)
        calls.append((list(tokens), k, list(proposal.tokens)))
        return proposal

    monkeypatch.setattr(SlmDrafter, "propose", propose)
    return calls


def _check_proposals(engine, calls) -> int:
    """Every proposed token is in the head; a proposal cut short ends where the rest column wins
    (checked with a fresh forward over the same tokens). Returns the number cut short."""
    slm = engine.slm
    vocab = slm.head_vocab
    allowed = set(vocab.ids.tolist())
    stops = 0
    for tokens, k, draft in calls:
        assert set(draft) <= allowed
        logits = slm.forward(slm.new_cache(), tokens + draft, all_logits=True)[len(tokens) - 1:]
        assert not vocab.rest_wins(logits[:len(draft)]).any()
        if len(draft) < k:
            assert vocab.rest_wins(logits[len(draft)])
            stops += 1
    return stops


def test_speculate_with_the_reduced_head_drafts_only_its_tokens_stops_at_the_rest_and_equals_full(
        reduced_engine, monkeypatch):
    calls = _recorded_proposals(reduced_engine, monkeypatch)
    for prompt in PROMPTS:
        full = reduced_engine.generate(prompt, max_new_tokens=NEW).tokens
        assert reduced_engine.generate(prompt, max_new_tokens=NEW, mode="speculate", light="slm").tokens == full
    stops = _check_proposals(reduced_engine, calls)
    assert calls and stops > 0  # the rest column did stop drafts on this model


def test_route_calls_the_llm_where_the_reduced_head_cannot_draft(reduced_engine, monkeypatch):
    calls = _recorded_proposals(reduced_engine, monkeypatch)
    for prompt in PROMPTS:
        session = reduced_engine.session(max_new_tokens=NEW, mode="route", light="slm", route_threshold=0.99,
                                         fallback=None)
        traces = list(session.generate_tokens(prompt))
        drafts = iter(calls[-len(traces):])
        for trace in traces:  # no entropy over 600 ids reaches 0.99: the LLM only where the SLM proposed nothing
            _, _, draft = next(drafts)
            assert (trace.source == "llm") == (not draft)
    stops = _check_proposals(reduced_engine, calls)
    assert 0 < stops < len(calls)
