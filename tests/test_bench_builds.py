"""tools/bench_builds.py: builds of the library timed against each other on a random model of a
real layout (the check for a machine without the bundles: a lent device, a board)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tools import bench_builds

REPO = Path(__file__).resolve().parents[1]
needs_git = pytest.mark.skipif(shutil.which("git") is None or not (REPO / ".git").exists(),
                               reason="not a git checkout: prepare builds commits")


def tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "tools" / "bench_builds.py"), *args], capture_output=True,
                          text=True, cwd=REPO)


def test_run_without_a_prepared_kit_says_to_prepare_one(tmp_path):
    done = tool("run", str(tmp_path))
    assert done.returncode != 0 and "run `prepare` into it first" in done.stderr


@needs_git
def test_prepare_refuses_a_name_that_is_no_commit_or_a_missing_file_before_building(tmp_path):
    done = tool("prepare", str(tmp_path / "kit"), "--commits", "HEAD,no-such-commit")
    assert done.returncode != 0 and "no-such-commit is not a commit" in done.stderr
    done = tool("prepare", str(tmp_path / "kit"), "--commits", "HEAD", "--layout", str(tmp_path / "none.bin"))
    assert done.returncode != 0 and "none.bin: no such native weight file" in done.stderr
    assert not (tmp_path / "kit").exists()  # refused before anything was built


@pytest.mark.slow
def test_a_random_model_keeps_the_layout_and_sets_every_block_scale(smollm2_bundles, tmp_path):
    native = smollm2_bundles["int4"][0] / "llm" / "native.bin"
    layout = bench_builds.write_layout(native, tmp_path / "llm")
    written = bench_builds.random_model(tmp_path / "llm", tmp_path / "model.bin")
    assert written == layout and layout["vocab"] == 49152
    model = (tmp_path / "model.bin").read_bytes()
    assert len(model) == native.stat().st_size and model.startswith((tmp_path / "llm.head").read_bytes())
    import numpy as np

    for t in layout["tensors"]:
        data = np.frombuffer(model, dtype=np.uint8, count=t["nbytes"], offset=t["offset"])
        if t["type"] == "Q4_1":
            blocks = data.reshape(-1, 20)
            scales = blocks[:, :4].copy().view(np.float16)
            assert (scales == np.float16(bench_builds.SCALE)).all(), t["name"]
        elif t["type"] == "F32" and "norm" in t["name"]:
            assert (data.view(np.float32) == 1.0).all(), t["name"]


@pytest.mark.slow
@needs_git
def test_a_build_timed_against_itself_on_the_demo_layout(smollm2_bundles, tmp_path):
    """One commit given twice: one library, two models, every pass length and thread count
    reported for both, the second as a ratio to the first (a null control)."""
    kit, out = tmp_path / "kit", tmp_path / "builds.json"
    native = smollm2_bundles["int4"][0] / "llm" / "native.bin"
    done = tool("prepare", str(kit), "--commits", "HEAD,HEAD", "--layout", f"demo.llm={native}")
    assert done.returncode == 0, done.stderr[-3000:]
    described = json.loads((kit / "kit.json").read_text())
    assert [b["name"] for b in described["builds"]] == ["HEAD", "HEAD #2"] and described["layouts"] == ["demo.llm"]
    assert len(list(kit.glob("lib-*.so"))) == 1
    done = tool("run", str(kit), "--kernels", "generic", "--threads", "1,2", "--contexts", "8", "--m", "1,3",
                "--rounds", "2", "--passes", "1", "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "x HEAD" in done.stdout and "demo.llm" in done.stdout
    report = json.loads(out.read_text())
    cases = {(r["threads"], r["ctx"], r["m"]) for r in report["results"]}
    assert cases == {(1, 8, 1), (1, 8, 3), (2, 8, 1), (2, 8, 3)}
    assert set(report["summary"]["demo.llm threads=2 ctx=8 m=3"]) == {"HEAD", "HEAD #2"}
    for r in report["results"]:
        first, second = r["builds"]
        assert first["x_first"] == 1.0 and len(first["ms"]) == len(second["ms"]) == 2
        assert min(first["ms"] + second["ms"]) > 0 and second["q1"] <= second["x_first"] <= second["q3"]
    done = tool("run", str(kit), "--kernels", "generic", "--contexts", "8", "--m", "3", "--rounds", "1", "--passes", "1",
                "--logits", "last", "--json", str(out))  # a prefill: the last row's logits only
    assert done.returncode == 0, done.stderr[-3000:]
    assert "the last row's logits" in " ".join(done.stdout.split())  # the table's title, however it wraps
    assert json.loads(out.read_text())["logits"] == "last"
    done = tool("run", str(kit), "--kernels", "no-such-set", "--contexts", "8", "--rounds", "1", "--passes", "1")
    assert done.returncode != 0 and "has no kernel set named no-such-set" in done.stderr
