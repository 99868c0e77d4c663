"""`edgeroute calibrate`: labels, routers, thresholds, the calibration section and its use."""

from __future__ import annotations

import dataclasses
import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from edgeroute.bundle import MANIFEST, Bundle, Calibration, RouterCalibration
from edgeroute.calibration.calibrate import (
    CalibrateOptions,
    DraftingResult,
    RunConfig,
    calibrate,
    choose_profiles,
    confirm_task_drafts,
    light_data,
    lookup_then_slm,
)
from edgeroute.calibration.checks import echoes_instructions, task_verdict
from edgeroute.calibration.drafting import (
    DraftCosts,
    DraftFit,
    DraftSetting,
    fit_drafting,
    fit_per_task,
    replay,
    runtime_default,
)
from edgeroute.calibration.labels import (
    DIVERGENT,
    NEUTRAL,
    UNCHECKED,
    UNRANKED,
    Labels,
    LabelSettings,
    label_prompt,
    label_prompts,
    plan_shards,
    rejoins,
    shard_path,
    unused_shards,
)
from edgeroute.calibration.prompts import TASKS, builtin_prompts
from edgeroute.calibration.thresholds import BudgetUnreachable, choose_threshold, prompt_risks
from edgeroute.calibration.train import TrainSettings, router_onnx, train_router
from edgeroute.cli import app
from edgeroute.cpu import cpu_signature
from edgeroute.errors import BundleError, CalibrationDeviceWarning, DamagedShardWarning, InputError
from edgeroute.runtime import Engine
from edgeroute.runtime.calibrated import format_token_ids
from edgeroute.runtime.decoding import DecodeOptions
from edgeroute.runtime.drafters import Proposal
from edgeroute.runtime.routers import (
    NGRAM_FEATURES,
    SLM_FEATURES,
    TrainedRouter,
    ngram_features,
    proposal_features,
)

runner = CliRunner()
SMALL = LabelSettings(max_answer_tokens=8, shard_size=4, path_window=4, path_checks=2)


@pytest.fixture
def slm_bundle_copy(tiny_slm_bundle, tmp_path) -> Path:
    return Path(shutil.copytree(tiny_slm_bundle, tmp_path / "bundle"))


def test_builtin_prompts_cover_every_task_with_stable_unique_ids():
    prompts = builtin_prompts()
    assert len(prompts) >= 200
    assert {p.task for p in prompts} == set(TASKS)
    assert len({p.id for p in prompts}) == len({p.content for p in prompts}) == len(prompts)
    assert [p.id for p in builtin_prompts()] == [p.id for p in prompts]


def test_labelling_killed_and_resumed_equals_an_uninterrupted_run(tiny_engine, tmp_path):
    prompts = builtin_prompts(2)
    whole = label_prompts(tiny_engine, prompts, SMALL, tmp_path / "whole")

    def killed_after_first_shard(task, done, total):
        if task == "label shards" and done == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        label_prompts(tiny_engine, prompts, SMALL, tmp_path / "resumed", killed_after_first_shard)
    assert len(list((tmp_path / "resumed").glob("*.npz"))) == 1
    unfinished = plan_shards(tiny_engine, prompts, SMALL)[1]
    half_written = tmp_path / "resumed" / f".{unfinished.id}.123.tmp"  # a kill mid-write
    half_written.write_bytes(b"half a shard")
    resumed = label_prompts(tiny_engine, prompts, SMALL, tmp_path / "resumed")
    assert not half_written.exists()
    assert resumed.prompt_ids == whole.prompt_ids == [p.id for p in prompts]
    assert whole.arrays.keys() == resumed.arrays.keys()
    for key in whole.arrays:
        np.testing.assert_array_equal(whole[key], resumed[key], err_msg=key)
    assert len(whole) == sum(len(p) for p in [whole["position"]])
    assert (whole["slm_token"] != whole["llm_token"]).any(), "the SLM always agrees: the labels would prove nothing"


def test_shard_files_of_no_planned_shard_are_found_and_left_where_they_are(tiny_engine, tmp_path):
    prompts = builtin_prompts(2)
    label_prompts(tiny_engine, prompts[:4], SMALL, tmp_path)
    older = tmp_path / "0123456789abcdef.npz"  # an older label version's, say
    older.write_bytes(b"old")
    assert unused_shards(tmp_path, plan_shards(tiny_engine, prompts[:4], SMALL)) == [older]
    fewer = plan_shards(tiny_engine, prompts[:2], SMALL)  # a run of other prompts: the first run's shard is unused
    assert len(unused_shards(tmp_path, fewer)) == 2 and older.exists()


