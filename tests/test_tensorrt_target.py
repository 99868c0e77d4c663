"""`edgeroute export --target tensorrt`: graphs TensorRT 10 takes (re-blocked int4, fp16), the
manifest's target, the runtime's refusals, and what the re-blocking costs on SmolLM2."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto

from edgeroute.bundle import Bundle
from edgeroute.errors import EdgerouteError, InputError
from edgeroute.runtime import Engine, OrtModel
from tests.conftest import export_tiny


@pytest.fixture(scope="module")
def tiny_tensorrt_bundle(tiny_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("trt") / "llama"
    export_tiny(tiny_models["llama"][0], out, quant="int4-rtn", target="tensorrt")
    return out


@pytest.fixture(scope="module")
def tiny_tensorrt_slm_engine(tiny_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("trt-slm") / "llama"
    src = tiny_models["llama"][0]
    export_tiny(src, out, quant="int4-rtn", target="tensorrt", slm=str(src), slm_layers=1)
    return Engine(out)


def test_the_manifest_records_the_target_and_the_target_writes_fp16_cache_graphs_only(tiny_tensorrt_bundle):
    bundle = Bundle.open(tiny_tensorrt_bundle)
    assert bundle.manifest["target"] == "tensorrt" and bundle.target.name == "tensorrt"
    llm = bundle.llm
    assert llm.native is None and llm.quantization["block_size"] == 64 and llm.quantization["head"] == "fp16"
    assert llm.has_attention("portable", "float16")
    assert not llm.has_attention("portable", "float32") and not llm.has_attention("ort")
    assert {g.flavour for g in llm.graphs.values()} == {"portable"}
    layer = onnx.load(str(bundle.file(llm.graph("layer", 0, kv_dtype="float16").file)), load_external_data=False)
    blocks = {next(a.i for a in n.attribute if a.name == "block_size") for n in layer.graph.node
              if n.op_type == "DequantizeLinear"}
    assert blocks == {64}
    scales = [i for i in layer.graph.initializer if i.name.endswith(".scales.fp16")]
    assert scales and all(s.data_type == TensorProto.FLOAT16 for s in scales)


def test_an_export_of_the_default_target_records_it(tiny_bundles):
    assert Bundle.open(tiny_bundles["llama"]).manifest["target"] == "onnxruntime"


def test_the_runtime_keeps_the_targets_fp16_cache_and_its_steps_match_one_pass(tiny_tensorrt_bundle):
    engine = Engine(tiny_tensorrt_bundle)
    assert engine.llm.kv_dtype == "float16"
    model = engine.llm
    prompt = [1, 504, 3458, 282, 4649, 314, 253, 17]
    whole = model.forward(model.new_cache(), prompt, all_logits=True)
    cache = model.new_cache()
    model.forward(cache, prompt[:5])
    steps = np.stack([model.forward(cache, [t]) for t in prompt[5:]])
    assert np.isfinite(whole).all()
    np.testing.assert_allclose(steps, whole[5:], rtol=0, atol=2e-2 * np.abs(whole).max())


@pytest.mark.parametrize("options", [
    dict(), dict(mode="speculate", light="slm"), dict(mode="route", light="slm"), dict(mode="slm"),
    dict(mode="skip", scorer="random", skip_ratio=0.5, protected_first=1, protected_last=0, max_free_layers=1,
         re_eval_interval=1),
    dict(mode="skip", granularity="mlp", scorer="random", skip_ratio=0.5, protected_first=1, protected_last=0,
         max_free_layers=1, re_eval_interval=1),
], ids=["full", "speculate", "route", "slm", "skip", "skip-mlp"])
def test_every_mode_runs_on_the_target_with_its_slm(tiny_tensorrt_slm_engine, options):
    """kv_i's fp16 rows fill the fp16 cache for skipped layers; attn_i/mlp_i serve MLP skips."""
    generation = tiny_tensorrt_slm_engine.generate("The capital of France is", max_new_tokens=12, **options)
    assert len(generation.tokens) == 12 and generation.finish_reason == "length"


@pytest.mark.parametrize("settings, named", [
    (dict(kv_dtype="float32"), "--target tensorrt"),
    (dict(attention="ort"), "--target tensorrt"),
])
def test_settings_the_target_has_no_graphs_for_are_refused_naming_it(tiny_tensorrt_bundle, settings, named):
    with pytest.raises(InputError, match=named):
        OrtModel(Bundle.open(tiny_tensorrt_bundle), **settings)


def test_the_native_backend_is_refused_naming_the_target(tiny_tensorrt_bundle):
    with pytest.raises(EdgerouteError, match="--target tensorrt"):
        Engine(tiny_tensorrt_bundle, backend="native")


@pytest.mark.parametrize("options, named", [
    (dict(block_size=32), "--block-size 32"),
    (dict(head="int8"), "--head 'int8'"),
    (dict(quant="fp32"), "--quant fp32"),
    (dict(target="tpu"), "--target 'tpu'"),
    (dict(block_size=128), "--block-size 128 does not divide the model's hidden_size 64"),
])
def test_options_the_target_cannot_hold_are_refused(tiny_models, tmp_path, options, named):
    settings = {"quant": "int4-rtn", "target": "tensorrt", **options}
    with pytest.raises(EdgerouteError, match=named):
        export_tiny(tiny_models["llama"][0], tmp_path / "x", **settings)
    assert not (tmp_path / "x").exists()


# Measured 2026-12-02, SmolLM2-135M (Q4_1 GGUF), 512 held-out tokens, teacher-forced top-1 agreement
# with the dequantized fp32 model on ONNX Runtime CPU: exact carry-over (default target) 95.9%;
# tensorrt target (re-blocked at 64 from the dequantized weights, with per-block offsets) GPTQ, its
# default, 82.2%, RTN 77.5% (symmetric, before offsets: 77.9% / 68.4%); fp16 weights and
# activations alone 100.0% (256 tokens): the loss is the re-blocking's. The test runs RTN (GPTQ
# takes minutes on 2 cores) and pins floors a little under the measured figures.
CARRY_OVER_FLOOR = 0.93
TENSORRT_RTN_FLOOR = 0.72


@pytest.mark.slow
def test_the_reblocked_tensorrt_target_keeps_its_agreement_floor_next_to_the_exact_carry_over(
        smollm2_bundles, tmp_path):
    from edgeroute.export import ExportOptions, export_bundle
    from edgeroute.export.pipeline import _tokenize, parity
    from edgeroute.export.sources import load_source
    from edgeroute.texts import evaluation_text

    report = export_bundle(ExportOptions(out=tmp_path / "trt", slm=None, target="tensorrt", quant="int4-rtn",
                                         parity_tokens=512))
    reblocked = report.models[0].agreement
    source = load_source("smollm2")
    ids = _tokenize(source.tokenizer, evaluation_text(), 512)
    carried_over, _ = parity(smollm2_bundles["int4"][0], "llm", source, source.weights, ids)
    print(f"top-1 agreement with fp32: carry-over {carried_over:.1%}, tensorrt re-blocked (RTN) {reblocked:.1%}")
    assert carried_over >= CARRY_OVER_FLOOR
    assert reblocked >= TENSORRT_RTN_FLOOR
