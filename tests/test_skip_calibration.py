"""Skip calibration: observations on the quantized model, the first-crossing fit with a bound,
the verdict, and the runtime's use of a calibrated skip setting."""

from __future__ import annotations

import numpy as np
import pytest

from edgeroute.calibration.skipping import (
    SkipObservations,
    decision_points,
    first_crossing,
    fit_skip,
    judge_skipping,
    observe_skips,
    outcomes,
)
from edgeroute.calibration.thresholds import BudgetUnreachable
from edgeroute.runtime.calibrated import calibrated_options
from edgeroute.runtime.decoding import DecodeOptions
from edgeroute.runtime.layers import RUN, SKIP, SKIP_MLP
from edgeroute.runtime.policies import SkipController
from edgeroute.skip_options import SkipOptions


def synthetic(prompts: int = 60, per_prompt: int = 10, seed: int = 0, informative: bool = True) -> SkipObservations:
    """Three decision points; a token is changed by skipping where its score is high (or at random)."""
    rng = np.random.default_rng(seed)
    n, points = prompts * per_prompt, 3
    scores = rng.uniform(0, 1, (n, points)).astype(np.float32)
    changed = scores > 0.7 if informative else rng.random((n, points)) < 0.3
    full = rng.integers(0, 50, n)
    skipped = np.where(changed, full[:, None] + 1, full[:, None])
    return SkipObservations([2, 4, 6], np.array([2, 2, 2]), 10, {"update": scores, "cosine": 1 - scores},
                            full, skipped, np.repeat(np.arange(prompts), per_prompt).astype(np.int32),
                            rng.normal(size=(n, points, 4)).astype(np.float16))


def test_decision_points_are_the_controllers():
    assert decision_points(10, SkipOptions(protected_first=2, protected_last=2, re_eval_interval=2)) == [2, 4, 6]
    assert decision_points(4, SkipOptions()) == []


def test_a_token_skips_at_the_first_point_below_the_threshold_and_pays_that_points_change():
    obs = SkipObservations([2, 4], np.array([2, 1]), 8, {"update": np.array([[0.9, 0.1], [0.2, 0.1], [0.9, 0.9]])},
                           np.array([5, 6, 7]), np.array([[5, 9], [1, 6], [7, 7]]), np.zeros(3, np.int32),
                           np.zeros((3, 2, 1), np.float16))
    np.testing.assert_array_equal(first_crossing(obs.scores["update"], np.array([0.15, 0.5])),
                                  [[1, 1, -1], [1, 0, -1]])
    wrong, skipped = outcomes(obs, "update", np.array([0.15, 0.5]))
    # threshold 0.15: tokens 0 and 1 skip at the second point (1 layer of 8); token 0 changes there
    np.testing.assert_array_equal(wrong, [[True, False, False], [True, True, False]])
    np.testing.assert_allclose(skipped, [[1 / 8, 1 / 8, 0], [1 / 8, 2 / 8, 0]])


def test_the_fitted_threshold_meets_the_budget_and_skips_the_safe_tokens():
    obs = synthetic()
    fit = fit_skip(obs, "update", budget=0.9)
    assert fit.choice.bound <= 0.1 + 1e-9 and fit.skipped_share > 0.05
    assert fit.choice.threshold <= 0.75  # above 0.7 skipping changes the token
    with pytest.raises(BudgetUnreachable, match=r"skipping with the cosine scorer.*layer work run"):
        fit_skip(obs, "cosine", budget=0.99)  # high cosine score = safe: the wrong direction for this scorer


def test_the_verdict_keeps_a_paying_heuristic_and_turns_off_an_uninformative_one():
    splits = np.asarray(["train", "calibration", "validation"] * 20)
    early = np.arange(60) % 5 == 0
    paying = judge_skipping(synthetic(), "layer", splits, early, 0.9, "crc", 0.1)
    assert paying.options is not None and paying.options["scorer"] == "update"
    assert paying.options["skip_ratio"] >= paying.figures["scorers"]["update"]["validation"]["skipped_share"]
    assert paying.figures["scorers"]["update"]["validation"]["agreement"] >= 0.9
    # changes at random, 30% of tokens per point: what stays within 97% skips under 3% of the work
    useless = judge_skipping(synthetic(informative=False), "mlp", splits, early, 0.97, "crc", 0.1)
    assert useless.options is None and "no heuristic scorer" in useless.why
    assert {"update", "cosine", "learned"} <= set(useless.figures["scorers"])


def test_a_calibrated_skip_setting_is_the_default_of_skip_modes_only_when_left_unset():
    from edgeroute.bundle import Calibration

    calibration = Calibration(created="", edgeroute_version="", data_sha256="", budget={}, routers={}, profiles={},
                              decoding={"skip": {"granularity": "mlp", "scorer": "cosine", "importance_threshold": 0.3,
                                                 "max_free_layers": 2, "skip_ratio": 0.07, "speed_vs_full": 1.1}},
                              figures={})
    skip = calibrated_options(DecodeOptions(mode="skip"), calibration, lambda entry: None).skip
    assert (skip.granularity, skip.scorer, skip.importance_threshold, skip.skip_ratio) == ("mlp", "cosine", 0.3, 0.07)
    explicit = DecodeOptions(mode="skip").updated(importance_threshold=0.5)
    assert calibrated_options(explicit, calibration, lambda entry: None).skip.importance_threshold == 0.5
    assert calibrated_options(DecodeOptions(mode="full"), calibration, lambda entry: None).skip == SkipOptions()


