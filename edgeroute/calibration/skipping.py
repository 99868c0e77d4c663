"""Layer skipping fitted on the quantized model's own activations (FreeToken, section 5.2).

A skip threshold fitted on one model's activations does not carry over to its quantized
version: quantization moves the importance scores, and the two errors compound. So the
scores and their consequences are observed on the bundle the runtime runs.

**Observations.** For each labelled answer (teacher-forced, the LLM's own greedy tokens), at
every decision point ``d`` of the skip controller (past the protected first layers, every
``re_eval_interval`` layers):

- each scorer's importance for each answer token, from the hidden state entering ``d`` and
  the one at the previous checkpoint, exactly as :class:`SkipController` computes it;
- the top-1 token when the answer's tokens skip the free run from ``d`` (``free_layers``
  layers, up to the protected last ones), in one pass over the answer with the prompt's rows
  computed in full. Every answer token skips there, so a token also reads its predecessors'
  filled K/V: the observed change is a pessimistic one.

**Fit.** A threshold makes a token skip at the first decision point whose score is below it
(the controller's rule); the token is then wrong where that point's skipped pass changed its
top-1 token. Per prompt this gives the risk (1 - teacher-forced agreement with ``full``) and
the skipped share of layer work; the same conformal / Learn-then-Test bounds as the routers
pick the most permissive threshold within the budget. A token may skip again after its free
run in the runtime, which the first-crossing model does not count: the calibrated
``skip_ratio`` caps the skipped share at the fitted one, and the runtime runs on validation
prompts confirm the figures.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgeroute.calibration.thresholds import BudgetUnreachable, Choice, bounded_choice, per_prompt_means
from edgeroute.calibration.train import TrainSettings, roc_auc, train_router
from edgeroute.runtime.backends.onnxruntime import OrtModel
from edgeroute.runtime.layers import RUN, SKIP, SKIP_MLP
from edgeroute.runtime.policies import make_scorer
from edgeroute.skip_options import SkipOptions

SCORERS = ("update", "cosine")
Progress = Callable[[str, int, int], None]


def decision_points(num_layers: int, options: SkipOptions) -> list[int]:
    """Layers where :class:`SkipController` scores a token (when no free run is under way)."""
    return list(range(options.protected_first, num_layers - options.protected_last, options.re_eval_interval))


@dataclass
class SkipObservations:
    points: list[int]
    free_run: np.ndarray  # int [points]: layers a skip from each point leaves out
    num_layers: int
    scores: dict[str, np.ndarray]  # scorer -> float32 [positions, points]
    full_tokens: np.ndarray  # int64 [positions]: top-1 without skipping
    skipped_tokens: np.ndarray  # int64 [positions, points]: top-1 when skipping from each point
    prompt: np.ndarray  # int32 [positions]: index into the sequences observed
    hidden: np.ndarray  # float16 [positions, points, d]: the hidden state entering each point

    @property
    def changed(self) -> np.ndarray:
        """[positions, points]: skipping from the point changes the top-1 token."""
        return self.skipped_tokens != self.full_tokens[:, None]

    def subset(self, keep: np.ndarray) -> SkipObservations:
        """The positions of the prompts where ``keep`` (indexed by prompt) is true."""
        rows = keep[self.prompt]
        return SkipObservations(self.points, self.free_run, self.num_layers,
                                {name: s[rows] for name, s in self.scores.items()}, self.full_tokens[rows],
                                self.skipped_tokens[rows], self.prompt[rows], self.hidden[rows])

    def with_scores(self, scores: dict[str, np.ndarray]) -> SkipObservations:
        return SkipObservations(self.points, self.free_run, self.num_layers, scores, self.full_tokens,
                                self.skipped_tokens, self.prompt, self.hidden)


def observe_skips(llm: OrtModel, sequences: Sequence[tuple[Sequence[int], Sequence[int]]], options: SkipOptions,
                  progress: Progress | None = None) -> SkipObservations:
    """Scores and skipped top-1 tokens over (prompt ids, answer ids) pairs; see the module doc."""
    points = decision_points(llm.num_layers, options)
    if not points:
        raise ValueError(f"a {llm.num_layers}-layer model has no skip decision points with "
                         f"{options.protected_first} + {options.protected_last} protected layers")
    last = llm.num_layers - options.protected_last
    free = options.free_layers(llm.num_layers)
    ends = [min(d + free, last) for d in points]
    action = SKIP_MLP if options.granularity == "mlp" else SKIP
    scorers = {name: make_scorer(name) for name in SCORERS}
    checkpoints = [0, *points[:-1]]
    parts: list[dict[str, np.ndarray]] = []
    for i, (ids, answer) in enumerate(sequences):
        if progress is not None:
            progress("skip observations", i, len(sequences))
        p, n = len(ids), len(answer)
        tokens = [ids[-1], *answer[:-1]]  # the rows whose logits predict the answer
        cache = llm.new_cache(p + n)
        if p > 1:
            llm.forward(cache, ids[:-1])
        entering: dict[int, list[np.ndarray]] = {}

        def record(layer: int, hidden: np.ndarray, entering: dict = entering) -> str:
            entering.setdefault(layer, []).append(hidden)
            return RUN

        full = llm.forward(cache, tokens, plan=record, tail=n).argmax(-1)
        states = {layer: np.concatenate(chunks) for layer, chunks in entering.items()}
        skipped = np.empty((n, len(points)), np.int64)
        for k, (start, end) in enumerate(zip(points, ends, strict=True)):
            skipped[:, k] = _skipped_top1(llm, cache, states[start], p - 1, start, end, action)
        scores = {name: np.asarray([[scorer(states[c][j:j + 1], states[d][j:j + 1])
                                     for c, d in zip(checkpoints, points, strict=True)] for j in range(n)],
                                   np.float32).reshape(n, len(points))
                  for name, scorer in scorers.items()}
        parts.append({"full": full, "skipped": skipped, "prompt": np.full(n, i, np.int32),
                      "hidden": np.stack([states[d] for d in points], axis=1).astype(np.float16),
                      **{f"score_{name}": s for name, s in scores.items()}})
    if progress is not None:
        progress("skip observations", len(sequences), len(sequences))
    joined = {key: np.concatenate([part[key] for part in parts]) for key in parts[0]}
    return SkipObservations(points, np.asarray(ends) - np.asarray(points), llm.num_layers,
                            {name: joined[f"score_{name}"] for name in SCORERS},
                            joined["full"], joined["skipped"], joined["prompt"], joined["hidden"])


def _skipped_top1(llm: OrtModel, cache, hidden: np.ndarray, row: int, start: int, end: int,
                  action: str) -> np.ndarray:
    """Top-1 tokens of the answer rows (from cache row ``row``) when layers [start, end) take
    ``action``. Below ``start`` nothing differs from the full pass, so it resumes from the
    hidden state entering ``start``; the cache rows of the layers from ``start`` on are
    rewritten (points run in ascending order, so a later point never reads a row this wrote)."""
    for layer in range(start, llm.num_layers):
        if not start <= layer < end:
            hidden = llm.layer(layer, hidden, cache, row)
        elif action == SKIP_MLP:
            hidden = llm.attention(layer, hidden, cache, row)
        else:
            llm.kv_fill(layer, hidden, cache, row)
    return llm.head(hidden).argmax(-1)


def first_crossing(scores: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
    """[thresholds, positions]: the first decision point whose score is below the threshold, -1 for none."""
    below = scores[None, :, :] < thresholds[:, None, None]
    return np.where(below.any(axis=2), below.argmax(axis=2), -1)


def outcomes(observations: SkipObservations, scorer: str, thresholds: np.ndarray,
             reference: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per threshold and position: is the token wrong (against ``reference``, default the
    model's own full top-1), and the share of its layers skipped."""
    reference = observations.full_tokens if reference is None else reference
    point = first_crossing(observations.scores[scorer], thresholds)
    rows = np.arange(point.shape[1])
    token = np.where(point >= 0, observations.skipped_tokens[rows[None, :], np.maximum(point, 0)],
                     observations.full_tokens[None, :])
    skipped = np.where(point >= 0, observations.free_run[np.maximum(point, 0)], 0) / observations.num_layers
    return token != reference[None, :], skipped


