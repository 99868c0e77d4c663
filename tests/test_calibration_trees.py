"""`edgeroute calibrate`'s draft trees: the lookup's trees (speculate/ngram) replayed over the
labelled answers exactly as the runtime drafts and verifies them, the SLM's (speculate/slm) from
the labels' ranks of the LLM's tokens among its choices, the shape fitted per task from the
replay, and the fitted shape reaching the decode options only where the caller set none."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgeroute.bundle import Bundle, Calibration
from edgeroute.calibration.calibrate import (
    LOOKUP_TREES,
    SLM_TREES,
    DraftingResult,
    LightData,
    RunConfig,
    calibrate_slm_trees,
    calibrate_trees,
    choose_profiles,
)
from edgeroute.calibration.drafting import (
    LINEAR,
    DraftCosts,
    DraftSetting,
    TreeShape,
    fit_slm_tree,
    fit_tree,
    lookup_passes,
    measure_costs,
    memories_without_own,
    replay,
    replay_lookup,
    tree_shapes,
)
from edgeroute.calibration.labels import UNRANKED
from edgeroute.calibration.prompts import TASKS
from edgeroute.runtime import Engine
from edgeroute.runtime.answer_memory import SEPARATOR, AnswerMemory
from edgeroute.runtime.calibrated import calibrated_options
from edgeroute.runtime.decoding import DecodeOptions
from edgeroute.runtime.routers import TOP_K

# a native LLM's passes of 4 rows (AVX2 tiles): rows cheap within a pass, the pass itself the cost
COSTS = DraftCosts(slm_step=0.0, llm_pass=1.0, llm_row=0.05, pass_rows=4)
SPLITS = np.array(["calibration", "validation"] * 20)


def tables(n: int, older: bool, seed: int = 0, rows: int = 4) -> list[tuple[list[int], list[int]]]:
    """(prompt, answer) pairs: a prompt holds two tables with the same keys (2 tokens) and other
    values (2 tokens); the answer writes each key after a new token, then the first table's values
    (``older``: the lookup's second continuation, its most recent match being the second table's)
    or the second's (its first continuation)."""
    rng = np.random.default_rng(seed)
    pairs = []
    for _ in range(n):
        fresh = iter(rng.permutation(np.arange(100, 5000)).tolist())
        keys, first, second = ([[next(fresh), next(fresh)] for _ in range(rows)] for _ in range(3))
        sep = next(fresh)
        prompt = [next(fresh), *[t for i in range(rows) for t in (*keys[i], *first[i], sep)], next(fresh),
                  *[t for i in range(rows) for t in (*keys[i], *second[i], sep)], next(fresh)]
        answer = [t for i in range(rows) for t in (next(fresh), *keys[i], *(first if older else second)[i])]
        pairs.append((prompt, answer))
    return pairs


def sources(passes: list[tuple[int, int, bool]], tokens: int) -> list[str]:
    """The token sources a decoder's trace shows for these passes: the accepted drafts, then the
    LLM's own token (cut where the answer ends)."""
    shown = [s for _, accepted, _ in passes for s in ["draft:ngram"] * accepted + ["llm"]]
    return shown[:tokens]


def test_the_lookup_replay_follows_the_runtimes_linear_drafts_token_for_token(tiny_engine):
    """speculate/ngram on the tiny model (ONNX Runtime: linear drafts): the replay over the prompt
    and the answer drafts, accepts and adapts its draft length as the decoder did, pass for pass."""
    checked = 0
    for text in ("one two three one two three one two", "red blue red green red blue red", "a b a b a b a b"):
        messages = [{"role": "user", "content": text}]
        generation = tiny_engine.generate(messages, mode="speculate", light="ngram", max_new_tokens=40)
        passes = lookup_passes(tiny_engine.encode_prompt(messages), generation.tokens, LINEAR,
                               tiny_engine.llm.pass_rows)
        assert sources(passes, len(generation.tokens)) == [t.source for t in generation.trace]
        assert len(passes) == generation.stats.llm_calls
        checked += sum(accepted for _, accepted, _ in passes)
    assert checked, "no lookup draft was ever accepted: the test would prove nothing"


