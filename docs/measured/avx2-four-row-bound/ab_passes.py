"""Paired pass timing of two builds of libedgeroute: one long-lived process per library
(EDGEROUTE_NATIVE_LIB), each holding the 1.5B after a 96-token prefix; 1- and 4-token passes
(5 each) alternate between them round by round, so a drift of the host hits both alike.

    python ab_passes.py THREADS ROUNDS BEFORE.so AFTER.so   (from the repository root; AB_OUT: JSON path)
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

WORKER = r"""
import sys, time
from edgeroute.runtime import Engine
engine = Engine("bundles/qwen-pair", backend="native", kernels="avx2", threads=int(sys.argv[1]))
prefix = (engine.encode("The driver asked for the route to the station and the assistant answered ") * 8)[:96]
cache = engine.llm.new_cache()
engine.llm.forward(cache, prefix)
print("ready", flush=True)
for line in sys.stdin:
    rows, passes = map(int, line.split())
    start = time.perf_counter()
    for _ in range(passes):
        cache.truncate(96)
        engine.llm.forward(cache, prefix[:rows], tail=rows)
    print((time.perf_counter() - start) / passes * 1e3, flush=True)
"""


def start(library: str, threads: str) -> subprocess.Popen:
    env = dict(os.environ, EDGEROUTE_NATIVE_LIB=library)
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER, threads], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    if worker.stdout.readline().strip() != "ready":
        raise SystemExit(f"{library}: the worker did not start")
    return worker


def timed(worker: subprocess.Popen, rows: int) -> float:
    worker.stdin.write(f"{rows} 5\n")
    worker.stdin.flush()
    return float(worker.stdout.readline())


def main() -> None:
    threads, rounds, libraries = sys.argv[1], int(sys.argv[2]), sys.argv[3:5]
    workers = [start(library, threads) for library in libraries]
    ms = {(b, rows): [] for b in range(2) for rows in (1, 4)}
    for r in range(rounds):
        for rows in (1, 4):
            for b in (0, 1) if r % 2 == 0 else (1, 0):
                ms[(b, rows)].append(timed(workers[b], rows))
    for worker in workers:
        worker.stdin.close()
        worker.wait()
    report = {}
    for b, library in enumerate(libraries):
        one, four = np.array(ms[(b, 1)]), np.array(ms[(b, 4)])
        ratio = four / one
        report[library] = {
            "m1_ms": float(np.median(one)),
            "m4_ms": float(np.median(four)),
            "ratio_median": float(np.median(ratio)),
            "ratio_q": [float(q) for q in np.percentile(ratio, [25, 75])],
            "m1_all": one.tolist(),
            "m4_all": four.tolist(),
        }
        print(
            f"{Path(library).name} threads {threads}: M=1 {np.median(one):.1f} ms  M=4 {np.median(four):.1f} ms  "
            f"M4/M1 {np.median(ratio):.3f} ({np.percentile(ratio, 25):.3f}-{np.percentile(ratio, 75):.3f})"
        )
    for rows in (1, 4):
        paired = np.array(ms[(1, rows)]) / np.array(ms[(0, rows)])
        report[f"paired_m{rows}"] = paired.tolist()
        print(
            f"M={rows} after / before: {np.median(paired):.3f} ({np.percentile(paired, 25):.3f}-{np.percentile(paired, 75):.3f})"
        )
    Path(os.environ.get("AB_OUT", "ab_passes.json")).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
