"""Speed and memory over context length: edgeroute (each attention flavour) vs llama.cpp.

Every case runs in a fresh subprocess (so one case's memory never shows in another's), and
the cases are interleaved runtime by runtime and repeated (``--repeats``; medians reported),
so load from other work hits all runtimes alike: compare ratios within one run.

- **decode tok/s at context C**: prefill C tokens of held-out text, then time ``--steps``
  greedy one-token steps (no detokenizing). edgeroute: ``OrtModel.forward`` (the LLM's
  ``full`` path); llama.cpp: ``Llama.eval`` of one token after a greedy argmax of its logits.
- **TTFT** for a P-token prompt: prefill until the first token's logits are in hand.
- **peak RSS**: ``VmHWM`` of the case's process after the prompt, its high-water mark reset
  after loading (``/proc/self/clear_refs``), next to the RSS after loading: ``peak - load`` is
  what the prompt itself costs (activations, arena, logits).

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

RUNTIMES = ("edgeroute:ort", "edgeroute:portable", "llama.cpp")


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS


def _text_ids(tokenizer_file: Path, n: int) -> list[int]:
    from tokenizers import Tokenizer

    from edgeroute.texts import evaluation_text

    ids = Tokenizer.from_file(str(tokenizer_file)).encode(evaluation_text(), add_special_tokens=False).ids
    if len(ids) < n:
        raise SystemExit(f"the evaluation text has only {len(ids)} tokens, {n} asked")
    return ids[:n]


class EdgerouteCase:
    def __init__(self, bundle: Path, flavour: str) -> None:
        from edgeroute.runtime import Bundle, OrtModel

        self.model = OrtModel(Bundle.open(bundle, verify=False), attention=flavour)
        self.cache = self.model.new_cache()

    def prefill(self, ids: list[int]):
        return self.model.forward(self.cache, ids)

    def step(self, logits) -> object:
        return self.model.forward(self.cache, [int(logits.argmax())])


class LlamaCppCase:
    def __init__(self, gguf: Path, threads: int, n_ctx: int) -> None:
        import numpy as np
        from llama_cpp import Llama

        self.np = np
        self.llm = Llama(model_path=str(gguf), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                         verbose=False, logits_all=False)

    def prefill(self, ids: list[int]):
        self.llm.eval(ids)
        return self.np.asarray(self.llm.eval_logits[-1])

    def step(self, logits):
        self.llm.eval([int(logits.argmax())])
        return self.np.asarray(self.llm.eval_logits[-1])


def worker(spec: dict) -> dict:
    """One case in this (fresh) process: load, prefill, decode; print a JSON record."""
    os.environ["EDGEROUTE_THREADS"] = str(spec["threads"])
    ids = _text_ids(Path(spec["tokenizer"]), spec["tokens"])
    if spec["runtime"] == "llama.cpp":
        case = LlamaCppCase(Path(spec["gguf"]), spec["threads"], spec["n_ctx"])
    else:
        case = EdgerouteCase(Path(spec["bundle"]), spec["runtime"].split(":")[1])
    load_rss = _status_bytes("VmRSS")
    _reset_peak()
    start = time.perf_counter()
    logits = case.prefill(ids)
    ttft = time.perf_counter() - start
    record = {**spec, "load_rss": load_rss, "peak_rss": _status_bytes("VmHWM"), "ttft_s": ttft}
    if spec["steps"]:
        start = time.perf_counter()
        for _ in range(spec["steps"]):
            logits = case.step(logits)
        record["decode_tok_s"] = spec["steps"] / (time.perf_counter() - start)
    return record


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
    parser.add_argument("--gguf", type=Path, help="llama.cpp's model (default: the packaged SmolLM2 GGUF)")
    parser.add_argument("--runtimes", default=",".join(RUNTIMES))
    parser.add_argument("--contexts", default="32,512,1024,1800", help="decode speed at these context lengths")
    parser.add_argument("--prompts", default="256,1024,1800", help="TTFT and peak RSS for these prompt lengths")
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per context")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench-context.json"))
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0

    from edgeroute.bundle import Bundle
    from edgeroute.export.sources import packaged_gguf

    bundle = Bundle.open(args.bundle, verify=False)
    gguf = args.gguf or packaged_gguf()
    base = {"bundle": str(args.bundle), "gguf": str(gguf), "threads": args.threads,
            "tokenizer": str(bundle.file(bundle.tokenizer["file"])), "n_ctx": int(bundle.generation["context_length"])}
    runtimes = args.runtimes.split(",")
    cases = [("decode", int(c), args.steps) for c in args.contexts.split(",") if c] + \
            [("prompt", int(p), 0) for p in args.prompts.split(",") if p]
    records: list[dict] = []
    for repeat in range(args.repeats):
        for kind, tokens, steps in cases:
            for runtime in runtimes:
                record = run_case({**base, "runtime": runtime, "kind": kind, "tokens": tokens, "steps": steps})
                records.append({**record, "repeat": repeat})
                print(f"[{repeat}] {kind:6s} {tokens:5d} {runtime:20s} ttft {record['ttft_s']:.2f}s "
                      f"load {record['load_rss'] / 2**20:.0f} MiB peak {record['peak_rss'] / 2**20:.0f} MiB"
                      + (f" decode {record['decode_tok_s']:.1f} tok/s" if steps else ""), flush=True)

    def pick(kind, tokens, runtime):
        return [r for r in records if (r["kind"], r["tokens"], r["runtime"]) == (kind, tokens, runtime)]

    summary = {}
    print(f"\ndecode tok/s (median of {args.repeats}), ratio to llama.cpp in brackets")
    for kind, tokens, _ in cases:
        row = {}
        for runtime in runtimes:
            rs = pick(kind, tokens, runtime)
            row[runtime] = {"decode_tok_s": median_of(rs, "decode_tok_s"), "ttft_s": median_of(rs, "ttft_s"),
                            "load_rss_mib": median_of(rs, "load_rss") / 2**20,
                            "peak_rss_mib": median_of(rs, "peak_rss") / 2**20}
        summary[f"{kind}:{tokens}"] = row
    for kind, tokens, _ in cases:
        row = summary[f"{kind}:{tokens}"]
        ref = row.get("llama.cpp", {})
        cells = []
        for runtime in runtimes:
            m = row[runtime]
            if kind == "decode":
                ratio = m["decode_tok_s"] / ref["decode_tok_s"] if ref else None
                cells.append(f"{runtime} {m['decode_tok_s']:.1f}" + (f" [{ratio:.2f}x]" if ratio else ""))
            else:
                cells.append(f"{runtime} TTFT {m['ttft_s']:.2f}s peak {m['peak_rss_mib']:.0f} "
                             f"(+{m['peak_rss_mib'] - m['load_rss_mib']:.0f}) MiB")
        print(f"{kind} {tokens:5d} | " + " | ".join(cells))
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "summary": summary,
                                    "records": records, "load_average": os.getloadavg()}, indent=1))
    print(f"\nwrote {args.out} (load average now {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