def test_a_damaged_label_shard_is_labelled_again_with_a_warning(tiny_engine, tmp_path):
    prompts = builtin_prompts(2)
    whole = label_prompts(tiny_engine, prompts, SMALL, tmp_path)
    damaged = shard_path(tmp_path, plan_shards(tiny_engine, prompts, SMALL)[1])
    data = damaged.read_bytes()
    damaged.write_bytes(data[:len(data) // 2] + bytes(len(data) - len(data) // 2))  # its second half lost
    with pytest.warns(DamagedShardWarning, match=f"1 label shard.*{damaged.name}.*labelled again"):
        again = label_prompts(tiny_engine, prompts, SMALL, tmp_path)
    for key in whole.arrays:
        np.testing.assert_array_equal(whole[key], again[key], err_msg=key)


def test_shard_ids_are_stable_and_change_with_the_settings(tiny_engine):
    prompts = builtin_prompts(2)
    first = [s.id for s in plan_shards(tiny_engine, prompts, SMALL)]
    assert first == [s.id for s in plan_shards(tiny_engine, prompts, SMALL)]
    other = LabelSettings(max_answer_tokens=9, shard_size=4)
    assert not set(first) & {s.id for s in plan_shards(tiny_engine, prompts, other)}
    rechecked = [dataclasses.replace(p, assertions=({"type": "regex", "value": "."},)) for p in prompts]
    assert [s.id for s in plan_shards(tiny_engine, rechecked, SMALL)] == first  # checks do not change labels


def test_constrained_labels_give_the_router_what_the_constrained_decoder_shows_it(tiny_engine):
    """A json prompt is labelled under its profile's grammar: the answer is the constrained
    one, the grammar's forced positions are not free, and each free position's SLM features
    are those a route session under the same grammar hands its router (the masked
    distribution), position for position."""
    from edgeroute.calibration.checks import task_response_format

    prompt = next(p for p in builtin_prompts(2) if p.task == "json")
    settings = LabelSettings(max_answer_tokens=12, path_window=4, path_checks=2)
    labels = label_prompt(tiny_engine, prompt, settings)
    seen: dict[int, np.ndarray] = {}

    def recording_router(proposal, i):
        seen[proposal.answer_position] = proposal_features(SLM_FEATURES, proposal, i)
        return 1.0  # always the LLM: the answer stays full's

    generation = tiny_engine.generate([{"role": "user", "content": prompt.content}], mode="route", light="slm",
                                      router=recording_router, fallback=None, max_new_tokens=12,
                                      response_format=task_response_format("json"))
    assert generation.tokens == labels["llm_token"].tolist()
    free = labels["free"]
    assert not free.all(), "the grammar forced nothing: the test would not tell forced positions apart"
    assert sorted(seen) == np.flatnonzero(free).tolist()
    for j, features in seen.items():
        np.testing.assert_allclose(labels["slm_features"][j].astype(np.float32), features, rtol=2e-2, atol=2e-2)
    assert (labels["slm_token"][~free] == labels["llm_token"][~free]).all()  # forced: no light token to differ


@pytest.mark.parametrize("task", ["voice-command", "json"])
def test_verified_routing_judges_each_difference_with_the_features_it_was_labelled_with(tiny_engine, task):
    """Verified routing that never keeps a difference decodes full's answer and judges exactly
    the positions where the labels' SLM token differs, reading the features stored there (the
    LLM's pass masked by the grammar as the labels' teacher-forced logits are)."""
    from edgeroute.calibration.checks import task_response_format
    from edgeroute.runtime.routers import verify_features

    prompt = next(p for p in builtin_prompts(2) if p.task == task)
    labels = label_prompt(tiny_engine, prompt, LabelSettings(max_answer_tokens=12, path_window=4, path_checks=0))
    seen: dict[int, np.ndarray] = {}

    class RecordingJudge:
        def difference(self, logits, p, token, position):
            seen[position] = verify_features(logits, p, token, position)
            return 1.0

    generation = tiny_engine.generate([{"role": "user", "content": prompt.content}], mode="route", light="slm",
                                      route_check="verified", router=RecordingJudge(), max_new_tokens=12,
                                      response_format=task_response_format(task))
    assert generation.tokens == labels["llm_token"].tolist() and generation.stats.kept_differences == 0
    differ = np.flatnonzero(labels["slm_token"] != labels["llm_token"])
    assert differ.size, "the SLM agrees everywhere: nothing to judge"
    assert sorted(seen) == differ.tolist()
    for j, features in seen.items():
        np.testing.assert_allclose(labels["verify_features"][j].astype(np.float32), features, rtol=2e-2, atol=5e-2)


def test_labels_rank_the_llms_token_among_the_slms_choices_as_its_drafter_sees_them(tiny_engine):
    """``slm_rank``: how many tokens the SLM's drafter, stepping over the LLM's answer, gives more
    probability than the LLM's token (0 exactly where the SLM's own token is the LLM's): what its
    draft trees are replayed from."""
    from edgeroute.runtime.drafters import SlmDrafter
    from edgeroute.runtime.sampling import softmax

    prompt = next(p for p in builtin_prompts(2) if p.task == "dialogue")
    labels = label_prompt(tiny_engine, prompt, LabelSettings(max_answer_tokens=16, path_window=4, path_checks=0))
    ids, answer = tiny_engine.encode_prompt([{"role": "user", "content": prompt.content}]), labels["llm_token"].tolist()
    drafter = SlmDrafter(tiny_engine.slm)
    expected = []
    for j, token in enumerate(answer):
        p = softmax(drafter.next_logits(ids + answer[:j]))
        expected.append(0 if p.argmax() == token else min(max(int((p > p[token]).sum()), 1), UNRANKED))
    assert labels["slm_rank"].tolist() == expected
    assert ((labels["slm_rank"] == 0) == (labels["slm_token"] == labels["llm_token"])).all()
    assert (labels["slm_rank"] > 0).sum() > 0, "the SLM always agrees: the ranks would prove nothing"


def test_verified_routing_is_full_at_threshold_zero_and_keeps_the_slms_tokens_at_one(tiny_engine):
    messages = [{"role": "user", "content": "Navigate to 12 Baker Street in London."}]
    full = tiny_engine.generate(messages, mode="full", max_new_tokens=16)
    strict = tiny_engine.generate(messages, mode="route", light="slm", route_check="verified", route_threshold=0.0,
                                  max_new_tokens=16)
    assert strict.tokens == full.tokens and strict.stats.kept_differences == 0
    loose = tiny_engine.generate(messages, mode="route", light="slm", route_check="verified", route_threshold=1.0,
                                 max_new_tokens=16)
    slm = tiny_engine.generate(messages, mode="slm", max_new_tokens=16)
    assert loose.stats.kept_differences > 0 and loose.stats.llm_tokens < full.stats.llm_tokens
    assert loose.tokens[:4] == slm.tokens[:4]  # every draft token stays: the SLM's answer leads
    with pytest.raises(InputError, match="verified routing"):
        tiny_engine.generate(messages, mode="route", light="ngram", route_check="verified")
    with pytest.raises(InputError, match="does not score"):
        tiny_engine.generate(messages, mode="route", light="slm", router="entropy", route_check="verified")


def test_the_slm_router_must_catch_divergent_differences_only_and_forced_positions_drop_out():
    """R2R's target: a difference whose path check rejoined (neutral) may stay with the SLM, a
    divergent one and an unchecked one may not (unchecked: the bound stays conservative);
    training rows are the labelled ones; grammar-forced positions are nobody's decision."""
    llm = np.array([1, 2, 3, 4, 5, 6])
    slm = np.array([1, 9, 9, 9, 5, 7])
    path = np.array([UNCHECKED, NEUTRAL, DIVERGENT, UNCHECKED, UNCHECKED, UNCHECKED], np.int8)
    free = np.array([True, True, True, True, True, False])
    features = np.zeros((6, 4 + 11), np.float16)
    labels = Labels({"llm_token": llm, "slm_token": slm, "slm_rank": np.where(slm == llm, 0, 1), "slm_path": path,
                     "free": free,
                     "slm_features": features, "prompt": np.zeros(6, np.int32), "task": np.zeros(6, np.int8),
                     "position": np.arange(6, dtype=np.int32), "ngram_token": np.full(6, -1),
                     "ngram_length": np.zeros(6, np.int32), "ngram_count": np.zeros(6, np.int32)}, ["p0"])
    data = light_data(labels, "slm", np.full(6, "train"))
    assert data.differ.tolist() == [False, True, True, True, False]
    assert data.harmful.tolist() == [False, False, True, True, False]
    assert data.known.tolist() == [True, True, True, False, True]
    assert len(data.scores["entropy"]) == 5


def test_path_following_rejoin_is_bounded_by_the_shift():
    assert rejoins([5, 1, 2, 3], [1, 2, 3, 4], rejoin=3, max_shift=2)
    assert not rejoins([5, 6, 7, 8, 9, 1, 2, 3], [1, 2, 3, 4, 5, 6, 7, 8], rejoin=3, max_shift=2)
    assert rejoins([7, 0], [7], rejoin=3, max_shift=2)  # the answer ends: the continuation must start with it


def test_onnx_router_equals_torch_router():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(600, 20)).astype(np.float32) * 3 + 1
    y = (x[:, 0] + rng.normal(size=600) > 1).astype(np.float32)
    for units in (16, 0):
        net, auc = train_router(x[:400], y[:400], x[400:], y[400:], TrainSettings(hidden_units=units, epochs=30, batch_size=64,
                                                                               learning_rate=1e-2))
        assert auc > 0.8
        router = TrainedRouter(router_onnx(net), NGRAM_FEATURES)
        np.testing.assert_allclose(router.scores(x), net.probability(x), atol=1e-5)


def test_trained_router_scores_a_proposal_from_the_runtime_features():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(200, 5)).astype(np.float32)
    net, _ = train_router(x, (x[:, 0] > 0).astype(np.float32), x, (x[:, 0] > 0).astype(np.float32),
                          TrainSettings(hidden_units=0, epochs=3))
    router = TrainedRouter(router_onnx(net), NGRAM_FEATURES)
    proposal = Proposal([7], [None], match_length=4, match_count=2, answer_position=3)
    assert router(proposal, 0) == pytest.approx(float(net.probability(ngram_features(4, 2, 0, 3)[None])[0]), abs=1e-6)
    assert router(Proposal([], []), 0) == 1.0


