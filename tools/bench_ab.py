"""Two checkouts of edgeroute, paired: decode tok/s of the same runtime and bundle, A against B.

A change to the runtime (the native library, the binding) is judged against the code before
it: give both checkouts (``git worktree add ../base main`` makes one of the previous main) and
each case runs in a fresh process of each checkout (its own ``tools/bench_context.py --worker``
with its own package on ``PYTHONPATH``), alternating A, B / B, A round by round, so load from
other work hits both alike. "B / A" is the median over rounds of each round's ratio, with its
quartiles; a round's two cases ran back to back.

``--clock cpu --threads 1`` times the process's CPU time instead of the wall clock (a machine
shared with other work). Prints a table, writes JSON (``--out``) and a PNG of the ratios.

    python tools/bench_ab.py --a ../base --b . --bundle bundles/smollm2-demo --contexts 32,1800
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path


def run_case(checkout: Path, spec: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    env.pop("EDGEROUTE_NATIVE_LIB", None)
    out = subprocess.run([sys.executable, str(checkout / "tools" / "bench_context.py"), "--worker", json.dumps(spec)],
                         capture_output=True, text=True, env=env, cwd=checkout)
    if out.returncode != 0:
        raise SystemExit(f"{checkout}: case {spec} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def plot(path: Path, title: str, rows: list[dict]) -> None:
    from edgeroute.plots import pyplot

    plt = pyplot()

    figure, axis = plt.subplots(figsize=(6, 3.5))
    labels = [str(r["context"]) for r in rows]
    medians = [r["ratio"] for r in rows]
    errors = [[r["ratio"] - r["q1"] for r in rows], [r["q3"] - r["ratio"] for r in rows]]
    axis.bar(labels, medians, yerr=errors, capsize=4, color="#4c72b0")
    axis.axhline(1.0, color="black", linewidth=0.8)
    axis.set_xlabel("context (tokens)")
    axis.set_ylabel("decode tok/s, B / A")
    axis.set_title(title, fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", type=Path, required=True, help="the baseline checkout")
    parser.add_argument("--b", type=Path, default=Path("."), help="the checkout under test")
    parser.add_argument("--bundle", type=Path, default=Path("bundles/smollm2-demo"))
    parser.add_argument("--runtime", default="edgeroute:native", help="a bench_context runtime, e.g. edgeroute:native:float16")
    parser.add_argument("--contexts", default="32,1800")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    parser.add_argument("--out", type=Path, default=Path("bench-ab.json"))
    args = parser.parse_args(argv)
    a, b = args.a.resolve(), args.b.resolve()
    bundle = args.bundle.resolve()
    base = {"bundle": str(bundle), "gguf": "", "threads": args.threads, "clock": args.clock,
            "tokenizer": str(bundle / "tokenizer.json"), "runtime": args.runtime, "steps": args.steps}
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        rates: dict[str, list[float]] = {"a": [], "b": []}
        for round_ in range(args.rounds):
            order = (("a", a), ("b", b)) if round_ % 2 == 0 else (("b", b), ("a", a))
            for name, checkout in order:
                rates[name].append(run_case(checkout, {**base, "tokens": context})["decode_tok_s"])
        ratios = [rb / ra for ra, rb in zip(rates["a"], rates["b"], strict=True)]
        q1, ratio, q3 = quartiles(ratios)
        rows.append({"context": context, "a_tok_s": statistics.median(rates["a"]), "b_tok_s": statistics.median(rates["b"]),
                     "ratio": ratio, "q1": q1, "q3": q3, "rounds": rates})
        print(f"context {context:5d}: A {rows[-1]['a_tok_s']:7.1f} tok/s  B {rows[-1]['b_tok_s']:7.1f} tok/s  "
              f"B/A {ratio:.3f} ({q1:.3f}-{q3:.3f})", flush=True)
    title = f"{args.runtime} on {bundle.name}, {args.threads} threads, {args.clock} clock, {args.rounds} rounds"
    result = {"a": str(a), "b": str(b), "settings": vars(args) | {"a": str(a), "b": str(b), "bundle": str(bundle),
                                                                "out": str(args.out)}, "rows": rows}
    args.out.write_text(json.dumps(result, indent=2, default=str))
    plot(args.out.with_suffix(".png"), title, rows)
    print("\n| context | A tok/s | B tok/s | B / A (quartiles) |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['context']} | {r['a_tok_s']:.1f} | {r['b_tok_s']:.1f} | {r['ratio']:.3f} ({r['q1']:.3f}-{r['q3']:.3f}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