@dataclass(frozen=True)
class SkipFit:
    scorer: str
    choice: Choice  # threshold, bound, risk; its llm_share is the share of layer work still run
    skipped_share: float  # of layer work, calibration prompts


def candidate_skip_thresholds(observations: SkipObservations, scorer: str, steps: int = 120) -> np.ndarray:
    scores = observations.scores[scorer].ravel()
    return np.unique(np.concatenate([[0.0], np.quantile(scores, np.linspace(0, 0.6, steps))]))


def fit_skip(observations: SkipObservations, scorer: str, budget: float, method: str = "crc",
             delta: float = 0.1) -> SkipFit:
    """The most permissive threshold for ``scorer`` within the budget (raises BudgetUnreachable)."""
    if not len(observations.full_tokens):
        raise BudgetUnreachable(f"skipping with the {scorer} scorer: no prompts to fit a threshold on "
                                "(raise --skip-prompts)")
    thresholds = candidate_skip_thresholds(observations, scorer)
    wrong, skipped = outcomes(observations, scorer, thresholds)
    risks = per_prompt_means(wrong, observations.prompt)
    run_share = 1.0 - skipped.mean(axis=1)
    choice = bounded_choice(thresholds, risks, run_share, budget, method, delta,
                            what=f"skipping with the {scorer} scorer", share_name="layer work run")
    index = int(np.flatnonzero(thresholds == choice.threshold)[0])
    return SkipFit(scorer, choice, float(skipped[index].mean()))


# -- the calibration step: scorers compared on held-out prompts, a verdict per granularity --------

GRANULARITIES = ("layer", "mlp")
FREE_LAYERS = 2  # measured on the 1.5B: an 8-layer free run changes 21-76% of tokens from any point
MIN_SKIPPED_SHARE = 0.03  # of layer work: below this a skip mode cannot pay for its scoring
LEARNED_SCORER = TrainSettings(hidden_units=0, dropout=0.0)  # a logistic regression per decision point


