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

from edgeroute.runtime.drafters import FIRST_DRAFT, DraftLength, NgramDrafter, draft_lengths, longest_draft
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
    trees: tuple[float, ...] = ()  # ``trees[k]``: a tree forward over k tokens and the one before them, where measured

    def pass_seconds(self, drafted: int) -> float:
        if drafted < len(self.passes):
            return self.passes[drafted]
        return self.llm_pass + drafted * self.llm_row

    def tree_seconds(self, drafted: int) -> float:
        """A tree forward over ``drafted`` tokens: measured, else a linear pass of as many rows
        (a tree forward reads the weights once too)."""
        return self.trees[drafted] if drafted < len(self.trees) else self.pass_seconds(drafted)


def measure_costs(engine: Engine, repeats: int = 15, longest: int = max(MAX_DRAFT_TOKENS)) -> DraftCosts:
    """Time an SLM step and LLM passes of 1 .. 1 + ``longest`` tokens after a prefix
    (medians). They are timed in turn within every repeat, so a change of the machine's pace
    during the measurement (clock boost, another process) hits them alike: a row's cost is a
    difference of two of them, and unpaired timings moved the fitted draft length between runs
    on one machine. Where the LLM's backend verifies trees, tree forwards of 1 .. ``longest``
    tokens (two branches) after the token before them are timed in the same loop."""
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

    def tree_after_prefix(tokens: int):
        cache, llm = caches[engine.llm], engine.llm
        ids = prefix[:tokens + 1]  # the tree's root (the token before the drafts) and its tokens
        half = (tokens + 1) // 2  # two branches from the root: tokens 1..half and the rest
        parents = [-1, *(i - 1 if i > 1 and i != half + 1 else 0 for i in range(1, tokens + 1))]

        def one() -> None:
            cache.truncate(len(prefix))
            llm.forward_tree(cache, ids, parents)
            llm.keep_path(cache, [])

        one()
        return one

    calls = {"slm": pass_after_prefix(engine.slm, 1),
             **{rows: pass_after_prefix(engine.llm, rows) for rows in range(1, longest + 2)}}
    if engine.llm.tree_forwards:
        calls.update({f"tree{tokens}": tree_after_prefix(tokens) for tokens in range(1, longest + 1)})
    samples: dict[str | int, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            samples[name].append(time.perf_counter() - start)
    passes = tuple(statistics.median(samples[rows]) for rows in range(1, longest + 2))
    trees = tuple(statistics.median(samples[f"tree{tokens}"]) for tokens in range(1, longest + 1)
                  if f"tree{tokens}" in samples)
    return DraftCosts(slm_step=statistics.median(samples["slm"]), llm_pass=passes[0],
                      llm_row=max(passes[-1] - passes[0], 0.0) / longest, passes=passes,
                      pass_rows=engine.llm.pass_rows, trees=(passes[0], *trees) if trees else ())


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
                "costs": {**asdict(self.costs), "passes": list(self.costs.passes),
                                                             "trees": list(self.costs.trees)}}  # as JSON reads it back


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


# -- draft trees (speculate/ngram on a backend that verifies trees) ---------------------------------
#
# Only the prompt lookup's trees are fitted. Its drafts are a function of the token history, so
# replaying them over the prompt and the LLM's labelled answer gives the runtime's trees exactly
# (the LLM's tokens are full's, greedy). The SLM's trees branch into its second and third choices
# where it is unsure, and the labels keep only its first (``slm_token``; ``slm_features`` has the
# alternatives' probabilities, not their ids): replaying them would need new labels (a
# LABELS_VERSION bump relabels every shard, calibration's slowest stage) for a replay that is an
# approximation anyway after the SLM's first wrong token. So ``--light slm`` trees stay unfitted.

TREE_BRANCHES = (2, 3)  # lookup continuations a tree may hold (1: linear drafts, the baseline)


@dataclass(frozen=True)
class TreeShape:
    """How speculate/ngram drafts where the LLM's backend verifies trees: up to ``branches``
    continuations of the lookup's disagreeing matches, at most ``nodes`` tokens in a tree
    (``branches`` 1: linear drafts, ``nodes`` unused)."""

    branches: int
    nodes: int | None = None

    @property
    def name(self) -> str:
        return "linear" if self.branches == 1 else f"{self.branches}x{self.nodes}"

    def options(self) -> dict[str, int | None]:
        """The DecodeOptions fields of this shape."""
        return {"draft_branches": self.branches, "draft_tree_nodes": self.nodes}


LINEAR = TreeShape(1)


def tree_shapes(pass_rows: int | None) -> tuple[TreeShape, ...]:
    """Linear drafts, then trees of 2 and 3 branches whose tokens fill one, two or three passes'
    rows (a tree's pass is its tokens and the token before them, ``pass_rows`` rows a pass: the
    measured pass costs step where a pass's rows run out, so a size between pays for rows it leaves
    empty), up to the longest pass ``measure_costs`` times."""
    rows = pass_rows or longest_draft(pass_rows) // 2
    sizes = sorted({m * rows - 1 for m in (1, 2, 3)} & set(range(2, max(MAX_DRAFT_TOKENS) + 1)))
    return (LINEAR, *(TreeShape(b, n) for b in TREE_BRANCHES for n in sizes))