def _synthetic(prompts: int, seed: int):
    """Positions of ``prompts`` prompts whose light token differs more often at high scores."""
    rng = np.random.default_rng(seed)
    prompt = np.repeat(np.arange(prompts), 30)
    scores = rng.random(len(prompt))
    differ = rng.random(len(prompt)) < scores ** 3 * 0.6
    return scores, differ, np.zeros(len(prompt), bool), prompt


@pytest.mark.parametrize("method", ["crc", "ltt"])
def test_chosen_threshold_meets_the_budget_on_held_out_prompts(method):
    """crc promises the budget in expectation over calibration sets, ltt with probability
    1 - delta: check both over repeated random splits of held-out prompts."""
    scores, differ, forced, prompt = _synthetic(600, seed=2)
    rng = np.random.default_rng(4)
    held_out_agreement, shares = [], []
    for _ in range(30):
        calibration = np.isin(prompt, rng.permutation(600)[:300])
        choice = choose_threshold(scores[calibration], differ[calibration], forced[calibration],
                                  prompt[calibration], budget=0.95, method=method)
        assert 0.0 < choice.threshold < 1.0 and choice.risk <= choice.bound <= 0.05 + 1e-9
        held = ~calibration
        risks, share = prompt_risks(scores[held], differ[held], forced[held], prompt[held],
                                    np.array([choice.threshold]))
        held_out_agreement.append(1.0 - risks.mean())
        shares.append(share[0])
    if method == "crc":
        assert np.mean(held_out_agreement) >= 0.95
    else:
        assert np.mean(np.asarray(held_out_agreement) < 0.95) <= 0.1
    assert max(shares) < 0.9  # the guarantee is not bought by sending everything to the LLM


def test_a_per_answer_bound_counts_answers_that_keep_any_harmful_token_and_is_stricter():
    scores, differ, forced, prompt = _synthetic(600, seed=5)
    thresholds = np.array([0.3, 0.7])
    per_token, _ = prompt_risks(scores, differ, forced, prompt, thresholds)
    per_answer, _ = prompt_risks(scores, differ, forced, prompt, thresholds, per_answer=True)
    assert set(np.unique(per_answer)) <= {0.0, 1.0}
    np.testing.assert_array_equal(per_answer, (per_token > 0).astype(float))
    tokens = choose_threshold(scores, differ, forced, prompt, budget=0.9)
    answers = choose_threshold(scores, differ, forced, prompt, budget=0.9, per_answer=True)
    assert answers.threshold < tokens.threshold and answers.llm_share > tokens.llm_share
    with pytest.raises(BudgetUnreachable, match="answers without a divergent token kept"):
        choose_threshold(scores[:300], differ[:300], forced[:300], prompt[:300], budget=0.999, per_answer=True)


def test_unreachable_budget_names_the_best_achievable_figures():
    scores, differ, forced, prompt = _synthetic(20, seed=3)
    with pytest.raises(BudgetUnreachable, match=r"99.9%.*best achievable is 9\d\.\d+%.*LLM share"):
        choose_threshold(scores, differ, forced, prompt, budget=0.999)


def ranked(agree: np.ndarray) -> np.ndarray:
    """Labels' ranks of the LLM's tokens where only whether the SLM's own token is it matters."""
    return np.where(agree, 0, UNRANKED)


