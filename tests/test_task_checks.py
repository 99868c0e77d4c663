"""Task checks that can fail, bounds that hold, and a choice of mode that never trades quality it
cannot measure: the built-in held-out checks against right and wrong answers, the exact
binomial bounds, and the profile choice on synthetic runtime runs."""

from __future__ import annotations

import math
import shutil
import warnings
from collections import Counter

import pytest

from edgeroute.calibration.calibrate import choose_profiles
from edgeroute.calibration.checks import task_verdict
from edgeroute.calibration.prompts import (
    HELD_OUT_PER_TASK,
    HELD_OUT_VALUES,
    TASKS,
    builtin_prompts,
    held_out_prompts,
    numbers_in,
)
from edgeroute.quality.bounds import compare_paired, interval, lower_bound, upper_bound
from edgeroute.quality.runs import RunConfig, eligibility, summarize

HELD_OUT = {p.id: p for p in held_out_prompts()}


def verdicts(prompt_id: str, answers: dict[str, str]) -> dict[str, bool | None]:
    return {name: task_verdict(HELD_OUT[prompt_id], answer).passed for name, answer in answers.items()}


def wrong_answers(right: str, changed: str, prompt_id: str) -> dict[str, str]:
    """The wrong answers every check must refuse: empty, gibberish, a changed slot value, the
    right answer cut in half, and the right answer followed by the prompt's instructions."""
    return {"empty": "", "gibberish": "zq xv blorp wub", "changed": changed, "truncated": right[:len(right) // 2],
            "echo": f"{right} {HELD_OUT[prompt_id].instructions}"}


CASES = {
    "heldout-voice-000": ("Navigating to the closest gas station in Nantes, avoiding tolls.",
                          "Navigating to the closest gas station in Verona, avoiding tolls."),
    "heldout-voice-001": ("Setting the temperature to 14 degrees and turning on the seat heating.",
                          "Setting the temperature to 15 degrees and turning on the seat heating."),
    "heldout-voice-002": ("Playing blues and lowering the volume a little.",
                          "Playing opera and lowering the volume a little."),
    "heldout-voice-003": ("Calling Felix to tell them you arrive at 9:55.",
                          "Calling Felix to tell them you arrive at 9:15."),
    "heldout-templated-000": ("Head to Maple Drive, Nantes: you arrive at 6:20 after 4.6 km with 9% battery left.",
                              "Head to Maple Drive, Nantes: you arrive at 6:20 after 4.6 km with 19% battery left."),
    "heldout-json-000": ('{"intent": "navigate", "street": "Maple Drive", "city": "Nantes"}',
                         '{"intent": "navigate", "street": "Maple Drive", "city": "Verona"}'),
    "heldout-json-002": ('{"intent": "call", "contact": "Olga"}', '{"intent": "call", "contact": "Hugo"}'),
    "heldout-grounded-000": ("The Cliffs of Moher are 214 meters high.", "The Cliffs of Moher are 241 meters high."),
    "heldout-grounded-005": ("It is in Ireland.", "It is in Northern Ireland."),
    "heldout-grounded-010": ("Each year the Cliffs of Moher draw about 1.5 million visitors.",
                             "Each year the Cliffs of Moher draw about 2.5 million visitors."),
    "heldout-grounded-015": ("Each spring visitors come to the Cliffs of Moher, 214 meters high, in Ireland.",
                             "Each spring visitors come to the Cliffs of Moher, 214 meters high, in Iceland."),
    "heldout-code-000": ("```python\ndef larger(a, b):\n    return a if a > b else b\n```",
                         "```python\ndef larger(a, b):\n    return a if a < b else b\n```"),
}


@pytest.mark.parametrize("prompt_id", sorted(CASES))
def test_each_held_out_check_passes_the_right_answer_and_fails_every_wrong_one(prompt_id):
    right, changed = CASES[prompt_id]
    results = verdicts(prompt_id, {"right": right, **wrong_answers(right, changed, prompt_id)})
    assert results == {"right": True, "empty": False, "gibberish": False, "changed": False, "truncated": False,
                       "echo": False}


def test_a_json_answer_may_keep_the_models_own_layout_but_not_other_values():
    prompt = next(p for p in HELD_OUT.values() if p.task == "json" and "climate" in p.content)
    degrees = prompt.content.split("cabin to ")[1].split()[0]
    fenced = f'```json\n{{\n  "intent": "climate",\n  "temperature": {degrees}\n}}\n```'
    assert task_verdict(prompt, fenced).passed  # pretty-printed, in a fence, a number: the same values
    assert task_verdict(prompt, f'{{"intent": "climate", "temperature": "{degrees}"}}').passed
    assert not task_verdict(prompt, f'{{"intent": ["climate"], "temperature": {degrees}}}').passed
    assert not task_verdict(prompt, f'{{"intent": null, "temperature": {degrees}}}').passed


def test_a_voice_confirmation_may_say_a_time_the_12_hour_way_but_not_the_opposite_action():
    call = next(p for p in HELD_OUT.values() if p.task == "voice-command" and "arrive at 13:45" in p.content)
    name = call.content.split()[1]
    assert task_verdict(call, f"Calling {name} to say you arrive at 1:45 PM.").passed
    assert task_verdict(call, f"Calling {name} to say you arrive at 13:45.").passed
    assert not task_verdict(call, f"Calling {name} to say you arrive at 1:45.").passed  # am or pm: not said
    early = next(p for p in HELD_OUT.values() if p.task == "voice-command" and "arrive at 9:55" in p.content)
    assert task_verdict(early, f"Calling {early.content.split()[1]}: you arrive at 09:55.").passed
    heating = HELD_OUT["heldout-voice-001"]
    assert not task_verdict(heating, "Setting 14 degrees and turning off the seat heating.").passed
    volume = HELD_OUT["heldout-voice-002"]
    assert not task_verdict(volume, "Playing blues and raising the volume a little.").passed


def test_a_json_intent_with_a_key_it_was_not_asked_for_fails():
    climate = next(p for p in HELD_OUT.values() if p.task == "json" and "climate" in p.content)
    degrees = climate.content.split("cabin to ")[1].split()[0]
    assert not task_verdict(climate, f'{{"intent": "climate", "temperature": {degrees}, "unit": "F"}}').passed


def test_a_voice_confirmation_with_an_invented_number_fails():
    right = CASES["heldout-voice-000"][0]
    assert task_verdict(HELD_OUT["heldout-voice-000"], right).passed
    assert not task_verdict(HELD_OUT["heldout-voice-000"], right + " You will be there in 12 minutes.").passed


def test_code_is_run_against_unit_tests_not_searched_for_its_name():
    prompt = HELD_OUT["heldout-code-000"]
    named_only = "```python\ndef larger(a, b):\n    pass\n```"
    assert not task_verdict(prompt, named_only).passed
    assert not task_verdict(prompt, "```python\nwhile True:\n    pass\n```").passed  # killed at the time limit


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed: JavaScript checks are unjudged")
def test_javascript_code_prompts_run_their_unit_tests_in_node():
    prompt = next(p for p in HELD_OUT.values() if p.task == "code" and "JavaScript function named larger" in p.content)
    assert task_verdict(prompt, "```javascript\nfunction larger(a, b) { return Math.max(a, b); }\n```").passed
    assert task_verdict(prompt, "const larger = (a, b) => (a > b ? a : b);").passed
    assert not task_verdict(prompt, "```javascript\nfunction larger(a, b) { return a; }\n```").passed
    assert not task_verdict(prompt, "").passed


def test_open_dialogue_has_no_check_and_says_so():
    prompt = next(p for p in HELD_OUT.values() if p.task == "dialogue")
    verdict = task_verdict(prompt, "Take a break every two hours.")
    assert verdict.passed is None and "no automatic check" in verdict.reason


def test_asking_for_more_held_out_prompts_than_a_task_has_says_how_many_it_has():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the default count is there for every task
        assert len(held_out_prompts(HELD_OUT_PER_TASK)) == HELD_OUT_PER_TASK * len(TASKS)
    with pytest.warns(UserWarning, match=r"fewer distinct prompts than the 150 per task asked for \(voice-command "
                                         r"106, json 124, grounded 80, dialogue 72, code 66\)"):
        prompts = held_out_prompts(150)
    assert Counter(p.task for p in prompts) == {"voice-command": 106, "templated": 150, "json": 124, "grounded": 80,
                                                "dialogue": 72, "code": 66}


def test_the_held_out_set_is_large_and_shares_no_slot_value_with_calibration_prompts():
    by_task = {task: [p for p in HELD_OUT.values() if p.task == task] for task in TASKS}
    assert all(len(prompts) == HELD_OUT_PER_TASK for prompts in by_task.values())
    assert len({p.content for p in HELD_OUT.values()}) == len(HELD_OUT)
    calibration = " ".join(p.content for p in builtin_prompts())
    values = [*HELD_OUT_VALUES.cities, *HELD_OUT_VALUES.streets, *HELD_OUT_VALUES.names,
              *(key for _, key in HELD_OUT_VALUES.places), *(name for _, name, _ in HELD_OUT_VALUES.functions),
              *(fact[0] for fact in HELD_OUT_VALUES.facts), *HELD_OUT_VALUES.times]
    assert [v for v in values if v in calibration] == []
    calibration_numbers = {n for p in builtin_prompts() for n in numbers_in(p.content)}
    assert {n for p in HELD_OUT.values() for n in numbers_in(p.content)} & calibration_numbers == set()
    kinds = Counter(p.content.split()[0] for p in by_task["voice-command"])
    assert min(kinds.values()) >= 8, kinds  # every kind of command, not only the easy ones
    assert all(p.assertions for task in TASKS if task != "dialogue" for p in by_task[task])


# -- bounds ----------------------------------------------------------------------------------------


def test_clopper_pearson_bounds_match_their_closed_forms():
    for n in (6, 60, 200):
        assert upper_bound(0, n, 0.95) == pytest.approx(1 - 0.05 ** (1 / n), abs=1e-9)
        assert lower_bound(n, n, 0.95) == pytest.approx(0.05 ** (1 / n), abs=1e-9)
    assert upper_bound(0, 6) > 0.39 and upper_bound(0, 60) < 0.05
    low, high = interval(5, 10, 0.95)
    assert low == pytest.approx(0.1871, abs=1e-3) and high == pytest.approx(0.8129, abs=1e-3)
    assert interval(0, 0) == (0.0, 1.0)


def test_the_binomial_bound_covers_the_true_rate_at_its_confidence():
    """Coverage of the one-sided bound, computed exactly over every outcome for a few rates."""
    n = 40
    for rate in (0.02, 0.1, 0.3):
        covered = sum(math.comb(n, k) * rate ** k * (1 - rate) ** (n - k) for k in range(n + 1)
                      if upper_bound(k, n, 0.9) >= rate)
        assert covered >= 0.9


def test_paired_comparison_counts_losses_and_gains_against_full():
    comparison = compare_paired([True, False, True, True], [True, True, False, True])
    assert (comparison.n, comparison.lost, comparison.gained, comparison.passed, comparison.full_passed) == \
        (4, 1, 1, 3, 3)
    assert comparison.difference_lower_bound == -comparison.loss_bound < -0.5  # 1 loss in 4: nothing is bounded
    with pytest.raises(ValueError, match="same prompts"):
        compare_paired([True], [True, False])


# -- choosing a mode -------------------------------------------------------------------------------


def _rows(task: str, n: int, seconds: float, passes, same=True) -> list[dict]:
    return [{"case": f"{task}-{i}", "task": task, "tokens": 33, "seconds": seconds, "llm_tokens": 8,
             "pass": passes(i) if callable(passes) else passes, "reason": "",
             "same_as_full": same(i) if callable(same) else same} for i in range(n)]


CONFIGS = [RunConfig("full", {"mode": "full"}), RunConfig("speculate/slm", {"mode": "speculate", "light": "slm"}),
           RunConfig("route/slm", {"mode": "route", "light": "slm"})]


def test_a_faster_lossy_mode_that_loses_answers_is_not_chosen():
    runs = {"full": _rows("voice-command", 60, 1.0, True),
            "speculate/slm": _rows("voice-command", 60, 0.7, True),
            "route/slm": _rows("voice-command", 60, 0.5, lambda i: i % 15 != 0, same=False)}  # 4 losses
    profile = choose_profiles(runs, CONFIGS)["voice-command"]
    assert profile["config"] == "speculate/slm"
    assert not profile["eligible"]["route/slm"]["eligible"] and "lost 4 of 60" in profile["eligible"]["route/slm"]["why"]
    assert profile["quality"]["judged"] == 60 and profile["quality"]["task_pass"] == 1.0


def test_a_lossy_mode_is_chosen_only_on_enough_held_out_prompts_without_a_loss():
    for n, chosen in ((60, "route/slm"), (6, "speculate/slm")):
        runs = {"full": _rows("templated", n, 1.0, True), "speculate/slm": _rows("templated", n, 0.7, True),
                "route/slm": _rows("templated", n, 0.5, True, same=False)}
        profile = choose_profiles(runs, CONFIGS)["templated"]
        assert profile["config"] == chosen, n
        assert profile["quality"]["loss_bound"] == pytest.approx(upper_bound(0, n), abs=1e-9)
        assert profile["quality"]["why"].startswith("lossless" if chosen == "speculate/slm" else "lost 0 of 60")


def test_a_task_without_a_check_gets_a_lossy_mode_only_where_its_text_rarely_differs():
    runs = {"full": _rows("dialogue", 60, 1.0, None), "speculate/slm": _rows("dialogue", 60, 0.8, None),
            "route/slm": _rows("dialogue", 60, 0.4, None, same=lambda i: i % 10 != 0)}  # 6 of 60 differ
    profiles = choose_profiles(runs, CONFIGS)
    assert profiles["dialogue"]["config"] == "speculate/slm"
    assert "no check" in profiles["dialogue"]["eligible"]["route/slm"]["why"]
    runs["speculate/slm"] = _rows("dialogue", 60, 0.8, None, same=lambda i: i != 3)  # one answer differs
    assert choose_profiles(runs, CONFIGS)["dialogue"]["config"] == "full"
    runs["route/slm"] = _rows("dialogue", 60, 0.4, None)  # the same text on all 60: differences bounded at 4.9%
    assert choose_profiles(runs, CONFIGS)["dialogue"]["config"] == "route/slm"


def test_picking_among_several_lossy_candidates_tightens_each_bound():
    configs = [*CONFIGS, RunConfig("route/ngram", {"mode": "route", "light": "ngram"})]
    runs = {"full": _rows("templated", 60, 1.0, True), "speculate/slm": _rows("templated", 60, 0.7, True),
            "route/slm": _rows("templated", 60, 0.5, True, same=False),
            "route/ngram": _rows("templated", 60, 0.6, True, same=False)}
    profile = choose_profiles(runs, configs)["templated"]
    assert profile["quality"]["candidates"] == 2 and profile["quality"]["confidence_each"] == pytest.approx(0.975)
    assert profile["config"] == "speculate/slm"  # 0 losses in 60 bound the loss at 6.0% at 97.5%: not enough
    more = {name: rows * 2 for name, rows in runs.items()}  # 120 prompts without a loss: 3.0%
    assert choose_profiles(more, configs)["templated"]["config"] == "route/slm"


def test_a_lossy_mode_slower_than_the_best_lossless_one_is_no_candidate_and_costs_no_confidence():
    configs = [*CONFIGS, RunConfig("route/ngram", {"mode": "route", "light": "ngram"})]
    runs = {"full": _rows("templated", 60, 1.0, True), "speculate/slm": _rows("templated", 60, 0.7, True),
            "route/slm": _rows("templated", 60, 0.5, True, same=False),
            "route/ngram": _rows("templated", 60, 0.8, True, same=False)}  # 1.25x: slower than speculation
    profile = choose_profiles(runs, configs)["templated"]
    assert profile["quality"]["candidates"] == 1 and profile["quality"]["confidence_each"] == pytest.approx(0.95)
    assert profile["config"] == "route/slm"
    assert "not a candidate" in profile["eligible"]["route/ngram"]["why"]
    runs["route/slm"] = _rows("templated", 60, 0.75, True, same=False)  # now slower than speculation too
    profile = choose_profiles(runs, configs)["templated"]
    assert profile["config"] == "speculate/slm" and profile["quality"]["candidates"] == 0


def test_the_default_profile_pools_tasks_and_an_unjudged_task_keeps_lossy_modes_out():
    runs = {name: _rows("json", 60, seconds, True, same=name != "route/slm") + _rows("dialogue", 60, seconds, None,
                                                                                    same=name != "route/slm")
            for name, seconds in (("full", 1.0), ("speculate/slm", 0.9), ("route/slm", 0.5))}
    profiles = choose_profiles(runs, CONFIGS)
    assert profiles["json"]["config"] == "route/slm"
    assert profiles["default"]["config"] == "speculate/slm"


def test_summaries_leave_unjudged_prompts_out_of_the_pass_rate():
    full = _rows("code", 4, 1.0, lambda i: [True, True, None, False][i])
    mode = _rows("code", 4, 0.5, lambda i: [True, False, True, True][i], same=False)
    figures = summarize(mode, full)
    assert figures["judged"] == 3 and figures["task_pass"] == pytest.approx(2 / 3) and figures["lost"] == 1
    assert figures["gained"] == 1 and figures["speed_vs_full"] == pytest.approx(2.0)
    assert not eligibility("route/slm", figures)[0]


def test_calibrate_judges_a_users_task_file_beside_the_built_in_held_out_set(tiny_slm_bundle, tmp_path):
    from edgeroute.calibration.calibrate import CalibrateOptions, CalibrationRun
    from edgeroute.errors import InputError

    tasks = tmp_path / "mine.jsonl"
    tasks.write_text('{"id": "mine-1", "task": "facts", "prompt": "Capital of Portugal?", '
                     '"assert": [{"type": "icontains", "value": "Lisbon"}]}\n')
    run = CalibrationRun.start(tiny_slm_bundle, CalibrateOptions(eval_cases=tasks, validation_prompts_per_task=2), None)
    assert len(run.held_out) == 2 * len(TASKS) + 1 and run.held_out[-1].task == "facts"
    assert not run.held_out[-1].verdict("Madrid").passed
    tasks.write_text('{"id": "heldout-voice-000", "prompt": "x", "assert": [{"type": "regex", "value": "."}]}\n')
    with pytest.raises(InputError, match="ids must be unique"):
        CalibrationRun.start(tiny_slm_bundle, CalibrateOptions(eval_cases=tasks, validation_prompts_per_task=2), None)
    with pytest.raises(InputError, match="task loss"):
        CalibrateOptions(task_loss=1.5).validate()


def test_uncalibrated_skipping_is_conservative_and_says_its_quality_is_unmeasured(tiny_engine):
    from edgeroute.errors import UnmeasuredQualityWarning
    from edgeroute.skip_options import UNCALIBRATED_FREE_LAYERS, SkipOptions

    assert UNCALIBRATED_FREE_LAYERS <= 2 and SkipOptions().free_layers(28) == UNCALIBRATED_FREE_LAYERS
    assert SkipOptions().skip_ratio <= 0.1 and SkipOptions().protected_first >= 1 and SkipOptions().protected_last >= 1
    with pytest.warns(UnmeasuredQualityWarning, match="quality is unmeasured"):
        # the tiny model is too shallow for the default protected layers (2 + 2)
        tiny_engine.resolve(tiny_engine.options.updated(mode="skip", protected_first=1, protected_last=1))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnmeasuredQualityWarning)
        tiny_engine.resolve(tiny_engine.options.updated(mode="speculate"))


