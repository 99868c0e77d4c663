"""A soak: many chat turns on one engine, mixing ``full``, ``speculate`` (the SLM drafting) and
structured output (a JSON schema, speculated), with conversations opened and closed as an app
does. After a warm-up, the process's resident memory must stay within +-5% of what it was when
the warm-up ended, and its open files and threads must not grow. Prints a table of the samples
and the verdict; exits 1 where a check fails.

    python -m tools.soak --bundle bundles/smollm2-demo --turns 1000

Each conversation runs ``--turns-per-chat`` turns (then its sessions are closed and a new one
opens), each turn ``--max-new-tokens`` new tokens at temperature 0, with ``context_policy=
"drop_oldest"`` so that long conversations forget their oldest exchanges instead of failing.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from edgeroute.runtime import Engine

QUESTIONS = ["Give me one tip for staying awake on a long drive.", "What is the capital of France?",
             "Name a fruit that is yellow.", "How many legs does a spider have?", "Say hello in Spanish.",
             "What colour is the sky on a clear day?", "Suggest a name for a cat.", "What is 7 times 6?"]
SCHEMA = {"type": "json_schema", "json_schema": {"schema": {
    "type": "object", "properties": {"answer": {"type": "string", "maxLength": 40}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"], "additionalProperties": False}}}
# turn kinds, in rotation: name -> the decoding options of the turn
KINDS = {"full": {"mode": "full"},
         "speculate": {"mode": "speculate", "light": "slm"},
         "structured": {"mode": "speculate", "light": "slm", "response_format": SCHEMA}}


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


@dataclass
class Sample:
    turn: int
    seconds: float
    rss: int
    files: int
    threads: int
    tokens: int  # new tokens since the previous sample
    kinds: dict[str, int]  # turns of each kind since the previous sample


def soak(bundle: str, turns: int, every: int, warmup: int, per_chat: int, max_new_tokens: int, backend: str,
         progress=print) -> tuple[list[Sample], list[str]]:
    """Runs the turns; returns the samples (one at the end of the warm-up, then every ``every``
    turns) and the failed checks (empty: the soak passed)."""
    engine = Engine(bundle, backend=backend)
    samples: list[Sample] = []
    start, tokens, kinds = time.perf_counter(), 0, dict.fromkeys(KINDS, 0)
    chat = None
    for turn in range(1, turns + 1):
        if (turn - 1) % per_chat == 0:
            chat = None  # the conversation's sessions go with it (its KV caches freed)
            chat = engine.chat(system="You are a brief assistant.", context_policy="drop_oldest", temperature=0.0)
        kind = list(KINDS)[turn % len(KINDS)]
        generation = chat.generate(QUESTIONS[turn % len(QUESTIONS)], max_new_tokens=max_new_tokens, **KINDS[kind])
        tokens += len(generation.tokens)
        kinds[kind] += 1
        if turn in (warmup, turns) or (turn > warmup and (turn - warmup) % every == 0):
            gc.collect()
            samples.append(Sample(turn, time.perf_counter() - start, rss_bytes(), open_files(), threads(), tokens, kinds))
            tokens, kinds = 0, dict.fromkeys(KINDS, 0)
            progress(row(samples[-1], samples[0]))
    return samples, verdict(samples)


def verdict(samples: list[Sample]) -> list[str]:
    base = samples[0]
    failed = []
    for s in samples[1:]:
        if abs(s.rss / base.rss - 1) > 0.05:
            failed.append(f"turn {s.turn}: RSS {s.rss / 2**20:.1f} MiB is {100 * (s.rss / base.rss - 1):+.1f}% of "
                          f"{base.rss / 2**20:.1f} MiB after the warm-up (allowed: +-5%)")
        if s.files > base.files:
            failed.append(f"turn {s.turn}: {s.files} open files, {base.files} after the warm-up")
        if s.threads > base.threads:
            failed.append(f"turn {s.turn}: {s.threads} threads, {base.threads} after the warm-up")
    return failed


HEADER = f"{'turn':>6} {'seconds':>8} {'RSS MiB':>8} {'vs warm':>8} {'files':>6} {'threads':>7} {'tokens':>7}  kinds"


def row(s: Sample, base: Sample) -> str:
    kinds = " ".join(f"{k}:{n}" for k, n in s.kinds.items())
    return (f"{s.turn:>6} {s.seconds:>8.1f} {s.rss / 2**20:>8.1f} {100 * (s.rss / base.rss - 1):>+7.1f}% {s.files:>6} "
            f"{s.threads:>7} {s.tokens:>7}  {kinds}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", default="bundles/smollm2-demo")
    parser.add_argument("--turns", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=None, help="turns before the baseline (default: a tenth)")
    parser.add_argument("--every", type=int, default=None, help="turns between samples (default: a tenth of the rest)")
    parser.add_argument("--turns-per-chat", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--backend", default="auto")
    args = parser.parse_args(argv)
    warmup = args.warmup if args.warmup is not None else max(1, args.turns // 10)
    every = args.every or max(1, (args.turns - warmup) // 10)
    print(f"soak: {Path(args.bundle)}, {args.turns} turns ({', '.join(KINDS)} in rotation), {args.turns_per_chat} per "
          f"conversation, {args.max_new_tokens} tokens each, warm-up {warmup} turns; {platform.machine()}, "
          f"{os.cpu_count()} CPUs, Python {platform.python_version()}")
    print(HEADER)
    samples, failed = soak(args.bundle, args.turns, every, warmup, args.turns_per_chat, args.max_new_tokens, args.backend)
    rss = [s.rss for s in samples]
    print(f"RSS after the warm-up: {rss[0] / 2**20:.1f} MiB; range {min(rss) / 2**20:.1f}..{max(rss) / 2**20:.1f} MiB "
          f"({100 * (min(rss) / rss[0] - 1):+.1f}% .. {100 * (max(rss) / rss[0] - 1):+.1f}%), median "
          f"{statistics.median(rss) / 2**20:.1f}; files {samples[0].files} -> {samples[-1].files}; threads "
          f"{samples[0].threads} -> {samples[-1].threads}; {samples[-1].seconds:.0f} s")
    for line in failed:
        print(f"FAILED: {line}")
    print("soak passed" if not failed else f"soak failed: {len(failed)} check(s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
