"""Label generation on the local executor vs Ray tasks: wall time, per-shard time, Ray's cost.

Each configuration runs in its own process (the runtime's thread count is fixed per process)
and labels the same shards of the built-in prompts into a fresh directory:

- ``local``: ``edgeroute calibrate``'s default executor, ``--threads`` runtime threads;
- ``ray``: ``--executor ray`` on a local Ray started in that process (its start is timed on
  its own), ``--workers`` tasks in flight of one CPU and one runtime thread each.

From the driver's progress callbacks: when each shard was on disk. ``first shard`` holds the
one-time costs (on Ray: starting worker processes, each opening the bundle); ``per shard`` is
the time from the end of the first round (the first shard per worker) to the last shard over
the shards after that round: the steady rate, one-time costs left out. Ray's overhead per
shard is its 1-worker per-shard time minus the local executor's with 1 thread (both label one
shard at a time on one thread), and, apart from the labelling's noise, the median time of a
Ray task that returns one shard's arrays. ``same`` compares every label array with the first
configuration's. The machine may be shared: the load average is recorded beside the figures.

    python tools/bench_label_executors.py --bundle bundles/smollm2-demo --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

CONFIGS = {"local 2 threads": ["local", "2"], "local 1 thread": ["local", "1"],
           "ray 1 worker x 1 thread": ["ray", "1"], "ray 2 workers x 1 thread": ["ray", "2"]}


def run_one(args: argparse.Namespace) -> None:
    """One configuration, in this process: print its figures as one JSON line."""
    from edgeroute.bundle import Bundle
    from edgeroute.calibration.labels import LabelSettings, label_prompts, uncalibrated_engine
    from edgeroute.calibration.prompts import builtin_prompts

    executor, count = args.one
    executor_object, ray_start = None, None
    if executor == "ray":
        import logging

        import ray

        from edgeroute.calibration.cluster import RayExecutor

        start = time.perf_counter()
        ray.init(num_cpus=int(count), include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
        ray_start = time.perf_counter() - start
        executor_object = RayExecutor(workers=int(count))
    engine = uncalibrated_engine(Bundle.open(args.bundle))
    settings = LabelSettings(max_answer_tokens=args.answer_tokens, shard_size=args.shard_size)
    prompts = builtin_prompts(args.prompts_per_task)[:args.shards * args.shard_size]
    finished: list[float] = []

    def progress(task: str, done: int, total: int) -> None:
        if task == "label shards" and done:
            finished.append(time.perf_counter() - start)

    start = time.perf_counter()
    labels = label_prompts(engine, prompts, settings, Path(args.out), progress, executor_object)
    wall = time.perf_counter() - start
    in_flight = 1 if executor == "local" else int(count)
    per_shard = (finished[-1] - finished[in_flight - 1]) / (len(finished) - in_flight)
    np.savez(Path(args.out) / "labels.npz", **labels.arrays)
    print(json.dumps({"wall_s": wall, "ray_start_s": ray_start, "first_shard_s": finished[0], "per_shard_s": per_shard,
                      "shards": len(finished), "positions": len(labels), "loadavg": os.getloadavg(),
                      "round_trip_ms": round_trip_ms(labels.arrays, args.shards) if executor == "ray" else None}))


def round_trip_ms(arrays: dict[str, np.ndarray], shards: int, repeats: int = 20) -> float:
    """Median milliseconds of a Ray task that returns one shard's worth of label arrays (what a
    shard costs on Ray besides labelling: submission, scheduling, the result's transfer)."""
    import ray

    shard = {key: value[:len(value) // shards] for key, value in arrays.items()}
    stored = ray.put(shard)
    echo = ray.remote(lambda arrays: arrays).options(num_cpus=1)
    ray.get(echo.remote(stored))  # a worker started
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        ray.get(echo.remote(stored))
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle", default="bundles/smollm2-demo")
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--shard-size", type=int, default=4)
    parser.add_argument("--prompts-per-task", type=int, default=6)
    parser.add_argument("--answer-tokens", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--configs", default=",".join(CONFIGS), help="a comma-separated subset of: "
                        + "; ".join(CONFIGS) + " (the first is the reference)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        return run_one(args)
    console = Console(width=110)
    chosen = [name.strip() for name in args.configs.split(",")]
    unknown = sorted(set(chosen) - set(CONFIGS))
    if unknown:
        parser.error(f"unknown configurations {unknown}; known: {list(CONFIGS)}")
    in_flight = max(int(CONFIGS[name][1]) if CONFIGS[name][0] == "ray" else 1 for name in chosen)
    if args.shards <= in_flight:
        parser.error(f"--shards {args.shards} leaves no shard after the first round of {in_flight} in flight: the "
                     f"steady per-shard rate needs more than {in_flight}")
    runs: dict[str, list[dict]] = {name: [] for name in chosen}
    reference = None
    with tempfile.TemporaryDirectory() as root:
        for round_ in range(args.rounds):  # configurations interleaved: a busy spell hits all alike
            for name in chosen:
                executor, count = CONFIGS[name]
                out = Path(root) / f"{round_}-{executor}-{count}"
                threads = count if executor == "local" else "1"
                command = [sys.executable, __file__, "--one", executor, count, "--out", str(out), "--bundle",
                           args.bundle, "--shards", str(args.shards), "--shard-size", str(args.shard_size),
                           "--prompts-per-task", str(args.prompts_per_task), "--answer-tokens", str(args.answer_tokens)]
                console.print(f"[dim]round {round_ + 1}/{args.rounds}: {name}...[/]")
                done = subprocess.run(command, capture_output=True, text=True, check=True,
                                      env={**os.environ, "EDGEROUTE_THREADS": threads, "OMP_NUM_THREADS": threads})
                figures = json.loads(done.stdout.strip().splitlines()[-1])
                with np.load(out / "labels.npz") as data:
                    arrays = {key: data[key] for key in data.files}
                reference = reference or arrays
                figures["same"] = all(np.array_equal(arrays[k], reference[k]) for k in reference)
                runs[name].append(figures)
    results = {name: {key: statistics.median(r[key] for r in rs) if rs[0][key] is not None else None
                      for key in ("wall_s", "ray_start_s", "first_shard_s", "per_shard_s")}
               | {"same": all(r["same"] for r in rs), "runs": rs} for name, rs in runs.items()}
    local_one, ray_one = results.get("local 1 thread"), results.get("ray 1 worker x 1 thread")
    overhead = ray_one["per_shard_s"] - local_one["per_shard_s"] if local_one and ray_one else None
    trips = [r["round_trip_ms"] for name in chosen if name.startswith("ray") for r in runs[name]]
    round_trip = statistics.median(trips) if trips else None
    table = Table(title=f"label generation: {args.shards} shards of {args.shard_size} prompts, {args.answer_tokens} "
                        f"answer tokens, {args.bundle}; medians of {args.rounds} rounds")
    for column in ("executor", "Ray start", "first shard", "per shard", "labelling", f"vs {chosen[0]}", "same"):
        table.add_column(column)
    base = results[chosen[0]]["wall_s"]
    for name, r in results.items():
        start = "-" if r["ray_start_s"] is None else f"{r['ray_start_s']:.1f} s"
        table.add_row(name, start, f"{r['first_shard_s']:.1f} s", f"{r['per_shard_s']:.2f} s", f"{r['wall_s']:.1f} s",
                      f"{base / r['wall_s']:.2f}x", "yes" if r["same"] else "NO")
    console.print(table)
    load = [r["loadavg"][0] for rs in runs.values() for r in rs]
    if overhead is not None:
        console.print(f"Ray's overhead per shard (1 worker vs local, 1 thread each): {overhead:+.2f} s "
                      f"({overhead / local_one['per_shard_s']:+.1%})")
    if round_trip is not None:
        console.print(f"a Ray task returning one shard's arrays: {round_trip:.1f} ms")
    console.print(f"1-minute load average {min(load):.1f}-{max(load):.1f}")
    if args.json:
        args.json.write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items()}, "results": results,
                                         "ray_overhead_per_shard_s": overhead, "round_trip_ms": round_trip},
                                        indent=2))


if __name__ == "__main__":
    main()