def lookup_passes(prompt: list[int], answer: list[int], shape: TreeShape,
                  pass_rows: int | None) -> list[tuple[int, int, bool]]:
    """The LLM passes of greedy speculate/ngram over ``answer`` after ``prompt``, as the decoder
    runs them (``Decoder._verify_draft`` / ``_verify_tree``), each as (drafted tokens, accepted
    tokens, verified as a tree): the lookup drafts from the history; a tree's accepted path is its
    longest branch prefix that matches the answer; a tree of one branch, and the first pass (it
    catches up on the prompt), are verified as the linear draft of its first branch; the draft
    length adapts as the runtime's does, from its defaults. Acceptance ends at the answer's end."""
    drafter, sequence = NgramDrafter(), [*prompt, *answer]
    length = DraftLength(*draft_lengths(None, None, pass_rows))
    passes, position = [], 0
    while position < len(answer):
        history, left = sequence[:len(prompt) + position], answer[position:]
        if shape.branches == 1:
            tokens, parents = drafter.propose(history, length.current).tokens, None
        else:
            tree = drafter.propose_tree(history, length.current, shape.branches, shape.nodes)
            tokens, parents = tree.tokens, tree.parents
            if tree.branches < 2 or (position == 0 and len(prompt) > 1):
                tokens, parents = tree.first_branch(), None
        if parents is None:  # a chain: accepted up to its first token that is not the answer's
            pairs = enumerate(zip(tokens, left, strict=False))
            accepted = next((i for i, (t, a) in pairs if t != a), min(len(tokens), len(left)))
            depth = len(tokens)
        else:
            node, accepted = -1, 0
            while accepted < len(left):
                node = next((i for i, (t, p) in enumerate(zip(tokens, parents, strict=True))
                             if p == node and t == left[accepted]), None)
                if node is None:
                    break
                accepted += 1
            depth = max(_depths(parents), default=0)
        passes.append((len(tokens), accepted, parents is not None))
        length.update(depth, accepted)
        position += accepted + 1  # the accepted drafts and the LLM's own token
    return passes


def _depths(parents: list[int]) -> list[int]:
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return depths


def replay_lookup(answers: list[tuple[list[int], list[int]]], shape: TreeShape,
                  costs: DraftCosts) -> tuple[float, int]:
    """(seconds, tokens) of greedy speculate/ngram over the (prompt, answer) pairs: each pass
    costs the measured pass over its drafted tokens and the token before them
    (``DraftCosts.tree_seconds`` for a tree: a tree forward reads the weights once, as a linear
    pass of as many rows does); the lookup itself costs no model step."""
    seconds = 0.0
    for prompt, answer in answers:
        for drafted, _, tree in lookup_passes(prompt, answer, shape, costs.pass_rows):
            seconds += costs.tree_seconds(drafted) if tree else costs.pass_seconds(drafted)
    return seconds, sum(len(answer) for _, answer in answers)


@dataclass
class TreeFit:
    shape: TreeShape
    curve: dict[str, dict[str, float]]  # shape name -> replayed tok/s on calibration / validation
    speedup_vs_linear: float  # replayed on the validation split

    def to_dict(self) -> dict:
        return {**asdict(self), "shape": asdict(self.shape)}


def fit_tree(answers: list[tuple[list[int], list[int]]], splits: np.ndarray, costs: DraftCosts) -> TreeFit:
    """Pick the shape (linear drafts among them, first: it wins ties) with the most replayed
    tokens per second on the calibration split; ``splits`` holds each answer's split."""
    def rate(split: str, shape: TreeShape) -> float:
        seconds, tokens = replay_lookup([a for a, s in zip(answers, splits, strict=True) if s == split], shape, costs)
        return tokens / seconds if seconds else 0.0

    shapes = tree_shapes(costs.pass_rows)
    curve = {s.name: {"calibration": rate("calibration", s), "validation": rate("validation", s)} for s in shapes}
    best = max(shapes, key=lambda s: curve[s.name]["calibration"])
    return TreeFit(best, curve, curve[best.name]["validation"] / max(curve[LINEAR.name]["validation"], 1e-12))


def fit_tree_per_task(answers: list[tuple[list[int], list[int]]], splits: np.ndarray, tasks: np.ndarray,
                      costs: DraftCosts, min_answers: int = MIN_TASK_ANSWERS) -> dict[int, TreeFit]:
    """:func:`fit_tree` on each task's answers alone (``tasks``: each answer's task index), for
    tasks with at least ``min_answers`` answers in each split: how often an answer repeats its
    request's spans with different values (a table's rows, a list's items) differs by task."""
    fits = {}
    for task in np.unique(tasks):
        mask = tasks == task
        if min((splits[mask] == split).sum() for split in ("calibration", "validation")) >= min_answers:
            fits[int(task)] = fit_tree([a for a, m in zip(answers, mask, strict=True) if m], splits[mask], costs)
    return fits
