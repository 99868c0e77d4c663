"""tools/soak.py's verdict (the full soak is a benchmark, docs/measured: 1,000 turns take ~45
minutes on 2 cores, longer than a test may run): resident memory more than 5% off the warm-up's,
or more open files or threads than after the warm-up, fail the soak; staying within passes."""

from __future__ import annotations

from tools.soak import Sample, verdict

MIB = 2**20


def sample(turn: int, rss_mib: float, files: int = 9, threads: int = 4) -> Sample:
    return Sample(turn, float(turn), int(rss_mib * MIB), files, threads, 16, {})


def test_the_soak_passes_within_five_percent_and_no_growth():
    assert verdict([sample(100, 400), sample(200, 419), sample(300, 381), sample(400, 400, files=8)]) == []


def test_the_soak_fails_on_memory_past_five_percent_either_way():
    failed = verdict([sample(100, 400), sample(200, 421), sample(300, 379)])
    assert len(failed) == 2 and "turn 200: RSS" in failed[0] and "+5.2%" in failed[0] and "-5.2%" in failed[1]


def test_the_soak_fails_on_more_open_files_or_threads_than_after_the_warm_up():
    failed = verdict([sample(100, 400), sample(200, 400, files=10), sample(300, 400, threads=5)])
    assert failed == ["turn 200: 10 open files, 9 after the warm-up", "turn 300: 5 threads, 4 after the warm-up"]