def test_the_lookup_replay_drafts_from_the_answer_memory_as_the_runtime_does(tiny_engine):
    """With an answer memory (the engine's, as a calibrated bundle ships it), the replay given the
    memory's haystack drafts, accepts and adapts as the decoder did; the memory made a difference."""
    messages = [{"role": "user", "content": "please list the stations on the red line"}]
    prompt = tiny_engine.encode_prompt(messages)
    first = tiny_engine.generate(messages, mode="speculate", light="ngram", max_new_tokens=40)
    memory = AnswerMemory(learning=False)
    memory.remember("templated", first.tokens)
    tiny_engine.answer_memory = memory
    try:
        again = tiny_engine.generate(messages, mode="speculate", light="ngram", max_new_tokens=40, task="templated")
    finally:
        tiny_engine.answer_memory = None
    assert again.tokens == first.tokens  # greedy: the memory changes the passes, never the tokens
    passes = lookup_passes(prompt, again.tokens, LINEAR, tiny_engine.llm.pass_rows, memory.haystack("templated"))
    assert sources(passes, len(again.tokens)) == [t.source for t in again.trace]
    assert len(passes) == again.stats.llm_calls < first.stats.llm_calls


def test_each_answer_replays_with_its_tasks_other_answers_in_memory_never_its_own():
    answers = [([1], [10, 11, 12]), ([2], [20, 21]), ([3], [30]), ([4], [40, 41]), ([5], [50, 51])]
    tasks = np.array([0, 0, 0, 1, 2])
    memories = memories_without_own(answers, tasks)
    assert memories[0].tolist() == [20, 21, SEPARATOR]  # one token is no answer to continue (remember() drops it)
    assert memories[1].tolist() == [10, 11, 12, SEPARATOR]
    assert memories[2].tolist() == [10, 11, 12, SEPARATOR, 20, 21, SEPARATOR]
    assert memories[3].size == 0 and memories[4].size == 0  # no other answer of the task
    # answers that share a span their prompts lack: the memory drafts it, the prompt alone cannot
    span = list(range(600, 620))
    shared = [([7000 + i], [8000 + i, *span, 9000 + i]) for i in range(6)]
    memories = memories_without_own(shared, np.zeros(len(shared), int))
    with_memory, tokens = replay_lookup(shared, LINEAR, COSTS, memories)
    assert with_memory < replay_lookup(shared, LINEAR, COSTS)[0] and tokens == sum(len(a) for _, a in shared)


def test_each_answers_memory_is_what_an_answer_memory_of_its_tasks_other_answers_holds():
    rng = np.random.default_rng(7)
    answers = [([1], rng.integers(0, 50, rng.integers(1, 9)).tolist()) for _ in range(40)]
    tasks = rng.integers(0, 3, len(answers))
    memories = memories_without_own(answers, tasks)
    for index, task in enumerate(tasks.tolist()):
        others = AnswerMemory(learning=False)
        for other, ((_, answer), its_task) in enumerate(zip(answers, tasks.tolist(), strict=True)):
            if other != index and its_task == task:
                others.remember(str(task), answer)
        assert memories[index].tolist() == others.haystack(str(task)).tolist()
    chosen = np.flatnonzero(tasks == 1)[::-1]
    assert [m.tolist() for m in (memories.subset(chosen)[i] for i in range(len(chosen)))] == \
        [memories[i].tolist() for i in chosen]


