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

Where the LLM's backend verifies trees, both light paths' trees are fitted the same way over
shapes (branches x tokens): the SLM's from the labelled rank of the LLM's token among its
choices (a leaf beside the chain is accepted where it is the LLM's token), the lookup's by
running the lookup itself over each prompt and answer (``lookup_passes``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from edgeroute.runtime.answer_memory import AnswerMemory
from edgeroute.runtime.drafters import (
    FIRST_DRAFT,
    SIBLING_FLOOR,
    DraftLength,
    NgramDrafter,
    draft_lengths,
    longest_draft,
)
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


# -- draft trees, on a backend that verifies them ---------------------------------------------------
#
# A tree holds a light path's alternatives where it is unsure: the lookup's continuations where
# its matches disagree, the SLM's next likeliest tokens beside its chain. Both are fitted from
# replays on measured pass and tree-forward costs, per task, and kept only where they beat
# linear drafts.

TREE_BRANCHES = (2, 3)  # continuations (lookup) or choices at a position (SLM) a tree may hold (1: linear)


@dataclass(frozen=True)
class TreeShape:
    """How speculate drafts where the LLM's backend verifies trees: up to ``branches`` continuations
    of the lookup's disagreeing matches, or choices of the SLM at a position, at most ``nodes``
    tokens in a tree (``branches`` 1: linear drafts, ``nodes`` unused)."""

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


@dataclass
class TreeFit:
    shape: TreeShape
    curve: dict[str, dict[str, float]]  # shape name -> replayed tok/s on calibration / validation
    speedup_vs_linear: float  # replayed on the validation split

    def to_dict(self) -> dict:
        return {**asdict(self), "shape": asdict(self.shape)}


def pick_shape(rate: Callable[[str, TreeShape], float], pass_rows: int | None) -> TreeFit:
    """The shape of :func:`tree_shapes` (linear drafts first: they win ties) with the most replayed
    tokens per second on the calibration split (``rate(split, shape)``), and its replayed speed-up
    over linear drafts on the validation split."""
    shapes = tree_shapes(pass_rows)
    curve = {s.name: {"calibration": rate("calibration", s), "validation": rate("validation", s)} for s in shapes}
    best = max(shapes, key=lambda s: curve[s.name]["calibration"])
    return TreeFit(best, curve, curve[best.name]["validation"] / max(curve[LINEAR.name]["validation"], 1e-12))


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


def replay(rank: np.ndarray, top_p: np.ndarray, answers: np.ndarray, setting: DraftSetting, costs: DraftCosts,
           shape: TreeShape = LINEAR) -> tuple[float, int]:
    """(seconds, tokens) of greedy speculate/slm over the labelled answers: ``rank[i]`` the rank of
    the LLM's token among the SLM's choices at position i (0: the SLM's own token, accepted),
    ``top_p[i]`` the SLM's probabilities of its likeliest tokens, descending (``top_p[i, 0]`` its
    confidence; 1-D: that column alone), ``answers`` the index where each answer starts (in
    order); the draft length adapts as in the runtime, afresh for each answer.

    With a tree ``shape`` the SLM drafts as ``SlmDrafter.propose_tree`` does: beside each chain
    token, its next likeliest tokens of at least SIBLING_FLOOR (``shape.branches`` in all) as
    leaves, ``shape.nodes`` tokens at most; a draft below the confidence ends the tree after its
    candidates where together they reach it. The walk takes the chain while it is the LLM's and
    a leaf that is; a pass with no leaf is verified as the linear draft it is. After a wrong chain
    token the SLM drafts from its own guess: as in a linear draft, those tokens are rejected
    whatever they are, and what they cost is read from the labelled positions."""
    top_p = top_p.reshape(len(top_p), -1)
    width = min(shape.branches, top_p.shape[1])
    budget = shape.nodes if shape.branches > 1 and shape.nodes else None  # linear drafts: the length alone
    # per position, as Python numbers (the loop below runs per drafted token, for every candidate setting)
    ranks, alternatives = rank.tolist(), (top_p[:, 1:width] >= SIBLING_FLOOR).sum(1).tolist()
    reach = np.cumsum(top_p[:, :width], axis=1).tolist()  # reach[j][c - 1]: the first c candidates' probability
    seconds, ends = 0.0, [*answers[1:], len(rank)]
    for start, end in zip(answers, ends, strict=True):
        position, length = start, DraftLength(setting.first_tokens, setting.max_tokens)  # as the decoder does
        while position < end:
            depth = nodes = steps = accepted = 0
            on_path, leaves = True, False
            while depth < length.current and position + depth < end - 1 and (budget is None or nodes < budget):
                j = position + depth
                steps += 1  # the SLM step that proposes this position's tokens
                candidates = 1 + alternatives[j]
                if budget is not None:
                    candidates = min(candidates, budget - nodes)
                sure = reach[j][0] >= setting.confidence
                if not sure and reach[j][candidates - 1] < setting.confidence:
                    break
                depth, nodes, leaves = depth + 1, nodes + candidates, leaves or candidates > 1
                if on_path:
                    accepted += ranks[j] < candidates  # the chain's token (rank 0) or a leaf that is the LLM's
                    on_path = ranks[j] == 0
                if not sure:
                    break
            seconds += steps * costs.slm_step + (costs.tree_seconds(nodes) if leaves else costs.pass_seconds(depth))
            length.update(depth, accepted)
            position += accepted + 1  # the accepted drafts and the LLM's own token
    return seconds, len(rank)


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


def _replayed_rate(rank: np.ndarray, top_p: np.ndarray, answer_ids: np.ndarray, mask: np.ndarray,
                   setting: DraftSetting, costs: DraftCosts, shape: TreeShape = LINEAR) -> float:
    """Replayed tokens per second over the positions in ``mask`` (``answer_ids``: each
    position's answer, contiguous runs)."""
    starts = np.flatnonzero(np.diff(answer_ids[mask], prepend=-1) != 0)
    seconds, tokens = replay(rank[mask], top_p[mask], starts, setting, costs, shape)
    return tokens / seconds if seconds else 0.0


def fit_drafting(rank: np.ndarray, top_p: np.ndarray, answer_ids: np.ndarray, splits: np.ndarray,
                 costs: DraftCosts) -> DraftFit:
    """Pick the candidate setting with the most replayed tokens per second on the calibration
    split (linear drafts; ``rank`` and ``top_p`` as :func:`replay` reads them); ``answer_ids``
    numbers each position's answer (contiguous runs)."""
    def rate(split: str, setting: DraftSetting) -> float:
        return _replayed_rate(rank, top_p, answer_ids, splits == split, setting, costs)

    curve = {s.name: {"calibration": rate("calibration", s), "validation": rate("validation", s)}
             for s in CANDIDATES}  # the runtime's default among them
    best = max(CANDIDATES, key=lambda s: curve[s.name]["calibration"])
    default = runtime_default(costs.pass_rows)
    speedup = curve[best.name]["validation"] / max(curve[default.name]["validation"], 1e-12)
    return DraftFit(best, costs, curve, speedup)


def fit_per_task(rank: np.ndarray, top_p: np.ndarray, answer_ids: np.ndarray, splits: np.ndarray,
                 tasks: np.ndarray, costs: DraftCosts, min_answers: int = MIN_TASK_ANSWERS) -> dict[int, DraftFit]:
    """:func:`fit_drafting` on each task's answers alone (``tasks``: each position's task
    index), for tasks with at least ``min_answers`` answers in each split: how sure the SLM is
    differs by task (it agrees with the LLM on ~96% of JSON-intent positions and ~72% of
    dialogue), and so does the draft length that pays."""
    fits = {}
    for task in tasks_with_answers(answer_ids, splits, tasks, min_answers):
        mask = tasks == task
        fits[task] = fit_drafting(rank[mask], top_p[mask], answer_ids[mask], splits[mask], costs)
    return fits


def tasks_with_answers(answer_ids: np.ndarray, splits: np.ndarray, tasks: np.ndarray,
                       min_answers: int = MIN_TASK_ANSWERS) -> list[int]:
    """The tasks with at least ``min_answers`` answers in each of the calibration and validation
    splits, enough for a fit of their own (``answer_ids``, ``splits`` and ``tasks`` given per
    position, or per answer)."""
    return [int(task) for task in np.unique(tasks)
            if min(len(np.unique(answer_ids[(tasks == task) & (splits == split)]))
                   for split in ("calibration", "validation")) >= min_answers]


def fit_slm_tree(rank: np.ndarray, top_p: np.ndarray, answer_ids: np.ndarray, splits: np.ndarray,
                 setting: DraftSetting, costs: DraftCosts) -> TreeFit:
    """The shape of speculate/slm's draft trees (:func:`pick_shape`; :func:`replay` with a tree
    shape) for the SLM drafting with ``setting`` (the fitted confidence and longest draft)."""
    return pick_shape(lambda split, shape: _replayed_rate(rank, top_p, answer_ids, splits == split, setting, costs,
                                                          shape), costs.pass_rows)


# -- the lookup's draft trees (speculate/ngram) --------------------------------------------------
#
# Its drafts are a function of the token history (and of the answer memory), so replaying them
# over the prompt and the LLM's labelled answer gives the runtime's trees exactly (the LLM's
# tokens are full's, greedy).

def lookup_passes(prompt: list[int], answer: list[int], shape: TreeShape, pass_rows: int | None,
                  memory: np.ndarray | None = None) -> list[tuple[int, int, bool]]:
    """The LLM passes of greedy speculate/ngram over ``answer`` after ``prompt``, as the decoder
    runs them (``Decoder._verify_draft`` / ``_verify_tree``), each as (drafted tokens, accepted
    tokens, verified as a tree): the lookup drafts from the history and from ``memory`` (an answer
    memory's haystack, as the session sets it: ``NgramDrafter.memory``); a tree's accepted path is its
    longest branch prefix that matches the answer; a tree of one branch, and the first pass (it
    catches up on the prompt), are verified as the linear draft of its first branch; the draft
    length adapts as the runtime's does, from its defaults. Acceptance ends at the answer's end."""
    drafter, sequence = NgramDrafter(), [*prompt, *answer]
    drafter.memory = memory
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


class LookupMemories:
    """Each answer's lookup memory in the replay, built when asked for: the answers of a task
    share one haystack, and an answer's memory is that haystack less the answer's own span, so
    the answers hold their task's tokens once rather than once each (calibrations labelled on a
    cluster have thousands of answers per task)."""

    def __init__(self, haystacks: dict[int, np.ndarray], spans: list[tuple[int, int, int]]) -> None:
        self._haystacks, self._spans = haystacks, spans  # spans: (task, start, end) in the task's haystack

    def __len__(self) -> int:
        return len(self._spans)

    def __getitem__(self, index: int) -> np.ndarray:
        task, start, end = self._spans[index]
        haystack = self._haystacks[task]
        return np.concatenate((haystack[:start], haystack[end:]))

    def subset(self, indices: np.ndarray | list[int]) -> LookupMemories:
        """The memories of the answers at ``indices``, in their order."""
        return LookupMemories(self._haystacks, [self._spans[i] for i in indices])


def memories_without_own(answers: list[tuple[list[int], list[int]]], tasks: np.ndarray) -> LookupMemories:
    """Each answer's lookup memory in the replay: the haystack of the answer memory calibrate ships
    (``calibrate.answer_memory``: every labelled answer of the task, in order) less the answer
    itself, which is what a new prompt of the task drafts from; a memory never holds the answer
    being replayed, as the runtime runs' held-out prompts are never in it."""
    every_token = sum(len(answer) for _, answer in answers) + 1  # as calibrate's: no answer evicted
    memories: dict[int, AnswerMemory] = {}
    ends: dict[int, int] = {}
    spans = []
    for (_, answer), task in zip(answers, tasks.tolist(), strict=True):
        memory = memories.setdefault(task, AnswerMemory(max_tokens=every_token, learning=False))
        kept, start = memory.answers(str(task)), ends.get(task, 0)
        memory.remember(str(task), answer)
        # the haystack holds each answer remember() kept, followed by SEPARATOR
        ends[task] = start + (len(answer) + 1 if memory.answers(str(task)) > kept else 0)
        spans.append((task, start, ends[task]))
    return LookupMemories({task: memory.haystack(str(task)) for task, memory in memories.items()}, spans)


def replay_lookup(answers: list[tuple[list[int], list[int]]], shape: TreeShape, costs: DraftCosts,
                  memories: LookupMemories | None = None) -> tuple[float, int]:
    """(seconds, tokens) of greedy speculate/ngram over the (prompt, answer) pairs, each drafting
    from its memory in ``memories`` where given: each pass costs the measured pass over its
    drafted tokens and the token before them (``DraftCosts.tree_seconds`` for a tree: a tree
    forward reads the weights once, as a linear pass of as many rows does); the lookup itself
    costs no model step."""
    seconds = 0.0
    for index, (prompt, answer) in enumerate(answers):
        memory = memories[index] if memories is not None else None
        for drafted, _, tree in lookup_passes(prompt, answer, shape, costs.pass_rows, memory):
            seconds += costs.tree_seconds(drafted) if tree else costs.pass_seconds(drafted)
    return seconds, sum(len(answer) for _, answer in answers)


def fit_tree(answers: list[tuple[list[int], list[int]]], splits: np.ndarray, costs: DraftCosts,
             memories: LookupMemories | None = None) -> TreeFit:
    """Pick the shape (linear drafts among them, first: it wins ties) with the most replayed
    tokens per second on the calibration split; ``splits`` holds each answer's split,
    ``memories`` each answer's lookup memory (:func:`memories_without_own`; None: none)."""
    def rate(split: str, shape: TreeShape) -> float:
        chosen = np.flatnonzero(splits == split)
        seconds, tokens = replay_lookup([answers[i] for i in chosen], shape, costs,
                                        None if memories is None else memories.subset(chosen))
        return tokens / seconds if seconds else 0.0

    return pick_shape(rate, costs.pass_rows)


def fit_tree_per_task(answers: list[tuple[list[int], list[int]]], splits: np.ndarray, tasks: np.ndarray,
                      costs: DraftCosts, memories: LookupMemories | None = None,
                      min_answers: int = MIN_TASK_ANSWERS) -> dict[int, TreeFit]:
    """:func:`fit_tree` on each task's answers alone (``tasks``: each answer's task index), for
    tasks with at least ``min_answers`` answers in each split: how often an answer repeats its
    request's spans with different values (a table's rows, a list's items) differs by task."""
    fits = {}
    for task in tasks_with_answers(np.arange(len(answers)), splits, tasks, min_answers):
        chosen = np.flatnonzero(tasks == task)
        fits[task] = fit_tree([answers[i] for i in chosen], splits[chosen], costs,
                              None if memories is None else memories.subset(chosen))
    return fits