def test_replayed_speculation_counts_accepted_prefixes_and_what_drafts_cost():
    costs = DraftCosts(slm_step=1.0, llm_pass=10.0, llm_row=0.5)
    agree = np.array([1, 1, 0, 1, 1, 1], bool)
    confidence = np.array([0.9, 0.9, 0.2, 0.9, 0.9, 0.9])
    # drafts of 2 without a stop: [0,1] both accepted (+ the LLM's token 2), then [3,4] accepted + 5
    assert replay(ranked(agree), confidence, np.array([0]), DraftSetting(0.0, 2), costs) == (2 * (2 * 1.0 + 10.0 + 2 * 0.5), 6)
    # a stop at 0.5 changes nothing here: the unsure token 2 is never drafted in this answer
    assert replay(ranked(agree), confidence, np.array([0]), DraftSetting(0.5, 2), costs)[0] == 2 * 13.0
    # two answers of 3: the draft never runs past an answer's last token
    seconds, tokens = replay(ranked(agree), confidence, np.array([0, 3]), DraftSetting(0.5, 4), costs)
    assert tokens == 6 and seconds == (2 * 1.0 + 11.0) + (2 * 1.0 + 11.0)
    # the unsure (and wrong) token at 0: drafted without a stop (both rejected: the draft
    # shrinks to 1), found unsure with one (an SLM step, then the LLM's own step)
    starts = np.array([0])
    wrong_first = ranked(np.array([0, 1, 1], bool)), np.array([0.2, 0.9, 0.9])
    assert replay(*wrong_first, starts, DraftSetting(0.0, 2), costs)[0] == (2 * 1.0 + 11.0) + (1.0 + 10.5)
    assert replay(*wrong_first, starts, DraftSetting(0.5, 2), costs)[0] == (1.0 + 10.0) + (1.0 + 10.5)


def test_replayed_draft_length_adapts_like_the_runtime():
    rounds = DraftCosts(slm_step=0.0, llm_pass=1.0, llm_row=0.0)  # seconds = LLM passes
    right, wrong, sure = np.ones(40, bool), np.zeros(40, bool), np.full(40, 0.9)
    # all accepted: 4, 5, 6, 7, 8, then the 4 left before the answer's last token
    assert replay(ranked(right), sure, np.array([0]), runtime_default(), rounds)[0] == 6
    # drafts of at most 2: three tokens a pass
    assert replay(ranked(right), sure, np.array([0]), DraftSetting(0.0, 2), rounds)[0] == 14
    # all rejected: 4, 3, 2, then 1 drafted token per pass; drafted rows cost what they cost
    rows = DraftCosts(slm_step=0.0, llm_pass=0.0, llm_row=1.0)
    assert replay(ranked(wrong), sure, np.array([0]), runtime_default(), rows)[0] == 4 + 3 + 2 + 37 * 1 - 1


def test_draft_fit_prefers_short_sure_drafts_when_verification_rows_are_costly():
    rng = np.random.default_rng(0)
    confidence = rng.uniform(0.05, 1.0, 4000)
    agree = rng.uniform(size=4000) < confidence  # a calibrated SLM: sure tokens are mostly right
    answer_ids = np.repeat(np.arange(100), 40)
    splits = np.where(answer_ids % 4 == 0, "validation", "calibration")
    costs = DraftCosts(slm_step=0.3, llm_pass=1.0, llm_row=0.4)  # the 2-core CPU's proportions
    fit = fit_drafting(ranked(agree), confidence, answer_ids, splits, costs)
    assert fit.setting.confidence > 0.0 and fit.setting.max_tokens < runtime_default().max_tokens
    assert fit.speedup_vs_default > 1.05
    assert fit.curve[fit.setting.name]["calibration"] == max(v["calibration"] for v in fit.curve.values())
    free_rows = fit_drafting(ranked(agree), confidence, answer_ids, splits, DraftCosts(0.01, 1.0, 0.0))
    assert free_rows.setting.max_tokens > fit.setting.max_tokens  # cheap drafts and rows: draft longer
    # the speed-up is over what the runtime drafts with on the measured backend: a native LLM whose
    # passes serve 4 rows drafts at most 3 tokens, one that does not say (ONNX Runtime) 8
    tiled = fit_drafting(ranked(agree), confidence, answer_ids, splits, dataclasses.replace(costs, pass_rows=4))
    assert runtime_default(4) == DraftSetting(0.0, 3) and runtime_default(None) == DraftSetting(0.0, 8)
    best = tiled.curve[tiled.setting.name]["validation"]
    assert tiled.speedup_vs_default == pytest.approx(best / tiled.curve["0.0/3"]["validation"])
    assert fit.speedup_vs_default == pytest.approx(best / fit.curve["0.0/8"]["validation"])


def test_measured_passes_replace_the_linear_row_cost():
    linear = DraftCosts(slm_step=0.0, llm_pass=10.0, llm_row=1.0)
    tiled = DraftCosts(slm_step=0.0, llm_pass=10.0, llm_row=1.0, passes=(10.0, 10.5, 11.0, 15.0))
    assert [tiled.pass_seconds(k) for k in range(5)] == [10.0, 10.5, 11.0, 15.0, 14.0]  # past the table: linear
    right, sure = np.ones(12, bool), np.full(12, 0.9)
    # drafts of 2 (3 tokens a pass, 3 passes + the last token's): the table's 11.0 per pass, not 12.0
    assert replay(ranked(right), sure, np.array([0]), DraftSetting(0.0, 2), tiled)[0] < \
        replay(ranked(right), sure, np.array([0]), DraftSetting(0.0, 2), linear)[0]


def test_each_task_gets_the_draft_setting_its_own_answers_favour():
    rng = np.random.default_rng(1)
    answer_ids = np.repeat(np.arange(120), 30)
    tasks = np.where(answer_ids < 60, 0, 1)  # task 0: an SLM that is nearly always right; task 1: a coin
    agree = np.where(tasks == 0, rng.uniform(size=3600) < 0.97, rng.uniform(size=3600) < 0.5)
    confidence = np.where(agree, 0.9, 0.3)
    splits = np.where(answer_ids % 4 == 0, "validation", "calibration")
    costs = DraftCosts(slm_step=0.3, llm_pass=1.0, llm_row=0.15)
    fits = fit_per_task(ranked(agree), confidence, answer_ids, splits, tasks, costs)
    assert set(fits) == {0, 1}
    assert fits[0].setting.max_tokens > fits[1].setting.max_tokens or fits[1].setting.confidence > 0.3
    assert fits[0].setting.max_tokens >= 4
    # a task with too few answers in a split gets none of its own
    assert fit_per_task(ranked(agree), confidence, answer_ids, splits, tasks, costs, min_answers=31) == {}


