"""Speed and memory over context length: edgeroute (the native backend, each ONNX Runtime
attention flavour; ``:float32``, ``:float16`` or ``:int8`` (native) after one names the KV
cache type, e.g. ``edgeroute:native:float32``; without one, ``kv_dtype="auto"``, what
``edgeroute.kv_formats.AUTO_KV_DTYPES`` keeps per backend and kernel set) vs llama.cpp.

Every case runs in a fresh subprocess (so one case's memory never shows in another's), and
the cases are interleaved runtime by runtime and repeated (``--repeats``; medians reported),
so load from other work hits all runtimes alike: compare ratios within one run.

One case = one context length C: prefill C tokens of held-out text, then ``--steps`` greedy
one-token steps (no detokenizing).

- **TTFT**: the prefill, until the first token's logits are in hand.
- **peak RSS**: ``VmHWM`` of the case's process right after the prefill, its high-water mark
  reset after loading (``/proc/self/clear_refs``), next to the RSS after loading:
  ``peak - load`` is what the prompt itself costs (activations, arena, logits).
- **decode tok/s at context C**: the steps after the prefill. edgeroute: the LLM model's
  ``forward`` (the ``full`` path); llama.cpp: ``Llama.eval`` of one token after a greedy argmax of
  its logits.

**Decode kept over context** (``--paired``): the runtime's decode at each context over its
decode at the first, measured in one process per runtime: a sequence per context, prefilled
once, then ``--rounds`` rounds of ``--steps`` steps at each context in alternating order (ABBA),
each block truncated back to its context. Both contexts see the same load and the same
process, so the ratio holds on a machine whose speed drifts from one minute to the next, where
the medians of separate processes do not (no TTFT or RSS in this mode: one process holds every
context's sequence). "kept" is the median over rounds of each round's ratio, with its quartiles
in parentheses (at least 2 rounds).

On a machine shared with other work, ``--clock cpu --threads 1`` times the process's CPU
time instead of the wall clock: a single-threaded runtime's work per token, which other
processes' load does not inflate (llama.cpp's worker threads spin-wait, so with two threads
on oversubscribed cores its wall-clock speed collapses to a fraction of a token per second).

Both modes print a table, write the records as JSON (``--out``) and plot decode tok/s over
context per runtime next to it (the same name, ``.png``).

    python tools/bench_context.py --bundle bundles/smollm2 --out bench-context.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools.benchlib, when run as a script

from edgeroute.measure.bench import EdgerouteCase, LlamaCppCase, prompt_ids  # noqa: E402

RUNTIMES = ("edgeroute:native", "edgeroute:ort", "edgeroute:portable", "llama.cpp")


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS


def open_case(spec: dict) -> EdgerouteCase | LlamaCppCase:
    if spec["runtime"] == "llama.cpp":
        return LlamaCppCase(Path(spec["gguf"]), spec["threads"], spec["n_ctx"])
    return EdgerouteCase(Path(spec["bundle"]), *spec["runtime"].split(":")[1:])  # edgeroute:FLAVOUR[:KV_DTYPE]


def worker(spec: dict) -> dict:
    """One case in this (fresh) process: load, prefill, decode; print a JSON record."""
    os.environ["EDGEROUTE_THREADS"] = str(spec["threads"])
    if "contexts" in spec:
        return paired_worker(spec)
    ids = prompt_ids(Path(spec["tokenizer"]), spec["tokens"])
    case = open_case(spec)
    clock = time.process_time if spec["clock"] == "cpu" else time.perf_counter
    load_rss = _status_bytes("VmRSS")
    _reset_peak()
    start = clock()
    logits = case.prefill(ids)
    ttft = clock() - start
    record = {**spec, "load_rss": load_rss, "peak_rss": _status_bytes("VmHWM"), "ttft_s": ttft}
    start = clock()
    for _ in range(spec["steps"]):
        logits = case.step(logits)
    record["decode_tok_s"] = spec["steps"] / (clock() - start)
    return record


def paired_worker(spec: dict) -> dict:
    """Decode at every context of ``spec["contexts"]`` in this one process, in alternating rounds."""
    contexts = spec["contexts"]
    ids = prompt_ids(Path(spec["tokenizer"]), max(contexts))
    cases = {c: open_case(spec) for c in contexts}
    logits = {c: cases[c].prefill(ids[:c]) for c in contexts}
    clock = time.process_time if spec["clock"] == "cpu" else time.perf_counter
    seconds: dict[int, list[float]] = {c: [] for c in contexts}
    for round_ in range(spec["rounds"]):
        for c in contexts if round_ % 2 == 0 else contexts[::-1]:
            last, start = logits[c], clock()
            for _ in range(spec["steps"]):
                last = cases[c].step(last)
            seconds[c].append(clock() - start)
            cases[c].truncate(c)
    # a round's contexts ran back to back: their ratio is a paired sample, whatever the machine's
    # speed did between rounds; the quartiles over rounds show how far one run can be trusted
    firsts = seconds[contexts[0]]
    kept = {str(c): statistics.quantiles([first / this for first, this in zip(firsts, seconds[c], strict=True)], n=4)
            for c in contexts[1:]}
    return {**spec, "decode_tok_s": {str(c): len(seconds[c]) * spec["steps"] / sum(seconds[c]) for c in contexts},
            "round_seconds": {str(c): seconds[c] for c in contexts}, "kept_quartiles": kept}


def paired(args: argparse.Namespace, base: dict, runtimes: list[str], contexts: list[int]) -> dict:
    records = []
    for runtime in runtimes:
        record = run_case({**base, "runtime": runtime, "contexts": contexts, "steps": args.steps,
                           "rounds": args.rounds})
        records.append(record)
        rates = record["decode_tok_s"]
        kept = record["kept_quartiles"]
        print(f"{runtime:26s} " + "  ".join(f"{c}: {rates[str(c)]:.1f}" for c in contexts) + " tok/s  kept: " +
              "  ".join(f"{c}: {kept[str(c)][1]:.0%} ({kept[str(c)][0]:.0%}-{kept[str(c)][2]:.0%})"
                        for c in contexts[1:]), flush=True)
    return {"records": records}


def plot(path: Path, title: str, contexts: list[int], rates: dict[str, list[float]]) -> None:
    """Decode tok/s over context, a line per runtime."""
    from edgeroute.plots import pyplot

    plt = pyplot()

    figure, ax = plt.subplots(figsize=(7, 4.5))
    for runtime, values in rates.items():
        ax.plot(contexts, values, marker="o", label=runtime)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode tokens/s")
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def run_case(spec: dict) -> dict:
    out = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    if out.returncode != 0:
        raise SystemExit(f"case {spec} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def median_of(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records if r.get(key) is not None]
    return statistics.median(values) if values else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--bundle", type=Path, default=Path("bundles/smollm2"))
    parser.add_argument("--gguf", type=Path,
                        help="llama.cpp's model: the bundle's source GGUF (default: the path it recorded at export; a "
                             "file given here must be that source, checked by sha256)")
    parser.add_argument("--runtimes", default=",".join(RUNTIMES))
    parser.add_argument("--contexts", default="32,256,512,1024,1800", help="prompt lengths (= decode contexts)")
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per context")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: the process's CPU time (use with --threads 1 on a shared machine)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--paired", action="store_true",
                        help="decode kept over context, every context in one process per runtime (see above)")
    parser.add_argument("--rounds", type=int, default=8,
                        help="--paired: alternating rounds of --steps per context (at least 2)")
    parser.add_argument("--out", type=Path, default=Path("bench-context.json"))
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0

    from edgeroute.bundle import Bundle
    from tools.benchlib.llama import checked_gguf

    bundle = Bundle.open(args.bundle, verify=False)
    gguf = checked_gguf(bundle, "llm", args.gguf) if "llama.cpp" in args.runtimes.split(",") else args.gguf
    base = {"bundle": str(args.bundle), "gguf": str(gguf), "threads": args.threads, "clock": args.clock,
            "tokenizer": str(bundle.file(bundle.tokenizer["file"])), "n_ctx": int(bundle.generation["context_length"])}
    runtimes = args.runtimes.split(",")
    contexts = [int(c) for c in args.contexts.split(",") if c]
    if args.paired:
        if args.rounds < 2:
            parser.error("--paired needs --rounds >= 2 (kept is a median over rounds)")
        print(f"decode tok/s per context, one process per runtime, {args.rounds} alternating rounds of "
              f"{args.steps} steps, {args.threads} thread(s), {args.clock} clock; kept = over the first context")
        result = paired(args, base, runtimes, contexts)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, **result,
                                        "load_average": os.getloadavg()}, indent=1))
        plot(args.out.with_suffix(".png"), f"decode over context, one process per runtime ({args.threads} threads)",
             contexts, {r["runtime"]: [r["decode_tok_s"][str(c)] for c in contexts] for r in result["records"]})
        print(f"\nwrote {args.out} and {args.out.with_suffix('.png')}")
        return 0
    records: list[dict] = []
    for repeat in range(args.repeats):
        for tokens in contexts:
            for runtime in runtimes:
                record = run_case({**base, "runtime": runtime, "tokens": tokens, "steps": args.steps})
                records.append({**record, "repeat": repeat})
                print(f"[{repeat}] {tokens:5d} {runtime:20s} ttft {record['ttft_s']:.2f}s "
                      f"load {record['load_rss'] / 2**20:.0f} MiB peak {record['peak_rss'] / 2**20:.0f} MiB "
                      f"decode {record['decode_tok_s']:.1f} tok/s", flush=True)

    summary: dict[str, dict[str, dict]] = {}
    for tokens in contexts:
        for runtime in runtimes:
            rs = [r for r in records if (r["tokens"], r["runtime"]) == (tokens, runtime)]
            summary.setdefault(str(tokens), {})[runtime] = {
                key: median_of(rs, key) for key in ("decode_tok_s", "ttft_s", "load_rss", "peak_rss")}
    print(f"\nmedians of {args.repeats}, {args.threads} thread(s), {args.clock} clock; [x] = ratio to llama.cpp; "
          "RSS in MiB: peak (peak - after load)")
    header = "context | " + " | ".join(f"{r}: tok/s, TTFT s, peak RSS" for r in runtimes)
    print(header)
    for tokens in contexts:
        row, cells = summary[str(tokens)], []
        ref = row.get("llama.cpp")
        for runtime in runtimes:
            m = row[runtime]
            ratio = f" [{m['decode_tok_s'] / ref['decode_tok_s']:.2f}x]" if ref and runtime != "llama.cpp" else ""
            cells.append(f"{m['decode_tok_s']:.1f}{ratio}, {m['ttft_s']:.2f}, "
                         f"{m['peak_rss'] / 2**20:.0f} (+{(m['peak_rss'] - m['load_rss']) / 2**20:.0f})")
        print(f"{tokens:7d} | " + " | ".join(cells))
    first, last = str(contexts[0]), str(contexts[-1])
    for runtime in runtimes:
        kept = summary[last][runtime]["decode_tok_s"] / summary[first][runtime]["decode_tok_s"]
        print(f"{runtime}: decode at {last} = {kept:.0%} of at {first}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "summary": summary,
                                    "records": records, "load_average": os.getloadavg()}, indent=1))
    plot(args.out.with_suffix(".png"), f"decode over context, medians of {args.repeats} processes ({args.threads} threads)",
         contexts, {r: [summary[str(c)][r]["decode_tok_s"] for c in contexts] for r in runtimes})
    print(f"\nwrote {args.out} and {args.out.with_suffix('.png')} (load average now {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} cores)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
