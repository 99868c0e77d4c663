"""The benchmark's measures: task-level checks, per-configuration figures, the graph clock."""

from __future__ import annotations

import json

import pytest

from edgeroute.calibration.checks import echoes_instructions, parse_json_object
from tools.benchlib.metrics import GraphClock, common_prefix, summarize, tokens_per_second
from tools.benchlib.tasks import record_values, split_prompt, task_check

RECORD = {"messages": [{"role": "user", "content": "Confirm this navigation request to the driver in one sentence.\n"
                                                   "intent: navigate\ndestination: 221B Baker Street, London\n"
                                                   "arrival: 14:35"}]}
REQUEST = {"messages": [{"role": "user", "content": "Write a one-sentence confirmation for the driver: calling "
                                                    "Maria Lopez at +1 415 555 0172."}]}
TEMPLATED_JSON = {"messages": [{"role": "user", "content": 'Return this request as JSON with the keys "intent", '
                                                           '"volume": Turn the volume down to 12.'}]}
JSON_PROMPT = {"instruction": 'Turn the voice command into a JSON intent with the keys "intent" and "volume". Reply '
                              "with the JSON object only.", "command": "Turn the volume up to 18.",
               "keys": ["intent", "volume"], "values": {"volume": 18},
               "messages": [{"role": "user", "content": "..."}]}


def test_record_prompt_splits_into_instruction_and_values_without_the_intent():
    instruction, _ = split_prompt(RECORD)
    assert instruction == "Confirm this navigation request to the driver in one sentence."
    assert record_values(RECORD) == ["221B Baker Street, London", "14:35"]


def test_one_line_request_values_are_its_numbers_and_names():
    assert record_values(REQUEST) == ["Maria", "Lopez", "1", "415", "555", "0172"]


def test_templated_answer_passes_with_every_value_and_fails_naming_what_is_missing():
    good = task_check("templated", RECORD, "Navigating to 221B Baker Street in London, arriving at 14:35.")
    assert good.passed and good.kind == "templated" and not good.echo
    bad = task_check("templated", RECORD, "Navigating to Baker Street, arriving at 14:35.")
    assert not bad.passed and "221B Baker Street, London" in bad.reason


def test_an_answer_that_repeats_the_instruction_fails_as_an_echo():
    answer = ("Calling Maria Lopez at +1 415 555 0172. Write a one-sentence confirmation for the driver: done.")
    check = task_check("templated", REQUEST, answer)
    assert check.echo and not check.passed and "echoes" in check.reason
    assert not echoes_instructions("Here is a confirmation for the driver.", "Write a one-sentence confirmation for the driver")


def test_json_answer_in_a_code_fence_parses_and_needs_the_keys_and_listed_values():
    assert parse_json_object('```json\n{"intent": "volume", "volume": 18}\n```') == {"intent": "volume", "volume": 18}
    assert parse_json_object('{"intent": "volume", "volume": 1') is None  # left unclosed
    assert task_check("json", JSON_PROMPT, '{"intent": "set_volume", "volume": 18}').passed
    assert "wrong values" in task_check("json", JSON_PROMPT, '{"intent": "set_volume", "volume": 12}').reason
    assert "missing keys" in task_check("json", JSON_PROMPT, '{"volume": 18}').reason
    assert task_check("json", JSON_PROMPT, '{"intent": "x", "volume": 18').reason == "no JSON object"


def test_json_answer_of_a_mode_must_carry_fulls_keys_and_values():
    full = '{"intent": "set_volume", "volume": 18}'
    assert task_check("json", JSON_PROMPT, '{"intent": "Set_Volume ", "volume": 18}', full).passed
    assert "differ from full" in task_check("json", JSON_PROMPT, '{"intent": "volume_up", "volume": 18}', full).reason
    extra = task_check("json", JSON_PROMPT, '{"intent": "set_volume", "volume": 18, "unit": "%"}', full)
    assert "keys" in extra.reason


def test_templated_prompt_asking_for_json_is_checked_as_json_and_other_workloads_are_not_checked():
    check = task_check("templated", TEMPLATED_JSON, '{"intent": "volume", "volume": 12}')
    assert check.kind == "json" and check.passed
    assert task_check("open", RECORD, "anything") is None


def _run(tokens, decode_seconds, agreement=None, task=None, **extra):
    run = {"tokens": tokens, "ttft": 0.5, "decode_seconds": decode_seconds, "gaps": [decode_seconds / 2] * 2,
           "llm_tokens": len(tokens), "llm_calls": len(tokens), "llm_layers_run": 2 * len(tokens), "drafted": 0,
           "accepted": 0, "fallbacks": 0, "agreement": agreement, "task": task}
    return {**run, **extra}


def test_summary_pools_rates_and_counts_task_passes_and_echoes():
    agreement = {"prefix": 3, "tf_matches": 3, "tf_positions": 3, "identical": True, "divergence_gap": None,
                 "full_tokens": 3}
    runs = [_run([1, 2, 3], 1.0, agreement, {"passed": True, "echo": False}),
            _run([1, 2, 3], 3.0, agreement, {"passed": False, "echo": True}, drafted=4, accepted=1)]
    s = summarize(runs, num_layers=2, rss=None, full_runs=[_run([1, 2, 3], 2.0), _run([1, 2, 3], 2.0)])
    assert s["tokens_per_second"] == pytest.approx(4 / 4.0)
    assert s["paired_median_vs_full"] == pytest.approx((2.0 + 2 / 3) / 2)
    assert s["task_pass_rate"] == 0.5 and s["task_echoes"] == 1 and s["task_checked"] == 2
    assert s["acceptance"] == 0.25 and s["identical"] == 2 and s["tf_agreement"] == 1.0
    assert tokens_per_second(_run([1], 1.0)) is None and common_prefix([1, 2, 3], [1, 2, 4]) == 2


def test_graph_clock_collects_the_runtime_timing_hook_per_phase_and_kind(tiny_engine):
    clock = GraphClock()
    llm = tiny_engine.llm
    llm.timings = clock.hook()
    try:
        session = tiny_engine.session(max_new_tokens=4)
        for i, _ in enumerate(session.generate_tokens("Navigate to 12 Baker Street")):
            if i == 0:
                clock.phase = "decode"
    finally:
        llm.timings = None
    layers = llm.num_layers
    assert dict(clock.calls["prefill"]) == {"embed": 1, "layer": layers, "head": 1}
    assert dict(clock.calls["decode"]) == {"embed": 3, "layer": 3 * layers, "head": 3}
    profile = clock.decode_profile(decode_seconds=1.0, decode_tokens=3)
    assert 0 < profile["ort_seconds"] < 1.0 and json.dumps(profile)