def test_a_tree_replays_as_linear_drafts_where_the_lookups_matches_never_disagree():
    """Each key occurs once: every tree has one branch, verified as the linear draft it is."""
    once = [(prompt[:len(prompt) // 2], answer) for prompt, answer in tables(10, older=True)]
    for prompt, answer in once:
        linear = lookup_passes(prompt, answer, LINEAR, COSTS.pass_rows)
        assert any(accepted for _, accepted, _ in linear)
        for shape in tree_shapes(COSTS.pass_rows)[1:]:
            if shape.nodes >= 3:  # the longest linear draft of 4-row passes
                assert lookup_passes(prompt, answer, shape, COSTS.pass_rows) == linear
    assert replay_lookup(once, TreeShape(3, 7), COSTS) == replay_lookup(once, LINEAR, COSTS)
    seconds, tokens = replay_lookup(once[:1], LINEAR, COSTS)
    assert tokens == len(once[0][1])
    assert seconds == pytest.approx(sum(COSTS.pass_seconds(d) for d, _, _ in lookup_passes(*once[0], LINEAR, 4)))


def test_a_tree_accepts_the_lookups_older_continuation_where_the_llm_takes_it():
    prompt, answer = tables(1, older=True)[0]
    linear = lookup_passes(prompt, answer, LINEAR, COSTS.pass_rows)
    tree = lookup_passes(prompt, answer, TreeShape(2, 7), COSTS.pass_rows)
    # after the first key's first token: the linear draft (its second token, the second table's
    # value) keeps 1 token, the tree (the second token, then both tables' values: 5 tokens) 3
    assert linear[2] == (3, 1, False) and tree[2] == (5, 3, True)
    assert len(tree) < len(linear)
    # a measured tree forward replaces the linear pass of as many rows
    measured = DraftCosts(0.0, 1.0, 0.05, pass_rows=4, trees=(1.0,) * 5 + (3.0,))  # a 5-token tree: 3.0
    assert replay_lookup([(prompt, answer)], TreeShape(2, 7), measured)[0] > \
        replay_lookup([(prompt, answer)], TreeShape(2, 7), COSTS)[0]


def test_the_fit_picks_a_tree_where_the_llm_takes_the_lookups_second_continuation():
    answers = tables(40, older=True)
    fit = fit_tree(answers, SPLITS, COSTS)
    assert fit.shape.branches > 1 and fit.speedup_vs_linear > 1.2
    assert fit.curve[fit.shape.name]["calibration"] == max(v["calibration"] for v in fit.curve.values())
    tasks = np.full(len(answers), TASKS.index("templated"))
    result = calibrate_trees(answers, SPLITS, tasks, COSTS, runs_trees=True)
    assert result.fit is not None and result.shape == fit.shape and "draft trees of up to" in result.why
    config = result.run_config()
    assert config.name == LOOKUP_TREES and config.options_for("templated") == {
        "mode": "speculate", "light": "ngram", **fit.shape.options()}
    assert config.options_for("json")["draft_branches"] == 1  # a grammar keeps drafts linear: its profile says so
    # a backend that verifies no trees (ONNX Runtime) gets none, whatever the replay says
    none = calibrate_trees(answers, SPLITS, tasks, COSTS, runs_trees=False)
    assert none.fit is None and none.run_config() is None and "verifies no draft trees" in none.why


def test_the_fit_keeps_linear_drafts_where_trees_only_cost_rows():
    """The LLM takes the lookup's most recent continuation: the linear draft. A tree's other
    branches cost verification rows and are never accepted."""
    answers = tables(40, older=False)
    fit = fit_tree(answers, SPLITS, COSTS)
    assert fit.shape == LINEAR and fit.speedup_vs_linear == 1.0
    assert fit.curve["2x7"]["calibration"] < fit.curve["linear"]["calibration"]
    result = calibrate_trees(answers, SPLITS, np.full(len(answers), TASKS.index("templated")), COSTS, True)
    assert result.fit is None and result.run_config() is None and "drafts stay linear" in result.why


def test_each_task_gets_the_tree_shape_its_own_answers_favour():
    answers = tables(40, older=True) + tables(40, older=False, seed=1)
    tasks = np.repeat([TASKS.index("templated"), TASKS.index("grounded")], 40)
    result = calibrate_trees(answers, np.tile(SPLITS, 2), tasks, COSTS, runs_trees=True)
    config = result.run_config()
    shapes = {task: config.options_for(task)["draft_branches"] for task in ("templated", "grounded")}
    assert shapes["templated"] > 1 and shapes["grounded"] == 1
    assert set(result.figures["per_task"]) == {"templated", "grounded"}


# -- the SLM's trees -----------------------------------------------------------------------------

SURE, UNSURE = [0.9, 0.05, 0.05], [0.5, 0.4, 0.1]  # the SLM's top-3 probabilities at a position


def test_an_slm_tree_keeps_the_llms_second_choice_where_a_linear_draft_loses_the_pass():
    """One answer of 4 tokens; at position 1 the SLM is unsure and the LLM takes its second choice.
    A 2x3 tree: its chain's token at 0, then both choices at 1 as leaves (3 tokens: the budget):
    2 accepted in one tree forward. A linear draft of 3 keeps 1, and shrinks."""
    rank, top_p = np.array([0, 1, 0, 0]), np.array([SURE, UNSURE, SURE, SURE])
    costs = DraftCosts(slm_step=1.0, llm_pass=10.0, llm_row=1.0, pass_rows=4)
    setting, starts = DraftSetting(0.0, 3), np.array([0])
    # tree: 2 SLM steps + a 3-token tree forward; then the answer's last token, a plain step
    assert replay(rank, top_p, starts, setting, costs, TreeShape(2, 3)) == ((2 + 13) + 10, 4)
    # linear: 3 steps + a 3-token pass keeping 1; then a 1-token draft (the answer's end) kept
    assert replay(rank, top_p, starts, setting, costs) == ((3 + 13) + (1 + 11), 4)
    # an alternative below SIBLING_FLOOR is no leaf: the tree is the linear draft, and costs as one
    rare = np.array([SURE, [0.5, 0.05, 0.05], SURE, SURE])
    assert replay(rank, rare, starts, setting, costs, TreeShape(2, 3)) == replay(rank, rare, starts, setting, costs)
    # a leaf that is not the LLM's token is a rejected row
    assert replay(np.array([0, 2, 0, 0]), top_p, starts, setting, costs, TreeShape(2, 3)) == ((2 + 13) + (1 + 11), 4)


def slm_data(rank: np.ndarray, top_p: np.ndarray, answer_ids: np.ndarray, splits: np.ndarray,
             tasks: np.ndarray) -> LightData:
    n = len(rank)
    features = np.zeros((n, 2 + TOP_K + 3), np.float32)  # a 2-wide hidden state, then the top-k log p
    features[:, 2:2 + top_p.shape[1]] = np.log(top_p)
    zeros = np.zeros(n, bool)
    return LightData(rank > 0, rank > 0, ~zeros, zeros, answer_ids, splits, tasks, features, rank, {})


def second_choices(seed: int, right: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """80 answers of 30 positions: the SLM unsure on 30% of them, where the LLM takes its second
    choice with probability ``right`` (else its first); sure and right elsewhere."""
    rng = np.random.default_rng(seed)
    answer_ids = np.repeat(np.arange(80), 30)
    unsure = rng.uniform(size=answer_ids.size) < 0.3
    top_p = np.where(unsure[:, None], UNSURE, SURE)
    rank = np.where(unsure & (rng.uniform(size=answer_ids.size) < right), 1, 0)
    return rank, top_p, answer_ids, np.where(answer_ids % 2, "validation", "calibration")


def test_the_slm_tree_fit_branches_where_the_llm_takes_its_second_choice_and_stays_linear_where_it_never_does():
    costs = DraftCosts(slm_step=0.1, llm_pass=1.0, llm_row=0.05, pass_rows=4)
    rank, top_p, answer_ids, splits = second_choices(0, right=0.6)
    fit = fit_slm_tree(rank, top_p, answer_ids, splits, DraftSetting(0.0, 3), costs)
    assert fit.shape.branches > 1 and fit.speedup_vs_linear > 1.05
    never = np.where(rank == 1, UNRANKED, rank)  # the LLM's token is neither choice: leaves only cost rows
    assert fit_slm_tree(never, top_p, answer_ids, splits, DraftSetting(0.0, 3), costs).shape == LINEAR


def test_calibrate_keeps_slm_trees_per_task_with_the_fitted_draft_settings():
    costs = DraftCosts(slm_step=0.1, llm_pass=1.0, llm_row=0.05, pass_rows=4)
    rank, top_p, answer_ids, splits = second_choices(1, right=0.6)
    tasks = np.full(rank.size, TASKS.index("dialogue"))
    drafts = DraftingResult(None, "", {}, {}, DraftSetting(0.0, 3), costs)
    result = calibrate_slm_trees(slm_data(rank, top_p, answer_ids, splits, tasks), drafts, runs_trees=True)
    assert result.fit is not None and result.shape.branches > 1 and "speculate/slm: draft trees" in result.why
    config = result.run_config()
    assert config.name == SLM_TREES
    assert config.options_for("dialogue") == {"mode": "speculate", "light": "slm", **result.shape.options()}
    assert config.options_for("json")["draft_branches"] == 1  # a grammar keeps drafts linear
    none = calibrate_slm_trees(slm_data(rank, top_p, answer_ids, splits, tasks), drafts, runs_trees=False)
    assert none.fit is None and none.run_config() is None and "verifies no draft trees" in none.why


def slm_trees_confirmed(tmp_path: Path, fit, decoding: dict, tree_seconds: float = 0.7) -> tuple[dict, list[str]]:
    """``decoding`` and the messages after the runtime runs' confirmation of the SLM's trees, where
    speculate/slm took 0.8 s for a dialogue prompt and its trees ``tree_seconds``."""
    from edgeroute.calibration.calibrate import CalibrateOptions, CalibrationRun

    costs = DraftCosts(slm_step=0.1, llm_pass=1.0, llm_row=0.05, pass_rows=4)
    rank, top_p, answer_ids, splits = second_choices(1, right=0.6)
    data = slm_data(rank, top_p, answer_ids, splits, np.full(rank.size, TASKS.index("dialogue")))
    row = {"task": "dialogue", "tokens": 30, "llm_tokens": 10, "pass": True, "same_as_full": True}
    runs = {"full": [{**row, "seconds": 1.0}], "speculate/slm": [{**row, "seconds": 0.8}],
            SLM_TREES: [{**row, "seconds": tree_seconds}]}
    drafting = DraftingResult(fit, "", {}, {}, DraftSetting(0.0, 3), costs)
    run = CalibrationRun(None, None, CalibrateOptions(), [], tmp_path, None, None, runs=runs, decoding=decoding,
                         drafting=drafting, slm_trees=calibrate_slm_trees(data, drafting, runs_trees=True))
    run._confirm_trees()
    return run.decoding, run.messages


def test_slm_trees_become_speculates_default_only_with_the_draft_setting_they_were_fitted_with(tmp_path):
    """The trees won their runtime runs; they reach ``decoding`` where explicit speculate/slm
    drafts as they were replayed: the runtime's defaults, or a fitted setting the runs kept."""
    from edgeroute.calibration.calibrate import DraftFit

    decoding, _ = slm_trees_confirmed(tmp_path, None, {})
    assert decoding["slm_tree"]["draft_branches"] > 1  # the defaults: replayed and run alike
    fitted = DraftFit(DraftSetting(0.5, 2), DraftCosts(0.1, 1.0, 0.05, 4), {}, 1.1)
    assert "slm_tree" in slm_trees_confirmed(tmp_path, fitted, dict(fitted.setting.options()))[0]
    # the runs did not keep the setting the trees were fitted with
    assert "slm_tree" not in slm_trees_confirmed(tmp_path, fitted, {})[0]


def test_trees_whose_runtime_win_is_within_the_timing_noise_stay_linear(tmp_path):
    decoding, messages = slm_trees_confirmed(tmp_path, None, {}, tree_seconds=0.78)  # 1.03x linear drafts
    assert "slm_tree" not in decoding
    assert any("did not speed up speculate/slm by 1.05x in the runtime runs" in m for m in messages)
    assert "slm_tree" in slm_trees_confirmed(tmp_path, None, {}, tree_seconds=0.76)[0]  # 1.05x


def calibration(decoding: dict, profiles: dict | None = None, figures: dict | None = None) -> Calibration:
    return Calibration("2026-01-01T00:00:00Z", "test", "0" * 64, {"tf_agreement": 0.9, "bound": "crc"}, {},
                       profiles or {}, figures or {}, decoding=decoding)


def test_the_fitted_tree_shape_reaches_decode_options_only_where_the_caller_set_none():
    fitted = calibration({"lookup_tree": {"draft_branches": 3, "draft_tree_nodes": 7}})

    def resolved(**options) -> tuple[int, int | None]:
        chosen = calibrated_options(DecodeOptions(**options), fitted, lambda entry: None)
        return chosen.draft_branches, chosen.draft_tree_nodes

    assert resolved(mode="speculate", light="ngram") == (3, 7)
    assert resolved(mode="speculate", light="ngram", draft_branches=2) == (2, None)
    assert resolved(mode="speculate", light="ngram", draft_tree_nodes=4) == (1, 4)
    assert resolved(mode="speculate", light="slm") == (1, None)  # the lookup's shape is the lookup's
    slm = calibration({"slm_tree": {"draft_branches": 2, "draft_tree_nodes": 3}})
    for light, shape in (("slm", (2, 3)), ("ngram", (1, None)), ("ngram+slm", (1, None))):
        chosen = calibrated_options(DecodeOptions(mode="speculate", light=light), slm, lambda entry: None)
        assert (chosen.draft_branches, chosen.draft_tree_nodes) == shape, light
    assert resolved(mode="route", light="ngram") == (1, None)
    # auto: the task profile's shape, chosen from the runtime runs (choose_profiles keeps it)
    tree = RunConfig(LOOKUP_TREES, {"mode": "speculate", "light": "ngram", "draft_branches": 2, "draft_tree_nodes": 5})
    runs = {name: [{"task": "templated", "tokens": 33, "seconds": seconds, "llm_tokens": 5, "pass": True,
                    "same_as_full": True}] for name, seconds in (("full", 1.0), (LOOKUP_TREES, 0.5))}
    profiles = choose_profiles(runs, [RunConfig("full", {"mode": "full"}), tree])
    assert (profiles["templated"]["draft_branches"], profiles["templated"]["draft_tree_nodes"]) == (2, 5)
    fitted = calibration({}, profiles)
    assert resolved(mode="auto", task="templated") == (2, 5)
    assert resolved(mode="auto", task="templated", draft_branches=3) == (3, None)


@pytest.mark.slow
def test_replayed_lookup_trees_accept_what_the_runtimes_trees_accepted(smollm2_bundles):
    """On the demo bundle's native LLM (tree forwards): the replay's passes over the runtime's own
    answer are the runtime's, trees and the branches they accepted included."""
    from tests.test_tree_forward import TABLE, unavailable

    if unavailable("auto"):
        pytest.skip(f"native kernels unavailable: {unavailable('auto')}")
    engine = Engine(Bundle.open(smollm2_bundles["int4"][0]), backend="native")
    messages = [{"role": "user", "content": TABLE}]
    trees = 0
    for shape in (TreeShape(2, 5), TreeShape(3, 7)):
        generation = engine.generate(messages, mode="speculate", light="ngram", max_new_tokens=60,
                                     **shape.options())
        passes = lookup_passes(engine.encode_prompt(messages), generation.tokens, shape, engine.llm.pass_rows)
        assert sources(passes, len(generation.tokens)) == [t.source for t in generation.trace], shape
        assert len(passes) == generation.stats.llm_calls
        trees += sum(tree for _, _, tree in passes)
    assert trees, "no tree was ever verified: the test would prove nothing"


def test_the_report_shows_the_replayed_shapes_and_what_was_written():
    from edgeroute.calibration.report import _tree_section

    result = calibrate_trees(tables(40, older=True), SPLITS, np.full(40, TASKS.index("templated")), COSTS, True)
    shown = "\n".join(_tree_section(calibration({"lookup_tree": result.shape.options()},
                                                 figures={"trees": result.figures})))
    assert "## Draft trees of the prompt lookup" in shown and "| 2x7 |" in shown and "| linear |" in shown
    assert f"decoding.lookup_tree {result.shape.options()}" in shown
    assert _tree_section(calibration({})) == []  # no tree fit (an older calibration, no trees run): no section
    costs = DraftCosts(slm_step=0.1, llm_pass=1.0, llm_row=0.05, pass_rows=4)
    rank, top_p, answer_ids, splits = second_choices(1, right=0.6)
    slm = calibrate_slm_trees(slm_data(rank, top_p, answer_ids, splits, np.full(rank.size, TASKS.index("dialogue"))),
                              DraftingResult(None, "", {}, {}, DraftSetting(0.0, 3), costs), runs_trees=True)
    shown = "\n".join(_tree_section(calibration({"slm_tree": slm.shape.options()}, figures={"slm_trees": slm.figures})))
    assert "## Draft trees of the SLM (speculate/slm)" in shown and "Draft trees of the prompt lookup" not in shown
    assert f"decoding.slm_tree {slm.shape.options()}" in shown and "| dialogue |" in shown


@pytest.mark.slow
def test_tree_forwards_are_measured_beside_linear_passes_where_the_backend_runs_them(smollm2_bundles, tiny_engine):
    from tests.test_tree_forward import unavailable

    assert measure_costs(tiny_engine, repeats=1, longest=2).trees == ()  # ONNX Runtime verifies no trees
    if unavailable("auto"):
        pytest.skip(f"native kernels unavailable: {unavailable('auto')}")
    engine = Engine(Bundle.open(smollm2_bundles["int4"][0]), backend="native")
    costs = measure_costs(engine, repeats=1, longest=3)
    assert len(costs.trees) == 4 and costs.trees[0] == costs.passes[0] and min(costs.trees) > 0
    assert costs.tree_seconds(2) == costs.trees[2] and costs.tree_seconds(5) == costs.pass_seconds(5)
