"""Every figure of README.md and docs/benchmarks.md stands on a record under docs/records/
whose regenerate command parses (tools/records.py defines a figure and a record)."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from edgeroute.llamacpp import NotTheSource, Unavailable, source_gguf
from tools import records
from tools.benchlib import decoding

REPO = Path(__file__).resolve().parents[1]
ALL = records.all_records()


def test_every_figure_in_the_docs_names_a_record_that_exists():
    problems = [p for doc in records.DOCS for p in records.check_doc(doc)]
    assert problems == []


@pytest.mark.parametrize("path", ALL, ids=[p.stem for p in ALL])
def test_each_record_has_its_fields_and_a_make_target(path):
    assert records.check_record(path) == []
    record = records.load(path)
    makefile = (REPO / "Makefile").read_text()
    assert re.search(rf"^{re.escape(record['make'])}:", makefile, re.M), f"no make target {record['make']}"
    assert re.search(rf"^{re.escape(record['make'])}:.*\n\t\$\(RECORD\) .*\b{re.escape(path.stem)}\b", makefile, re.M), \
        f"make {record['make']} does not run record {path.stem}"


@pytest.mark.parametrize("command", [(p.stem, c) for p in ALL for c in records.load(p)["command"]],
                         ids=lambda c: c[0])
def test_each_record_command_parses(command):
    records.parse_command(command[1])  # raises CommandError where the tool refuses its arguments


def test_each_record_is_linked_from_the_docs():
    linked = {path for doc in records.DOCS for block in records.blocks(doc.read_text())
              for _, path in records.record_links(block.text, doc)}
    assert {p.resolve() for p in ALL} - linked == set()


# -- the check itself ------------------------------------------------------------------------------

def _doc(tmp_path: Path) -> Path:
    return records.RECORDS.parent / "benchmarks.md"  # links resolve from docs/, as benchmarks.md's do


def test_an_unrecorded_figure_fails_the_check(tmp_path):
    doc = _doc(tmp_path)
    assert records.check_doc(doc, "Decode is 3.2x faster than before.\n")
    assert records.check_doc(doc, "## Section\n\nIt uses 1,248 MiB at peak, 250 tok/s and 5% more.\n")
    recorded = "Decode is 1.59x `full` ([record](records/avx2-speculation.json)).\n"
    assert records.check_doc(doc, recorded) == []


def test_what_counts_as_a_figure():
    assert records.figures_in("1.24x / 1.38x, 196.6 tok/s, 0.75 s, 1,829 MiB, 20 GB/s, 77% (73-81%)") == [
        "1.24x", "1.38x", "196.6 tok/s", "0.75 s", "1,829 MiB", "20 GB/s", "77%", "73-81%"[3:]]
    # no unit, inside code, a version, an ISA name, a model size: not figures
    assert records.figures_in("2 threads, `--steps 16 --contexts 32,1024 3x`, llama-cpp-python 0.3.36, AVX2, "
                              "AVX-512, 1.5B, Q4_1, x86-64, 360/360") == []


def test_a_table_row_may_share_its_captions_record_but_not_a_table_without_one(tmp_path):
    doc = _doc(tmp_path)
    captioned = "Command: `x` ([record](records/avx2-decode.json)).\n\n| a | b |\n|---|---|\n| 1.5B | 1.27x |\n"
    assert records.check_doc(doc, captioned) == []
    bare = "Some text.\n\n| a | b |\n|---|---|\n| 1.5B | 1.27x |\n"
    assert records.check_doc(doc, bare)
    in_code = "```\n native  32  250 tok/s  97%\n```\n"
    assert records.check_doc(doc, in_code) == []


def test_a_missing_record_or_an_unmarked_pending_one_fails(tmp_path, monkeypatch):
    measured = next(p for p in ALL if records.load(p)["status"] == "measured")
    folder = tmp_path / "records"  # the tree may have no pending record left: one is made here
    folder.mkdir()
    (folder / measured.name).write_text(measured.read_text())
    (folder / "waiting.json").write_text(json.dumps({**records.load(measured), "status": "pending"}))
    monkeypatch.setattr(records, "RECORDS", folder)
    doc = tmp_path / "benchmarks.md"
    assert records.check_doc(doc, "2.0x ([record](records/no-such-record.json))\n")
    assert records.check_doc(doc, "2.0x ([record](records/waiting.json))\n")
    assert records.check_doc(doc, "2.0x ([record: pending](records/waiting.json))\n") == []
    assert records.check_doc(doc, f"2.0x ([record: pending](records/{measured.name}))\n")  # measured: restate
    assert records.check_doc(doc, f"2.0x ([record](records/{measured.name}))\n") == []


def test_an_incomplete_record_fails(tmp_path):
    path = tmp_path / "r.json"
    good = records.load(next(p for p in ALL if records.load(p)["status"] == "measured"))
    path.write_text(json.dumps({k: v for k, v in good.items() if k != "cpu_flags"}))
    assert any("cpu_flags" in p for p in records.check_record(path))
    path.write_text(json.dumps({**good, "samples": None}))
    assert any("samples" in p for p in records.check_record(path))
    path.write_text(json.dumps({**good, "source": {"raw": ["docs/measured/gone.json"]}}))
    assert any("not in the tree" in p for p in records.check_record(path))


def test_a_command_that_does_not_parse_fails():
    with pytest.raises(records.CommandError):
        records.parse_command("python -m tools.bench_context --bundle b --no-such-flag")
    with pytest.raises(records.CommandError):
        records.parse_command("edgeroute bench bundles/x --no-such-flag")
    with pytest.raises(records.CommandError):
        records.parse_command("bash -c 'anything'")
    parsed = records.parse_command("python -m tools.bench_run --bundle bundles/qwen-pair --slm-gguf source --json {out}")
    assert str(parsed.slm_gguf) == "source"


# -- llama.cpp times the bundle's own source, or refuses -----------------------------------------

def _bundle(tmp_path: Path, data: bytes, **source) -> tuple[SimpleNamespace, Path]:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(data)
    recorded = {"format": "gguf", "name": "model", "path": str(gguf), "sha256": hashlib.sha256(data).hexdigest(),
                **source}
    return SimpleNamespace(path=tmp_path, models={"llm": SimpleNamespace(source=recorded)}), gguf


def test_a_gguf_that_is_not_the_bundles_source_is_refused(tmp_path):
    bundle, gguf = _bundle(tmp_path, b"the source")
    assert source_gguf(bundle, "llm") == gguf  # the recorded path
    assert source_gguf(bundle, "llm", gguf) == gguf  # the same file, checked
    other = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    other.write_bytes(b"another model")
    with pytest.raises(NotTheSource, match="not the GGUF"):
        source_gguf(bundle, "llm", other)
    unchecked, _ = _bundle(tmp_path, b"the source", sha256=None)
    with pytest.raises(NotTheSource, match="records no sha256"):
        source_gguf(unchecked, "llm", other)
    moved, _ = _bundle(tmp_path, b"the source", path=str(tmp_path / "gone.gguf"))
    with pytest.raises(Unavailable, match="not on this machine"):
        source_gguf(moved, "llm")


def test_the_bench_tools_stop_instead_of_timing_another_model(tmp_path):
    from tools.benchlib.llama import checked_gguf

    bundle, _ = _bundle(tmp_path, b"the source")
    other = tmp_path / "other.gguf"
    other.write_bytes(b"another model")
    with pytest.raises(SystemExit, match="refusing to time llama.cpp"):
        checked_gguf(bundle, "llm", other)


def test_running_a_record_fills_the_machine_commit_and_samples(tmp_path):
    path = tmp_path / "listing.json"
    pending = {key: None for key in records.REQUIRED}
    path.write_text(json.dumps({**pending, "figure": "the records listed", "docs": [], "status": "pending",
                                "command": ["PYTHONHASHSEED=0 python -m tools.records list"], "make": "records"}))
    record = records.run_record(path)  # times nothing: the listing's stdout is the sample
    assert records.check_record(path) == []
    assert record["status"] == "measured" and record["commit"] and record["machine"]["cpu"]
    assert "pair-workloads" in next(iter(record["samples"].values()))["stdout_tail"]
    assert records.split_env("A=1 B=x python -m tools.x --out {out}", "o.json") == (
        {"A": "1", "B": "x"}, ["python", "-m", "tools.x", "--out", "o.json"])


def test_a_commit_is_dirty_for_changes_to_the_tree_but_not_to_the_records(tmp_path, monkeypatch):
    import subprocess

    def git(*args: str) -> None:
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)

    (tmp_path / "docs" / "records").mkdir(parents=True)
    (tmp_path / "docs" / "records" / "a.json").write_text("{}")
    (tmp_path / "tool.py").write_text("x = 1\n")
    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", "one")
    monkeypatch.setattr(records, "REPO", tmp_path)
    clean = records.commit()
    assert re.fullmatch("[0-9a-f]{40}", clean)
    (tmp_path / "docs" / "records" / "a.json").write_text('{"rewritten": true}')  # a run of several records
    assert records.commit() == clean
    (tmp_path / "tool.py").write_text("x = 2\n")
    assert records.commit() == f"{clean}-dirty"


def test_running_the_pending_records_when_none_is_pending_says_so(monkeypatch, capsys):
    monkeypatch.setattr(records, "all_records", lambda: [p for p in ALL if records.load(p)["status"] == "measured"])
    assert records.main(["run", "--pending"]) == 0
    assert "no record is pending" in capsys.readouterr().out


def test_an_inspected_calibration_is_summarized_as_the_docs_quote_it():
    def figures(speed: float, same: float, **quality) -> dict:
        return {"prompts": 60, "speed_vs_full": speed, "same_as_full": same, **quality}

    code = {"config": "route/slm+verified",
            "figures": {"full": figures(1.0, 1.0, task_pass=0.9, pass_interval=[0.8, 0.96]),
                        "speculate/ngram": figures(1.2, 1.0),
                        "route/slm+verified": figures(1.3, 59 / 60, lost=0, gained=1, loss_bound=0.049, differ=1)}}
    dialogue = {"config": "full", "figures": {"full": figures(1.0, 1.0), "speculate/ngram": figures(1.02, 1.0)}}
    inspected = {"path": "b", "calibration": {
        "profiles": {"code": code, "dialogue": dialogue},
        "figures": {"seconds": {"labels": 5.0}, "drafting": {"costs": {"slm_step": 0.01}},
                    "slm_trees": {"shape": {"branches": 2, "nodes": 2}, "speedup_vs_linear": 1.04,
                                  "per_task": {"code": {"shape": {"branches": 1, "nodes": 2}}},
                                  "runtime": {"speculate/slm": 38.5, "speculate/slm+tree": 39.0}}},
        "decoding": {}}}
    summary = records.summarize(["/venv/bin/edgeroute", "inspect", "b", "--json"], inspected)
    assert summary["per_task"]["code"]["auto"] == "route/slm+verified"
    assert summary["per_task"]["code"]["same_as_full"] == "59/60" and summary["per_task"]["code"]["lost"] == 0
    assert summary["per_task"]["code"]["route/slm+verified"]["x_full"] == 1.3
    assert summary["per_task"]["dialogue"]["candidates_x_full"] == {"speculate/ngram": 1.02}
    assert summary["x_full_range"] == [1.3, 1.3]  # tasks that stay on full are no speedup
    assert summary["slm_trees"]["written"] is None and summary["trees"] is None
    assert summary["drafting_costs"] == {"slm_step": 0.01}
    uncalibrated = {"path": "b", "calibration": None}
    assert "no summary section" in records.summarize(["edgeroute", "inspect", "b", "--json"], uncalibrated)
    assert records.summarize(["python", "-m", "tools.x"], {"summary": {"a": 1}}) == {"a": 1}


def test_an_eval_report_is_summarized_per_task_with_what_auto_ran_and_its_ratio_to_llama_cpp():
    def figures(tok_s: float, ran: list[str], judged: int = 6) -> dict:
        return {"prompts": 6, "judged": judged, "tok_s": tok_s, "speed_vs_full": tok_s / 40.0, "ran": ran,
                "same_as_full": 1.0, "task_pass": 5 / 6 if judged else None}

    code = {"full": figures(40.0, ["full"]), "auto": figures(52.0, ["route/slm+verified"]),
            "llama.cpp": figures(32.5, [])}
    json_task = {"full": figures(40.0, ["full"]), "auto": figures(60.0, ["speculate/ngram"]),
                 "llama.cpp": figures(0.0, [], judged=0)}  # llama.cpp ran no schema
    report = {"overall": code, "per_task": {"code": code, "json": json_task}}
    summary = records.summarize(["/venv/bin/edgeroute", "eval", "b", "--tasks", "builtin", "--json", "o"], report)
    auto = summary["per_task"]["code"]["auto"]
    assert auto == {"tok_s": 52.0, "x_full": 1.3, "ran": ["route/slm+verified"], "same_as_full": "6/6",
                    "passed": "5/6", "x_llama_cpp": 1.6}
    assert summary["per_task"]["code"]["llama.cpp"] == {"tok_s": 32.5}
    assert "x_llama_cpp" not in summary["per_task"]["json"]["auto"]


def test_a_decode_bench_is_summarized_per_role_and_context_with_natives_ratio_to_llama_cpp():
    def record(role: str, backend: str, context: int, tok_s: float) -> dict:
        return {"role": role, "backend": backend, "context": context, "decode_tok_s": tok_s}

    report = {"records": [record("llm", "native", 32, 27.8), record("llm", "llama.cpp", 32, 20.1),
                          record("slm", "native", 1024, 62.7), record("slm", "onnxruntime", 1024, 30.0)]}
    summary = records.summarize(["/venv/bin/edgeroute", "bench", "b", "--json", "o"], report)
    assert summary == {"llm ctx 32": {"native_tok_s": 27.8, "llama_cpp_tok_s": 20.1, "native_x_llama_cpp": 1.38},
                       "slm ctx 1024": {"native_tok_s": 62.7, "onnxruntime_tok_s": 30.0}}


def test_pass_benchmarks_are_summarized_as_a_four_token_pass_over_a_one_token_one():
    llama = {"threads": 2, "logits": "all", "m1_ms": [50.0, 60.0, 55.0], "m4_ms": [150.0, 150.0, 220.0]}
    summary = decoding.llama_passes_summary(llama)  # the tool writes it as its JSON's summary
    assert summary["m1_ms_median"] == 55.0 and summary["m4_ms_median"] == 150.0
    assert summary["m4_over_m1_median"] == 3.0  # the median of the rounds' ratios (3, 2.5, 4), not of the medians
    ours = [{"kernels_run": "avx2", "threads": 1, "slm_step_ms": 29.3, "pass_ms": [60.0, 66.0, 80.0, 90.0, 120.0]}]
    summary = records.summarize(["/venv/bin/python", "-m", "tools.bench_passes", "b", "--out", "o"], ours)
    assert summary == {"avx2, 1 thread(s)": {"m1_ms": 60.0, "m4_ms": 90.0, "m4_over_m1": 1.5, "slm_step_ms": 29.3}}
