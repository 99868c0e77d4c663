"""`edgeroute calibrate`'s draft trees for speculate/ngram: the lookup's trees replayed over the
labelled answers exactly as the runtime drafts and verifies them, the shape fitted per task from
the replay, and the fitted shape reaching the decode options only where the caller set none."""

from __future__ import annotations

import numpy as np
import pytest

from edgeroute.bundle import Bundle, Calibration
from edgeroute.calibration.calibrate import LOOKUP_TREES, RunConfig, calibrate_trees, choose_profiles
from edgeroute.calibration.drafting import (
    LINEAR,
    DraftCosts,
    TreeShape,
    fit_tree,
    lookup_passes,
    measure_costs,
    replay_lookup,
    tree_shapes,
)
from edgeroute.calibration.prompts import TASKS
from edgeroute.runtime import Engine
from edgeroute.runtime.calibrated import calibrated_options
from edgeroute.runtime.decoding import DecodeOptions

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
    assert resolved(mode="speculate", light="slm") == (1, None)  # the fit replayed the lookup's trees only
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
