"""Long voice sessions: memory over many chat turns and one long generation, and the time to
first token of a new session with and without a shared system-prompt prefix.

Scenarios (one process, batch 1, greedy; the machine may be shared: compare within one run):

- **chat**: ``--turns`` user turns (short in-car voice commands, cycled) in ONE ``engine.chat()``
  per mode, ``--answer-tokens`` new tokens each (stop at end of turn), with the context
  policy ``drop_oldest`` (``--policy reset`` instead resets the session when the next turn
  would not fit). RSS (resident set, /proc/self/statm) is sampled after every turn.
- **long**: one generation of ``--tokens`` new tokens (end of text ignored, so it runs to the
  end), RSS sampled every ``--every`` tokens. Needs a bundle whose context holds them
  (``edgeroute export --context-length 12000 --out bundles/smollm2-12k``).
- **prefix**: TTFT of the first turn of a new chat session with a ~400-token system prompt,
  without and with ``engine.share_prefix`` (two engines on the same bundle, runs interleaved),
  ``--repeats`` times each; medians.
- **detokenize**: the text of answers of 500 / 2,000 / 8,000 tokens (held-out prose, no
  model), decoded whole at every token as ``Session.stream`` used to, and incrementally.

Flatness: after the warm-up (the first ``--warmup`` share of turns or tokens), the spread
(max - min) of RSS relative to RSS at the end of the warm-up; the target is within +-5%.

    python tools/bench_sessions.py chat --bundle bundles/smollm2-demo --modes full,speculate
    python tools/bench_sessions.py long --bundle bundles/smollm2-12k --tokens 10000
    python tools/bench_sessions.py prefix --bundle bundles/smollm2-demo
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from pydoc_data.topics import topics

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from tokenizers import Tokenizer

from edgeroute.bundle import Bundle
from edgeroute.runtime import Engine
from edgeroute.runtime.text_stream import IncrementalDetokenizer

MIB = 1 << 20
COMMANDS = ["Navigate to 221B Baker Street.", "Call Anna Schmidt.", "Set the temperature to 21 degrees.",
            "Play some jazz.", "How far is the next charging station?", "Remind me to buy milk at six.",
            "Turn on the seat heating.", "Read my last message.", "What is the battery level?",
            "Find a parking garage near the museum.", "Skip this song.", "Open the sunroof halfway."]
SYSTEM = "You are the voice assistant of a car. Answer the driver in one short sentence."
VEHICLE_STATE = ("Vehicle state: battery 64 percent, range 210 km, cabin 22 C, outside 9 C, tyre pressure normal, "
                 "next service in 3,400 km, driver profile Anna, seat position 2, navigation idle, media Bluetooth "
                 "(phone: Anna's phone), windows closed, doors locked, lights auto. ")
TOOLS = ("Tools: navigate(destination), call(contact), message(contact, text), set_climate(zone, temperature), "
         "play(query), remind(text, time), seat_heating(level), sunroof(position), find_parking(near). ")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def long_system_prompt(engine: Engine, tokens: int = 400) -> str:
    text = SYSTEM + " " + TOOLS
    while len(engine.encode(text)) < tokens:
        text += VEHICLE_STATE
    return text


def flatness(samples: list[int], warmup: float) -> dict:
    start = max(1, int(len(samples) * warmup))
    base, after = samples[start - 1], samples[start:]
    return {"warm_rss_mib": base / MIB, "min_mib": min(after) / MIB, "max_mib": max(after) / MIB,
            "end_mib": samples[-1] / MIB, "spread_pct": 100 * (max(after) - min(after)) / base,
            "end_drift_pct": 100 * (samples[-1] - base) / base}


def progress_bar(console: Console) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=True)


def run_chat(args: argparse.Namespace, console: Console) -> dict:
    engine = Engine(args.bundle, verify=False)
    loaded = rss()
    results = {"load_rss_mib": loaded / MIB, "modes": {}}
    for mode in args.modes.split(","):
        policy = "drop_oldest" if args.policy == "drop_oldest" else "error"
        chat = engine.chat(system=SYSTEM, context_policy=policy, mode=mode)
        samples, resets, seconds, ttfts = [], 0, [], []
        with progress_bar(console) as bar:
            task = bar.add_task(f"chat {mode}", total=args.turns)
            for turn in range(args.turns):
                text = COMMANDS[turn % len(COMMANDS)]
                start = time.perf_counter()
                try:
                    generation = chat.generate(text, max_new_tokens=args.answer_tokens)
                except Exception as err:  # the context filled (policy reset): start over
                    if policy != "error" or "context" not in str(err):
                        raise
                    chat.reset()
                    resets += 1
                    generation = chat.generate(text, max_new_tokens=args.answer_tokens)
                seconds.append(time.perf_counter() - start)
                ttfts.append(generation.stats.time_to_first_token)
                samples.append(rss())
                bar.advance(task)
                if (turn + 1) % args.log_every == 0:
                    console.log(f"{mode} turn {turn + 1}: RSS {samples[-1] / MIB:.0f} MiB, resets {resets}, "
                                f"turn {seconds[-1]:.2f} s")
        results["modes"][mode] = {"rss_mib": [s / MIB for s in samples], "resets": resets,
                                  "turn_seconds_median": statistics.median(seconds),
                                  "turn_seconds_max": max(seconds), "ttft_median": statistics.median(ttfts),
                                  **flatness(samples, args.warmup)}
    return results


def run_long(args: argparse.Namespace, console: Console) -> dict:
    engine = Engine(args.bundle, verify=False)
    engine.eos_ids = set()  # run to the end: the measurement is about length, not about the answer
    loaded = rss()
    session = engine.session()
    samples, stamps = [], []
    with progress_bar(console) as bar:
        task = bar.add_task("long generation", total=args.tokens)

        def on_token(trace) -> None:
            bar.advance(task)
            if (trace.position - session.last.stats.prompt_tokens + 1) % args.every == 0:
                samples.append(rss())
                stamps.append(time.perf_counter())
                if len(samples) % max(1, args.log_every // 10) == 0:
                    console.log(f"{trace.position} tokens in context: RSS {samples[-1] / MIB:.0f} MiB")

        generation = session.generate("Once upon a time, in a small town by the sea,", on_token=on_token,
                                      max_new_tokens=args.tokens)
    rates = [args.every / (b - a) for a, b in zip(stamps, stamps[1:], strict=False)]
    return {"load_rss_mib": loaded / MIB, "tokens": len(generation.tokens), "every": args.every,
            "rss_mib": [s / MIB for s in samples], "tok_s_by_window": rates, **flatness(samples, args.warmup)}


def run_prefix(args: argparse.Namespace, console: Console) -> dict:
    plain, shared = Engine(args.bundle, verify=False), Engine(args.bundle, verify=False)
    system = long_system_prompt(plain)
    prefix_tokens = shared.share_prefix(system)
    ttft: dict[str, list[float]] = {"prefilled": [], "shared prefix": []}
    for _ in range(args.repeats):
        for name, engine in (("prefilled", plain), ("shared prefix", shared)):
            generation = engine.chat(system=system).generate(COMMANDS[0], max_new_tokens=1)
            ttft[name].append(generation.stats.time_to_first_token)
    return {"system_prompt_tokens": prefix_tokens, "ttft_s": ttft,
            "ttft_median_s": {k: statistics.median(v) for k, v in ttft.items()}}


def run_detokenize(args: argparse.Namespace, console: Console) -> dict:
    """Streaming text for answers of n tokens (held-out prose, no model): decoding the whole
    answer at every token (what ``Session.stream`` did) against the incremental detokenizer."""
    bundle = Bundle.open(args.bundle, verify=False)
    tokenizer = Tokenizer.from_file(str(bundle.file(bundle.tokenizer["file"])))

    def decode(ids):
        return tokenizer.decode(list(ids), skip_special_tokens=True)

    ids = tokenizer.encode(" ".join(topics.values()), add_special_tokens=False).ids
    rows = {}
    for n in (500, 2000, 8000):
        answer = ids[:n]
        start = time.perf_counter()
        for i in range(1, n + 1):
            decode(answer[:i])
        whole = time.perf_counter() - start
        start = time.perf_counter()
        detokenizer = IncrementalDetokenizer(decode)
        text = "".join(detokenizer.add(t) for t in answer) + detokenizer.flush()
        incremental = time.perf_counter() - start
        assert text == decode(answer)
        rows[n] = {"whole_us_per_token": whole / n * 1e6, "incremental_us_per_token": incremental / n * 1e6}
    return {"tokens": rows}


def show(scenario: str, result: dict, console: Console) -> None:
    table = Table(title=f"bench_sessions {scenario}")
    if scenario == "prefix":
        for column in ("new session", "TTFT median", "runs"):
            table.add_column(column)
        for name, values in result["ttft_s"].items():
            table.add_row(name, f"{result['ttft_median_s'][name] * 1000:.0f} ms", str(len(values)))
        console.print(table)
        console.print(f"system prompt: {result['system_prompt_tokens']} tokens")
        return
    if scenario == "detokenize":
        for column in ("answer tokens", "whole answer per token", "incremental"):
            table.add_column(column)
        for n, r in result["tokens"].items():
            table.add_row(str(n), f"{r['whole_us_per_token']:.0f} us/token", f"{r['incremental_us_per_token']:.0f} us/token")
        console.print(table)
        return
    rows = result["modes"].items() if scenario == "chat" else [("generation", result)]
    for column in ("run", "load", "after warm-up", "min..max after", "end", "spread", "end drift"):
        table.add_column(column)
    for name, r in rows:
        table.add_row(name, f"{result['load_rss_mib']:.0f} MiB", f"{r['warm_rss_mib']:.0f} MiB",
                      f"{r['min_mib']:.0f}..{r['max_mib']:.0f} MiB", f"{r['end_mib']:.0f} MiB",
                      f"{r['spread_pct']:.1f}%", f"{r['end_drift_pct']:+.1f}%")
    console.print(table)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scenario", choices=["chat", "long", "prefix", "detokenize"])
    parser.add_argument("--bundle", default="bundles/smollm2-demo")
    parser.add_argument("--modes", default="full,speculate", help="chat: decoding modes, one session each")
    parser.add_argument("--turns", type=int, default=400)
    parser.add_argument("--answer-tokens", type=int, default=24)
    parser.add_argument("--policy", choices=["drop_oldest", "reset"], default="drop_oldest")
    parser.add_argument("--tokens", type=int, default=10_000, help="long: new tokens")
    parser.add_argument("--every", type=int, default=250, help="long: sample RSS every N tokens")
    parser.add_argument("--warmup", type=float, default=0.1, help="share of turns/tokens before flatness counts")
    parser.add_argument("--repeats", type=int, default=5, help="prefix: runs per configuration")
    parser.add_argument("--log-every", type=int, default=20, help="print progress every N turns (long: N/10 samples)")
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    args = parser.parse_args(argv)
    console = Console()
    scenarios = {"chat": run_chat, "long": run_long, "prefix": run_prefix, "detokenize": run_detokenize}
    result = scenarios[args.scenario](args, console)
    result["args"] = {k: str(v) for k, v in vars(args).items()}
    show(args.scenario, result, console)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"sessions-{args.scenario}.json"
    path.write_text(json.dumps(result, indent=1))
    console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
