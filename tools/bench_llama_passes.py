"""llama.cpp's forward of 4 tokens against 1 on a bundle's LLM (its source GGUF, checked), after
a 96-token prefix, the two lengths alternated round by round: what a speculative verification
pass costs in llama.cpp. The peer of ``tools/bench_passes.py`` (edgeroute's passes, same prefix).

    python -m tools.bench_llama_passes --bundle bundles/qwen-pair --threads 1 --rounds 12 --logits all --out passes.json

``--logits all``: logits of every row (what a verification reads), ``last``: of the last only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools.benchlib, when run as a script

from edgeroute.files import atomic_write  # noqa: E402
from tools.benchlib.decoding import llama_passes_summary  # noqa: E402
from tools.benchlib.llama import checked_gguf, open_llama  # noqa: E402

PREFIX = 96
REPEATS = 5  # passes per timing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", type=Path, required=True)
    parser.add_argument("--gguf", type=Path, help="the LLM's source GGUF (default: the path the bundle recorded)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--logits", choices=("all", "last"), default="all")
    parser.add_argument("--out", type=Path, default=Path("bench-llama-passes.json"))
    args = parser.parse_args(argv)
    gguf = checked_gguf(args.bundle, "llm", args.gguf)
    llm = open_llama(gguf, args.threads, 512, logits_all=args.logits == "all")
    ids = [(i * 7919) % 20000 + 100 for i in range(PREFIX + 4)]
    llm.eval(ids[:PREFIX])
    times: dict[int, list[float]] = {1: [], 4: []}
    for r in range(-1, args.rounds):  # round -1 warms up
        for m in (1, 4):
            start = time.perf_counter()
            for _ in range(REPEATS):
                llm.n_tokens = PREFIX
                llm.eval(ids[PREFIX:PREFIX + m])
            if r >= 0:
                times[m].append((time.perf_counter() - start) / REPEATS * 1e3)
    result = {"gguf": str(gguf), "threads": args.threads, "logits": args.logits, "m1_ms": times[1], "m4_ms": times[4]}
    result["summary"] = summary = llama_passes_summary(result)
    print(f"llama.cpp, {args.threads} thread(s), logits of {args.logits}: M=1 {summary['m1_ms_median']} ms  "
          f"M=4 {summary['m4_ms_median']} ms  M4/M1 {summary['m4_over_m1_median']} "
          f"({summary['quartiles'][0]}-{summary['quartiles'][1]})")
    atomic_write(args.out, json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
