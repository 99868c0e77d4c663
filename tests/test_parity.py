"""fp32 bundles compute what transformers computes, through every path the runtime drives,
in every attention variant the bundle carries (flavour x KV cache dtype)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from edgeroute.bundle import ATTENTION_VARIANTS
from edgeroute.errors import InputError
from edgeroute.runtime import Bundle, OrtModel
from edgeroute.runtime.backends.onnxruntime import choose_flavour
from tests.conftest import relative_error

FAMILIES = ("llama", "qwen2", "qwen3")
# (attention flavour, KV dtype) as the runtime runs them; an fp16 cache rounds K/V to fp16
VARIANTS = [pytest.param(v, id="-".join(v)) for v in ATTENTION_VARIANTS]
TOLERANCE = {"float32": 1e-3, "float16": 5e-3}  # relative error of the logits against transformers
PROMPT = [1, 504, 3458, 282, 4649, 314, 253, 17, 9046, 30, 198]


def _hf_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def check_prefill_and_greedy_decode(model: OrtModel, hf_model, steps: int = 32, tolerance: float = 1e-3) -> None:
    cache = model.new_cache()
    logits = model.forward(cache, PROMPT, all_logits=True)
    assert relative_error(logits, _hf_logits(hf_model, PROMPT)) <= tolerance
    ids = list(PROMPT)
    for _ in range(steps):
        ids.append(int(np.argmax(logits[-1] if logits.ndim == 2 else logits)))
        logits = model.forward(cache, ids[-1:])
        assert relative_error(logits, _hf_logits(hf_model, ids)[-1]) <= tolerance
    assert cache.length == len(ids)


def _model(tiny_bundles, family: str, variant: tuple[str, str]) -> OrtModel:
    flavour, kv_dtype = variant
    return OrtModel(Bundle.open(tiny_bundles[family]), attention=flavour, kv_dtype=kv_dtype)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_bundle_matches_transformers_prefill_and_32_decode_steps(family, variant, tiny_bundles, tiny_models):
    model = _model(tiny_bundles, family, variant)
    assert (model.flavour, model.kv_dtype) == variant and model.new_cache().keys.dtype == np.dtype(variant[1])
    check_prefill_and_greedy_decode(model, tiny_models[family][1], tolerance=TOLERANCE[variant[1]])


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_catch_up_of_pending_tokens_equals_one_token_steps(family, variant, tiny_bundles):
    model = _model(tiny_bundles, family, variant)
    pending = [400, 401, 402, 403, 404]
    stepwise, batched = model.new_cache(), model.new_cache()
    model.forward(stepwise, PROMPT)
    model.forward(batched, PROMPT)
    one_by_one = np.stack([model.forward(stepwise, [t]) for t in pending])
    at_once = model.forward(batched, pending, all_logits=True)
    assert relative_error(at_once, one_by_one) <= 1e-5
    n = len(PROMPT) + len(pending)
    for layer in range(model.num_layers):
        for got, want in zip(batched.rows(layer, 0, n), stepwise.rows(layer, 0, n), strict=True):
            np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_long_prompt_runs_in_chunks_with_the_same_logits(variant, tiny_bundles, monkeypatch):
    model = _model(tiny_bundles, "qwen2", variant)
    ids = PROMPT * 3
    whole, chunked = model.new_cache(), model.new_cache()
    want = model.forward(whole, ids, all_logits=True)
    monkeypatch.setattr(model, "chunk_tokens", 4)  # passes of 4 tokens
    got = model.forward(chunked, ids, all_logits=True)
    assert got.shape == want.shape and chunked.length == len(ids)
    assert relative_error(got, want) <= 1e-5
    chunked.truncate(0)
    np.testing.assert_array_equal(model.forward(chunked, ids, tail=6), got[-6:])  # a tail across chunks
    chunked.truncate(0)
    np.testing.assert_array_equal(model.forward(chunked, ids), got[-1])


@pytest.mark.parametrize("variant", VARIANTS)
def test_cache_copy_and_clone_continue_like_the_original(variant, tiny_bundles):
    model = _model(tiny_bundles, "llama", variant)
    cache = model.new_cache()
    model.forward(cache, PROMPT)
    clone, prefix = cache.clone(), model.new_cache()
    prefix.copy_from(cache, 6)
    want = model.forward(cache, [400, 401], all_logits=True)
    np.testing.assert_array_equal(model.forward(clone, [400, 401], all_logits=True), want)
    np.testing.assert_array_equal(model.forward(prefix, PROMPT[6:] + [400, 401], all_logits=True)[-2:], want)
    for other in ATTENTION_VARIANTS:
        if other != variant:
            with pytest.raises(ValueError, match="different models, attention flavours or KV dtypes"):
                _model(tiny_bundles, "llama", other).new_cache().copy_from(cache)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_per_layer_calls_equal_the_forward_step(family, variant, tiny_bundles):
    model = _model(tiny_bundles, family, variant)
    cache_a, cache_b = model.new_cache(), model.new_cache()
    want = model.forward(cache_a, PROMPT, plan=[True] * model.num_layers, all_logits=True)
    hidden = model.embed(np.array(PROMPT))
    for layer in range(model.num_layers):
        hidden = model.mlp(layer, model.attention(layer, hidden, cache_b, 0))
    np.testing.assert_array_equal(model.head(hidden), want)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_kv_fill_equals_the_layers_key_value_projections(family, variant, tiny_bundles, tiny_models):
    model, hf = _model(tiny_bundles, family, variant), tiny_models[family][1]
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    layer, start, hidden = 1, 7, np.random.default_rng(0).normal(size=(3, 64)).astype(np.float32)
    cache = model.new_cache()
    model.kv_fill(layer, hidden, cache, start)
    block = hf.model.layers[layer]
    a = model.arch
    with torch.no_grad():
        h = block.input_layernorm(torch.from_numpy(hidden))
        k = block.self_attn.k_proj(h).view(3, a.num_kv_heads, a.head_dim)
        v = block.self_attn.v_proj(h).view(3, a.num_kv_heads, a.head_dim)
        if a.qk_norm:
            k = block.self_attn.k_norm(k)
        positions = torch.arange(start, start + 3)[None]
        cos, sin = hf.model.rotary_emb(k[None], positions)
        _, k = apply_rotary_pos_emb(k.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
        k = k[0].transpose(0, 1)
    keys, values = cache.rows(layer, start, start + 3)
    tolerance = {"atol": 1e-5} if variant[1] == "float32" else {"atol": 1e-4, "rtol": 1e-3}  # fp16: 11 bits
    np.testing.assert_allclose(keys, k.numpy(), **tolerance)
    np.testing.assert_allclose(values, v.numpy(), **tolerance)


@pytest.mark.parametrize("variant", VARIANTS)
def test_skipped_layer_gets_kv_and_its_output_is_not_applied(variant, tiny_bundles):
    model = _model(tiny_bundles, "llama", variant)
    run = [True, False, True]
    skipped, manual = model.new_cache(), model.new_cache()
    logits = model.forward(skipped, PROMPT, plan=run)
    hidden = model.embed(np.array(PROMPT))
    hidden = model.mlp(0, model.attention(0, hidden, manual, 0))
    model.kv_fill(1, hidden, manual, 0)
    hidden = model.mlp(2, model.attention(2, hidden, manual, 0))
    np.testing.assert_array_equal(logits, model.head(hidden[-1:])[0])
    np.testing.assert_array_equal(skipped.rows(1, 0, len(PROMPT))[0], manual.rows(1, 0, len(PROMPT))[0])
    full = model.forward(model.new_cache(), PROMPT)
    assert not np.allclose(logits, full)


@pytest.mark.slow
def test_smollm2_fp32_bundle_matches_transformers(smollm2_bundles, smollm2_reference):
    check_prefill_and_greedy_decode(OrtModel(Bundle.open(smollm2_bundles["fp32"][0])), smollm2_reference)


def test_manifest_records_flavours_and_a_missing_or_unknown_flavour_is_a_clear_error(tiny_bundles):
    entry = Bundle.open(tiny_bundles["llama"]).llm
    ort_graphs = {name for name, g in entry.graphs.items() if g.flavour == "ort"}
    assert ort_graphs == {f"{kind}_{i:03d}_ort" for kind in ("layer", "attn") for i in range(entry.num_layers)}
    narrow = {name for name, g in entry.graphs.items()
              if any(i["name"] == "past_key" and i["dtype"] == "float16" for i in g.inputs)}
    assert narrow == {f"{kind}_{i:03d}_kv16" for kind in ("layer", "attn") for i in range(entry.num_layers)}
    portable_only = dataclasses.replace(entry, graphs={n: g for n, g in entry.graphs.items()
                                                       if n not in ort_graphs | narrow})
    assert choose_flavour(portable_only, "auto") == "portable" and not portable_only.has_attention("ort")
    with pytest.raises(InputError, match="no 'ort' attention graphs"):
        choose_flavour(portable_only, "ort")
    with pytest.raises(InputError, match="no 'portable' attention graphs for a float16 KV cache.*re-export"):
        choose_flavour(portable_only, "auto", "float16")
    with pytest.raises(InputError, match="ort attention keeps a float32 KV cache only"):
        choose_flavour(entry, "ort", "float16")
    with pytest.raises(InputError, match="'fast' is not one of auto, portable, ort"):
        choose_flavour(entry, "fast")
    with pytest.raises(InputError, match="KV dtype 'int4' is not one of float32, float16, int8"):
        choose_flavour(entry, "auto", "int4")
    with pytest.raises(InputError, match="int8 KV cache runs on the native backend only"):
        choose_flavour(entry, "auto", "int8")