def test_a_task_runs_and_keeps_its_own_options():
    config = RunConfig("speculate/slm+fitted", {"mode": "speculate", "light": "slm", "max_draft_tokens": 1},
                       {"json": {"max_draft_tokens": 6, "draft_confidence": 0.5}})
    assert config.options_for("json")["max_draft_tokens"] == 6 and config.options_for("code")["max_draft_tokens"] == 1
    full = RunConfig("full", {"mode": "full"})
    runs = {name: [{"task": task, "tokens": 33, "seconds": seconds, "llm_tokens": 5, "pass": True,
                    "same_as_full": True} for task in ("json", "code")] for name, seconds in
            (("full", 1.0), ("speculate/slm+fitted", 0.5))}
    profiles = choose_profiles(runs, [full, config])
    assert profiles["json"]["max_draft_tokens"] == 6 and profiles["json"]["draft_confidence"] == 0.5
    assert profiles["code"]["max_draft_tokens"] == 1 and "draft_confidence" not in profiles["code"]


def test_a_tasks_own_draft_setting_stays_only_where_its_runtime_runs_beat_the_overall_one():
    costs = DraftCosts(slm_step=0.3, llm_pass=1.0, llm_row=0.15)
    fit = lambda confidence, longest: DraftFit(DraftSetting(confidence, longest), costs, {}, 1.1)  # noqa: E731
    drafting = DraftingResult(fit(0.2, 1), "", {}, {"json": fit(0.8, 8), "code": fit(0.5, 4)})
    fitted, overall = drafting.run_config(), drafting.overall_config()
    assert overall.options_for("json")["max_draft_tokens"] == 1 and fitted.options_for("json")["max_draft_tokens"] == 8

    def rows(seconds: dict[str, float]) -> list[dict]:
        return [{"task": task, "tokens": 33, "seconds": seconds[task], "llm_tokens": 5, "pass": True,
                 "same_as_full": True} for task in ("json", "code", "dialogue")]

    runs = {"full": rows({"json": 1.0, "code": 1.0, "dialogue": 1.0}),
            fitted.name: rows({"json": 0.9, "code": 0.6, "dialogue": 0.8}),  # json's own: slower than the overall
            overall.name: rows({"json": 0.7, "code": 0.8, "dialogue": 0.8})}
    messages = confirm_task_drafts(runs, drafting, fitted)
    assert set(drafting.per_task) == {"code"} and set(fitted.per_task) == {"code"}
    assert len(messages) == 1 and messages[0].startswith("json: its own draft setting 0.8/8")
    assert runs[fitted.name][0]["seconds"] == 0.7  # json's prompts now stand for the overall setting
    profiles = choose_profiles(runs, [RunConfig("full", {"mode": "full"}), fitted, overall])
    assert profiles["json"]["max_draft_tokens"] == 1 and profiles["code"]["max_draft_tokens"] == 4
    assert DraftingResult(fit(0.2, 1), "", {}, {}).overall_config() is None  # no task of its own: nothing to confirm


def test_task_checks_catch_unclosed_json_missing_values_and_echoes():
    json_prompt = next(p for p in builtin_prompts(3) if p.task == "json")
    right = '{"intent": "navigate", "street": "Oak Avenue", "city": "Lyon"}'
    assert task_verdict(json_prompt, right).passed
    assert not task_verdict(json_prompt, '{"intent": "navigate", "street": "Oak Avenue"').passed
    templated = next(p for p in builtin_prompts(3) if p.task == "templated")
    record = templated.record
    reference = (f"Drive to {record['destination']}, arriving at {record['arrival']} after {record['distance_km']} km "
                 f"with {record['battery_percent']}% battery.")
    assert task_verdict(templated, reference).passed
    assert not task_verdict(templated, "Drive soon.").passed
    assert echoes_instructions(f"Sure. {templated.instructions}", templated.instructions)
    assert not task_verdict(templated, f"{reference} {templated.instructions}").passed


def _calibration_with_trained_router(bundle: Path) -> Calibration:
    engine = Engine(bundle)
    width = engine.bundle.slm.arch.hidden_size + 11
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, width)).astype(np.float32)
    net, _ = train_router(x, (x[:, 0] > 0).astype(np.float32), x, (x[:, 0] > 0).astype(np.float32),
                          TrainSettings(hidden_units=8, epochs=2))
    figures = {"speed_vs_full": 1.5, "llm_share": 0.3, "task_pass": 1.0}
    calibration = Calibration(
        "2026-01-01T00:00:00Z", "test", "0" * 64, {"tf_agreement": 0.9, "bound": "crc", "delta": None},
        {"slm": RouterCalibration("slm", "trained", 0.42, "calibration/router-slm-test.onnx", SLM_FEATURES,
                                  {"bound": {"bound": 0.05}}),
         "ngram": RouterCalibration("ngram", "ngram", 0.3)},
        {"json": {"mode": "route", "light": "slm", "protect_format": True, "config": "route/slm",
                  "figures": {"route/slm": figures, "full": figures}},
         "templated": {"mode": "speculate", "light": "ngram", "config": "speculate/ngram",
                       "figures": {"speculate/ngram": figures, "full": figures}}},
        decoding={"draft_confidence": 0.35, "draft_tokens": 2, "max_draft_tokens": 3})
    Bundle.open(bundle).with_calibration(calibration, {"calibration/router-slm-test.onnx": router_onnx(net)})
    return calibration


def test_a_calibrated_bundles_defaults_are_used_by_run(slm_bundle_copy):
    _calibration_with_trained_router(slm_bundle_copy)
    engine = Engine(slm_bundle_copy)
    session = engine.session(mode="route", light="slm")
    assert isinstance(session.options.router, TrainedRouter) and session.options.route_threshold == 0.42
    assert engine.session(mode="route", light="ngram").options.route_threshold == 0.3
    explicit = engine.session(mode="route", light="slm", router="entropy", route_threshold=0.7).options
    assert explicit.router == "entropy" and explicit.route_threshold == 0.7
    assert engine.session(mode="speculate", light="slm").options.draft_confidence == 0.35
    assert engine.session(mode="speculate", light="slm", draft_confidence=0.0).options.draft_confidence == 0.0
    fitted = engine.session(mode="speculate", light="slm").options
    assert (fitted.draft_tokens, fitted.max_draft_tokens) == (2, 3)
    own = engine.session(mode="speculate", light="slm", max_draft_tokens=6).options
    assert (own.draft_tokens, own.max_draft_tokens) == (None, 6)  # the first draft: the runtime's 4
    lookup = engine.session(mode="speculate", light="ngram").options  # the lengths fitted are the SLM's drafts'
    assert (lookup.draft_tokens, lookup.max_draft_tokens) == (DecodeOptions.draft_tokens, DecodeOptions.max_draft_tokens)
    auto = engine.session(mode="auto", task="json").options
    assert (auto.mode, auto.light, auto.protect_format) == ("route", "slm", True) and auto.protected_tokens
    traces = list(engine.session(mode="route", light="slm").generate_tokens("one two three", max_new_tokens=6))
    assert all(t.router_score is not None and 0.0 <= t.router_score <= 1.0 for t in traces)

    result = runner.invoke(app, ["run", str(slm_bundle_copy), "--prompt", "hello", "--max-new-tokens", "5",
                                 "--mode", "auto", "--profile", "templated"])
    assert result.exit_code == 0, result.output
    assert "mode speculate" in " ".join(result.output.split())
    shown = runner.invoke(app, ["inspect", str(slm_bundle_copy)])
    assert shown.exit_code == 0 and "calibrated routers" in shown.output and "route/slm" in shown.output