def learned_scores(observations: SkipObservations, train: np.ndarray, early: np.ndarray,
                   settings: TrainSettings = LEARNED_SCORER) -> tuple[np.ndarray, list[float]]:
    """Per decision point, a logistic regression from the hidden state entering it (and the
    heuristic scores) to P(skipping here changes the token), trained on the positions of the
    ``train`` prompts, early-stopped on those of its prompts marked ``early`` (held out of the
    fit). Returns the scores of every position [positions, points] and the early-stopping AUC
    per point."""
    rows, stop = (train & ~early)[observations.prompt], (train & early)[observations.prompt]
    scores = np.ones(observations.scores[SCORERS[0]].shape, np.float32)
    aucs = []
    for k in range(len(observations.points)):
        features = np.concatenate([observations.hidden[:, k].astype(np.float32),
                                   np.stack([observations.scores[s][:, k] for s in SCORERS], axis=1)], axis=1)
        label = observations.changed[:, k]
        if label[rows].all() or not label[rows].any():  # one class: nothing to learn
            aucs.append(float("nan"))
            continue
        net, auc = train_router(features[rows], label[rows], features[stop], label[stop], settings)
        scores[:, k] = net.probability(features)
        aucs.append(auc)
    return scores, aucs


@dataclass
class SkipVerdict:
    granularity: str
    figures: dict[str, Any]
    options: dict[str, Any] | None  # the runtime skip options worth confirming; None: skipping stays off
    why: str


def _auc(value: float) -> float | None:
    """Rounded for the manifest; None where one class is missing (JSON has no NaN)."""
    return None if math.isnan(value) else round(value, 3)


def _held_out(observations: SkipObservations, scorer: str, threshold: float) -> dict[str, float] | None:
    if not len(observations.full_tokens):
        return None
    wrong, skipped = outcomes(observations, scorer, np.asarray([threshold]))
    return {"agreement": float(1.0 - wrong.mean()), "skipped_share": float(skipped.mean()),
            "tokens_skipping": float((skipped > 0).mean())}


def judge_skipping(observations: SkipObservations, granularity: str, splits: np.ndarray, early: np.ndarray,
                   budget: float, method: str, delta: float) -> SkipVerdict:
    """Fit each scorer's threshold (heuristics on train + calibration prompts, the learned
    scorer's on calibration prompts after training on train ones), measure it on validation
    prompts, and keep the best heuristic that skips at least MIN_SKIPPED_SHARE within the
    budget there. (A learned scorer is reported, not shipped: the runtime scores with the
    heuristics only, and so far none was worth adding; see the figures.)"""
    learned, early_aucs = learned_scores(observations, splits == "train", early)
    observations = observations.with_scores({**observations.scores, "learned": learned})
    held = observations.subset(splits == "validation")
    changed = held.changed
    figures: dict[str, Any] = {
        "positions": len(observations.full_tokens), "prompts": len(splits),
        "validation_positions": len(held.full_tokens), "points": observations.points,
        "free_layers": int(observations.free_run.max()),
        "change_rate": [round(float(c), 4) for c in observations.changed.mean(axis=0)],
        "learned_early_stopping_auc": [_auc(a) for a in early_aucs], "scorers": {}}
    best: tuple[float, str, float] | None = None
    for scorer in (*SCORERS, "learned"):
        fit_split = splits == "calibration" if scorer == "learned" else splits != "validation"
        entry: dict[str, Any] = {"validation_auc": [_auc(roc_auc(held.scores[scorer][:, k], changed[:, k]))
                                                    for k in range(len(held.points))]}
        try:
            fit = fit_skip(observations.subset(fit_split), scorer, budget, method, delta)
        except BudgetUnreachable as err:
            entry["unreachable"] = str(err)
        else:
            entry.update(threshold=fit.choice.threshold, bound=fit.choice.bound,
                         calibration_skipped_share=fit.skipped_share, validation=_held_out(held, scorer,
                                                                                           fit.choice.threshold))
            result = entry["validation"]
            if result is not None and scorer != "learned" and result["agreement"] >= budget and (
                    best is None or result["skipped_share"] > best[0]):
                best = (result["skipped_share"], scorer, fit.choice.threshold)
        figures["scorers"][scorer] = entry
    if best is None or best[0] < MIN_SKIPPED_SHARE:
        skipped = 0.0 if best is None else best[0]
        return SkipVerdict(granularity, figures, None, f"no heuristic scorer skips {MIN_SKIPPED_SHARE:.0%} of layer work "
                           f"within the budget on validation prompts (best: {skipped:.1%})")
    share, scorer, threshold = best
    options = {"granularity": granularity, "scorer": scorer, "importance_threshold": threshold,
               "max_free_layers": figures["free_layers"], "skip_ratio": math.ceil(share * 100) / 100}
    return SkipVerdict(granularity, figures, options, f"the {scorer} scorer skips {share:.1%} of layer work within the "
                       "budget on validation prompts")
