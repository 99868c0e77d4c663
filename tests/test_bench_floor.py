"""edgeroute bench's measured memory floor: the logic, not timings (the machine is shared)."""

from __future__ import annotations

import statistics
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from edgeroute.measure import bench
from edgeroute.measure.bench import BenchOptions, BenchRecord, BenchReport, FloorProbe


def test_the_floor_read_is_larger_than_the_last_level_cache(tmp_path):
    for llc in (None, 8 << 20, 32 << 20, 256 << 20):
        nbytes = bench.floor_buffer_bytes(llc)
        assert nbytes >= bench.FLOOR_MIN_BYTES
        assert nbytes >= bench.FLOOR_CACHE_MULTIPLE * (llc or bench.FALLBACK_LLC_BYTES) > (llc or 0)
    probe = FloorProbe(threads=2, nbytes=None)
    try:
        assert probe.buffer.nbytes >= bench.floor_buffer_bytes(probe.llc_bytes)
        if probe.llc_bytes is not None:
            assert probe.buffer.nbytes > probe.llc_bytes
        assert sum(s.nbytes for s in probe.slices) == probe.buffer.nbytes and len(probe.slices) == 2
    finally:
        probe.close()


def test_the_last_level_cache_is_read_from_sysfs(tmp_path):
    for name, level, kind, size in (("index0", 1, "Data", "48K"), ("index1", 1, "Instruction", "32K"),
                                    ("index2", 2, "Unified", "1024K"), ("index3", 3, "Unified", "32768K")):
        index = tmp_path / name
        index.mkdir()
        (index / "level").write_text(f"{level}\n")
        (index / "type").write_text(f"{kind}\n")
        (index / "size").write_text(f"{size}\n")
    assert bench.llc_bytes(tmp_path) == 32 << 20
    assert bench.llc_bytes(tmp_path / "none") is None


def test_a_floor_read_is_bytes_over_the_fastest_pass():
    ticks = iter([0.0, 0.5, 1.0, 1.25])  # two passes: 0.5 s, then 0.25 s
    probe = FloorProbe(threads=1, nbytes=1 << 20, clock=lambda: next(ticks))
    try:
        gb_s = probe.measure(passes=2)
    finally:
        probe.close()
    assert gb_s == pytest.approx((1 << 20) / 0.25 / 1e9)
    assert probe.samples == [gb_s]


def test_the_share_is_each_runs_gb_s_over_its_own_rounds_floor():
    assert bench.floor_share([10.0, 30.0, 20.0], [40.0, 60.0, 20.0]) == pytest.approx(0.5)  # median of .25 .5 1
    assert bench.floor_share([None, None], [40.0, 60.0]) is None
    with pytest.raises(ValueError):
        bench.floor_share([1.0], [1.0, 2.0])  # one floor read per round, no more, no less


class _Case:
    def __init__(self, name: str, events: list[str]) -> None:
        self.name, self.events = name, events

    def describe(self) -> str:
        return self.name

    def truncate(self, length: int) -> None:
        pass

    def prefill(self, ids):
        self.events.append(self.name)
        return np.zeros(4)

    def step(self, logits):
        return logits


class _Floor:
    def __init__(self, events: list[str], values: list[float]) -> None:
        self.events, self.values, self.samples = events, iter(values), []

    def measure(self) -> float:
        self.events.append("floor")
        self.samples.append(next(self.values))
        return self.samples[-1]


def test_bench_reads_the_floor_once_per_round_between_the_runs_and_records_the_share(monkeypatch):
    events: list[str] = []
    monkeypatch.setattr(bench, "_open_case", lambda bundle, role, backend, options, threads: _Case(backend, events))
    monkeypatch.setattr(bench, "_step_bytes", lambda bundle, role, backend, case: (10**9, None))
    monkeypatch.setattr(bench, "prompt_ids", lambda bundle, n: list(range(n)))
    bundle = SimpleNamespace(path=Path("b"), target=SimpleNamespace(graphs=["x"], name="default"))
    options = BenchOptions(contexts=(8, 16), steps=2, repeats=3, backends=("native", "onnxruntime"))
    report = BenchReport({}, "avx2", 1, "wall", 2, 3, [8, 16], None, None, {})
    floor = _Floor(events, [40.0, 50.0, 60.0, 10.0, 20.0, 30.0])
    bench._bench_model(bundle, "llm", options, 1, None, report, floor=floor)
    timed = events[2:]  # after the warm-up run of each backend
    assert timed.count("floor") == 6  # one per round: 3 repeats x 2 contexts
    rounds = [timed[i:i + 3] for i in range(0, len(timed), 3)]
    assert all(r[0] == "floor" and sorted(r[1:]) == ["native", "onnxruntime"] for r in rounds)
    for record in report.records:
        assert isinstance(record, BenchRecord)
        floors = [40.0, 50.0, 60.0] if record.context == 8 else [10.0, 20.0, 30.0]
        assert record.floor_runs_gb_s == floors
        assert record.floor_gb_s == statistics.median(floors)
        run_gb_s = [10**9 * d / 1e9 for d in record.decode_runs_tok_s]
        assert record.floor_share == pytest.approx(statistics.median(g / f for g, f in zip(run_gb_s, floors, strict=True)))


def test_the_floor_fields_are_in_the_json_and_no_floor_leaves_them_empty(monkeypatch):
    monkeypatch.setattr(bench, "_open_case", lambda bundle, role, backend, options, threads: _Case(backend, []))
    monkeypatch.setattr(bench, "_step_bytes", lambda bundle, role, backend, case: (None, None))
    monkeypatch.setattr(bench, "prompt_ids", lambda bundle, n: list(range(n)))
    bundle = SimpleNamespace(path=Path("b"), target=SimpleNamespace(graphs=["x"], name="default"))
    report = BenchReport({}, "avx2", 1, "wall", 1, 1, [4], None, None, {})
    bench._bench_model(bundle, "llm", BenchOptions(contexts=(4,), steps=1, repeats=1, backends=("native",)), 1, None,
                       report, floor=None)
    fields = report.to_dict()["records"][0]
    assert {"floor_gb_s", "floor_runs_gb_s", "floor_share"} <= set(fields)
    assert fields["floor_gb_s"] is None and fields["floor_runs_gb_s"] == [] and fields["floor_share"] is None
    assert BenchOptions().floor is True and "floor" in report.to_dict()
