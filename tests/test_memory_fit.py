"""The fit check before load: a bundle's need (weights, KV at the context, working memory)
against a device profile's budget; a refusal says what would fit."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from typer.testing import CliRunner

from edgeroute.arch import ArchConfig
from edgeroute.bundle import Bundle
from edgeroute.cli import app
from edgeroute.errors import InputError
from edgeroute.runtime import Engine
from edgeroute.runtime.memory import RESIDENT_FACTOR, check_fit, estimate, kv_cache_bytes
from edgeroute.runtime.profiles import load_profile

QWEN_15B = dict(family="qwen2", hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2, head_dim=128,
                intermediate_size=8960, vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1e6,
                max_position_embeddings=32768, attention_bias=True)
QWEN_05B = dict(QWEN_15B, hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64,
                intermediate_size=4864)


def qwen_pair(context: int) -> Bundle:
    """The real pair's manifest as the fit check reads it (no files needed): the 1.5B LLM's
    1,797 MB and the 0.5B SLM's ~700 MB of graphs."""
    model = {"graphs": [], "quantization": {}, "source": {}}
    manifest = {"models": {"llm": {**model, "arch": QWEN_15B}, "slm": {**model, "arch": QWEN_05B}},
                "files": {"llm/layer.weights": {"bytes": 1_797_000_000}, "slm/layer.weights": {"bytes": 700_000_000},
                          "tokenizer.json": {"bytes": 7_000_000}},
                "generation": {"context_length": context}}
    return Bundle(Path("bundles/qwen-pair"), manifest)


def test_kv_bytes_are_layers_capacity_kv_heads_head_dim_k_and_v_bytes():
    arch = ArchConfig(**QWEN_15B)
    assert kv_cache_bytes(arch, 32768) == 28 * 32768 * 2 * 128 * 2 * 4
    assert kv_cache_bytes(arch, 32768, "float16") == kv_cache_bytes(arch, 32768) // 2
    assert kv_cache_bytes(arch, 32768, "int8") == 28 * 32768 * 2 * (128 + 4 * 4) * 2  # codes, then 4 scales a row


def test_a_budget_only_an_int8_cache_meets_offers_it():
    bundle = qwen_pair(32768)
    int8, half = estimate(bundle, 32768, "int8"), estimate(bundle, 32768, "float16")
    with pytest.raises(InputError, match="What would fit: .*int8 KV cache .*kv_dtype='int8'") as err:
        check_fit(bundle, 32768, int8.total)
    assert "kv_dtype='float16'" not in str(err.value)
    with pytest.raises(InputError, match="kv_dtype='float16'.*kv_dtype='int8'"):
        check_fit(bundle, 32768, half.total)
    assert check_fit(bundle, 32768, int8.total, "int8") == int8


def test_need_adds_weights_kv_of_both_models_and_working_memory():
    bundle = qwen_pair(4096)
    need, alone = estimate(bundle, 4096), estimate(bundle, 4096, slm=False)
    assert need.weights == int(1_797_000_000 * RESIDENT_FACTOR) + int(700_000_000 * RESIDENT_FACTOR)
    assert need.kv == kv_cache_bytes(bundle.llm.arch, 4096) + kv_cache_bytes(bundle.slm.arch, 4096)
    assert alone.kv == kv_cache_bytes(bundle.llm.arch, 4096) and alone.weights < need.weights
    assert need.total == need.weights + need.kv + need.working and need.working > 96 << 20
    assert estimate(bundle, 8192).total > need.total


def test_orin_nano_refuses_the_pair_at_32k_and_says_what_would_fit_while_orin_nx_accepts_it():
    bundle = qwen_pair(32768)
    nano, nx = load_profile("jetson-orin-nano-8gb"), load_profile("jetson-orin-nx-16gb")
    with pytest.raises(InputError, match="more than the memory budget of 5,632 MiB") as err:
        check_fit(bundle, 32768, nano.memory_budget)
    message = str(err.value)
    assert "bundles/qwen-pair needs about" in message and "KV cache at context 32768" in message
    assert "What would fit: a context of" in message and "fp16 KV cache" in message
    shorter = int(message.split("a context of ")[1].split(" ")[0])
    assert 2048 <= shorter < 32768 and shorter % 256 == 0
    assert check_fit(bundle, shorter, nano.memory_budget).total <= nano.memory_budget
    assert estimate(bundle, shorter + 256).total > nano.memory_budget  # the longest that fits
    assert check_fit(bundle, 32768, nx.memory_budget).total <= nx.memory_budget
    assert check_fit(bundle, nano.context_length, nano.memory_budget)  # the device's default context fits