def test_eval_says_what_auto_ran_on_each_task(slm_bundle_copy, tmp_path):
    from edgeroute.quality.cases import load_cases
    from edgeroute.quality.evaluation import evaluate

    _calibration_with_trained_router(slm_bundle_copy)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"{task}-{i}", "task": task, "prompt": "one two three",
                                         "assert": [{"type": "regex", "value": "."}]}) + "\n"
                             for task in ("json", "templated") for i in range(2)))
    report = evaluate(Engine(slm_bundle_copy), load_cases(tasks), "full,auto", max_new_tokens=6)
    assert report.per_task["json"]["auto"]["ran"] == ["route/slm"]
    assert report.per_task["templated"]["auto"]["ran"] == ["speculate/ngram"]
    assert report.overall["auto"]["ran"] == ["route/slm", "speculate/ngram"]
    assert report.overall["full"]["ran"] == ["full"]
    result = runner.invoke(app, ["eval", str(slm_bundle_copy), "--tasks", str(tasks), "--modes", "full,auto",
                                 "--max-new-tokens", "6"])
    assert result.exit_code == 0, result.output
    assert "auto ran: json route/slm; templated speculate/ngram" in " ".join(result.output.split())


def test_an_uncalibrated_bundle_says_so(tiny_slm_bundle):
    result = runner.invoke(app, ["inspect", str(tiny_slm_bundle)])
    assert result.exit_code == 0 and "uncalibrated" in result.output
    with pytest.raises(InputError, match="uncalibrated.*edgeroute calibrate"):
        Engine(tiny_slm_bundle).session(mode="auto", task="json")


def test_a_bundle_calibrated_on_another_kind_of_cpu_warns(slm_bundle_copy):
    _calibration_with_trained_router(slm_bundle_copy)
    manifest = json.loads((slm_bundle_copy / MANIFEST).read_text())
    here = cpu_signature()

    def recorded(device: dict | None) -> None:
        data = json.loads(json.dumps(manifest))
        if device is not None:
            data["calibration"]["device"] = device
        (slm_bundle_copy / MANIFEST).write_text(json.dumps(data))

    # nothing recorded (an older calibration), this kind of CPU, and the backend this engine runs
    for device in (None, here, {**here, "backend": "portable"}, {**here, "backend": "portable", "kv_dtype": "float32"}):
        recorded(device)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            Engine(slm_bundle_copy)
    recorded({**here, "backend": "native"})  # the tiny bundle runs on ONNX Runtime (no native weights)
    with pytest.warns(CalibrationDeviceWarning, match="timings of the native backend; this engine runs portable"):
        Engine(slm_bundle_copy)
    recorded({**here, "backend": "portable", "kv_dtype": "float16"})  # the engine keeps ONNX Runtime's fp32 cache
    with pytest.warns(CalibrationDeviceWarning, match="calibrated on a float16 KV cache; this engine keeps float32"):
        Engine(slm_bundle_copy)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Engine(slm_bundle_copy, kv_dtype="float16")
    recorded({**here, "backend": "portable"})  # before the cache was recorded: calibrate ran on float32
    with pytest.warns(CalibrationDeviceWarning, match=r"float32 KV cache \(not recorded.*this engine keeps float16"):
        Engine(slm_bundle_copy, kv_dtype="float16")
    for device, message in (({**here, "isa": [*here["isa"], "made_up_isa"]}, "this CPU lacks made_up_isa"),
                            ({**here, "isa": []}, "this CPU adds" if here["isa"] else None),
                            ({**here, "machine": "riscv64"}, "calibrated on riscv64")):
        if message is None:
            continue  # no extension to lack on a CPU that lists none
        recorded(device)
        with pytest.warns(CalibrationDeviceWarning, match=f"{message}.*run `edgeroute calibrate`"):
            engine = Engine(slm_bundle_copy)
        assert engine.session(mode="route", light="slm").options.route_threshold == 0.42  # still applied
    result = runner.invoke(app, ["inspect", str(slm_bundle_copy)])
    assert result.exit_code == 0 and "timings taken on: riscv64" in result.output
    recorded({**here, "backend": "native", "kv_dtype": "float16"})
    result = runner.invoke(app, ["inspect", str(slm_bundle_copy)])
    assert result.exit_code == 0 and "native backend, float16 KV cache" in " ".join(result.output.split())


def test_corrupt_calibration_section_is_a_clear_error(slm_bundle_copy):
    _calibration_with_trained_router(slm_bundle_copy)
    manifest = json.loads((slm_bundle_copy / MANIFEST).read_text())
    for damage, message in ((lambda c: c["routers"]["slm"].update(threshold=7), "threshold 7 outside"),
                            (lambda c: c.pop("profiles"), "profiles"),
                            (lambda c: c["decoding"].update(draft_confidence=2), "draft_confidence must be"),
                            (lambda c: c["decoding"].update(max_draft_tokens=1), "1 <= draft_tokens <= max_draft"),
                            (lambda c: c["decoding"].pop("draft_tokens"), "go together"),
                            (lambda c: c["decoding"].update(skip={"importance_threshold": 3}),
                             "decoding.skip is not a valid skip setting: importance_threshold"),
                            (lambda c: c["decoding"].update(skip={"layers": 3}), "decoding.skip is not a valid"),
                            (lambda c: c["decoding"].update(lookup_tree={"draft_branches": 0}), "lookup_tree must be"),
                            (lambda c: c["decoding"].update(lookup_tree={"draft_branches": 2, "draft_tree_nodes": "5"}),
                             "lookup_tree must be"),
                            (lambda c: c["decoding"].update(slm_tree={"draft_branches": True}), "slm_tree must be"),
                            (lambda c: c.update(device={"machine": 3}), "device must be"),
                            (lambda c: c.update(device={"machine": "x86_64", "backend": 1}), "device must be"),
                            (lambda c: c.update(device={"machine": "x86_64", "kv_dtype": "int4"}), "device must be"),
                            (lambda c: c["routers"]["slm"].update(file="calibration/gone.onnx"), "does not list"),
                            (lambda c: c["decoding"].update(answer_memory="/etc/passwd"), "answer_memory must name"),
                            (lambda c: c["decoding"].update(answer_memory="calibration/gone.npz"), "does not list")):
        broken = json.loads(json.dumps(manifest))
        damage(broken["calibration"])
        (slm_bundle_copy / MANIFEST).write_text(json.dumps(broken))
        with pytest.raises(BundleError, match=f"(?s)calibration.*{message}.*edgeroute calibrate"):
            Bundle.open(slm_bundle_copy)


