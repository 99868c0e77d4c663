"""Every command's help and output fit an 80-column terminal: no line longer than 80, no cell
cut short (rich's `…`, click's `...` in a command summary), one line per option in the help."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_calibration import _calibration_with_trained_router

COMMANDS = ("export", "inspect", "run", "calibrate", "eval", "sources", "build-engines", "bench", "trace")
WIDTH = 80


def edgeroute(*args: str) -> subprocess.CompletedProcess:
    """The CLI as a user's terminal of 80 columns runs it (output piped: rich reads COLUMNS)."""
    env = {**os.environ, "COLUMNS": str(WIDTH), "OMP_NUM_THREADS": "1", "EDGEROUTE_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "edgeroute.cli", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def assert_fits(text: str, what: str) -> None:
    for line in text.splitlines():
        assert len(line.rstrip()) <= WIDTH, f"{what}: a line of {len(line.rstrip())} columns: {line!r}"
        assert "…" not in line, f"{what}: a cut cell: {line!r}"


def test_every_help_fits_80_columns_with_one_line_per_option():
    overview = edgeroute("--help")
    assert overview.returncode == 0, overview.stderr
    assert_fits(overview.stdout, "edgeroute --help")
    summaries = overview.stdout.split("Commands:")[1].splitlines()[1:]
    assert {line.split()[0] for line in summaries if line.strip()} == set(COMMANDS)
    assert not [line for line in summaries if line.rstrip().endswith("...")], overview.stdout  # a cut summary
    for command in COMMANDS:
        shown = edgeroute(command, "--help")
        assert shown.returncode == 0, shown.stderr
        assert_fits(shown.stdout, f"edgeroute {command} --help")
        options = shown.stdout.split("Options:")[1].splitlines()
        continued = [line for line in options if line.startswith("   ")]
        assert not continued, f"edgeroute {command} --help: an option's help runs over a line: {continued}"
        assert sum(line.startswith("  --") for line in options) >= 2


def test_inspect_fits_80_columns_calibrated_or_not_and_gives_json(tiny_slm_bundle, tmp_path):
    plain = edgeroute("inspect", str(tiny_slm_bundle))
    assert plain.returncode == 0, plain.stderr
    assert_fits(plain.stdout, "inspect")
    assert "uncalibrated" in plain.stdout and "source sha256:" in plain.stdout
    calibrated = Path(shutil.copytree(tiny_slm_bundle, tmp_path / "bundle"))
    _calibration_with_trained_router(calibrated)
    shown = edgeroute("inspect", str(calibrated))
    assert shown.returncode == 0, shown.stderr
    assert_fits(shown.stdout, "inspect (calibrated)")
    assert "calibrated routers" in shown.stdout and "speculate/ngram" in shown.stdout  # the tables' cells, whole
    summary = json.loads(edgeroute("inspect", str(calibrated), "--json").stdout)
    assert set(summary["models"]) == {"llm", "slm"} and summary["calibration"]["routers"]["slm"]["threshold"] == 0.42


def test_inspect_shows_a_bundle_path_with_brackets_as_it_is(tiny_slm_bundle, tmp_path):
    # rich reads [text] as markup and drops it: the path has to be printed as text
    bundle = Path(shutil.copytree(tiny_slm_bundle, tmp_path / "bundle[v2]"))
    shown = edgeroute("inspect", str(bundle))
    assert shown.returncode == 0, shown.stderr
    assert f"{bundle}: format" in shown.stdout.replace("\n", "")


def test_eval_fits_80_columns_with_every_cell_whole(tiny_slm_bundle, tmp_path):
    calibrated = Path(shutil.copytree(tiny_slm_bundle, tmp_path / "bundle"))
    _calibration_with_trained_router(calibrated)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"{task}-{i}", "task": task, "prompt": "one two three",
                                         "assert": [{"type": "regex", "value": "."}]}) + "\n"
                             for task in ("json", "templated") for i in range(2)))
    shown = edgeroute("eval", str(calibrated), "--tasks", str(tasks), "--max-new-tokens", "4",
                      "--modes", "full,speculate/ngram+slm,route/slm,auto")
    assert shown.returncode == 0, shown.stderr
    assert_fits(shown.stdout, "eval")
    rows = [line.split()[:3] for line in shown.stdout.splitlines()]
    for mode in ("full", "speculate/ngram+slm", "route/slm", "auto"):  # each mode's row whole, not folded
        assert rows.count([mode, "4/4", "(40-100%)"]) == 1, shown.stdout  # over all cases
        assert rows.count([mode, "2/2", "(16-100%)"]) == 2, shown.stdout  # per task


def test_run_and_sources_fit_80_columns(tiny_slm_bundle):
    ran = edgeroute("run", str(tiny_slm_bundle), "--prompt", "Navigate to 221B Baker Street", "--max-new-tokens", "6",
                    "--profile", "cpu,voice-command")
    assert ran.returncode == 0, ran.stderr
    assert_fits(ran.stderr, "run's summary")  # stdout is the model's answer
    assert "6 tokens" in ran.stderr
    sources = edgeroute("sources")
    assert sources.returncode == 0, sources.stderr
    assert_fits(sources.stdout, "sources")
    assert "qwen2.5-coder-1.5b" in sources.stdout and "part packages:" in sources.stdout


@pytest.mark.slow
def test_export_fits_80_columns(tiny_models, tmp_path):
    out = tmp_path / "bundle"
    exported = edgeroute("export", "--llm", str(tiny_models["llama"][0]), "--no-slm", "--quant", "int4-rtn",
                         "--parity-tokens", "32", "--out", str(out))
    assert exported.returncode == 0, exported.stderr
    assert_fits(exported.stdout, "export")
    assert "top-1 agreement:" in exported.stdout and (out / "manifest.json").is_file()
