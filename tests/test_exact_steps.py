"""Exact speculation with the fast int4 kernels (int8 activations) on the SmolLM2 demo
bundle: with ``exact_steps`` a one-token step rounds exactly like the same token's row in a
multi-token pass, so `speculate` gives `full`'s greedy tokens bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from edgeroute.runtime import Bundle, Engine
from edgeroute.runtime.backends.onnxruntime import OrtModel
from edgeroute.runtime.evaluate import tokenize_text
from edgeroute.texts import evaluation_text

PROMPTS = [
    "Navigate to 12 Baker Street, then call Anna. Repeat the address: 12 Baker Street,",
    "List the planets of the solar system in order from the sun:",
    "Write a JSON object with the keys city and temperature for Berlin at 21 degrees.",
]


@pytest.fixture(scope="module")
def int4_bundle(smollm2_bundles):
    return Bundle.open(smollm2_bundles["int4"][0])


@pytest.mark.slow
def test_exact_one_token_steps_equal_the_rows_of_a_multi_token_pass(int4_bundle):
    model = OrtModel(int4_bundle, exact_steps=True)
    ids = tokenize_text(int4_bundle, evaluation_text(), 80)
    whole = model.forward(model.new_cache(), ids, all_logits=True)

    cache, prefix = model.new_cache(), 40
    model.forward(cache, ids[:prefix])
    steps = np.stack([model.forward(cache, [token]) for token in ids[prefix:]])
    assert cache.length == len(ids)
    np.testing.assert_array_equal(steps, whole[prefix:])


@pytest.mark.slow
def test_speculate_gives_fulls_tokens_with_int8_activations_and_exact_steps(int4_bundle):
    engine = Engine(int4_bundle, exact_steps=True)
    accepted = 0
    for prompt in PROMPTS:
        full = engine.generate(prompt, max_new_tokens=48)
        for light in ("ngram", "slm"):
            got = engine.generate(prompt, max_new_tokens=48, mode="speculate", light=light)
            assert got.tokens == full.tokens, (light, prompt)
            accepted += got.stats.accepted
    assert accepted > 0, "no draft was ever accepted: the test would prove nothing"


def test_exact_steps_at_the_last_position_of_the_context_run_one_row(tiny_bundles):
    """No room for the throw-away row at the context's end: the step runs as one row."""
    bundle = Bundle.open(tiny_bundles["llama"])
    model = OrtModel(bundle, exact_steps=True)
    cache = model.new_cache()
    model.forward(cache, list(range(3, 3 + cache.capacity - 2)))
    for token in (7, 8):  # two rows fit, then only one
        logits = model.forward(cache, [token])
        assert logits.shape == (bundle.llm.arch.vocab_size,) and np.isfinite(logits).all()
    assert cache.length == cache.capacity
