"""Quality of the int4 bundles against the fp32 (dequantized) SmolLM2, teacher-forced on
evaluation text (never the calibration text GPTQ was fitted to)."""

from __future__ import annotations

import time

import pytest

from edgeroute.runtime import Bundle
from edgeroute.runtime.evaluate import TeacherForced, evaluate_bundle, tokenize_text
from edgeroute.texts import evaluation_text
from tests.conftest import export_tiny

DEMO_TOKENS = 2048  # predictions compared for the demo bundle
GPTQ_TOKENS = 1024  # predictions compared for rtn vs gptq: a multiple of the 512 window, see fp32_forced
GPTQ_CALIBRATION_TOKENS = 2048  # export's default


@pytest.fixture(scope="module")
def evaluation_ids(smollm2_bundles):
    return tokenize_text(smollm2_bundles["fp32"][0], evaluation_text(), DEMO_TOKENS + 1)


@pytest.fixture(scope="module")
def fp32_forced(smollm2_bundles, evaluation_ids) -> TeacherForced:
    """The fp32 bundle of the dequantized GGUF (equal to transformers: test_parity) over the
    evaluation ids; its prefix of GPTQ_TOKENS equals a run over the first GPTQ_TOKENS + 1 ids."""
    return evaluate_bundle(smollm2_bundles["fp32"][0], evaluation_ids)


@pytest.mark.slow
def test_demo_int4_bundle_agrees_with_dequantized_model_on_2000_tokens(smollm2_bundles, evaluation_ids, fp32_forced):
    int4 = evaluate_bundle(smollm2_bundles["int4"][0], evaluation_ids)
    agreement = int4.agreement(fp32_forced)
    print(f"\ndemo int4 (Q4_1 carried over) vs fp32 over {len(int4)} tokens: top-1 agreement {agreement:.4f}; "
          f"perplexity int4 {int4.perplexity:.3f}, fp32 {fp32_forced.perplexity:.3f}")
    assert len(int4) >= DEMO_TOKENS
    assert agreement >= 0.92


@pytest.mark.slow
def test_int4_demo_bundle_is_at_most_45_percent_of_fp32(smollm2_bundles):
    int4 = Bundle.open(smollm2_bundles["int4"][0], verify=False).total_bytes("llm/")
    fp32 = Bundle.open(smollm2_bundles["fp32"][0], verify=False).total_bytes("llm/")
    print(f"\nllm/ bytes: int4 {int4 / 1e6:.1f} MB, fp32 {fp32 / 1e6:.1f} MB ({int4 / fp32:.1%})")
    assert int4 <= 0.45 * fp32


@pytest.mark.slow
def test_gptq_agrees_at_least_as_well_as_rtn_from_an_fp32_source(smollm2_float_checkpoint, evaluation_ids, fp32_forced,
                                                                 tmp_path):
    ids = evaluation_ids[:GPTQ_TOKENS + 1]
    fp32 = fp32_forced.prefix(GPTQ_TOKENS)
    forced = {}
    for quant in ("int4-rtn", "int4-gptq"):
        start = time.perf_counter()
        report = export_tiny(smollm2_float_checkpoint, tmp_path / quant, quant, block_size=32, head="int8",
                             calibration_tokens=GPTQ_CALIBRATION_TOKENS, context_length=2048)
        origin = quant.removeprefix("int4-")
        assert report.models[0].formats == {f"int4/b32 ({origin})": 210, "embedding: int8/b32 (rtn)": 1,
                                            "lm_head: int8/b32 (rtn)": 1}
        print(f"\n{quant} export: {time.perf_counter() - start:.1f} s")
        forced[quant] = evaluate_bundle(tmp_path / quant, ids)
    rtn, gptq = (forced[q].agreement(fp32) for q in ("int4-rtn", "int4-gptq"))
    print(f"top-1 agreement with fp32 over {GPTQ_TOKENS} tokens: rtn {rtn:.4f}, gptq {gptq:.4f} "
          f"(gptq calibrated on {GPTQ_CALIBRATION_TOKENS} tokens)")
    print("perplexity: " + ", ".join(f"{name} {tf.perplexity:.3f}" for name, tf in
                                     (("fp32", fp32), ("rtn", forced["int4-rtn"]), ("gptq", forced["int4-gptq"]))))
    assert gptq >= rtn