def test_json_profile_never_routes_format_tokens(tiny_engine):
    vocabulary = tiny_engine.tokenizer.get_vocab()
    protected = format_token_ids(vocabulary)
    assert {vocabulary[t] for t in ("{", '"', ":", ",", "}")} <= protected and vocabulary["the"] not in protected
    # the SLM's own tokens, protected: with a threshold of 1 every other token stays with the SLM
    free = list(tiny_engine.session(mode="route", light="slm", route_threshold=1.0, fallback=None)
                .generate_tokens("one two three", max_new_tokens=16))
    slm_tokens = frozenset(t.token for t in free if t.source == "slm")
    assert slm_tokens, "the SLM wrote nothing: the test would prove nothing"
    guarded = list(tiny_engine.session(mode="route", light="slm", route_threshold=1.0, fallback=None,
                                       protect_format=True, protected_tokens=slm_tokens)
                   .generate_tokens("one two three", max_new_tokens=16))
    assert not [t for t in guarded if t.source == "slm" and t.token in slm_tokens]
    assert any(t.source == "llm" for t in guarded)


def test_lookup_then_slm_runs_with_the_slms_fitted_drafts_and_can_become_a_tasks_choice():
    costs = DraftCosts(slm_step=0.3, llm_pass=1.0, llm_row=0.15)
    fit = lambda confidence, longest: DraftFit(DraftSetting(confidence, longest), costs, {}, 1.1)  # noqa: E731
    fitted = DraftingResult(fit(0.2, 1), "", {}, {"json": fit(0.8, 2)}).run_config()
    hybrid = lookup_then_slm(fitted)
    assert hybrid.options_for("code") == {**fitted.options_for("code"), "light": "ngram+slm"}
    assert hybrid.options_for("json")["draft_confidence"] == 0.8 and hybrid.options_for("json")["light"] == "ngram+slm"
    del fitted.per_task["json"]  # confirm_task_drafts dropping json's own setting: the hybrid ran with it, keeps it
    assert hybrid.options_for("json")["max_draft_tokens"] == 2
    assert lookup_then_slm(None).options == {"mode": "speculate", "light": "ngram+slm"}
    runs = {name: [{"task": "templated", "tokens": 33, "seconds": seconds, "llm_tokens": 5, "pass": True,
                    "same_as_full": True}] for name, seconds in (("full", 1.0), (fitted.name, 0.8), (hybrid.name, 0.6))}
    profiles = choose_profiles(runs, [RunConfig("full", {"mode": "full"}), fitted, hybrid])
    assert profiles["templated"]["config"] == "speculate/ngram+slm" and profiles["templated"]["light"] == "ngram+slm"


def test_calibrate_end_to_end_writes_a_section_the_runtime_reads(slm_bundle_copy, tmp_path):
    options = CalibrateOptions(budget=0.8, task_loss=0.3, builtin_per_task=4, labels=SMALL, work=tmp_path / "work",
                               validation_prompts_per_task=1,
                               slm_router=TrainSettings(hidden_units=8, epochs=3),
                               ngram_router=TrainSettings(hidden_units=0, epochs=3, dropout=0.0))
    report = calibrate(slm_bundle_copy, options)
    bundle = Bundle.open(slm_bundle_copy)  # sha256 of every file, router graphs included
    calibration = bundle.calibration
    assert calibration == report.calibration
    # the timings' CPU and backend, for the runtime's check
    assert calibration.device == {**cpu_signature(), "backend": "portable", "kv_dtype": "float32"}
    assert calibration.figures["labels"]["positions"] > 0 and "default" in calibration.profiles
    for profile in calibration.profiles.values():
        assert profile["eligible"][profile["config"]]["eligible"] and profile["quality"]["why"]
        assert "speculate/ngram+slm" in profile["figures"]
    assert calibration.budget["held_out"]["prompts"] == len(TASKS)  # one held-out prompt per task
    for router in calibration.routers.values():  # the SLM's on answers (task loss), the n-gram's on tokens
        assert router.figures["bound"]["bound"] <= (0.3 if router.light == "slm" else 1 - 0.8) + 1e-9
    verified = calibration.routers["slm:verified"]  # verified routing's own router, and the runtime reads it
    assert verified.light == "slm" and "route/slm+verified" in calibration.profiles["default"]["figures"]
    engine = Engine(slm_bundle_copy)
    resolved = engine.resolve(engine.options.updated(mode="route", light="slm", route_check="verified"))
    assert resolved.route_threshold == verified.threshold
    assert (verified.file is None) == isinstance(resolved.router, str)
    # the labelled answers ship as the answer memory speculation's lookup drafts from, per task
    memory = engine.answer_memory
    assert calibration.decoding["answer_memory"] in bundle.manifest["files"] and not memory.learning
    assert set(memory.tasks()) == set(TASKS) and 0 < memory.answers() <= calibration.figures["labels"]["prompts"]
    shown = runner.invoke(app, ["inspect", str(slm_bundle_copy)])
    assert shown.exit_code == 0 and f"answer memory: {memory.answers()} answers" in " ".join(shown.output.split())
    drafting = calibration.figures["drafting"]
    assert set(drafting["curve"]) >= {"0.0/8", "0.5/2"} and drafting["costs"]["slm_step"] > 0
    assert "## How the SLM drafts" in report.report.read_text() and "| 0.5 | " in report.report.read_text()
    assert (tmp_path / "work" / "token-layers.png").stat().st_size > 1000
    assert len(list((tmp_path / "work" / "shards").glob("*.npz"))) == 6
    assert "## Task profiles" in report.report.read_text()
    again = calibrate(slm_bundle_copy, options)  # labels come from the shards on disk
    assert again.seconds["labels"] < report.seconds["labels"]


