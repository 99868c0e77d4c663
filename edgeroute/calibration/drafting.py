"""How speculate/slm drafts: ``draft_confidence`` and the draft length, fitted on labels and
measured costs.

A drafted token costs an SLM step and a row of the LLM's verification pass; it saves an LLM
step only if it and every draft token before it are accepted. On a CPU, where a verification
row can cost a good part of a step, long drafts of unsure tokens lose; how much a row costs
depends on the CPU (the 1.5B on 2 cores: 53 ms a step +20 ms a row with AVX2, 48 ms +6 ms with
AVX-512 VNNI, which fitted 1-token and 3-token drafts), so calibrate on the device's CPU class.

Greedy speculation over the labelled answers can be replayed exactly from the teacher-forced
labels: at each point the SLM drafts from the LLM's own prefix, and a draft is accepted up to
its first token that differs from the LLM's. (After a wrong token the SLM would draft from its
own guess; those tokens are rejected whatever they are, and their confidence is taken from the
labelled position, an approximation of what the SLM would then be sure of.) The replay follows
the runtime's draft length: it starts at ``draft_tokens``, grows by one after a fully accepted
draft up to ``max_draft_tokens``, and shrinks by one when less than half was accepted
(``DecodeOptions.adaptive_draft``).

For each candidate setting (confidence x longest draft) the replay gives the decode time of
every answer under the cost model ``slm_steps * slm_step + llm_pass(1 + drafted)`` (a draft
that ends at an unsure token paid the SLM step that found it unsure), with the costs measured
on this machine and this bundle; the fit picks the setting with the highest tokens per second
on the calibration split and reports the replayed speed-up over the runtime's defaults on the
validation split.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np

from edgeroute.runtime.drafters import FIRST_DRAFT, DraftLength, longest_draft
from edgeroute.runtime.engine import Engine

CONFIDENCES = (0.0, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
MAX_DRAFT_TOKENS = (1, 2, 3, 4, 6, 8)
MEASURED_CONTEXT = 96  # tokens before the timed steps (a short prompt and answer)
MIN_TASK_ANSWERS = 8  # answers per split a task needs for a draft setting of its own


@dataclass(frozen=True)
class DraftCosts:
    """Seconds on this machine: an SLM draft step, and an LLM pass over 1 + k tokens:
    ``passes[k]`` where measured, else ``llm_pass + k * llm_row``. A pass is not linear in its
    rows (the native kernels take activation rows in tiles of 3: 4 rows cost two tiles), so the
    fit reads the measured passes."""

    slm_step: float
    llm_pass: float
    llm_row: float
    passes: tuple[float, ...] = ()
    pass_rows: int | None = None  # the LLM backend's rows per pass (what the runtime's longest draft follows)

    def pass_seconds(self, drafted: int) -> float:
        if drafted < len(self.passes):
            return self.passes[drafted]
        return self.llm_pass + drafted * self.llm_row


def measure_costs(engine: Engine, repeats: int = 15, longest: int = max(MAX_DRAFT_TOKENS)) -> DraftCosts:
    """Time an SLM step and LLM passes of 1 .. 1 + ``longest`` tokens after a prefix
    (medians). They are timed in turn within every repeat, so a change of the machine's pace
    during the measurement (clock boost, another process) hits them alike: a row's cost is a
    difference of two of them, and unpaired timings moved the fitted draft length between runs
    on one machine."""
    prefix = (engine.encode("The driver asked for the route to the station and the assistant answered ") * 8)
    prefix = prefix[:MEASURED_CONTEXT]
    caches = {}  # one per model, the prefix in it: every pass starts from it (a cache is the whole context's K/V)
    for model in (engine.slm, engine.llm):
        caches[model] = model.new_cache()
        model.forward(caches[model], prefix)

    def pass_after_prefix(model, tokens: int):
        cache = caches[model]

        def one() -> None:
            cache.truncate(len(prefix))
            model.forward(cache, prefix[:tokens], tail=tokens)

        one()  # warm-up (first call of this shape)
        return one

    calls = {"slm": pass_after_prefix(engine.slm, 1),
             **{rows: pass_after_prefix(engine.llm, rows) for rows in range(1, longest + 2)}}
    samples: dict[str | int, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            samples[name].append(time.perf_counter() - start)
    passes = tuple(statistics.median(samples[rows]) for rows in range(1, longest + 2))
    return DraftCosts(slm_step=statistics.median(samples["slm"]), llm_pass=passes[0],
                      llm_row=max(passes[-1] - passes[0], 0.0) / longest, passes=passes,
                      pass_rows=engine.llm.pass_rows)


@dataclass(frozen=True)
class DraftSetting:
    """How speculate/slm drafts: the confidence that ends a draft and the longest draft (the
    runtime starts at ``min(FIRST_DRAFT, max_tokens)`` and adapts)."""

    confidence: float
    max_tokens: int

    @property
    def first_tokens(self) -> int:
        return min(FIRST_DRAFT, self.max_tokens)

    @property
    def name(self) -> str:
        return f"{self.confidence:.1f}/{self.max_tokens}"

    def options(self) -> dict[str, float | int]:
        """The DecodeOptions fields of this setting."""
        return {"draft_confidence": self.confidence, "draft_tokens": self.first_tokens,
                "max_draft_tokens": self.max_tokens}


def runtime_default(pass_rows: int | None = None) -> DraftSetting:
    """What speculate/slm drafts with when nothing is fitted, on an LLM backend whose passes
    serve ``pass_rows`` tokens (None: one that does not say)."""
    return DraftSetting(0.0, longest_draft(pass_rows))


CANDIDATES = tuple(DraftSetting(c, n) for c in CONFIDENCES for n in MAX_DRAFT_TOKENS)


def replay(agree: np.ndarray, confidence: np.ndarray, answers: np.ndarray, setting: DraftSetting,
           costs: DraftCosts) -> tuple[float, int]:
    """(seconds, tokens) of greedy speculation over the labelled answers: ``agree[i]`` the SLM's
    token equals the LLM's at position i, ``confidence[i]`` the SLM's probability of its token,
    ``answers`` the index where each answer starts (in order); the draft length adapts as in
    the runtime, afresh for each answer."""
    seconds, ends = 0.0, [*answers[1:], len(agree)]
    for start, end in zip(answers, ends, strict=True):
        position, length = start, DraftLength(setting.first_tokens, setting.max_tokens)  # as the decoder does
        while position < end:
            drafted, unsure = 0, False
            while drafted < length.current and position + drafted < end - 1:
                if confidence[position + drafted] < setting.confidence:
                    unsure = True
                    break
                drafted += 1
            accepted = 0
            while accepted < drafted and agree[position + accepted]:
                accepted += 1
            seconds += (drafted + unsure) * costs.slm_step + costs.pass_seconds(drafted)
            length.update(drafted, accepted)
            position += accepted + 1  # the accepted drafts and the LLM's own token
    return seconds, len(agree)


@dataclass
class DraftFit:
    setting: DraftSetting
    costs: DraftCosts
    curve: dict[str, dict[str, float]]  # setting name -> replayed tok/s on calibration / validation
    speedup_vs_default: float  # replayed on the validation split, over the runtime's default on the costs' backend

    def to_dict(self) -> dict:
        return {**asdict(self), "setting": asdict(self.setting),
                "costs": {**asdict(self.costs), "passes": list(self.costs.passes)}}  # as JSON reads it back


def fit_drafting(agree: np.ndarray, confidence: np.ndarray, answer_ids: np.ndarray, splits: np.ndarray,
                 costs: DraftCosts) -> DraftFit:
    """Pick the candidate setting with the most replayed tokens per second on the calibration
    split; ``answer_ids`` numbers each position's answer (contiguous runs)."""
    def rate(split: str, setting: DraftSetting) -> float:
        mask = splits == split
        starts = np.flatnonzero(np.diff(answer_ids[mask], prepend=-1) != 0)
        seconds, tokens = replay(agree[mask], confidence[mask], starts, setting, costs)
        return tokens / seconds if seconds else 0.0

    curve = {s.name: {"calibration": rate("calibration", s), "validation": rate("validation", s)}
             for s in CANDIDATES}  # the runtime's default among them
    best = max(CANDIDATES, key=lambda s: curve[s.name]["calibration"])
    default = runtime_default(costs.pass_rows)
    speedup = curve[best.name]["validation"] / max(curve[default.name]["validation"], 1e-12)
    return DraftFit(best, costs, curve, speedup)


def fit_per_task(agree: np.ndarray, confidence: np.ndarray, answer_ids: np.ndarray, splits: np.ndarray,
                 tasks: np.ndarray, costs: DraftCosts, min_answers: int = MIN_TASK_ANSWERS) -> dict[int, DraftFit]:
    """:func:`fit_drafting` on each task's answers alone (``tasks``: each position's task
    index), for tasks with at least ``min_answers`` answers in each split: how sure the SLM is
    differs by task (it agrees with the LLM on ~96% of JSON-intent positions and ~72% of
    dialogue), and so does the draft length that pays."""
    fits = {}
    for task in np.unique(tasks):
        mask = tasks == task
        answers = {split: len(np.unique(answer_ids[mask & (splits == split)])) for split in ("calibration", "validation")}
        if min(answers.values()) >= min_answers:
            fits[int(task)] = fit_drafting(agree[mask], confidence[mask], answer_ids[mask], splits[mask], costs)
    return fits
