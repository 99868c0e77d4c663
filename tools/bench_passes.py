"""What a multi-token pass of the LLM costs against a one-token step: speculative verification
and short prefills on the native kernels, per kernel set and thread count.

One case = one process (OpenMP's pool is sized once per process) of ``Engine(backend="native",
kernels=..., threads=...)``: the calibration's own cost measurement
(``edgeroute.calibration.drafting.measure_costs``) times an SLM step and LLM passes of 1 .. 9
tokens after a 96-token prefix, every pass length in turn within each repeat (medians), so a
drift of the machine's pace hits them alike and the ratios hold where absolute times do not.
"pass rows" is what the kernels serve in one pass over the weights (``er_model_info``), and
with it the runtime's longest default draft (``drafters.longest_draft``).

Prints a table, writes JSON (``--out``) and a PNG of pass(M) / pass(1) over M beside it.

    python tools/bench_passes.py bundles/qwen-pair --kernels avx2 --threads 1,2 --out passes.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

LONGEST = 8  # drafted tokens: passes of 1 .. LONGEST + 1 rows


def worker(spec: dict) -> dict:
    from edgeroute.calibration.drafting import measure_costs
    from edgeroute.runtime import Engine
    from edgeroute.runtime.drafters import longest_draft

    engine = Engine(spec["bundle"], backend="native", kernels=spec["kernels"], threads=spec["threads"])
    costs = measure_costs(engine, repeats=spec["repeats"], longest=LONGEST)
    return {**spec, "kernels_run": engine.llm.kernels, "pass_rows": engine.llm.pass_rows,
            "longest_default_draft": longest_draft(engine.llm.pass_rows),
            "slm_step_ms": costs.slm_step * 1e3, "pass_ms": [p * 1e3 for p in costs.passes]}


def run_case(spec: dict) -> dict:
    out = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"case {spec} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def plot(path: Path, records: list[dict]) -> None:
    from edgeroute.plots import pyplot

    plt = pyplot()

    figure, axes = plt.subplots(figsize=(7, 4.2))
    for r in records:
        rows = range(1, len(r["pass_ms"]) + 1)
        axes.plot(rows, [p / r["pass_ms"][0] for p in r["pass_ms"]], marker="o",
                  label=f"{r['kernels_run']}, {r['threads']} thread(s) (pass rows {r['pass_rows']})")
    axes.axhline(1.25, color="grey", linestyle=":", label="1.25x")
    axes.set_xlabel("tokens in the pass (M)")
    axes.set_ylabel("pass(M) / pass(1)")
    axes.set_title(f"{Path(records[0]['bundle']).name}: LLM pass cost over its length")
    axes.legend(fontsize=8)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bundle", nargs="?")
    parser.add_argument("--kernels", default="auto", help="comma-separated native kernel sets")
    parser.add_argument("--threads", default="1", help="comma-separated thread counts")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", type=Path, default=Path("bench-passes.json"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    if not args.bundle:
        parser.error("a bundle is required")

    from rich.console import Console
    from rich.table import Table

    records = []
    for kernels in args.kernels.split(","):
        for threads in (int(t) for t in args.threads.split(",")):
            records.append(run_case({"bundle": args.bundle, "kernels": kernels, "threads": threads,
                                     "repeats": args.repeats}))
    table = Table(title=f"{args.bundle}: LLM passes of M tokens against one (medians of {args.repeats})")
    for column in ("kernels", "threads", "pass rows", "M=1 ms", *(f"M={m}" for m in range(2, LONGEST + 2)),
                   "SLM step / M=1"):
        table.add_column(column, justify="right")
    for r in records:
        first = r["pass_ms"][0]
        table.add_row(r["kernels_run"], str(r["threads"]), str(r["pass_rows"]), f"{first:.1f}",
                      *(f"{p / first:.2f}" for p in r["pass_ms"][1:]), f"{r['slm_step_ms'] / first:.2f}")
    Console(width=max(Console().width, 140)).print(table)
    args.out.write_text(json.dumps(records, indent=2))
    plot(args.out.with_suffix(".png"), records)
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
