"""``edgeroute calibrate``: label, train routers, fit thresholds, confirm by running the
runtime on held-out prompts, and write the result into the bundle as its defaults.

Prompts split three ways by a hash of their id (stable when prompts are added): ``train``
(router training, with an early-stopping split inside it, also by prompt), ``calibration``
(router choice and the threshold's bound) and ``validation`` (held-out: teacher-forced
figures and the runtime runs that decide each task profile's configuration).
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from edgeroute import __version__
from edgeroute.bundle import CALIBRATION_DIR, Bundle, Calibration, RouterCalibration
from edgeroute.calibration.checks import prompt_case, task_response_format
from edgeroute.calibration.drafting import (
    LINEAR,
    TREE_BRANCHES,
    DraftCosts,
    DraftFit,
    DraftSetting,
    TreeFit,
    TreeShape,
    fit_drafting,
    fit_per_task,
    fit_slm_tree,
    fit_tree,
    fit_tree_per_task,
    measure_costs,
    memories_without_own,
    runtime_default,
    tasks_with_answers,
)
from edgeroute.calibration.labels import (
    DIVERGENT,
    NEUTRAL,
    UNCHECKED,
    UNRANKED,
    Labels,
    LabelSettings,
    LocalExecutor,
    ShardExecutor,
    label_prompts,
    plan_shards,
    uncalibrated_engine,
    unused_shards,
)
from edgeroute.calibration.prompts import (
    HELD_OUT_PER_TASK,
    PER_TASK,
    TASKS,
    CalibrationPrompt,
    builtin_prompts,
    held_out_prompts,
    load_prompts,
    prompts_sha256,
)
from edgeroute.calibration.report import plot_tradeoff, render
from edgeroute.calibration.skipping import (
    FREE_LAYERS,
    GRANULARITIES,
    SkipVerdict,
    decision_points,
    judge_skipping,
    observe_skips,
)
from edgeroute.calibration.thresholds import (
    BOUNDS,
    BudgetUnreachable,
    Choice,
    choose_threshold,
    per_prompt_means,
    share_at_agreement,
    tradeoff,
)
from edgeroute.calibration.train import TrainSettings, roc_auc, router_onnx, train_router
from edgeroute.cpu import cpu_signature
from edgeroute.errors import InputError, UnmeasuredQualityWarning
from edgeroute.measure.traces import plot_trace
from edgeroute.quality.cases import TaskCase, load_cases
from edgeroute.quality.runs import (
    DEFAULT_CONFIDENCE,
    DEFAULT_TOLERANCE,
    RunConfig,
    eligibility,
    is_lossless,
    run_cases,
    summarize,
)
from edgeroute.runtime.answer_memory import AnswerMemory
from edgeroute.runtime.calibrated import AUTO_KEYS, SKIP_KEYS, TREE_DECODING, TREE_KEYS, router_key
from edgeroute.runtime.decoding import VERIFIED_BASELINE
from edgeroute.runtime.drafters import Proposal
from edgeroute.runtime.engine import Engine
from edgeroute.runtime.policies import ngram_router
from edgeroute.runtime.routers import (
    NGRAM_FEATURES,
    SLM_FEATURES,
    TOP_K,
    VERIFY_FEATURES,
    TrainedRouter,
    ngram_features,
)
from edgeroute.runtime.sampling import softmax
from edgeroute.skip_options import SkipOptions

Progress = Callable[[str, int, int], None]
SPLITS = ("train", "calibration", "validation")
MIN_REPLAYED_SPEEDUP = 1.01  # a draft setting that replays slower than this is not worth a runtime run
FITTED_DRAFTS = "speculate/slm+fitted"  # the runtime runs' name for speculate/slm with the fitted draft setting
OVERALL_DRAFTS = "speculate/slm+overall"  # the overall fitted setting on every task (confirms tasks' own settings)
LOOKUP_THEN_SLM = "speculate/ngram+slm"  # prompt lookup where its match is long, the SLM (fitted drafts) elsewhere
LOOKUP_TREES = "speculate/ngram+tree"  # speculate/ngram with the fitted tree shape (a task's own on its prompts)
SLM_TREES = "speculate/slm+tree"  # speculate/slm with the fitted draft settings and tree shape
TREE_RUNS = {"ngram": LOOKUP_TREES, "slm": SLM_TREES}
MIN_SPEEDUP = 1.05  # below this a configuration's gain over full is within the timing noise of a shared machine
EXECUTORS = ("local", "ray")
SLM_BASELINES = {"entropy": TOP_K, "top1": TOP_K + 1, "margin": TOP_K + 2}  # column after the hidden state
VERIFIED = router_key("slm", "verified")  # verified routing's router among the calibration's routers
ROUTER_FEATURES = {"slm": SLM_FEATURES, "ngram": NGRAM_FEATURES, VERIFIED: VERIFY_FEATURES}
VERIFY_GAP = 2  # verify_features' column: LLM log p(draft token) - log p(its choice)
MAX_ROUTED_SHARE = 0.8


def file_name(router: str) -> str:
    return router.replace(":", "-")


@dataclass
class CalibrateOptions:
    budget: float = 0.97  # teacher-forced agreement with full, guaranteed by the bound
    prompts: Path | None = None  # a JSONL file of extra prompts
    builtin: bool = True
    builtin_per_task: int = PER_TASK
    work: Path | None = None  # label shards and the report (default: beside the bundle)
    bound: str = "crc"
    delta: float = 0.1  # ltt's failure probability
    labels: LabelSettings = field(default_factory=LabelSettings)
    slm_router: TrainSettings = field(default_factory=TrainSettings)
    ngram_router: TrainSettings = field(default_factory=lambda: TrainSettings(hidden_units=0, dropout=0.0))
    # held-out prompts per task the runtime runs judge every configuration on (the slow part);
    # below ~60 no lossy mode can show a loss bound of 5% (0 losses in n bound it at 1 - 0.05^(1/n))
    validation_prompts_per_task: int = HELD_OUT_PER_TASK
    task_loss: float = DEFAULT_TOLERANCE  # share of held-out prompts a lossy mode may lose against full
    confidence: float = DEFAULT_CONFIDENCE  # of the bound on that loss
    eval_cases: Path | None = None  # a task file (edgeroute eval's JSONL) judged beside the built-in held-out set
    # labelled prompts whose answers are observed with skipping (0: skipping is not calibrated);
    # the conformal bound at 97% needs 33 fitting prompts before it can allow any error
    skip_prompts: int = 48
    executor: str = "local"  # where the label shards run: local (this process) | ray (Ray tasks)
    address: str | None = None  # ray: the cluster to join (default: RAY_ADDRESS, else a local Ray for the run)
    workers: int | None = None  # ray: shards in flight (default: as many as the cluster's CPUs hold)
    worker_cpus: int = 1  # ray: CPUs, and runtime threads, per shard task

    def validate(self) -> None:
        if not 0.5 <= self.budget < 1.0:
            raise InputError(f"the budget is a teacher-forced agreement within [0.5, 1) (got {self.budget})")
        if self.bound not in BOUNDS:
            raise InputError(f"bound {self.bound!r} is not one of {', '.join(BOUNDS)}")
        if not 0.0 < self.delta < 1.0:
            raise InputError(f"delta must be within (0, 1) (got {self.delta})")
        for name, value in (("prompts per task", self.builtin_per_task), ("answer tokens", self.labels.max_answer_tokens),
                            ("validation prompts per task", self.validation_prompts_per_task)):
            if value < 1:
                raise InputError(f"{name} must be at least 1 (got {value})")
        if self.labels.path_checks < 0:
            raise InputError(f"path checks must be 0 or more (got {self.labels.path_checks})")
        if not 0.0 <= self.task_loss < 1.0:
            raise InputError(f"the task loss is the share of held-out prompts a lossy mode may lose against full, "
                             f"within [0, 1) (got {self.task_loss})")
        if not 0.5 <= self.confidence < 1.0:
            raise InputError(f"confidence must be within [0.5, 1) (got {self.confidence})")
        if self.skip_prompts < 0:
            raise InputError(f"skip prompts must be 0 or more (got {self.skip_prompts})")
        if self.executor not in EXECUTORS:
            raise InputError(f"executor {self.executor!r} is not one of {', '.join(EXECUTORS)}")
        if self.executor == "local" and (self.address, self.workers, self.worker_cpus) != (None, None, 1):
            raise InputError("an address, workers and worker CPUs are settings of the Ray executor: add "
                             "--executor ray (or drop them)")

    def shard_executor(self) -> ShardExecutor:
        if self.executor == "ray":
            from edgeroute.calibration.cluster import RayExecutor

            return RayExecutor(self.address, self.workers, self.worker_cpus)
        return LocalExecutor()


def split_of(prompt_id: str) -> str:
    bucket = int(hashlib.sha256(prompt_id.encode()).hexdigest()[:8], 16) % 10
    return "train" if bucket < 5 else "calibration" if bucket < 8 else "validation"


@dataclass
class LightData:
    """One light path's positions where a router decides (the grammar forces none of them):
    scores of every candidate router, and the labels."""

    differ: np.ndarray  # light token != LLM token
    harmful: np.ndarray  # what the router must send to the LLM (SLM: a divergent or unchecked difference)
    known: np.ndarray  # positions whose harm is labelled (SLM: agreeing, or path-checked): router training rows
    forced: np.ndarray  # no light token: the LLM runs
    prompt: np.ndarray
    split: np.ndarray
    task: np.ndarray
    features: np.ndarray
    rank: np.ndarray  # the LLM token's rank among the light path's choices (0: its own token is the LLM's)
    scores: dict[str, np.ndarray]

    def only(self, keep: np.ndarray) -> LightData:
        return LightData(*(getattr(self, f.name)[keep] for f in fields(self) if f.name != "scores"),
                         {name: score[keep] for name, score in self.scores.items()})


def _slm_stats_start(features: np.ndarray) -> int:
    """The first column after the hidden state in SLM features (slm_features: top-k
    log-probabilities, entropy, 1 - top1, 1 - margin)."""
    return features.shape[1] - (TOP_K + 3)


def light_data(labels: Labels, light: str, splits: np.ndarray) -> LightData:
    """The SLM path's harm is R2R's divergence: a difference the path-following check found
    neutral (the LLM's continuation rejoins its own answer) may stay, a divergent one and an
    unchecked one (counted as divergent: the bound stays conservative) may not; routers train
    on the labelled positions. The n-gram path has no path check: every difference counts."""
    llm = labels["llm_token"]
    free = labels.arrays.get("free", np.ones(len(llm), bool)).astype(bool)  # shards from before grammar-aware labels
    if light == "slm":
        features = labels["slm_features"].astype(np.float32)
        hidden = _slm_stats_start(features)
        scores = {name: features[:, hidden + column] for name, column in SLM_BASELINES.items()}
        differ, path = labels["slm_token"] != llm, labels["slm_path"]
        data = LightData(differ, differ & (path != NEUTRAL), ~differ | (path != UNCHECKED), np.zeros(len(llm), bool),
                         labels["prompt"], splits, labels["task"], features, labels["slm_rank"], scores)
        return data.only(free)
    token, length, count = labels["ngram_token"], labels["ngram_length"], labels["ngram_count"]
    features = np.stack([ngram_features(int(n), int(c), 0, int(p))
                         for n, c, p in zip(length, count, labels["position"], strict=True)])
    baseline = np.asarray([ngram_router(Proposal([int(t)], [None], int(n), int(c)), 0) if t >= 0 else 1.0
                           for t, n, c in zip(token, length, count, strict=True)])
    differ = (token != llm) & (token >= 0)
    return LightData(differ, differ, np.ones(len(llm), bool), token < 0, labels["prompt"], splits, labels["task"],
                     features, np.where(differ, UNRANKED, 0), {"ngram": baseline}).only(free)


@dataclass
class RouterResult:
    light: str
    router: str
    onnx: bytes | None
    choice: Choice | None
    unreachable: str | None
    figures: dict[str, Any]
    curves: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)  # validation: share, agreement


def _inner_split(prompt: np.ndarray, prompt_ids: list[str]) -> np.ndarray:
    """Early-stopping positions: a fifth of the training prompts, by prompt."""
    early = np.asarray([int(hashlib.sha256(f"early:{p}".encode()).hexdigest()[:8], 16) % 5 == 0
                        for p in prompt_ids])
    return early[prompt]


def calibrate_router(data: LightData, light: str, prompt_ids: list[str], options: CalibrateOptions) -> RouterResult:
    train = (data.split == "train") & ~data.forced & data.known
    early = _inner_split(data.prompt, prompt_ids)
    settings = options.slm_router if light.startswith("slm") else options.ngram_router
    net, early_auc = train_router(data.features[train & ~early], data.harmful[train & ~early],
                                  data.features[train & early], data.harmful[train & early], settings)
    scores = {**data.scores, "trained": net.probability(data.features)}
    scores["trained"][data.forced] = 1.0
    figures: dict[str, Any] = {"positions": {s: int((data.split == s).sum()) for s in SPLITS},
                               "early_stopping_auc": early_auc or None, "candidates": {}}
    for split in ("calibration", "validation"):
        part = data.split == split
        scoreable = part & ~data.forced & data.known
        for name, score in scores.items():
            entry = figures["candidates"].setdefault(name, {})
            auc = roc_auc(score[scoreable], data.harmful[scoreable])
            entry[f"{split}_auc"] = None if np.isnan(auc) else auc  # None: one class only (JSON has no NaN)
            entry[f"{split}_llm_share_at_budget"] = share_at_agreement(score[part], data.harmful[part],
                                                                       data.forced[part], options.budget)
    calibration_share = {name: c["calibration_llm_share_at_budget"] for name, c in figures["candidates"].items()}
    best_baseline = min((n for n in calibration_share if n != "trained"), key=calibration_share.get)
    chosen = "trained" if calibration_share["trained"] < calibration_share[best_baseline] else best_baseline
    figures["best_baseline"] = best_baseline
    figures["why"] = (f"trained router needs {calibration_share['trained']:.1%} LLM share at {options.budget:.0%} "
                      f"agreement on calibration prompts vs {calibration_share[best_baseline]:.1%} for "
                      f"{best_baseline}: {'kept' if chosen == 'trained' else 'the baseline is kept'}")
    part = data.split == "calibration"
    choice, unreachable = None, None
    # the SLM's labels say which differences change the answer: its routers are bounded on the share
    # of answers that keep one (the task loss the held-out checks then judge); the n-gram router on
    # teacher-forced agreement (--budget), as every difference counts there
    per_answer = light.startswith("slm")
    try:
        choice = choose_threshold(scores[chosen][part], data.harmful[part], data.forced[part], data.prompt[part],
                                  1.0 - options.task_loss if per_answer else options.budget, options.bound,
                                  options.delta, per_answer)
    except BudgetUnreachable as err:
        unreachable = f"route/{light}: {err}"
    figures["bound_unit"] = "answers" if per_answer else "tokens"
    held = data.split == "validation"
    if choice is not None and held.any():
        kept = (scores[chosen][held] <= choice.threshold) & ~data.forced[held]
        answers = per_prompt_means((kept & data.harmful[held])[None].astype(float), data.prompt[held])[0]
        figures["validation_answers_keeping_divergence"] = float((answers > 0).mean())
        figures["validation_tf_agreement"] = float(1.0 - (kept & data.harmful[held]).mean())
        figures["validation_token_agreement"] = float(1.0 - (kept & data.differ[held]).mean())
        # verified routing runs the LLM over every token: what it saves is the differences it keeps
        figures["validation_llm_share"] = None if light == VERIFIED else float(1.0 - kept.mean())
        figures["validation_kept_differences"] = float(kept.sum() / max(int(data.differ[held].sum()), 1))
        figures["per_task_validation_tf_agreement"] = {
            TASKS[t]: float(1.0 - (kept & data.harmful[held])[data.task[held] == t].mean())
            for t in np.unique(data.task[held])}
    curves = {name: tradeoff(score[held], data.harmful[held], data.forced[held])
              for name, score in scores.items()} if held.any() else {}
    return RouterResult(light, chosen, router_onnx(net) if chosen == "trained" else None, choice, unreachable,
                        figures, curves)


def router_cost(engine: Engine, router: TrainedRouter, repeats: int = 48) -> dict[str, float]:
    """Median milliseconds of one SLM decode step and of scoring its token with ``router``
    (the runtime's whole call: features from the proposal, then the graph), measured in the
    same loop."""
    slm, steps, calls = engine.slm, [], []
    cache = slm.new_cache()
    slm.forward(cache, list(range(1, 33)))
    for token in range(repeats):
        start = time.perf_counter()
        hidden = slm.hidden_states(cache, [token + 1])
        probabilities = softmax(slm.head(hidden)[0])
        steps.append(time.perf_counter() - start)
        cache.truncate(32)
        proposal = Proposal([int(probabilities.argmax())], [probabilities], match_length=token % 6,
                            match_count=1 + token % 3, hidden=[hidden[0]], answer_position=token)
        start = time.perf_counter()
        router(proposal, 0)
        calls.append(time.perf_counter() - start)
    return {"router_ms": 1000 * statistics.median(calls), "slm_step_ms": 1000 * statistics.median(steps)}


# -- runtime confirmation --------------------------------------------------------------------------


def run_configs(routers: dict[str, RouterResult], loaded: dict[str, Any]) -> tuple[list[RunConfig], list[str]]:
    """The runtime runs' configurations, and why a router's route was left out: routing ahead
    that calls the LLM for MAX_ROUTED_SHARE of held-out positions or more costs an SLM step on
    top of nearly every LLM step, so it cannot beat full (the pair's n-gram router: 94%)."""
    configs = [RunConfig("full", {"mode": "full"}), RunConfig("speculate/ngram", {"mode": "speculate", "light": "ngram"}),
               RunConfig("speculate/slm", {"mode": "speculate", "light": "slm"})]
    left_out = []
    for key, result in routers.items():
        if result.choice is None:
            continue
        light, _, check = key.partition(":")
        share = result.figures.get("validation_llm_share")
        if not check and share is not None and share >= MAX_ROUTED_SHARE:
            left_out.append(f"route/{key}: the LLM writes {share:.0%} of held-out positions at the fitted threshold: "
                            f"routing ahead cannot beat full there, not run")
            continue
        options = {"mode": "route", "light": light, "router": loaded[key], "route_threshold": result.choice.threshold}
        configs.append(RunConfig(f"route/{light}" + (f"+{check}" if check else ""),
                                 {**options, "route_check": check} if check else options))
    return configs, left_out


def verified_data(labels: Labels, splits: np.ndarray) -> LightData:
    """Verified routing's decisions: at each SLM draft token the LLM would not pick (after its
    pass), keep it (a neutral difference) or take the LLM's. Positions where both agree need no
    decision (``forced`` here: never kept against the LLM, never harmful); the harm is the SLM
    path's (divergent or unchecked). Baseline: the LLM's own probability ratio (``llm-ratio``)."""
    slm = light_data(labels, "slm", splits)
    free = labels.arrays.get("free", np.ones(len(labels), bool)).astype(bool)
    features = labels["verify_features"].astype(np.float32)[free]
    ratio = 1.0 - np.exp(np.minimum(features[:, VERIFY_GAP], 0.0))
    return replace(slm, forced=~slm.differ, features=features, scores={VERIFIED_BASELINE: ratio})


def choose_profiles(runs: dict[str, list[dict[str, Any]]], configs: list[RunConfig],
                    tolerance: float = DEFAULT_TOLERANCE, confidence: float = DEFAULT_CONFIDENCE,
                    ) -> dict[str, dict[str, Any]]:
    """Per task (and ``default`` over all): the fastest eligible configuration (see
    :func:`edgeroute.quality.runs.eligibility`), full when none is at least MIN_SPEEDUP faster.
    A lossy candidate can only be chosen where it runs faster than every eligible lossless one
    and at least MIN_SPEEDUP faster than full; picking among the k that do is k tests, so each
    is bounded at confidence ``1 - (1 - confidence) / k`` (Bonferroni) and the choice holds at
    ``confidence``. Candidates are admitted on speed alone, never on their pass counts, so the
    admission does not bias the test. Each profile records every configuration's figures, why
    it was or was not eligible, and the chosen one's quality."""
    profiles = {}
    found = {r["task"] for r in runs["full"]}
    tasks = [t for t in TASKS if t in found] + sorted(found - set(TASKS))
    for task in [*tasks, "default"]:
        pick = [i for i, r in enumerate(runs["full"]) if task in ("default", r["task"])]
        rows = {c.name: ([runs[c.name][i] for i in pick]) for c in configs}
        full_rows = rows["full"]
        speed = {c.name: summarize(rows[c.name], full_rows)["speed_vs_full"] if c.name != "full" else 1.0
                 for c in configs}
        lossless = [c for c in configs if is_lossless(c, task)]
        lossless_ok = {c.name: eligibility(c.name, summarize(rows[c.name], full_rows, confidence), tolerance, True)
                       for c in lossless}
        floor = max([MIN_SPEEDUP] + [speed[name] for name, (ok, _) in lossless_ok.items() if ok and name != "full"])
        contenders = [c for c in configs if not is_lossless(c, task) and speed[c.name] > floor]
        each = 1.0 - (1.0 - confidence) / max(len(contenders), 1)
        figures = {c.name: summarize(rows[c.name], full_rows, confidence if is_lossless(c, task) else each)
                   for c in configs}
        verdicts = {c.name: eligibility(c.name, figures[c.name], tolerance, is_lossless(c, task)) for c in configs}
        for c in configs:
            if not is_lossless(c, task) and c not in contenders:
                verdicts[c.name] = (False, f"{speed[c.name]:.2f}x full, not faster than the best eligible "
                                           f"lossless configuration ({floor:.2f}x) or {MIN_SPEEDUP}x full: not a "
                                           f"candidate ({verdicts[c.name][1]})")
        qualified = [c for c in configs if verdicts[c.name][0]]
        best = max(qualified, key=lambda c: speed[c.name])
        if best.name != "full" and speed[best.name] < MIN_SPEEDUP:
            best = configs[0]
        options = {k: v for k, v in best.options_for(task).items() if k in (*AUTO_KEYS, *TREE_KEYS, *SKIP_KEYS)}
        if task == "json" and options["mode"] == "route":
            options["protect_format"] = True
        chosen = figures[best.name]
        profiles[task] = {**options, "config": best.name, "figures": figures,
                          "eligible": {name: {"eligible": ok, "why": why} for name, (ok, why) in verdicts.items()},
                          "quality": {"task_pass": chosen["task_pass"], "full_task_pass": chosen["full_task_pass"],
                                      "judged": chosen["judged"], "prompts": chosen["prompts"],
                                      "loss_bound": chosen["loss_bound"], "confidence": confidence,
                                      "confidence_each": each, "candidates": len(contenders), "tolerance": tolerance,
                                      "why": verdicts[best.name][1]}}
    return profiles


@dataclass
class DraftingResult:
    fit: DraftFit | None  # None: no setting replayed faster than the runtime's defaults
    why: str
    figures: dict[str, Any]
    per_task: dict[str, DraftFit] = field(default_factory=dict)  # tasks whose own setting replays faster
    default: DraftSetting = field(default_factory=runtime_default)  # the runtime's own on the measured backend
    costs: DraftCosts | None = None  # what the fit read (the lookup's tree fit reads them too)

    def run_config(self) -> RunConfig | None:
        """speculate/slm with the fitted settings: the overall one, a task's own for its prompts."""
        if self.fit is None and not self.per_task:
            return None
        overall = self.fit.setting if self.fit is not None else self.default
        return RunConfig(FITTED_DRAFTS, {"mode": "speculate", "light": "slm", **overall.options()},
                         {task: fit.setting.options() for task, fit in self.per_task.items()})

    def overall_config(self) -> RunConfig | None:
        """speculate/slm with the overall fitted setting on every task, where some task has its
        own (a replay alone does not keep one: see :func:`confirm_task_drafts`)."""
        if self.fit is None or not self.per_task:
            return None
        return RunConfig(OVERALL_DRAFTS, {"mode": "speculate", "light": "slm", **self.fit.setting.options()})


def lookup_then_slm(fitted: RunConfig | None) -> RunConfig:
    """speculate/ngram+slm with the SLM drafting as ``fitted`` does (a task's own setting too);
    the lookup's own settings stay the runtime's defaults (``DecodeOptions.lookup_min_match`` /
    ``lookup_tokens``). Its runtime runs decide where it becomes a task's choice."""
    if fitted is None:
        return RunConfig(LOOKUP_THEN_SLM, {"mode": "speculate", "light": "ngram+slm"})
    return RunConfig(LOOKUP_THEN_SLM, {**fitted.options, "light": "ngram+slm"}, dict(fitted.per_task))


def confirm_task_drafts(runs: dict[str, list[dict[str, Any]]], drafting: DraftingResult,
                        fitted: RunConfig) -> list[str]:
    """Keep a task's own draft setting only where its runtime runs on the task's prompts were
    faster than the overall setting's; elsewhere the task takes the overall setting (``fitted``
    and its runs then stand for the overall one on that task's prompts). Found on the pair: json's
    own long drafts (0.8 / 8) replayed 1.13x the overall 1-token drafts on calibration labels but
    ran 0.91x of them on the benchmark's json prompts, twice."""
    if OVERALL_DRAFTS not in runs:
        return []
    messages = []
    for task in list(drafting.per_task):
        pick = [i for i, r in enumerate(runs["full"]) if r["task"] == task]
        own, overall = (summarize([runs[name][i] for i in pick], [runs["full"][i] for i in pick])["tok_s"]
                        for name in (FITTED_DRAFTS, OVERALL_DRAFTS))
        if own > overall:
            continue
        messages.append(f"{task}: its own draft setting {drafting.per_task[task].setting.name} ran at {own:.1f} tok/s "
                        f"against {overall:.1f} with the overall setting in the runtime runs: the overall one kept")
        del drafting.per_task[task], fitted.per_task[task]
        for i in pick:
            runs[FITTED_DRAFTS][i] = runs[OVERALL_DRAFTS][i]
    return messages


def slm_top_p(slm: LightData) -> np.ndarray:
    """The SLM's probabilities of its likeliest tokens at each position, descending: as many as a
    draft tree branches into (slm_features' top-k log-probabilities)."""
    start = _slm_stats_start(slm.features)
    return np.exp(slm.features[:, start:start + max(TREE_BRANCHES)].astype(np.float64))


def calibrate_drafting(engine: Engine, slm: LightData) -> DraftingResult:
    """Fit how speculate/slm drafts (see :mod:`edgeroute.calibration.drafting`) on the SLM
    labels, over all answers and per task; kept for the runtime runs only where the replay on
    validation prompts is faster than the defaults (a task's: than the overall setting)."""
    top_p = slm_top_p(slm)
    costs = measure_costs(engine)
    fit = fit_drafting(slm.rank, top_p, slm.prompt, slm.split, costs)
    figures = fit.to_dict()
    setting, default = fit.setting, runtime_default(costs.pass_rows)
    pays = setting != default and fit.speedup_vs_default >= MIN_REPLAYED_SPEEDUP
    overall = setting if pays else default
    per_task, notes = {}, []
    for index, task_fit in fit_per_task(slm.rank, top_p, slm.prompt, slm.split, slm.task, costs).items():
        task = TASKS[index]
        validation = task_fit.curve[task_fit.setting.name]["validation"]
        gain = validation / max(task_fit.curve[overall.name]["validation"], 1e-12)
        figures.setdefault("per_task", {})[task] = {"setting": asdict(task_fit.setting), "replayed_vs_overall": gain,
                                                   "replayed_tok_s": validation}
        if task_fit.setting != overall and gain >= MIN_REPLAYED_SPEEDUP:
            per_task[task] = task_fit
            notes.append(f"{task} {task_fit.setting.name} ({gain:.3f}x)")
    own = f"; a task's own (confidence/longest draft, replayed vs the overall): {', '.join(notes)}" if notes else ""
    if not pays:
        return DraftingResult(None, f"speculate/slm: no draft setting replayed faster than the defaults "
                                    f"({fit.speedup_vs_default:.3f}x on validation prompts): defaults kept{own}",
                              figures, per_task, default, costs)
    return DraftingResult(fit, f"speculate/slm: drafts of at most {setting.max_tokens} tokens, ending below SLM "
                               f"confidence {setting.confidence} (replayed {fit.speedup_vs_default:.3f}x the "
                               f"defaults on validation prompts){own}", figures, per_task, default, costs)


@dataclass
class TreeResult:
    light: str  # the light path whose drafts are trees: "ngram" (the lookup's) or "slm"
    fit: TreeFit | None  # None: no tree replayed faster than linear drafts, or the backend verifies none
    why: str
    figures: dict[str, Any]
    per_task: dict[str, TreeShape] = field(default_factory=dict)  # tasks whose own shape replays faster
    drafts: RunConfig | None = None  # the SLM's fitted draft settings the trees were replayed with

    @property
    def shape(self) -> TreeShape:
        return self.fit.shape if self.fit is not None else LINEAR

    @property
    def name(self) -> str:
        """The runtime runs' name of its configuration."""
        return TREE_RUNS[self.light]

    def run_config(self) -> RunConfig | None:
        """speculate with the fitted shapes (the overall one, a task's own for its prompts), the SLM
        drafting with its fitted settings (a task's own too)."""
        if self.fit is None and not self.per_task:
            return None
        base = self.drafts.options if self.drafts is not None else {"mode": "speculate", "light": self.light}
        drafts = self.drafts.per_task if self.drafts is not None else {}
        per_task = {task: {**drafts.get(task, {}), **(self.per_task[task].options() if task in self.per_task else {})}
                    for task in {*drafts, *self.per_task}}
        return RunConfig(self.name, {**base, **self.shape.options()}, per_task)


def keep_trees(light: str, fit: TreeFit, task_fits: dict[str, TreeFit], what: str,
               drafts: RunConfig | None = None) -> TreeResult:
    """A tree is kept for the runtime runs only where it replays at least MIN_REPLAYED_SPEEDUP
    faster than linear drafts on the validation prompts (a task's own shape: than the overall
    one). ``what``: what a tree's branches are, for the message."""
    figures = fit.to_dict()
    pays = fit.shape != LINEAR and fit.speedup_vs_linear >= MIN_REPLAYED_SPEEDUP
    overall = fit.shape if pays else LINEAR
    per_task, notes = {}, []
    for task, task_fit in task_fits.items():
        validation = task_fit.curve[task_fit.shape.name]["validation"]
        gain = validation / max(task_fit.curve[overall.name]["validation"], 1e-12)
        figures.setdefault("per_task", {})[task] = {"shape": asdict(task_fit.shape), "replayed_vs_overall": gain,
                                                   "replayed_tok_s": validation}
        if task_fit.shape != overall and gain >= MIN_REPLAYED_SPEEDUP:
            per_task[task] = task_fit.shape
            notes.append(f"{task} {task_fit.shape.name} ({gain:.3f}x)")
    if pays:  # constrained tasks run linear drafts anyway: their profiles say so
        per_task.update({t: LINEAR for t in TASKS if task_response_format(t) is not None})
    own = f"; a task's own (branches x tokens, replayed vs the overall): {', '.join(notes)}" if notes else ""
    if not pays:
        return TreeResult(light, None, f"speculate/{light}: no draft tree replayed faster than linear drafts "
                                       f"({fit.speedup_vs_linear:.3f}x on validation prompts): drafts stay linear{own}",
                          figures, per_task, drafts)
    return TreeResult(light, fit, f"speculate/{light}: draft trees of up to {overall.branches} {what}, "
                                  f"{overall.nodes} tokens (replayed {fit.speedup_vs_linear:.3f}x linear drafts on "
                                  f"validation prompts){own}", figures, per_task, drafts)


def no_trees(light: str, runs_trees: bool, free: np.ndarray) -> TreeResult | None:
    """Why no tree is fitted (None: one is): a backend that verifies none, or only constrained tasks."""
    if not runs_trees:
        return TreeResult(light, None, f"speculate/{light}: the LLM's backend verifies no draft trees: drafts stay "
                                       "linear", {})
    if not free.any():
        return TreeResult(light, None, f"speculate/{light}: every task constrains its output: drafts stay linear", {})
    return None


def lookup_answers(engine: Engine, labels: Labels, by_id: dict[str, CalibrationPrompt],
                   ) -> tuple[list[tuple[list[int], list[int]]], list[str]]:
    """Every labelled prompt's ids and the LLM's answer to it (in answer order): what the lookup's
    drafts are replayed over (:func:`edgeroute.calibration.drafting.lookup_passes`); and its id."""
    answers = []
    for index, prompt_id in enumerate(labels.prompt_ids):
        rows = np.flatnonzero(labels["prompt"] == index)
        answer = labels["llm_token"][rows[np.argsort(labels["position"][rows])]].tolist()
        answers.append((engine.encode_prompt([{"role": "user", "content": by_id[prompt_id].content}]), answer))
    return answers, list(labels.prompt_ids)


def answer_memory(answers: list[tuple[list[int], list[int]]], tasks: list[str]) -> AnswerMemory:
    """The LLM's answers to the labelled prompts, per task, as the bundle ships them: the runtime
    runs judge held-out prompts, which are never labelled, so no run drafts its own answer."""
    memory = AnswerMemory(max_tokens=sum(len(answer) for _, answer in answers) + 1, learning=False)
    for (_, answer), task in zip(answers, tasks, strict=True):
        memory.remember(task, answer)
    return memory


def calibrate_trees(answers: list[tuple[list[int], list[int]]], splits: np.ndarray, tasks: np.ndarray,
                    costs: DraftCosts, runs_trees: bool) -> TreeResult:
    """Fit the tree shape of speculate/ngram's lookup drafts (see ``drafting.fit_tree``) over all
    answers and per task (``tasks``: each answer's index in TASKS), kept as :func:`keep_trees`
    says, and only where the LLM's backend verifies trees (``runs_trees``). A task whose profile
    constrains its output is left out: a grammar keeps drafts linear. Each answer's lookup also
    drafts from the shipped answer memory less the answer itself
    (``drafting.memories_without_own``), as a held-out prompt's does."""
    free = np.asarray([task_response_format(TASKS[t]) is None for t in tasks], bool)
    unfitted = no_trees("ngram", runs_trees, free)
    if unfitted is not None:
        return unfitted
    chosen = np.flatnonzero(free)
    every_memory = memories_without_own(answers, tasks)
    kept, memories = [answers[i] for i in chosen], every_memory.subset(chosen)
    fit = fit_tree(kept, splits[free], costs, memories)
    task_fits = {TASKS[index]: task_fit
                 for index, task_fit in fit_tree_per_task(kept, splits[free], tasks[free], costs, memories).items()}
    return keep_trees("ngram", fit, task_fits, "lookup continuations")


def calibrate_slm_trees(slm: LightData, drafting: DraftingResult, runs_trees: bool) -> TreeResult:
    """Fit the tree shape of speculate/slm's drafts (``drafting.fit_slm_tree``: the SLM's next
    likeliest tokens beside its chain where it is unsure) over all answers and per task, the SLM
    drafting with its fitted setting (a task's own where it has one), kept as :func:`keep_trees`
    says; as :func:`calibrate_trees`, only on a backend that verifies trees and on unconstrained
    tasks."""
    free = np.asarray([task_response_format(TASKS[t]) is None for t in slm.task], bool)
    unfitted = no_trees("slm", runs_trees, free)
    if unfitted is not None:
        return unfitted
    data = slm.only(free)
    top_p, costs = slm_top_p(data), drafting.costs
    overall = drafting.fit.setting if drafting.fit is not None else drafting.default
    fit = fit_slm_tree(data.rank, top_p, data.prompt, data.split, overall, costs)
    task_fits = {}
    for index in tasks_with_answers(data.prompt, data.split, data.task):
        task = TASKS[index]
        setting = drafting.per_task[task].setting if task in drafting.per_task else overall
        mask = data.task == index
        task_fits[task] = fit_slm_tree(data.rank[mask], top_p[mask], data.prompt[mask], data.split[mask], setting,
                                       costs)
    return keep_trees("slm", fit, task_fits, "SLM choices at a position", drafting.run_config())


# -- skipping ----------------------------------------------------------------------------------------


def calibrate_skipping(engine: Engine, labels: Labels, by_id: dict[str, CalibrationPrompt], options: CalibrateOptions,
                       progress: Progress | None) -> list[SkipVerdict]:
    """Observe skipping on ``skip_prompts`` labelled answers (a stable mix of tasks and
    splits) for each granularity and judge it (see :mod:`edgeroute.calibration.skipping`)."""
    chosen = sorted(labels.prompt_ids, key=lambda i: hashlib.sha256(f"skip:{i}".encode()).hexdigest())
    chosen = chosen[:options.skip_prompts]
    sequences = []
    for prompt_id in chosen:
        rows = np.flatnonzero(labels["prompt"] == labels.prompt_ids.index(prompt_id))
        answer = labels["llm_token"][rows[np.argsort(labels["position"][rows])]].tolist()
        sequences.append((engine.encode_prompt([{"role": "user", "content": by_id[prompt_id].content}]), answer))
    splits = np.asarray([split_of(i) for i in chosen])
    early = _inner_split(np.arange(len(chosen)), chosen)
    verdicts = []
    for granularity in GRANULARITIES:
        skip = SkipOptions(granularity=granularity, max_free_layers=FREE_LAYERS)
        observations = observe_skips(engine.llm, sequences, skip,
                                     None if progress is None else lambda t, d, n, g=granularity: progress(
                                         f"skip observations ({g})", d, n))
        verdicts.append(judge_skipping(observations, granularity, splits, early, options.budget, options.bound,
                                       options.delta))
    return verdicts


# -- the whole calibration -------------------------------------------------------------------------


@dataclass
class CalibrateReport:
    bundle: Path
    calibration: Calibration
    messages: list[str]
    seconds: dict[str, float]
    report: Path  # report.md


def calibrate(bundle_path: str | Path, options: CalibrateOptions | None = None,
              progress: Progress | None = None) -> CalibrateReport:
    """Calibrate a bundle in its five stages and write the result into it (resumable: the labels
    are shards on disk)."""
    run = CalibrationRun.start(bundle_path, options or CalibrateOptions(), progress)
    run.label()
    run.train()
    run.fit()
    run.confirm()
    return run.write()


@dataclass
class CalibrationRun:
    """One calibration's state from stage to stage: what each stage produced, its time, and the
    messages the report and the CLI show."""

    bundle: Bundle
    engine: Engine
    options: CalibrateOptions
    prompts: list[CalibrationPrompt]
    work: Path
    progress: Progress | None
    executor: ShardExecutor  # where the label shards run
    seconds: dict[str, float] = field(default_factory=dict)
    messages: list[str] = field(default_factory=list)
    labels: Labels | None = None
    data: dict[str, LightData] = field(default_factory=dict)
    routers: dict[str, RouterResult] = field(default_factory=dict)
    configs: list[RunConfig] = field(default_factory=list)
    drafting: DraftingResult | None = None
    fitted_drafts: RunConfig | None = None
    trees: TreeResult | None = None  # speculate/ngram's draft trees
    slm_trees: TreeResult | None = None  # speculate/slm's
    memory: AnswerMemory | None = None  # the labelled answers, shipped for speculation's lookup
    skipping: list[SkipVerdict] = field(default_factory=list)
    held_out: list[TaskCase] = field(default_factory=list)  # what the runtime runs judge: never labelled
    runs: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    decoding: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def start(cls, bundle_path: str | Path, options: CalibrateOptions, progress: Progress | None) -> CalibrationRun:
        options.validate()
        executor = options.shard_executor()  # without Ray, say so before anything loads
        bundle = Bundle.open(bundle_path)
        if bundle.slm is None:
            raise InputError(f"bundle {bundle.path} has no SLM: calibration labels the SLM and n-gram light paths; "
                             "export with --slm")
        prompts = builtin_prompts(options.builtin_per_task) if options.builtin else []
        if options.prompts:
            prompts += load_prompts(options.prompts)
        if not prompts:
            raise InputError("no calibration prompts: keep the built-in set or give --prompts FILE.jsonl")
        if len({p.id for p in prompts}) != len(prompts):
            raise InputError("calibration prompt ids must be unique (a --prompts line reuses an id)")
        held_out = [prompt_case(p) for p in held_out_prompts(options.validation_prompts_per_task)] \
            if options.builtin else []
        if options.eval_cases:
            held_out += load_cases(options.eval_cases)
        if not held_out:
            raise InputError("no held-out prompts to judge the modes on: keep the built-in set or give --eval FILE.jsonl")
        if len({c.id for c in held_out}) != len(held_out):
            raise InputError("held-out case ids must be unique (an --eval line reuses a built-in id)")
        work = Path(options.work) if options.work else bundle.path.parent / f"{bundle.path.name}-calibration"
        try:  # before the models load: the label shards go there first
            work.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise InputError(f"cannot use {work} as the calibration's work folder (shards and report): "
                             f"{err.strerror}; give another with --work") from None
        return cls(bundle, uncalibrated_engine(bundle), options, prompts, work, progress, executor, held_out=held_out)

    @contextmanager
    def timed(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.seconds[stage] = time.perf_counter() - start

    @property
    def by_id(self) -> dict[str, CalibrationPrompt]:
        return {p.id: p for p in self.prompts}

    def label(self) -> None:
        """The LLM's answers, and per position what each light path proposed (label shards)."""
        shards = self.work / "shards"
        with self.timed("labels"):
            self.labels = label_prompts(self.engine, self.prompts, self.options.labels, shards, self.progress,
                                        self.executor)
        unused = unused_shards(shards, plan_shards(self.engine, self.prompts, self.options.labels))
        if unused:
            megabytes = sum(path.stat().st_size for path in unused) / 1e6
            self.messages.append(f"labels: {len(unused)} shard file(s) in {shards} ({megabytes:.1f} MB) belong to no "
                                 "prompt of this run (other prompts or settings, other weights, an older label "
                                 "version): delete them to free the space, or keep them for a run that has them")

    def train(self) -> None:
        """A router per light path, trained and bounded, kept only where it beats the baselines."""
        labels = self.labels
        splits = np.asarray([split_of(labels.prompt_ids[i]) for i in labels["prompt"]])
        with self.timed("routers"):
            self.data = {light: light_data(labels, light, splits) for light in ("slm", "ngram")}
            if "verify_features" in labels.arrays:
                self.data[VERIFIED] = verified_data(labels, splits)
            self.routers = {light: calibrate_router(self.data[light], light, labels.prompt_ids, self.options)
                            for light in self.data}
        for result in self.routers.values():
            self.messages.append(f"route/{result.light}: {result.figures['why']}")
            if result.unreachable:
                self.messages.append(result.unreachable)
        loaded = {light: TrainedRouter(r.onnx, ROUTER_FEATURES[light]) if r.onnx is not None else r.router
                  for light, r in self.routers.items()}
        for light, router in loaded.items():
            if isinstance(router, TrainedRouter) and light != VERIFIED:  # its cost is a row of the LLM's pass
                self.routers[light].figures["cost"] = router_cost(self.engine, router)
        self.configs, left_out = run_configs(self.routers, loaded)
        self.messages.extend(left_out)

    def fit(self) -> None:
        """How the SLM drafts, and whether skipping pays: the candidates the runtime runs confirm."""
        with self.timed("draft fit"):
            self.drafting = calibrate_drafting(self.engine, self.data["slm"])
        self.messages.append(self.drafting.why)
        self.fitted_drafts = self.drafting.run_config()
        if self.fitted_drafts is not None:
            self.configs.append(self.fitted_drafts)
        self.configs.append(lookup_then_slm(self.fitted_drafts))
        overall_drafts = self.drafting.overall_config()
        if overall_drafts is not None:
            self.configs.append(overall_drafts)
        with self.timed("tree fit"):
            answers, ids = lookup_answers(self.engine, self.labels, self.by_id)
            self.memory = answer_memory(answers, [self.by_id[i].task for i in ids])
            # the runtime runs' speculation drafts from it as the calibrated bundle's will
            self.engine.answer_memory = self.memory
            self.messages.append(f"answer memory: {self.memory.answers()} labelled answers "
                                 f"({', '.join(f'{t} {n}' for t, n in self.memory.tasks().items())}) for speculation's "
                                 "lookup to draft from")
            tasks = np.asarray([TASKS.index(self.by_id[i].task) for i in ids])
            self.trees = calibrate_trees(answers, np.asarray([split_of(i) for i in ids]), tasks, self.drafting.costs,
                                         self.engine.llm.tree_forwards)
            self.slm_trees = calibrate_slm_trees(self.data["slm"], self.drafting, self.engine.llm.tree_forwards)
        for trees in (self.trees, self.slm_trees):
            self.messages.append(trees.why)
            config = trees.run_config()
            if config is not None:
                self.configs.append(config)
        if self.options.skip_prompts and decision_points(self.engine.llm.num_layers, SkipOptions()):
            with self.timed("skipping"):
                self.skipping = calibrate_skipping(self.engine, self.labels, self.by_id, self.options, self.progress)
            for verdict in self.skipping:
                self.messages.append(f"skip/{verdict.granularity}: {verdict.why}")
                if verdict.options is not None:
                    self.configs.append(RunConfig(f"skip/{verdict.granularity}", {"mode": "skip", **verdict.options}))

    def confirm(self) -> None:
        """Every candidate run through the runtime on held-out prompts: what becomes a default."""
        with self.timed("runtime runs"):
            self.runs = run_cases(self.engine, self.held_out, self.configs, self.options.labels.max_answer_tokens,
                                  self.progress)
        if self.fitted_drafts is not None:
            self.messages.extend(confirm_task_drafts(self.runs, self.drafting, self.fitted_drafts))
            plain, fitted = (summarize(self.runs[name], self.runs["full"]) for name in ("speculate/slm", FITTED_DRAFTS))
            self.drafting.figures["runtime"] = {"speculate/slm": plain["tok_s"], FITTED_DRAFTS: fitted["tok_s"]}
        self._confirm_drafting()
        self._confirm_trees()
        self._confirm_skipping()

    def _confirm_drafting(self) -> None:
        """The overall draft setting becomes speculate's default where it ran: on the prompts of
        tasks without a setting of their own (with none, the replay alone decided)."""
        drafting, runs = self.drafting, self.runs
        if drafting.fit is None:
            return
        overall = [i for i, r in enumerate(runs["full"]) if r["task"] not in drafting.per_task]
        plain = fitted = {"tok_s": 0.0}
        if overall:
            plain, fitted = (summarize([runs[name][i] for i in overall], [runs["full"][i] for i in overall])
                             for name in ("speculate/slm", FITTED_DRAFTS))
        if not overall or fitted["tok_s"] > plain["tok_s"]:
            self.decoding.update(drafting.fit.setting.options())
        else:
            self.messages.append(f"draft setting {drafting.fit.setting.name} did not speed up speculate/slm in the "
                                 f"runtime runs ({fitted['tok_s']:.1f} vs {plain['tok_s']:.1f} tok/s): defaults kept")

    def _confirm_trees(self) -> None:
        """Each light path's overall tree shape becomes its explicit speculate default
        (``decoding["lookup_tree"]`` / ``["slm_tree"]``) where its runtime runs were at least
        MIN_SPEEDUP faster than linear drafts' (the SLM's: with the same draft settings) on the
        prompts of tasks without a shape of their own (with none, the replay alone decided): a
        smaller win is within a shared machine's timing noise, as it is for a mode against full.
        The SLM's only where explicit speculate/slm drafts with the setting its trees were fitted
        with."""
        runs = self.runs
        for trees in (self.trees, self.slm_trees):
            if trees is None or trees.fit is None:
                continue
            linear_name = FITTED_DRAFTS if trees.light == "slm" and FITTED_DRAFTS in runs else f"speculate/{trees.light}"
            pick = [i for i, r in enumerate(runs["full"]) if r["task"] not in trees.per_task]
            linear = tree = 0.0
            if pick:
                linear, tree = (summarize([runs[name][i] for i in pick], [runs["full"][i] for i in pick])["tok_s"]
                                for name in (linear_name, trees.name))
                trees.figures["runtime"] = {linear_name: linear, trees.name: tree}
            if trees.light == "slm" and self.drafting.fit is not None and "max_draft_tokens" not in self.decoding:
                # replayed with the fitted draft setting, which explicit speculate/slm will not run
                self.messages.append(f"draft trees {trees.shape.name} were fitted with draft setting "
                                     f"{self.drafting.fit.setting.name}, which the runtime runs did not keep: "
                                     "speculate/slm drafts stay linear")
            elif not pick or tree >= MIN_SPEEDUP * linear:
                self.decoding[TREE_DECODING[trees.light]] = trees.shape.options()
            else:
                self.messages.append(f"draft trees {trees.shape.name} did not speed up speculate/{trees.light} by "
                                     f"{MIN_SPEEDUP}x in the runtime runs ({tree:.1f} vs {linear:.1f} tok/s): drafts "
                                     "stay linear")

    def _confirm_skipping(self) -> None:
        """A skip setting becomes the skip modes' default only where it ran faster than full on
        every held-out prompt and, on those with a check, the bound on its loss meets the budget
        (each setting bounded at the Bonferroni share of the confidence)."""
        options = self.options
        candidates = [v for v in self.skipping if v.options is not None]
        each = 1.0 - (1.0 - options.confidence) / max(len(candidates), 1)
        judged = [i for i, r in enumerate(self.runs["full"]) if r["pass"] is not None]
        for verdict in candidates:
            name = f"skip/{verdict.granularity}"
            figures = summarize(self.runs[name], self.runs["full"], options.confidence)
            verdict.figures["runtime"] = figures
            eligible, why = eligibility(name, summarize([self.runs[name][i] for i in judged],
                                                        [self.runs["full"][i] for i in judged], each),
                                        options.task_loss)
            if figures["speed_vs_full"] >= MIN_SPEEDUP and eligible:
                if figures["speed_vs_full"] > self.decoding.get("skip", {}).get("speed_vs_full", 0.0):
                    self.decoding["skip"] = {**verdict.options, "speed_vs_full": figures["speed_vs_full"]}
            else:
                self.messages.append(f"{name}: ran at {figures['speed_vs_full']:.2f}x full on held-out prompts "
                                     f"({why}): stays off")

    def write(self) -> CalibrateReport:
        """The calibration section into the bundle (atomically), the report and its plots beside it."""
        files, entries = {}, {}
        for light, result in self.routers.items():
            if result.choice is None:
                continue
            file = None
            if result.onnx is not None:
                file = f"calibration/router-{file_name(light)}-{hashlib.sha256(result.onnx).hexdigest()[:12]}.onnx"
                files[file] = result.onnx
            entries[light] = RouterCalibration(light.partition(":")[0], result.router, result.choice.threshold, file,
                                               ROUTER_FEATURES[light] if file else None,
                                               {**result.figures, "bound": result.choice.to_dict()})
        if self.memory is not None and self.memory.answers():
            data = self.memory.to_bytes()
            file = f"{CALIBRATION_DIR}/answers-{hashlib.sha256(data).hexdigest()[:12]}.npz"
            files[file] = data
            self.decoding["answer_memory"] = file
        self.seconds["total"] = sum(self.seconds.values())
        options, engine = self.options, self.engine
        provenance = json.dumps({"prompts": prompts_sha256(self.prompts), "labels": asdict(options.labels),
                                 "budget": options.budget, "bound": options.bound}, sort_keys=True)
        calibration = Calibration(
            created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), edgeroute_version=__version__,
            data_sha256=hashlib.sha256(provenance.encode()).hexdigest(),
            budget={"tf_agreement": options.budget, "bound": options.bound,
                    "delta": options.delta if options.bound == "ltt" else None,
                    "task_loss": options.task_loss, "confidence": options.confidence,
                    "held_out": {"prompts": len(self.held_out), "sha256": cases_sha256(self.held_out)}},
            routers=entries, profiles=choose_profiles(self.runs, self.configs, options.task_loss, options.confidence),
            decoding=self.decoding,
            device={**cpu_signature(), "backend": engine.llm.flavour, "kv_dtype": engine.llm.kv_dtype},
            figures={"labels": label_counts(self.labels), "seconds": dict(self.seconds),
                     "drafting": self.drafting.figures,
                     "trees": self.trees.figures if self.trees is not None else {},
                     "slm_trees": self.slm_trees.figures if self.slm_trees is not None else {},
                     "routers": {light: {"candidates": r.figures["candidates"], "why": r.figures["why"]}
                                 for light, r in self.routers.items()},
                     "unreachable": [r.unreachable for r in self.routers.values() if r.unreachable],
                     "skipping": {v.granularity: {"why": v.why, **v.figures} for v in self.skipping}})
        self.bundle.with_calibration(calibration, files)
        self.work.mkdir(parents=True, exist_ok=True)
        report = self.work / "report.md"
        report.write_text(render(calibration, self.bundle.path, self.messages))
        for light, result in self.routers.items():
            if result.curves:
                plot_tradeoff(result, self.work / f"tradeoff-{file_name(light)}.png")
        if self.held_out:
            # a grounded answer mixes copied values (light path) and new wording (LLM): the telling picture
            sample = next((c for c in self.held_out if c.task == "grounded"), self.held_out[0])
            light = "slm" if engine.slm is not None else "ngram"
            routing = next((c.options for c in self.configs if c.name == f"route/{light}"),
                           {"mode": "route", "light": light})
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UnmeasuredQualityWarning)  # a picture, not a default
                plot_sample_answer(engine, sample, routing, options.labels.max_answer_tokens,
                                   self.work / "token-layers.png")
        return CalibrateReport(self.bundle.path, calibration, self.messages, self.seconds, report)


def cases_sha256(cases: list[TaskCase]) -> str:
    """Of the held-out cases' ids, messages and assertions: which set a calibration was judged on."""
    payload = [[c.id, c.task, c.messages, [[a.type, a.value] for a in c.assertions], c.response_format] for c in cases]
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def label_counts(labels: Labels) -> dict[str, Any]:
    """The report's label table: per light path, positions that agree with the LLM, differ,
    and (SLM) how the path-checked divergences came out."""
    slm_path = labels["slm_path"]
    differ = labels["slm_token"] != labels["llm_token"]
    return {"positions": len(labels), "prompts": len(labels.prompt_ids),
            "slm": {"agree": int((~differ).sum()), "differ": int(differ.sum()),
                    "path_checked": int((slm_path != -1).sum()), "path_neutral": int((slm_path == NEUTRAL).sum()),
                    "path_divergent": int((slm_path == DIVERGENT).sum())},
            "ngram": {"no_proposal": int((labels["ngram_token"] < 0).sum()),
                      "agree": int(((labels["ngram_token"] == labels["llm_token"])).sum()),
                      "differ": int(((labels["ngram_token"] != labels["llm_token"])
                                     & (labels["ngram_token"] >= 0)).sum())}}


def plot_sample_answer(engine: Engine, case: TaskCase, routing: dict[str, Any], max_tokens: int,
                       path: Path) -> None:
    """The token x layer view of one held-out answer in ``route+skip`` with the calibrated
    router and threshold (``routing``: the route configuration's options, a baseline's when
    no threshold met the budget; the engine itself runs uncalibrated) and the default skip
    settings."""
    light = routing["light"]
    messages = case.messages
    mode = "route+skip"
    chosen = {**routing, "max_new_tokens": max_tokens}
    try:
        generation = engine.generate(messages, **{**chosen, "mode": mode})
    except InputError:  # a model too shallow for the default protected layers: routing alone
        mode = "route"
        generation = engine.generate(messages, **{**chosen, "mode": mode})
    plot_trace(generation.trace, path, f"{case.id}: {mode}, light path {light} "
               f"({generation.stats.llm_share:.0%} LLM share)")