def test_an_auto_profile_runs_as_measured_without_the_bundle_wide_defaults():
    from edgeroute.bundle import Calibration

    calibration = Calibration(created="", edgeroute_version="", data_sha256="", budget={}, routers={},
                              profiles={"json": {"mode": "speculate", "light": "slm", "config": "speculate/slm"},
                                        "code": {"mode": "speculate", "light": "slm", "draft_confidence": 0.2,
                                                 "draft_tokens": 1, "max_draft_tokens": 1}},
                              decoding={"draft_confidence": 0.2, "draft_tokens": 1, "max_draft_tokens": 1},
                              figures={})
    resolve = lambda **kw: calibrated_options(DecodeOptions(**kw), calibration, lambda entry: None)  # noqa: E731
    json_profile, defaults = resolve(mode="auto", task="json"), DecodeOptions()
    assert json_profile.mode == "speculate" and json_profile.draft_confidence == defaults.draft_confidence
    assert (json_profile.draft_tokens, json_profile.max_draft_tokens) == (defaults.draft_tokens, defaults.max_draft_tokens)
    assert resolve(mode="auto", task="code").max_draft_tokens == 1
    explicit = resolve(mode="speculate", light="slm")  # an explicit mode takes the fitted defaults
    assert (explicit.draft_confidence, explicit.max_draft_tokens) == (0.2, 1)


@pytest.mark.slow
@pytest.mark.parametrize("granularity", ["layer", "mlp"])
def test_observations_equal_skipped_passes_and_the_controllers_scores(smollm2_bundles, granularity):
    """The resumed-from-the-point passes give the tokens of a whole pass with the skip plan,
    and the scores are what SkipController computes for the token."""
    from edgeroute.runtime.engine import Engine

    engine = Engine(smollm2_bundles["int4"][0], slm=False)
    llm = engine.llm
    options = SkipOptions(granularity=granularity, max_free_layers=2)
    ids = engine.encode_prompt([{"role": "user", "content": "Name three colours."}])
    answer = engine.encode("Red, green and blue.")
    obs = observe_skips(llm, [(ids, answer)], options)
    action = SKIP_MLP if granularity == "mlp" else SKIP
    tokens = [ids[-1], *answer[:-1]]
    for k in (0, len(obs.points) // 2, len(obs.points) - 1):
        start, end = obs.points[k], obs.points[k] + obs.free_run[k]
        cache = llm.new_cache(len(ids) + len(answer))
        llm.forward(cache, ids[:-1])
        whole = llm.forward(cache, tokens, tail=len(answer),
                            plan=lambda layer, _, s=start, e=end: action if s <= layer < e else RUN)
        np.testing.assert_array_equal(obs.skipped_tokens[:, k], whole.argmax(-1))
    # the controller scores a one-token step at its first points exactly as observed (last answer row)
    controller = SkipController(SkipOptions(importance_threshold=0.0, re_eval_interval=options.re_eval_interval,
                                            protected_first=options.protected_first), llm.num_layers)
    cache = llm.new_cache(len(ids) + len(answer))
    llm.forward(cache, ids[:-1] + tokens[:-1])
    llm.forward(cache, tokens[-1:], plan=controller)
    # (a one-row step rounds its int8 activations apart from a multi-row pass: ~3e-4 relative here)
    np.testing.assert_allclose(controller.last.importance, obs.scores["update"][-1], rtol=2e-3)



def test_the_report_shows_each_granularitys_verdict():
    from edgeroute.bundle import Calibration
    from edgeroute.calibration.report import render

    splits = np.asarray(["train", "calibration", "validation"] * 20)
    verdict = judge_skipping(synthetic(), "layer", splits, np.arange(60) % 5 == 0, 0.9, "crc", 0.1)
    labels = {"positions": 1, "prompts": 1, "slm": dict.fromkeys(
        ("agree", "differ", "path_checked", "path_neutral", "path_divergent"), 0),
        "ngram": dict.fromkeys(("agree", "differ", "no_proposal"), 0)}
    calibration = Calibration(created="", edgeroute_version="", data_sha256="0" * 16,
                              budget={"tf_agreement": 0.9, "bound": "crc"}, routers={}, profiles={},
                              figures={"labels": labels, "seconds": {}, "skipping": {
                                  "layer": {"why": verdict.why, **verdict.figures}}})
    text = render(calibration, "bundle", [])
    assert "## Skipping, observed on this bundle" in text and "| layer | update |" in text
    assert verdict.why in text and "| layer | cosine | " in text


@pytest.mark.slow
def test_the_resonance_tool_writes_its_table_and_plots(smollm2_bundles, tmp_path):
    import json

    from tools.skip_resonance import main

    out = tmp_path / "resonance.json"
    assert main(["--int4", str(smollm2_bundles["int4"][0]), "--fp32", str(smollm2_bundles["fp32"][0]),
                 "--prompts", "6", "--answer-tokens", "8", "--budget", "0.5", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    for rows in results["rows"].values():
        assert rows["(a) int4, no skip"]["skipped_share"] == 0.0
        assert 0.0 < rows["(a) int4, no skip"]["agreement_vs_fp32"] <= 1.0
    assert set(results["score_medians"]["update"]) == {"int4", "fp32"}
    assert out.with_suffix(".png").stat().st_size > 1000
    assert (tmp_path / "resonance-scores.png").stat().st_size > 1000


def test_a_sample_without_fitting_prompts_is_unreachable_not_nan():
    obs = synthetic(prompts=3)
    with pytest.raises(BudgetUnreachable, match="no prompts to fit"):
        fit_skip(obs.subset(np.zeros(3, bool)), "update", 0.9)
    verdict = judge_skipping(obs, "layer", np.asarray(["train", "train", "calibration"]), np.zeros(3, bool),
                             0.9, "crc", 0.1)
    assert verdict.options is None
    assert all(entry.get("validation") is None for entry in verdict.figures["scorers"].values())
