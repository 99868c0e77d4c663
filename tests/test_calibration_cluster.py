"""`edgeroute calibrate --executor ray`: label shards as Ray tasks, the same as a local run."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from edgeroute.bundle import MANIFEST, Bundle
from edgeroute.calibration.calibrate import CalibrateOptions, calibrate
from edgeroute.calibration.labels import Labels, LabelSettings, label_prompts, plan_shards, shard_path
from edgeroute.calibration.prompts import builtin_prompts
from edgeroute.cli import app
from edgeroute.errors import InputError
from edgeroute.runtime import Engine

runner = CliRunner()
needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                               reason="Ray is not installed: pip install 'edgeroute[cluster]' (make setup does)")
# what `calibrate --prompts-per-task 2 --answer-tokens 8 --path-checks 2` labels: 12 prompts, 2 shards
CLI_FLAGS = ["--prompts-per-task", "2", "--answer-tokens", "8", "--path-checks", "2"]
SETTINGS = LabelSettings(max_answer_tokens=8, path_checks=2)
TASK_TITLE = b"ray::label_on_worker"  # a Ray worker's process title while it runs a shard


def prompts():
    return builtin_prompts(2)


def assert_same_labels(got: Labels, want: Labels) -> None:
    assert got.prompt_ids == want.prompt_ids
    assert got.arrays.keys() == want.arrays.keys()
    for key in want.arrays:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def assert_same_shard_files(got: Path, want: Path) -> None:
    """The same shard files holding the same arrays (np.savez stamps its zip entries with the
    time of writing, so the bytes differ where the arrays do not)."""
    names = sorted(p.name for p in want.glob("*.npz"))
    assert names and names == sorted(p.name for p in got.glob("*.npz"))
    assert not list(got.glob(".*.tmp")), "a partial shard was left behind"
    for name in names:
        with np.load(got / name) as a, np.load(want / name) as b:
            assert a.files == b.files
            for key in b.files:
                np.testing.assert_array_equal(a[key], b[key], err_msg=f"{name}: {key}")


@pytest.fixture(scope="module")
def local_labels(tiny_engine, tmp_path_factory) -> Labels:
    labels = label_prompts(tiny_engine, prompts(), SETTINGS, tmp_path_factory.mktemp("local-shards"))
    assert len(plan_shards(tiny_engine, prompts(), SETTINGS)) == 2
    assert (labels["slm_token"] != labels["llm_token"]).any(), "the SLM always agrees: the labels would prove nothing"
    return labels


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray of 2 CPUs for the module's tests (starting one takes ~15 s on 2 cores)."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def _our_processes() -> dict[int, bytes]:
    """This test process's descendants (the Ray it started, its workers): pid -> command line."""
    parents, lines = {}, {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                lines[int(entry.name)] = (entry / "cmdline").read_bytes()
            except (OSError, IndexError, ValueError):
                continue  # ended while read
    ours, grown = {os.getpid()}, True
    while grown:
        found = {pid for pid, parent in parents.items() if parent in ours} - ours
        ours |= found
        grown = bool(found)
    return {pid: lines[pid] for pid in ours - {os.getpid()} if pid in lines}


def test_ray_without_ray_installed_says_how_to_install_it(monkeypatch, tiny_slm_bundle):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray fails as where it is not installed
    with pytest.raises(InputError, match=r"needs Ray.*pip install 'edgeroute\[cluster\]'"):
        calibrate(tiny_slm_bundle, CalibrateOptions(executor="ray"))
    result = runner.invoke(app, ["calibrate", str(tiny_slm_bundle), "--executor", "ray"])
    assert result.exit_code == 2 and "pip install 'edgeroute[cluster]'" in " ".join(result.output.split())
    assert "Traceback" not in result.output


def test_ray_settings_without_the_ray_executor_are_clear_errors(tiny_slm_bundle):
    for flags, message in ((["--address", "auto"], "add --executor ray"), (["--workers", "2"], "add --executor ray"),
                           (["--executor", "dask"], "executor 'dask' is not one of local, ray")):
        result = runner.invoke(app, ["calibrate", str(tiny_slm_bundle), *flags])
        assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output


@needs_ray
def test_calibrate_on_ray_writes_the_local_runs_shards_and_thresholds(tiny_slm_bundle, tmp_path):
    """The CLI with --executor ray on a local Ray it starts (2 workers) against the Python API
    with the local executor: the same shard arrays and the same fitted thresholds."""
    import ray

    assert not ray.is_initialized()  # so the run starts (and stops) its own local Ray
    budget = ["--budget", "0.6", "--validation-prompts", "1", "--skip-prompts", "0"]
    on_ray = Path(shutil.copytree(tiny_slm_bundle, tmp_path / "ray-bundle"))
    result = runner.invoke(app, ["calibrate", str(on_ray), "--work", str(tmp_path / "ray-work"), *CLI_FLAGS, *budget,
                                 "--executor", "ray", "--workers", "2"])
    assert result.exit_code == 0, result.output
    assert not ray.is_initialized()
    local = Path(shutil.copytree(tiny_slm_bundle, tmp_path / "local-bundle"))
    calibrate(local, CalibrateOptions(budget=0.6, builtin_per_task=2, labels=SETTINGS, work=tmp_path / "local-work",
                                      validation_prompts_per_task=1, skip_prompts=0))
    assert_same_shard_files(tmp_path / "ray-work" / "shards", tmp_path / "local-work" / "shards")
    ray_routers, local_routers = Bundle.open(on_ray).calibration.routers, Bundle.open(local).calibration.routers
    assert local_routers, "no router met the budget: the thresholds would prove nothing"
    assert {light: (r.router, r.threshold) for light, r in ray_routers.items()} == {
        light: (r.router, r.threshold) for light, r in local_routers.items()}


@needs_ray
def test_a_worker_killed_mid_shard_leaves_no_partial_shard_and_its_retry_labels_the_same(
        local_ray, tiny_engine, local_labels, tmp_path):
    from edgeroute.calibration.cluster import RayExecutor

    killed: list[tuple[int, bytes]] = []

    def kill_the_second_shards_worker() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            busy = [pid for pid, line in _our_processes().items() if line.startswith(TASK_TITLE)]
            if busy:
                environment = Path(f"/proc/{busy[0]}/environ").read_bytes()
                os.kill(busy[0], signal.SIGKILL)
                killed.append((busy[0], environment))
                return
            time.sleep(0.005)

    def progress(task: str, done: int, total: int) -> None:
        if task == "label shards" and done == 1:  # the worker has its engine: the kill lands mid-labelling
            threading.Thread(target=kill_the_second_shards_worker, daemon=True).start()

    labels = label_prompts(tiny_engine, prompts(), SETTINGS, tmp_path / "shards", progress, RayExecutor(workers=1))
    assert killed, "no shard's worker was seen running: nothing was killed, the test would prove nothing"
    assert b"EDGEROUTE_THREADS=1\0" in killed[0][1]  # the worker ran the runtime on its one CPU
    assert_same_labels(labels, local_labels)
    assert sorted(p.name for p in (tmp_path / "shards").iterdir()) == sorted(
        shard_path(tmp_path / "shards", s).name for s in plan_shards(tiny_engine, prompts(), SETTINGS))


@needs_ray
def test_a_killed_driver_resumes_from_its_finished_shards(local_ray, tiny_slm_bundle, tiny_engine, local_labels,
                                                          tmp_path):
    """A driver (the CLI on the module's Ray) killed after its first shard; the rerun labels
    only the other one, on Ray, and equals an uninterrupted local run."""
    from edgeroute.calibration.cluster import RayExecutor

    shards = tmp_path / "work" / "shards"
    driver = subprocess.Popen(
        [sys.executable, "-m", "edgeroute.cli", "calibrate", str(tiny_slm_bundle), "--work", str(tmp_path / "work"),
         *CLI_FLAGS, "--executor", "ray", "--address", local_ray.get_runtime_context().gcs_address, "--workers", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 90
        while not list(shards.glob("*.npz")) and driver.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        driver.kill()
        _, stderr = driver.communicate()
    finished = list(shards.glob("*.npz"))
    assert len(finished) == 1, f"the driver did not stop after one shard of two: {stderr.decode()[-2000:]}"
    first = finished[0].stat()
    labels = label_prompts(tiny_engine, prompts(), SETTINGS, shards, executor=RayExecutor(workers=1))
    assert finished[0].stat().st_mtime_ns == first.st_mtime_ns and finished[0].stat().st_ino == first.st_ino
    assert_same_labels(labels, local_labels)


@needs_ray
def test_a_worker_that_cannot_open_the_bundle_is_a_clear_error(local_ray, tiny_slm_bundle, tmp_path):
    from edgeroute.calibration.cluster import RayExecutor

    path = Path(shutil.copytree(tiny_slm_bundle, tmp_path / "bundle"))
    engine = Engine(path)  # the driver's engine is loaded; the workers open the path themselves
    moved = path.rename(tmp_path / "elsewhere")
    with pytest.raises(InputError, match=rf"worker on .* cannot open the bundle {path}: .*does not exist.*at that path"):
        label_prompts(engine, prompts()[:2], SETTINGS, tmp_path / "shards", executor=RayExecutor(workers=1))
    moved.rename(path)
    manifest = json.loads((path / MANIFEST).read_text())
    (path / "notes.txt").write_text("another bundle")  # another bundle at the same path: other files
    manifest["files"]["notes.txt"] = {"bytes": 14, "sha256": hashlib.sha256(b"another bundle").hexdigest()}
    (path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(InputError, match=rf"bundle at {path} on .* is not the one the driver calibrates"):
        label_prompts(engine, prompts()[:2], SETTINGS, tmp_path / "shards", executor=RayExecutor(workers=1))
    assert not (tmp_path / "shards").exists() or not list((tmp_path / "shards").iterdir())


@needs_ray
@pytest.mark.slow
def test_ray_labels_on_the_demo_bundle_equal_local_ones(local_ray, smollm2_bundles, tmp_path):
    """The demo bundle (native kernels where they build): 2 workers of one thread each label
    what this process labels with all its threads."""
    from edgeroute.calibration.cluster import RayExecutor
    from edgeroute.calibration.labels import uncalibrated_engine

    engine = uncalibrated_engine(Bundle.open(smollm2_bundles["int4"][0]))
    settings = LabelSettings(max_answer_tokens=16, shard_size=2)
    chosen = builtin_prompts(1)[:4]
    local = label_prompts(engine, chosen, settings, tmp_path / "local")
    on_ray = label_prompts(engine, chosen, settings, tmp_path / "ray", executor=RayExecutor(workers=2))
    assert_same_labels(on_ray, local)
    assert_same_shard_files(tmp_path / "ray", tmp_path / "local")
    assert (local["slm_token"] != local["llm_token"]).any(), "the SLM always agrees: the labels would prove nothing"