def test_a_bundle_that_fits_nothing_says_so():
    with pytest.raises(InputError, match="nothing at this size: export a smaller model or use a larger device"):
        check_fit(qwen_pair(4096), 4096, 1 << 30)


def test_engine_refuses_before_loading_and_accepts_what_the_message_offers(tiny_slm_bundle, monkeypatch):
    bundle = Bundle.open(tiny_slm_bundle)
    need, alone = estimate(bundle, 256), estimate(bundle, 256, slm=False)
    loads = []
    loaded = SimpleNamespace(capacity=256, flavour="portable")  # a model in name only: nothing loads
    monkeypatch.setattr("edgeroute.runtime.engine.open_model", lambda *a, **k: loads.append(a) or (loaded, None))
    with pytest.raises(InputError, match="What would fit: .*no SLM") as err:
        Engine(bundle, memory_budget=need.total - 1)
    assert loads == [] and "slm=False" in str(err.value)
    Engine(bundle, memory_budget=alone.total, slm=False)
    Engine(bundle, memory_budget=need.total)
    assert len(loads) == 2
    half = estimate(bundle, 256, "float16")
    assert half.kv == need.kv // 2
    with pytest.raises(InputError, match="What would fit: .*kv_dtype='float16'"):
        Engine(bundle, memory_budget=half.total)
    Engine(bundle, memory_budget=half.total, kv_dtype="float16")
    assert len(loads) == 3


def test_an_fp16_kv_engine_keeps_half_the_cache_and_answers_like_the_fp32_one(tiny_slm_bundle):
    wide, narrow = Engine(tiny_slm_bundle), Engine(tiny_slm_bundle, kv_dtype="float16")
    session = narrow.session(mode="speculate", light="slm")
    answer = session.generate("one two three four")
    assert session.state.llm_cache.keys.dtype == np.float16 and session.state.slm_drafter.cache.keys.dtype == np.float16
    assert session.state.llm_cache.keys.nbytes * 2 == wide.session().state.llm_cache.keys.nbytes
    assert answer.tokens == wide.generate("one two three four", mode="speculate", light="slm").tokens
    with pytest.raises(InputError, match="ort attention keeps a float32 KV cache only"):
        Engine(tiny_slm_bundle, kv_dtype="float16", attention="ort")


def test_engine_context_length_sets_each_sessions_capacity(tiny_slm_bundle):
    engine = Engine(tiny_slm_bundle, context_length=64)
    session = engine.session(mode="speculate", light="slm")
    session.generate("The capital of France is", max_new_tokens=4)
    assert session.state.llm_cache.capacity == 64 and session.state.slm_drafter.cache.capacity == 64
    with pytest.raises(InputError, match="context"):
        session.generate("word " * 60)
    for wrong in (512, 0, "big", True):
        with pytest.raises(InputError, match=r"context_length must be a whole number within 1..256 .*--context-length 256"):
            Engine(tiny_slm_bundle, context_length=wrong)


def test_run_with_a_device_profile_over_budget_is_a_clear_error(tiny_slm_bundle, tmp_path):
    profile = tmp_path / "small-board.json"
    profile.write_text(json.dumps({"name": "small-board", "memory": {"usable_gib": 0.05, "default_context": 128}}))
    result = CliRunner().invoke(app, ["run", str(tiny_slm_bundle), "--prompt", "hi", "--profile", str(profile)])
    assert result.exit_code == 2, result.output
    output = " ".join(result.output.split())
    assert "error:" in output and "more than the memory budget of 51 MiB" in output and "Traceback" not in output


def test_a_native_slm_counts_the_copy_of_its_heads_common_rows(smollm2_bundles):
    from edgeroute.runtime.memory import draft_rows_bytes, model_weight_bytes
    from edgeroute.runtime.vocab import DRAFT_ROWS

    demo = Bundle.open(smollm2_bundles["int4"][0])
    native = demo.models["slm"].native
    head = native.tensors.get("output.weight") or native.tensors["token_embd.weight"]
    assert head.shape[0] > DRAFT_ROWS  # SmolLM2's 49,152 ids
    rows = draft_rows_bytes(demo, "slm")
    assert rows == head.bytes // head.shape[0] * DRAFT_ROWS and draft_rows_bytes(demo, "llm") == 0
    assert model_weight_bytes(demo, "slm") >= demo.manifest["files"][native.file]["bytes"] + rows
