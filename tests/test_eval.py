"""`edgeroute eval`: a user's task file through several modes, judged by assertions that can
fail; pass rates with intervals, the loss bound against full, speed, JSON and a PNG."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from edgeroute.cli import app
from edgeroute.errors import InputError
from edgeroute.quality.cases import load_cases
from edgeroute.quality.evaluation import evaluate, parse_modes, print_report
from edgeroute.runtime import Engine

runner = CliRunner()


def write_cases(path: Path, cases: list[dict]) -> Path:
    path.write_text("".join(json.dumps(c) + "\n" for c in cases))
    return path


def test_modes_parse_with_full_first_and_bad_names_refused():
    assert [c.name for c in parse_modes("speculate/slm,route/ngram,full")] == ["full", "speculate/slm", "route/ngram"]
    assert parse_modes("route/slm")[1].options == {"mode": "route", "light": "slm"}
    # one row per configuration however it is spelled (a trailing slash ran speculate twice)
    assert [c.name for c in parse_modes("speculate, speculate/,speculate / ngram,full/")] == [
        "full", "speculate", "speculate/ngram"]
    with pytest.raises(InputError, match="mode 'fast'"):
        parse_modes("fast")
    with pytest.raises(InputError, match="light path 'cache'"):
        parse_modes("speculate/cache")


@pytest.mark.parametrize(("line", "message"), [
    ('{"prompt": "hi"}', r"\"assert\" must be a non-empty list"),
    ('{"prompt": "hi", "assert": []}', r"\"assert\" must be a non-empty list"),
    ('{"assert": [{"type": "contains", "value": "a"}]}', "give either \"prompt\""),
    ('{"prompt": "hi", "messages": [], "assert": [{"type": "contains", "value": "a"}]}', "not both"),
    ('{"prompt": "hi", "asert": [{"type": "contains", "value": "a"}]}', "unknown key"),
    ('{"prompt": "hi", "assert": [{"type": "smells-right", "value": "a"}]}', "smells-right"),
    ('{"prompt": "hi", "assert": [{"type": "contains", "value": "a"}], "max_new_tokens": 0}', "max_new_tokens"),
    ("not json", "is not JSON"),
    ('{"prompt": "hi", "assert": [{"type": "contains", "value": "a"}], "response_format": {"type": "bogus"}}',
     r"tasks.jsonl:1: response_format type 'bogus' is not one of"),
    ('{"prompt": "hi", "assert": [{"type": "contains", "value": "a"}], "response_format": {"type": "regex"}}',
     r"tasks.jsonl:1: response_format regex needs its text"),
    ('{"id": null, "prompt": "hi", "assert": [{"type": "contains", "value": "a"}]}',
     r"tasks.jsonl:1: \"id\" must be a non-empty string or a whole number \(got None\)"),
    ('{"id": {"n": 1}, "prompt": "hi", "assert": [{"type": "contains", "value": "a"}]}', r"\"id\" must be"),
])
def test_bad_task_files_are_clear_errors(tmp_path, line, message):
    path = tmp_path / "tasks.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(InputError, match=message):
        load_cases(path)


@pytest.mark.parametrize("checks", [
    [{"type": "not-contains", "value": "error"}],
    [{"type": "regex", "value": "Paris|"}],
    [{"type": "not-regex", "value": "\\d"}, {"type": "python", "value": "len(output) < 80"}],
])
def test_a_case_an_empty_answer_passes_is_refused_by_line(tmp_path, checks):
    path = write_cases(tmp_path / "tasks.jsonl", [{"prompt": "Where is the Louvre?", "assert": checks}])
    with pytest.raises(InputError, match=r"tasks.jsonl:1: an empty answer passes every assertion of this case"):
        load_cases(path)
    said = [*checks, {"type": "regex", "value": "\\S"}]  # the fix the message offers
    assert len(load_cases(write_cases(tmp_path / "fixed.jsonl", [{"prompt": "Where?", "assert": said}]))) == 1
    silence = [*checks, {"type": "equals", "value": ""}]  # a case that asks for no answer says so
    assert len(load_cases(write_cases(tmp_path / "quiet.jsonl", [{"prompt": "Say nothing.", "assert": silence}]))) == 1


def test_a_task_file_reuses_no_id_and_exists(tmp_path):
    case = {"id": "a", "prompt": "hi", "assert": [{"type": "contains", "value": "x"}]}
    with pytest.raises(InputError, match="used twice"):
        load_cases(write_cases(tmp_path / "t.jsonl", [case, case]))
    with pytest.raises(InputError, match="does not exist"):
        load_cases(tmp_path / "missing.jsonl")



def test_a_task_file_may_start_with_a_byte_order_mark_and_one_not_utf8_is_refused_by_line(tmp_path):
    line = json.dumps({"id": "a", "prompt": "hi", "assert": [{"type": "contains", "value": "x"}]}).encode()
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + line + b"\n")  # as Windows editors save UTF-8
    assert [c.id for c in load_cases(path)] == ["a"]
    path.write_bytes(line + b"\n" + line.replace(b"hi", b"caf\xe9") + b"\n")  # Latin-1
    with pytest.raises(InputError, match=r"t.jsonl is not UTF-8 text \(line 2"):
        load_cases(path)
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff")
    result = runner.invoke(app, ["eval", str(tmp_path / "no-bundle"), "--tasks", str(path)])
    assert result.exit_code == 2 and "is not UTF-8 text (line 1" in " ".join(result.output.split())
    assert "Traceback" not in result.output

def test_eval_judges_every_assertion_type_and_fails_the_ones_that_must(tiny_slm_bundle, tmp_path):
    """Cases written against full's own answer: the assertions that hold pass in full and in
    (identical) speculation; their negations and wrong values fail in every mode."""
    engine = Engine(tiny_slm_bundle)
    prompt = "one two three"
    answer = engine.generate([{"role": "user", "content": prompt}], max_new_tokens=12).text
    assert answer.strip(), "the tiny model wrote nothing: the test would prove nothing"
    word = answer.strip().split()[0]
    holds = [{"type": "contains", "value": word}, {"type": "icontains", "value": word.upper()},
             {"type": "contains-all", "value": [word]}, {"type": "contains-any", "value": [word, "zzzz"]},
             # a negation alone passes an empty answer too (such a case is refused): beside a check it fails
             [{"type": "not-contains", "value": "\x00never"}, {"type": "regex", "value": "."}], {"type": "regex", "value": "."},
             {"type": "equals", "value": answer}, {"type": "python", "value": f"output.startswith({answer[:3]!r})"}]
    fails = [[{"type": "not-contains", "value": word}, {"type": "regex", "value": "."}],
             {"type": "equals", "value": answer + "!"},
             {"type": "is-json"}, {"type": "json-schema", "value": {"type": "object"}},
             {"type": "python", "value": "len(output) > 10_000"}, {"type": "contains-all", "value": [word, "\x00no"]}]
    cases = [{"id": f"holds-{i}", "task": "holds", "prompt": prompt, "assert": a if isinstance(a, list) else [a]}
             for i, a in enumerate(holds)]
    cases += [{"id": f"fails-{i}", "task": "fails", "prompt": prompt, "assert": a if isinstance(a, list) else [a]}
              for i, a in enumerate(fails)]
    report = evaluate(engine, load_cases(write_cases(tmp_path / "t.jsonl", cases)), "full,speculate/ngram",
                      max_new_tokens=12)
    for mode in ("full", "speculate/ngram"):
        assert report.per_task["holds"][mode]["task_pass"] == 1.0, [r["reason"] for r in report.runs[mode]]
        assert report.per_task["fails"][mode]["task_pass"] == 0.0
        assert report.overall[mode]["judged"] == len(cases)
    assert report.overall["speculate/ngram"]["same_as_full"] == 1.0 and report.overall["speculate/ngram"]["eligible"]
    low, high = report.overall["full"]["pass_interval"]
    assert low < len(holds) / len(cases) < high


def test_eval_command_prints_the_table_and_writes_json_and_a_plot(tiny_slm_bundle, tmp_path):
    tasks = write_cases(tmp_path / "tasks.jsonl", [
        {"id": "any", "prompt": "one two", "assert": [{"type": "regex", "value": "."}]},
        {"id": "never", "prompt": "three four", "assert": [{"type": "contains", "value": "\x00"}]}])
    out, plot = tmp_path / "eval.json", tmp_path / "eval.png"
    result = runner.invoke(app, ["eval", str(tiny_slm_bundle), "--tasks", str(tasks), "--modes",
                                 "full,speculate/ngram,route/slm", "--max-new-tokens", "8", "--json", str(out),
                                 "--plot", str(plot)])
    assert result.exit_code == 0, result.output
    printed = " ".join(result.output.split())
    assert "2 cases" in printed and "speculate" in printed and "lossless" in printed
    report = json.loads(out.read_text())
    assert report["configs"] == ["full", "speculate/ngram", "route/slm"] and report["cases"] == 2
    assert report["overall"]["full"]["task_pass"] == 0.5 and len(report["runs"]["route/slm"]) == 2
    assert plot.stat().st_size > 5000


def test_eval_command_refuses_bad_input_with_exit_2(tiny_slm_bundle, tmp_path):
    result = runner.invoke(app, ["eval", str(tiny_slm_bundle), "--tasks", str(tmp_path / "none.jsonl")])
    assert result.exit_code == 2 and "does not exist" in " ".join(result.output.split())
    assert "Traceback" not in result.output
    tasks = write_cases(tmp_path / "t.jsonl", [{"prompt": "x", "assert": [{"type": "regex", "value": "."}]}])
    result = runner.invoke(app, ["eval", str(tiny_slm_bundle), "--tasks", str(tasks), "--modes", "auto"])
    assert result.exit_code == 2 and "uncalibrated" in " ".join(result.output.split())


@pytest.mark.slow
def test_eval_on_the_demo_model_passes_a_fact_it_knows_and_fails_a_wrong_one(smollm2_bundles, tmp_path):
    bundle = smollm2_bundles["int4"][0]
    tasks = write_cases(tmp_path / "facts.jsonl", [
        {"id": "paris", "prompt": "What is the capital of France? Answer in one short sentence.",
         "assert": [{"type": "icontains", "value": "Paris"}]},
        {"id": "wrong", "prompt": "What is the capital of France? Answer in one short sentence.",
         "assert": [{"type": "icontains", "value": "Madrid"}]}])
    report = evaluate(Engine(bundle), load_cases(tasks), "full,speculate/ngram", max_new_tokens=24)
    passed = {r["case"]: r["pass"] for r in report.runs["full"]}
    assert passed == {"paris": True, "wrong": False}, report.runs["full"]


def test_eval_says_why_there_is_no_llama_cpp_row_where_it_cannot_run_the_same_model(tiny_slm_bundle, tmp_path):
    tasks = write_cases(tmp_path / "t.jsonl", [{"prompt": "one", "assert": [{"type": "regex", "value": "."}]}])
    report = evaluate(Engine(tiny_slm_bundle), load_cases(tasks), "full", max_new_tokens=4, llama_cpp=True)
    assert "llama.cpp" not in report.runs and len(report.notes) == 1
    assert "not a GGUF" in report.notes[0] or "not installed" in report.notes[0]


def test_eval_prints_notes_reasons_and_task_names_with_their_brackets(tiny_slm_bundle, tmp_path):
    tasks = write_cases(tmp_path / "t.jsonl", [{"prompt": "one", "task": "[cabin]",
                                                 "assert": [{"type": "regex", "value": "."}]},
                                                {"prompt": "two", "assert": [{"type": "regex", "value": "."}]}])
    report = evaluate(Engine(tiny_slm_bundle), load_cases(tasks), "full,route/slm", max_new_tokens=4)
    report.notes = ["llama.cpp: llama-cpp-python is not installed (pip install 'edgeroute[bench]'): no row"]
    report.overall["route/slm"]["why"] += " [bold]"
    console = Console(file=io.StringIO(), width=300)
    print_report(report, console)
    printed = console.file.getvalue()
    assert "pip install 'edgeroute[bench]'" in printed and "[bold]" in printed and "[cabin]" in printed


def test_auto_counts_as_lossless_only_where_every_task_it_covers_runs_a_lossless_mode():
    from types import SimpleNamespace

    from edgeroute.quality.evaluation import _auto_lossless

    profiles = {"json": {"mode": "speculate"}, "code": {"mode": "route"}, "default": {"mode": "speculate"}}
    engine = SimpleNamespace(bundle=SimpleNamespace(calibration=SimpleNamespace(profiles=profiles)))
    assert _auto_lossless(engine, ["json"]) and _auto_lossless(engine, ["facts"])  # an uncalibrated task: default's
    assert not _auto_lossless(engine, ["code"]) and not _auto_lossless(engine, ["json", "code"])



@pytest.mark.parametrize(("setting", "message"), [
    ({"tolerance": 5.0}, r"task loss \(tolerance\) must be within \[0, 1\) \(got 5.0\)"),
    ({"tolerance": float("nan")}, r"task loss \(tolerance\) must be within"),
    ({"tolerance": -0.1}, r"task loss \(tolerance\) must be within"),
    ({"max_new_tokens": "8"}, r"max_new_tokens must be at least 1 \(got '8'\)"),
])
def test_evaluate_refuses_a_tolerance_out_of_range_and_a_token_count_that_is_no_integer(tmp_path, setting, message):
    """A tolerance of 5 let a mode that lost every case "replace full"; "8" was a TypeError."""
    tasks = write_cases(tmp_path / "t.jsonl", [{"prompt": "one", "assert": [{"type": "regex", "value": "."}]}])
    with pytest.raises(InputError, match=message):
        evaluate(object(), load_cases(tasks), "full,route/slm", **setting)


@pytest.mark.parametrize(("option", "message"), [
    (["--confidence", "1.5"], "confidence must be within"),
    (["--max-new-tokens", "0"], "max_new_tokens must be at least 1"),
    (["--modes", "full,warp"], "mode 'warp' is not one of"),
    (["--task-loss", "nan"], "task loss (tolerance) must be within [0, 1) (got nan)"),
])
def test_eval_checks_its_settings_before_it_loads_the_bundle(tmp_path, option, message):
    result = CliRunner().invoke(app, ["eval", str(tmp_path / "no-bundle"), "--tasks", "builtin", *option])
    assert result.exit_code == 2 and message in result.output and "no-bundle" not in result.output


def test_eval_refuses_per_task_beside_a_task_file_which_runs_every_case():
    """It was ignored without a word: --per-task 3 on a file of 40 cases ran 40."""
    result = CliRunner().invoke(app, ["eval", "no-bundle", "--tasks", "docs/examples/tasks.jsonl", "--per-task", "3"])
    printed = " ".join(result.output.split())
    assert result.exit_code == 2 and "--per-task counts the built-in held-out prompts" in printed, result.output


@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_eval_refuses_an_output_path_whose_folder_cannot_be_made_before_it_runs(tmp_path, option):
    """Refused after every case had run: --plot with a traceback, --json with the report lost."""
    taken = tmp_path / "results"
    taken.write_text("a file where the folder would go")
    out = taken / "new" / ("eval.json" if option == "--json" else "eval.png")
    result = CliRunner().invoke(app, ["eval", str(tmp_path / "no-bundle"), "--tasks", "builtin", option, str(out)])
    printed = " ".join(result.output.split())
    assert result.exit_code == 2 and f"{taken} is a file, so no folder can be made there" in printed, result.output
    assert "no-bundle" not in printed and "Traceback" not in result.output