def test_bad_calibration_inputs_are_clear_errors(tmp_path, tiny_slm_bundle):
    from edgeroute.calibration.prompts import load_prompts

    lines = tmp_path / "prompts.jsonl"
    lines.write_text('{"id": "a", "task": "json", "content": "x"}\n{"id": "b", "content": "no task"}\n')
    with pytest.raises(InputError, match=r"prompts.jsonl:2 is not a prompt line"):
        load_prompts(lines)
    lines.write_text('{"id": "a", "task": "poetry", "content": "x"}\n')
    with pytest.raises(InputError, match=r"task 'poetry' is not one of"):
        load_prompts(lines)
    result = runner.invoke(app, ["calibrate", str(tiny_slm_bundle), "--budget", "1.5"])
    assert result.exit_code == 2 and "budget" in result.output and "Traceback" not in result.output
    result = runner.invoke(app, ["calibrate", str(tiny_slm_bundle), "--skip-prompts", "-1"])
    assert result.exit_code == 2 and "skip prompts" in result.output and "Traceback" not in result.output





def test_a_work_folder_that_cannot_be_made_is_a_clear_error_and_leaves_the_bundle_as_it_was(slm_bundle_copy, tmp_path):
    manifest = (slm_bundle_copy / MANIFEST).read_bytes()
    taken = tmp_path / "a-file"
    taken.write_text("not a folder")
    for work in (taken, taken / "work"):
        result = runner.invoke(app, ["calibrate", str(slm_bundle_copy), "--work", str(work)])
        assert result.exit_code == 2 and "Traceback" not in result.output, result.output
        assert f"cannot use {work} as the calibration's work folder" in " ".join(result.output.split())
    assert (slm_bundle_copy / MANIFEST).read_bytes() == manifest

@pytest.mark.parametrize(("line", "message"), [
    ('{"id": 5, "task": "json", "content": "x"}', r'prompts.jsonl:1: "id" must be a non-empty string \(got 5\)'),
    ('{"id": "a", "task": "json", "content": 7}', r'prompts.jsonl:1: "content" must be a non-empty string \(got 7\)'),
    ('{"id": "a", "task": "json", "content": " "}', r'"content" must be a non-empty string'),
    ('{"id": "a", "task": ["json"], "content": "x"}', r'"task" must be a non-empty string'),
])
def test_a_prompt_line_whose_keys_are_not_strings_is_refused_by_line(tmp_path, line, message):
    """Before labelling starts: an integer id failed after it with a KeyError, integer content
    with an error that named no file."""
    from edgeroute.calibration.prompts import load_prompts

    path = tmp_path / "prompts.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(InputError, match=message):
        load_prompts(path)

def test_a_prompt_file_may_start_with_a_byte_order_mark_and_one_not_utf8_is_refused_by_line(tmp_path):
    from edgeroute.calibration.prompts import load_prompts

    line = b'{"id": "a", "task": "json", "content": "x"}'
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + line + b"\n")
    assert [p.id for p in load_prompts(path)] == ["a"]
    path.write_bytes(line + b"\n" + line.replace(b"x", b"caf\xe9") + b"\n")
    with pytest.raises(InputError, match=r"prompts.jsonl is not UTF-8 text \(line 2"):
        load_prompts(path)

@pytest.fixture(scope="module")
def six_layer_slm_bundle(tmp_path_factory, smollm2_tokenizer_dir) -> Path:
    """A tiny Llama deep enough for skip modes (2 + 2 protected layers), with a 1-layer SLM cut."""
    from tests.conftest import export_tiny, make_tiny_model

    root = tmp_path_factory.mktemp("six-layers")
    make_tiny_model("llama", root / "src", smollm2_tokenizer_dir, num_hidden_layers=6)
    export_tiny(root / "src", root / "bundle", slm=str(root / "src"), slm_layers=1)
    return root / "bundle"


def test_a_paying_skip_verdict_is_confirmed_in_runtime_runs_and_recorded(six_layer_slm_bundle, tmp_path,
                                                                         monkeypatch):
    """The skip stage runs on the bundle; a verdict that keeps a setting gets its runtime run,
    and the calibration records it (as the skip modes' default only where it paid)."""
    from edgeroute.calibration import calibrate as module
    from edgeroute.calibration.skipping import SkipVerdict

    observed, judge = [], module.judge_skipping

    def judged(observations, granularity, *args):  # the real judgement, then a setting kept for "layer"
        observed.append((granularity, observations.scores["update"].shape))
        verdict = judge(observations, granularity, *args)
        options = {"granularity": granularity, "scorer": "update", "importance_threshold": 0.99,
                   "max_free_layers": 2, "skip_ratio": 0.2}
        return SkipVerdict(granularity, verdict.figures, options if granularity == "layer" else None, "kept")

    monkeypatch.setattr(module, "judge_skipping", judged)
    bundle = Path(shutil.copytree(six_layer_slm_bundle, tmp_path / "bundle"))
    options = CalibrateOptions(budget=0.8, builtin_per_task=2, labels=SMALL, work=tmp_path / "work",
                               validation_prompts_per_task=1, skip_prompts=6,
                               slm_router=TrainSettings(hidden_units=8, epochs=2),
                               ngram_router=TrainSettings(hidden_units=0, epochs=2, dropout=0.0))
    report = calibrate(bundle, options)
    assert [g for g, _ in observed] == ["layer", "mlp"]
    assert observed[0][1][1] == 1  # one decision point, layer 2: layers 0-1 and 4-5 are protected
    skipping = report.calibration.figures["skipping"]
    assert "runtime" in skipping["layer"] and "runtime" not in skipping["mlp"]
    assert any("skip/layer" in profile["figures"] for profile in report.calibration.profiles.values())
    skip = report.calibration.decoding.get("skip")
    assert skip is None or skip["granularity"] == "layer" and skip["speed_vs_full"] >= 1.05
    Bundle.open(bundle)  # the section written is one the reader accepts