def test_routing_says_its_quality_is_unmeasured_unless_it_runs_the_calibrated_router(tiny_engine):
    from types import SimpleNamespace

    from edgeroute.errors import InputError, UnmeasuredQualityWarning
    from edgeroute.runtime.calibrated import calibrated_route

    with pytest.warns(UnmeasuredQualityWarning, match="route/slm routes with a router or threshold no calibration"):
        tiny_engine.resolve(tiny_engine.options.updated(mode="route", light="slm"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnmeasuredQualityWarning)
        # verified routing at threshold 0 keeps no difference: exact speculation
        tiny_engine.resolve(tiny_engine.options.updated(mode="route", light="slm", route_check="verified",
                                                        route_threshold=0.0))
        with pytest.raises(InputError, match="route_threshold"):  # the error alone, no warning before it
            tiny_engine.resolve(tiny_engine.options.updated(mode="route", light="slm", route_threshold=float("inf")))
    fitted = SimpleNamespace(routers={"slm": SimpleNamespace(router="entropy", threshold=0.7)})
    route = tiny_engine.options.updated(mode="route", light="slm")
    assert calibrated_route(route, fitted)
    assert calibrated_route(route.updated(router="entropy", route_threshold=0.7), fitted)
    assert not calibrated_route(route.updated(route_threshold=0.9), fitted)
    assert not calibrated_route(route.updated(router="top1"), fitted)
    assert not calibrated_route(route.updated(light="ngram"), fitted)
    assert not calibrated_route(route.updated(route_check="verified"), fitted)
    assert not calibrated_route(route, None)


def test_task_runs_measure_unmeasured_modes_without_warning_that_they_are_unmeasured(tiny_engine):
    from edgeroute.errors import UnmeasuredQualityWarning
    from edgeroute.quality.cases import TaskCase
    from edgeroute.quality.runs import RunConfig, run_cases

    case = TaskCase("c1", "dialogue", [{"role": "user", "content": "one two three"}])
    configs = [RunConfig("full", {"mode": "full"}), RunConfig("route/slm", {"mode": "route", "light": "slm"})]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnmeasuredQualityWarning)
        runs = run_cases(tiny_engine, [case], configs, 4)
    assert [row["ran"] for row in runs["route/slm"]] == ["route/slm"]
