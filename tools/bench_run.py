"""Benchmark `edgeroute run`'s decoding modes against llama.cpp on the four workloads.

Same machine, one run, batch 1, greedy, the same thread count for both runtimes (``--threads``,
default: every core). For every workload in ``tools/workloads/`` (templated, json, grounded,
open) and every configuration (``full``, ``slm``, ``speculate`` and ``route`` with the n-gram
and the SLM light paths, a ``skip`` sweep; llama.cpp on the LLM's GGUF, plain, with prompt
lookup and with the SLM's GGUF as draft model (``--slm-gguf``: the fair peer of
``speculate+slm``), and llama.cpp on the SLM's GGUF alone), each prompt is generated with up to
``--max-new-tokens`` new tokens (stop at end of turn). ``--slm-bundle`` runs the SLM modes again
with a second bundle's SLM (tagged ``[its directory name]``), e.g. a reduced-vocabulary head,
sharing the LLM sessions. The configurations are interleaved prompt by prompt (their order
rotates from one prompt to the next), so a change in the machine's load hits all of them
alike: compare ratios within one run.

    python -m tools.bench_run --bundle bundles/pair --gguf /work/cache/gguf/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \
        --slm-gguf /work/cache/gguf/qwen2.5-coder-0.5b-instruct.gguf --slm-bundle bundles/pair-v32k \
        --prompts 3 --max-new-tokens 64 --no-rss --profile-graphs

What is measured, and how (the same for every configuration):

- **decode tok/s**: (new tokens - 1) / (time from the first token to the last), pooled over the
  workload's prompts (sum of tokens over sum of seconds). Both runtimes are driven token by
  token (``Session.generate_tokens`` / ``Llama.generate``); neither timing includes detokenizing.
  **x full p.med**: the median over prompts of (this configuration's tok/s / full's tok/s on the
  same prompt, run next to it): less sensitive to a burst of load from other work than the
  pooled ratio. ``--repeats N`` keeps the fastest of N runs per prompt.
- **TTFT**: time to first token: prefill plus the first decode step (mean over prompts).
- **ITL p50 / p99**: inter-token latency, the wall time between two consecutive tokens as the
  caller receives them (``TokenTrace.seconds`` of every token but the first), pooled over
  prompts. Speculative modes hand over several tokens per LLM pass, so many of their gaps are
  near zero and their p99 is one LLM pass.
- **peak RSS**: the peak resident set of a *separate* process per runtime footprint
  (edgeroute with the LLM only; edgeroute with LLM + SLM; llama.cpp; llama.cpp with prompt
  lookup) that loads the model(s) and generates the workloads' longest prompt once: ``VmHWM``
  from ``/proc/self/status`` (``getrusage(RUSAGE_SELF).ru_maxrss`` where there is no /proc; on
  Linux ru_maxrss is carried over fork + exec from the parent, so a child started by a big
  parent would report the parent's peak; the JSON keeps it as ``ru_maxrss_bytes``). It is the
  process's high-water mark: Python, numpy, the runtime, the weights, the fixed-capacity
  KV buffers and the largest transient (the prefill's activations and logits). Every
  configuration shows its footprint's figure. (The timing process runs all runtimes at once, so
  its own peak would mean nothing.)
- **LLM share**: generated tokens chosen by the LLM / all generated tokens (accepted draft
  tokens and light-path tokens are not the LLM's).
- **layers / LLM tok**: LLM decoder layers fully run per LLM pass (``skip`` runs fewer).
- **saved**: LLM layer-passes saved against one full pass per generated token,
  1 - sum(layers run over LLM passes) / (layers x new tokens). For ``route`` and ``speculate`` it
  counts the passes avoided (a batch-1 pass over a few tokens costs about one pass on CPU); for
  ``skip`` the layers skipped (with ``granularity=mlp`` only the MLP half of a skipped layer).
- **accept**: accepted draft tokens / drafted tokens (speculative modes). For llama.cpp's
  prompt lookup, estimated as (new tokens - LLM passes) / drafted tokens.
- **prefix agr**: agreement with ``full``: tokens identical to full's before the first
  divergence, summed over prompts, as a fraction of full's tokens. **identical**: prompts whose
  whole output equals full's.
- **TF agr**: teacher-forced per-position agreement: the configuration's own output (prompt +
  its tokens) goes through the edgeroute LLM in one pass, and a position agrees when the
  configuration's token equals the LLM's argmax there; pooled over prompts. ``full`` itself
  scores a little under 100% where a multi-token int4 pass rounds differently from the
  one-token steps (the noise floor of this measure). Positions before a configuration's first
  divergence from full reuse full's pass (same tokens, same predictions).
- **near-tie**: at each first divergence from ``full``, the relative gap between the LLM's
  logit for full's token and for the configuration's token, (l_full - l_mine) / |l_full|, in the
  teacher-forced pass over full's tokens (a multi-token pass, so it can be negative: that pass
  prefers the configuration's token while full's one-token step did not). Under 1e-3 in
  magnitude it is a near-tie, a rounding difference rather than a decision; the JSON keeps
  every gap (``divergence_gap``).

- **task pass**: templated and json prompts only (see ``tools/benchlib/tasks.py``): a templated
  answer carries the record's values, a json answer parses with the asked keys and full's keys
  and values, and no answer echoes the prompt's instruction; **echoes** counts the answers that
  repeat it. The JSON keeps every answer's text and the reason of each failed check.

``--profile-graphs`` then times every ONNX Runtime call of a few decodes per profiled
configuration through the runtime's timing hook (``OrtModel.timings``) and reports the time per
graph kind and the share of decode time spent outside ONNX Runtime calls (orchestration:
Python, numpy, drafters, routers, the KV copies).

    python -m tools.bench_run                      # all prompts, 128 tokens -> bench-results/
    python -m tools.bench_run --prompts 5 --profile-graphs
    python -m tools.bench_run --quick              # smoke run: 2 prompts, 24 tokens, fewer configurations
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import platform
import resource
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
WORKLOAD_DIR = Path(__file__).resolve().parent / "workloads"
WORKLOADS = ("templated", "json", "grounded", "open")
# the calibrated task profile that ``auto`` takes on each workload (open questions: the default one)
WORKLOAD_TASKS = {"templated": "templated", "json": "json", "grounded": "grounded", "open": "default"}

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchlib, when run as a script
from benchlib.llama import checked_gguf, greedy_tokens, open_llama  # noqa: E402
from benchlib.metrics import GraphClock, common_prefix, summarize  # noqa: E402
from benchlib.tasks import task_check  # noqa: E402

# -- configurations -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    name: str
    runtime: str  # edgeroute | llama
    options: dict = field(default_factory=dict)  # edgeroute: session options; llama: model, lookup, draft
    footprint: str = "edgeroute-llm"  # which RSS probe stands for it
    curve: str | None = None  # trade-off curve it belongs to
    param: float | None = None  # the swept threshold on that curve
    alt_slm: bool = False  # edgeroute with the SLM of --slm-bundle (e.g. a reduced-vocabulary head)


SKIP_THRESHOLDS = (0.3, 0.5, 0.7, 0.9)
ROUTE_SLM_THRESHOLDS = (0.05, 0.15, 0.3)


def all_configs(skip_ratio: float, lookup_tokens: int, draft_tokens: int = 4, alt_slm: str | None = None) -> list[Config]:
    """Every configuration; ``alt_slm`` (a label, e.g. "v32k") adds the SLM modes again on the
    SLM of --slm-bundle; the llama.cpp SLM peers need --slm-gguf (dropped without it)."""
    configs = [
        Config("llama.cpp", "llama", {"model": "llm", "lookup": 0}, "llama"),
        Config("llama.cpp-slm", "llama", {"model": "slm", "lookup": 0}, "llama"),
        Config("llama.cpp+draft-slm", "llama", {"model": "llm", "lookup": 0, "draft": draft_tokens}, "llama-draft"),
        Config("llama.cpp+lookup", "llama", {"model": "llm", "lookup": lookup_tokens}, "llama-lookup"),
        Config("full", "edgeroute", {"mode": "full"}),
        Config("speculate+ngram", "edgeroute", {"mode": "speculate", "light": "ngram"}),
        Config("route+ngram", "edgeroute", {"mode": "route", "light": "ngram"}),
        Config("auto", "edgeroute", {"mode": "auto"}, "edgeroute-llm+slm"),  # a calibrated bundle's task profile
    ]
    for alt in (False, True) if alt_slm else (False,):
        tag = f"[{alt_slm}]" if alt else ""
        configs += [Config(f"slm{tag}", "edgeroute", {"mode": "slm"}, "edgeroute-llm+slm", alt_slm=alt),
                    Config(f"speculate+slm{tag}", "edgeroute", {"mode": "speculate", "light": "slm"}, "edgeroute-llm+slm",
                           alt_slm=alt),
                    # the SLM's whole head, beside the default draft vocabulary (its common rows and the sequence's)
                    Config(f"speculate+slm@whole-head{tag}", "edgeroute", {"mode": "speculate", "light": "slm",
                                                                       "draft_rows": 0}, "edgeroute-llm+slm", alt_slm=alt),
                    # the drafts' former default ceiling, beside the one-pass default
                    Config(f"speculate+slm@8{tag}", "edgeroute", {"mode": "speculate", "light": "slm", "max_draft_tokens": 8},
                           "edgeroute-llm+slm", alt_slm=alt),
                    Config(f"speculate+ngram+slm{tag}", "edgeroute", {"mode": "speculate", "light": "ngram+slm"},
                           "edgeroute-llm+slm", alt_slm=alt)]
        configs += [Config(f"route+slm@{t}{tag}", "edgeroute", {"mode": "route", "light": "slm", "route_threshold": t},
                           "edgeroute-llm+slm", f"route+slm{tag}", t, alt_slm=alt) for t in ROUTE_SLM_THRESHOLDS]
    for granularity in ("layer", "mlp"):
        configs += [Config(f"skip-{granularity}@{t}", "edgeroute",
                           {"mode": "skip", "importance_threshold": t, "skip_ratio": skip_ratio, "granularity": granularity},
                           curve=f"skip-{granularity}", param=t) for t in SKIP_THRESHOLDS]
    return configs


QUICK_CONFIGS = ("llama.cpp", "llama.cpp+draft-slm", "full", "speculate+ngram", "speculate+slm", "speculate+ngram+slm",
                 "route+ngram", "route+slm@0.15", "skip-layer@0.5", "skip-mlp@0.5")
PROFILE_CONFIGS = ("full", "speculate+ngram", "route+ngram")

# -- workloads ----------------------------------------------------------------------------------


def load_workloads(directory: Path, names: list[str], limit: int | None) -> dict[str, list[dict]]:
    workloads = {}
    for name in names:
        data = json.loads((directory / f"{name}.json").read_text())
        prompts = data["prompts"][:limit] if limit else data["prompts"]
        workloads[name] = prompts
    return workloads


# -- runners ------------------------------------------------------------------------------------


@dataclass
class Run:
    """One generation: what both runtimes report, the same way."""

    tokens: list[int]
    ttft: float
    decode_seconds: float
    gaps: list[float]  # seconds between consecutive tokens (after the first)
    llm_tokens: int
    llm_calls: int
    llm_layers_run: int
    drafted: int = 0
    accepted: int = 0
    fallbacks: int = 0
    sources: dict[str, int] = field(default_factory=dict)


class EdgerouteRunner:
    def __init__(self, engine) -> None:
        self.engine = engine
        self.num_layers = engine.llm.num_layers

    def run(self, ids_or_messages, options: dict, budget: int) -> Run:
        session = self.engine.session(max_new_tokens=budget, **options)
        traces = list(session.generate_tokens(ids_or_messages))
        stats = session.last.stats
        sources: dict[str, int] = defaultdict(int)
        for trace in traces:
            sources[trace.source] += 1
        return Run([t.token for t in traces], stats.time_to_first_token, stats.decode_seconds,
                   [t.seconds for t in traces[1:]], stats.llm_tokens, stats.llm_calls, stats.llm_layers_run,
                   stats.drafted, stats.accepted, stats.fallbacks, dict(sources))


class CountingDraft:
    """Wraps llama.cpp's draft model to count its proposals (and so the LLM passes)."""

    def __init__(self, inner) -> None:
        self.inner, self.calls, self.drafted = inner, 0, 0

    def __call__(self, input_ids, /, **kwargs):
        draft = self.inner(input_ids, **kwargs)
        self.calls += 1
        self.drafted += len(draft)
        return draft


class ModelDraft:
    """llama.cpp speculative decoding with a draft *model*: a second ``Llama`` (the SLM's GGUF)
    drafts ``tokens`` greedy tokens. ``Llama.generate`` keeps the longest common prefix of its
    cache, so each call evaluates only the tokens the draft model has not seen."""

    def __init__(self, gguf: Path, threads: int, n_ctx: int, tokens: int) -> None:
        self.model = open_llama(gguf, threads, n_ctx)
        self.tokens = tokens

    def __call__(self, input_ids, /, **kwargs):
        draft = []
        generator = self.model.generate(list(map(int, input_ids)), temp=0.0, top_k=1, top_p=1.0, min_p=0.0,
                                        repeat_penalty=1.0)
        try:
            for token in generator:
                draft.append(int(token))
                if len(draft) >= self.tokens:
                    break
        finally:
            generator.close()
        return np.array(draft, np.intc)


class LlamaRunner:
    def __init__(self, gguf: Path, threads: int, n_ctx: int, lookup: int, num_layers: int,
                 draft_gguf: Path | None = None, draft_tokens: int = 0) -> None:
        self.draft = None
        if lookup or draft_tokens:
            from llama_cpp.llama_speculative import LlamaDraftModel, LlamaPromptLookupDecoding

            inner = (ModelDraft(draft_gguf, threads, n_ctx, draft_tokens) if draft_tokens
                     else LlamaPromptLookupDecoding(num_pred_tokens=lookup))
            counting = type("CountingDraftModel", (CountingDraft, LlamaDraftModel), {})
            self.draft = counting(inner)
        self.llm = open_llama(gguf, threads, n_ctx, draft_model=self.draft)
        self.num_layers = num_layers
        self.source = "draft:slm" if draft_tokens else "draft:lookup"

    def run(self, ids: list[int], eos_ids: set[int], budget: int) -> Run:
        if self.draft is not None:
            self.draft.calls = self.draft.drafted = 0
        tokens, times = greedy_tokens(self.llm, ids, eos_ids, budget)
        passes = len(tokens)
        drafted = accepted = 0
        if self.draft is not None:  # one pass for the prompt, then one per draft (empty drafts included)
            passes = min(self.draft.calls + 1, len(tokens))
            drafted = self.draft.drafted
            accepted = max(len(tokens) - passes, 0)
        return Run(tokens, times[0], float(sum(times[1:])), times[1:], len(tokens) - accepted, passes,
                   passes * self.num_layers, drafted, accepted, 0,
                   {"llm": len(tokens) - accepted, **({self.source: accepted} if accepted else {})})


# -- peak RSS probes (separate processes) -------------------------------------------------------

FOOTPRINTS = {
    "edgeroute-llm": "edgeroute, LLM only (full / ngram / skip)",
    "edgeroute-llm+slm": "edgeroute, LLM + SLM",
    "llama": "llama.cpp",
    "llama-slm": "llama.cpp, the SLM's GGUF",
    "llama-lookup": "llama.cpp + prompt lookup",
    "llama-draft": "llama.cpp + the SLM as draft model",
}


def _proc_status_bytes(field_name: str) -> int | None:
    """A ``/proc/self/status`` memory figure (VmRSS, VmHWM) in bytes; None off Linux."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def rss_probe(args: argparse.Namespace) -> int:
    """Runs in its own process: load one runtime footprint, generate once, print the peaks."""
    probe = json.loads(args.probe)
    footprint = args.rss_probe
    before = time.perf_counter()
    if footprint.startswith("edgeroute"):
        from edgeroute.runtime import Engine

        engine = Engine(args.bundle, activations=args.activations, exact_steps=args.exact_steps, backend=args.backend)
        options = {"mode": "speculate", "light": "slm"} if footprint == "edgeroute-llm+slm" else {"mode": "full"}
        if footprint == "edgeroute-llm+slm":
            engine.slm  # noqa: B018 (loads the SLM sessions)
        loaded = _proc_status_bytes("VmRSS")
        run = EdgerouteRunner(engine).run(probe["messages"], options, args.max_new_tokens)
    else:  # token ids from the caller: nothing of edgeroute's is loaded in this process
        runner = LlamaRunner(Path(args.slm_gguf if footprint == "llama-slm" else args.gguf), args.threads, args.n_ctx,
                             args.lookup_tokens if footprint == "llama-lookup" else 0, probe["num_layers"],
                             args.slm_gguf, args.draft_tokens if footprint == "llama-draft" else 0)
        loaded = _proc_status_bytes("VmRSS")
        run = runner.run(probe["ids"], set(probe["eos_ids"]), args.max_new_tokens)
    # ru_maxrss survives fork + exec on Linux (a child starts with its parent's high-water mark),
    # so the figure is VmHWM, this process image's own peak RSS; ru_maxrss is kept for reference.
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    peak = _proc_status_bytes("VmHWM") or maxrss
    print(json.dumps({"footprint": footprint, "peak_rss_bytes": peak, "ru_maxrss_bytes": maxrss,
                      "rss_after_load_bytes": loaded,
                      "tokens": len(run.tokens), "seconds": time.perf_counter() - before}))
    return 0


def measure_rss(args: argparse.Namespace, footprints: list[str], probe: dict, console: Console) -> dict:
    results = {}
    for footprint in footprints:
        cmd = [sys.executable, "-m", "tools.bench_run", "--rss-probe", footprint, "--probe", json.dumps(probe),
               "--bundle", str(args.bundle), "--gguf", str(args.gguf), "--draft-tokens", str(args.draft_tokens),
               "--threads", str(args.threads), "--n-ctx", str(args.n_ctx), "--activations", args.activations,
               "--backend", args.backend,
               *(["--exact-steps"] if args.exact_steps else []),
               "--lookup-tokens", str(args.lookup_tokens), "--max-new-tokens", str(args.max_new_tokens),
               *(["--slm-gguf", str(args.slm_gguf)] if args.slm_gguf else [])]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)  # this checkout's edgeroute
        if proc.returncode != 0:
            console.print(f"[red]RSS probe {footprint} failed[/]: {proc.stderr.strip().splitlines()[-1:]}")
            continue
        results[footprint] = json.loads(proc.stdout.strip().splitlines()[-1])
        console.print(f"  peak RSS {FOOTPRINTS[footprint]}: {results[footprint]['peak_rss_bytes'] / 2**20:.0f} MiB")
    return results


# -- agreement with full ------------------------------------------------------------------------


def agreement_for_prompt(llm, prompt_ids: list[int], full: list[int], others: dict[str, list[int]]) -> dict[str, dict]:
    """Teacher-forced agreement of every output of one prompt with the LLM's argmax.

    One pass over prompt + full's tokens gives the LLM's predictions for every position of full's
    output (and one past it); an output that follows full's for d tokens shares those d + 1
    predictions and needs a pass over its remaining tokens only, on a copy of the prompt's and the
    shared tokens' cache."""
    p = len(prompt_ids)
    base_ids = prompt_ids + full
    cache = llm.new_cache(len(base_ids) + 1)
    base_logits = llm.forward(cache, base_ids, all_logits=True)[p - 1:]  # row i predicts output token i
    base_top1 = base_logits.argmax(-1)
    results = {}
    for name, tokens in {"full": full, **others}.items():
        d = common_prefix(tokens, full)
        shared = min(d, len(full)) + 1  # predictions 0..d come from the base pass
        predictions = list(base_top1[:min(shared, len(tokens))])
        if len(tokens) > shared:
            work = llm.new_cache(p + len(tokens))
            keep = p + shared - 1  # cached positions: the prompt and tokens[:shared - 1]
            work.copy_from(cache, keep)
            logits = llm.forward(work, tokens[shared - 1:len(tokens) - 1], all_logits=True)
            predictions += list(logits.argmax(-1))
        matches = int(sum(int(a == b) for a, b in zip(predictions, tokens, strict=True)))
        gap = None
        if d < min(len(tokens), len(full)):  # diverged: how close was the LLM's call there?
            row = base_logits[d]
            gap = float((row[full[d]] - row[tokens[d]]) / max(abs(float(row[full[d]])), 1e-6))
        results[name] = {"prefix": d, "tf_matches": matches, "tf_positions": len(tokens),
                         "identical": tokens == full, "divergence_gap": gap}
    return results


# -- profiling ----------------------------------------------------------------------------------


def profile_graphs(engines: dict[bool, object], configs: list[Config], prompts: list[dict], max_new_tokens: int,
                   console: Console) -> dict:
    """Decode time per graph kind through the models' ``timings`` hook (engines: by alt_slm)."""
    profiles = {}
    for config in configs:
        engine = engines[config.alt_slm]
        clock = GraphClock()
        engine.llm.timings = clock.hook()
        if config.options.get("light") == "slm" or config.options.get("mode") == "slm":
            engine.slm.timings = clock.hook("slm.")
        engine.generate(prompts[0]["messages"], max_new_tokens=8, **config.options)  # warm-up, discarded
        clock.clear()
        decode_seconds = prefill_seconds = 0.0
        decode_tokens = 0
        for prompt in prompts:
            clock.phase = "prefill"
            session = engine.session(max_new_tokens=max_new_tokens, **config.options)
            for i, _trace in enumerate(session.generate_tokens(prompt["messages"])):
                if i == 0:
                    clock.phase = "decode"
            stats = session.last.stats
            decode_seconds += stats.decode_seconds
            prefill_seconds += stats.time_to_first_token
            decode_tokens += max(stats.new_tokens - 1, 0)
        engine.llm.timings = None
        if engine.bundle.slm is not None:
            engine.slm.timings = None
        profiles[config.name] = {"prompts": len(prompts), "prefill_seconds": prefill_seconds,
                                 **clock.decode_profile(decode_seconds, decode_tokens)}
        console.print(f"  profiled {config.name}: {decode_tokens} decode tokens")
    return profiles


def run_profile(args: argparse.Namespace, engines: dict[bool, object], console: Console) -> dict:
    console.print("per-graph profile ...")
    wanted = [n.strip() for n in args.profile_configs.split(",") if n.strip()]
    profiled = [c for c in all_configs(args.skip_ratio, args.lookup_tokens, args.draft_tokens, args.slm_label)
                if c.name in wanted and c.runtime == "edgeroute" and c.alt_slm in engines]
    prompts = load_workloads(args.workload_dir, ["templated"], args.profile_prompts)["templated"]
    return profile_graphs(engines, profiled, prompts, args.max_new_tokens, console)


def print_profile(profile: dict, console: Console) -> None:
    for name, p in profile.items():
        tokens = max(p["decode_tokens"], 1)
        table = Table(title=f"per-graph decode profile: {escape(name)} ({p['prompts']} prompts, {p['decode_tokens']} decode "
                            f"tokens, {p['tokens_per_second'] or 0:.1f} tok/s)")
        for column in ("graph", "calls/token", "us/call", "ms/token", "share of decode"):
            table.add_column(column, justify="right" if column != "graph" else "left")
        for kind, g in sorted(p["graphs"].items(), key=lambda kv: -kv[1]["seconds"]):
            table.add_row(kind, f"{g['calls'] / tokens:.1f}", f"{g['seconds'] / max(g['calls'], 1) * 1e6:.0f}",
                          f"{g['seconds'] / tokens * 1e3:.2f}", f"{g['seconds'] / p['decode_seconds']:.1%}")
        table.add_row("[bold]all ONNX Runtime calls[/]", "", "", f"{p['ort_seconds'] / tokens * 1e3:.2f}",
                      f"{p['ort_seconds'] / p['decode_seconds']:.1%}")
        share = p["orchestration_share"] or 0.0
        verdict = "[green]PASS[/]" if share <= 0.10 else "[red]MISS[/]"
        table.add_row("[bold]outside ORT (orchestration)[/]", "", "", f"{p['orchestration_seconds'] / tokens * 1e3:.2f}",
                      f"{share:.1%} (target <= 10%: {verdict})")
        console.print(table)


# -- aggregation --------------------------------------------------------------------------------


def evaluate_targets(summary: dict[str, dict[str, dict]], profile: dict | None) -> list[dict]:
    targets = []

    def get(workload, config, key):
        return summary.get(workload, {}).get(config, {}).get(key)

    for workload in summary:
        full, llama = get(workload, "full", "tokens_per_second"), get(workload, "llama.cpp", "tokens_per_second")
        if full and llama:
            ratio = full / llama
            paired = get(workload, "llama.cpp", "paired_median_vs_full")
            value = f"{ratio:.2f}x" + (f" (paired median {1 / paired:.2f}x)" if paired else "")
            targets.append({"target": f"full >= 1.0x llama.cpp tok/s ({workload})", "value": value, "pass": ratio >= 1.0})
        spec = get(workload, "speculate+slm", "tokens_per_second")
        if full and spec:
            peer = get(workload, "llama.cpp+draft-slm", "tokens_per_second")
            identical, n = get(workload, "speculate+slm", "identical"), get(workload, "speculate+slm", "prompts")
            value = (f"{spec / full:.2f}x full" + (f", {spec / peer:.2f}x llama.cpp+draft-slm" if peer else "")
                     + f", {identical}/{n} identical")
            targets.append({"target": f"speculate+slm faster than full and llama.cpp+draft-slm ({workload})",
                            "value": value, "pass": spec > full and (peer is None or spec > peer)})
    if "templated" in summary:
        full = get("templated", "full", "tokens_per_second")
        spec = get("templated", "speculate+ngram", "tokens_per_second")
        if full and spec:
            ratio = spec / full
            identical, n = get("templated", "speculate+ngram", "identical"), get("templated", "speculate+ngram", "prompts")
            near = get("templated", "speculate+ngram", "near_tie_divergences")
            paired = get("templated", "speculate+ngram", "paired_median_vs_full")
            targets.append({"target": "speculate+ngram >= 1.5x full on templated, identical output",
                            "value": f"{ratio:.2f}x (paired median {paired or 0:.2f}x), {identical}/{n} identical "
                                     f"({n - identical - near} non-tie divergences)",
                            "pass": ratio >= 1.5 and identical == n})
        route = get("templated", "route+ngram", "tokens_per_second")
        if full and route:
            ratio, tf = route / full, get("templated", "route+ngram", "tf_agreement")
            paired = get("templated", "route+ngram", "paired_median_vs_full")
            targets.append({"target": "route+ngram >= 2x full on templated at >= 97% TF agreement",
                            "value": f"{ratio:.2f}x (paired median {paired or 0:.2f}x) at {tf:.1%}",
                            "pass": ratio >= 2.0 and tf >= 0.97})
    for name, p in (profile or {}).items():
        if p["orchestration_share"] is not None:
            targets.append({"target": f"orchestration <= 10% of decode time ({name})",
                            "value": f"{p['orchestration_share']:.1%}", "pass": p["orchestration_share"] <= 0.10})
    return targets


# -- output -------------------------------------------------------------------------------------


def _fmt(value, spec: str, scale: float = 1.0, none: str = "-") -> str:
    return none if value is None else format(value * scale, spec)


def print_tables(summary: dict, num_layers: int, console: Console) -> None:
    for workload, rows in summary.items():
        full = rows.get("full", {}).get("tokens_per_second")
        table = Table(title=f"workload {workload} ({next(iter(rows.values()))['prompts']} prompts)")
        columns = ("config", "tok/s", "x full", "x full p.med", "TTFT ms", "ITL p50 ms", "ITL p99 ms", "peak RSS MiB",
                   "LLM share", f"layers/LLM tok (of {num_layers})", "saved", "accept", "prefix agr", "TF agr", "identical",
                   "near-tie div", "task pass", "echoes")
        for column in columns:
            table.add_column(column, justify="left" if column == "config" else "right")
        for name, s in rows.items():
            tps = s["tokens_per_second"]
            table.add_row(
                escape(name), _fmt(tps, ".1f"), _fmt(tps / full if tps and full else None, ".2f"),
                _fmt(s.get("paired_median_vs_full"), ".2f"),
                _fmt(s["ttft_mean"], ".0f", 1e3), _fmt(s["itl_p50"], ".1f", 1e3), _fmt(s["itl_p99"], ".1f", 1e3),
                _fmt(s["peak_rss_bytes"], ".0f", 1 / 2**20), _fmt(s["llm_share"], ".0%"),
                _fmt(s["layers_per_llm_token"], ".1f"), _fmt(s["saved_compute"], ".0%"), _fmt(s["acceptance"], ".0%"),
                _fmt(s["prefix_agreement"], ".1%"), _fmt(s["tf_agreement"], ".1%"), f"{s['identical']}/{s['prompts']}",
                f"{s['near_tie_divergences']}/{s['divergences']}", _fmt(s.get("task_pass_rate"), ".0%"),
                "-" if not s.get("task_checked") else str(s["task_echoes"]))
        console.print(table)


def print_slm_agreement(slm_tf: dict, console: Console) -> None:
    if not slm_tf:
        return
    table = Table(title="SLM vs the LLM's greedy answers (teacher-forced over full's tokens)")
    for column in ("SLM", "workload", "positions", "TF agreement", "rest column wins"):
        table.add_column(column, justify="left" if column in ("SLM", "workload") else "right")
    for label, per_workload in slm_tf.items():
        for workload, a in per_workload.items():
            table.add_row(escape(label), workload, str(a["positions"]), _fmt(a["tf_agreement"], ".1%"),
                          _fmt(a["rest_wins"], ".1%"))
    console.print(table)


def print_targets(targets: list[dict], console: Console) -> None:
    table = Table(title="targets")
    for column in ("target", "measured", "verdict"):
        table.add_column(column)
    for t in targets:
        table.add_row(t["target"], t["value"], "[green]PASS[/]" if t["pass"] else "[red]MISS[/]")
    console.print(table)
    for t in targets:
        print(f"{'PASS' if t['pass'] else 'MISS'}: {t['target']}: {t['value']}")


def make_plots(summary: dict, configs: list[Config], directory: Path, console: Console) -> list[str]:
    from edgeroute.errors import EdgerouteError
    from edgeroute.plots import pyplot

    try:
        plt = pyplot()
    except EdgerouteError:
        console.print("[yellow]matplotlib is not installed: no plots[/] (pip install -e '.[bench]')")
        return []
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    workloads = list(summary)
    names = [c.name for c in configs if any(c.name in summary[w] for w in workloads)]

    fig, ax = plt.subplots(figsize=(max(8, 0.7 * len(names) + 2), 4.8))
    width = 0.8 / max(len(workloads), 1)
    for i, workload in enumerate(workloads):
        values = [summary[workload].get(n, {}).get("tokens_per_second") or 0.0 for n in names]
        ax.bar(np.arange(len(names)) + (i - (len(workloads) - 1) / 2) * width, values, width, label=workload)
    ax.set_xticks(np.arange(len(names)), names, rotation=45, ha="right")
    ax.set_ylabel("decode tokens/s (batch 1)")
    ax.set_title("decode tokens/s per configuration and workload")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path = directory / "tokens_per_second.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(str(path))

    curves = defaultdict(list)
    for c in configs:
        if c.curve:
            curves[c.curve].append(c)
    fig, axes = plt.subplots(2, len(workloads), figsize=(5 * len(workloads), 8.5), squeeze=False)
    for j, workload in enumerate(workloads):
        rows = summary[workload]
        full = rows.get("full", {}).get("tokens_per_second")
        for curve, members in curves.items():
            points = [(c.param, rows[c.name]) for c in members if c.name in rows]
            if not points:
                continue
            x = [s["tf_agreement"] for _, s in points]
            speed = [(s["tokens_per_second"] or 0) / full if full else 0 for _, s in points]
            saved = [s["saved_compute"] for _, s in points]
            for ax, y in ((axes[0][j], speed), (axes[1][j], saved)):
                ax.plot(x, y, marker="o", label=curve)
                for (param, _), xi, yi in zip(points, x, y, strict=True):
                    ax.annotate(f"{param:g}", (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=7)
        references = (("full", "s", "black"), ("speculate+ngram", "^", "tab:purple"), ("speculate+slm", "v", "tab:brown"),
                      ("route+ngram", "D", "tab:red"), ("llama.cpp", "x", "tab:gray"))
        for name, marker, color in references:
            s = rows.get(name)
            if s and full and s["tf_agreement"] is not None:
                axes[0][j].scatter([s["tf_agreement"]], [(s["tokens_per_second"] or 0) / full], marker=marker, color=color,
                                   label=name)
                axes[1][j].scatter([s["tf_agreement"]], [s["saved_compute"]], marker=marker, color=color, label=name)
        axes[0][j].set_title(f"{workload}: speed vs agreement")
        axes[0][j].set_ylabel("decode tok/s / full")
        axes[1][j].set_title(f"{workload}: saved LLM compute vs agreement")
        axes[1][j].set_ylabel("LLM layer-passes saved")
        for ax in (axes[0][j], axes[1][j]):
            ax.set_xlabel("teacher-forced agreement with the LLM")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle("trade-off over thresholds (labels: importance_threshold for skip, route_threshold for route+slm)")
    fig.tight_layout()
    path = directory / "tradeoff.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(str(path))
    return written


# -- main ---------------------------------------------------------------------------------------


def machine_info() -> dict:
    info = {"cpu_count": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version(),
            "load_average": os.getloadavg()}
    try:
        model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), None)
        info["cpu"] = model
    except OSError:
        pass
    for package in ("onnxruntime", "llama_cpp", "numpy"):
        try:
            info[package] = __import__(package).__version__
        except ImportError:
            info[package] = None
    return info


def select_configs(args: argparse.Namespace) -> list[Config]:
    configs = all_configs(args.skip_ratio, args.lookup_tokens, args.draft_tokens, args.slm_label)
    if args.slm_gguf is None:  # no SLM GGUF: no llama.cpp SLM peers
        configs = [c for c in configs if c.options.get("model") != "slm" and not c.options.get("draft")]
    if args.quick and not args.configs:
        configs = [c for c in configs if c.name in QUICK_CONFIGS]
    if args.configs:
        patterns = [p.strip() for p in args.configs.split(",") if p.strip()]
        configs = [c for c in configs if c.name == "full" or any(fnmatch.fnmatch(c.name, p) for p in patterns)]
    if args.no_llama:
        configs = [c for c in configs if c.runtime != "llama"]
    from edgeroute.bundle import Bundle

    if Bundle.open(args.bundle, verify=False).calibration is None:  # auto needs the calibrated profiles
        configs = [c for c in configs if c.options.get("mode") != "auto"]
    return configs


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle", type=Path, default=ROOT / "bundles" / "smollm2-demo")
    parser.add_argument("--gguf", type=Path, default=None,
                        help="llama.cpp's model: the LLM's source GGUF (default: the path the bundle recorded at "
                             "export; a file given here must be that source, checked by sha256)")
    parser.add_argument("--slm-gguf", type=Path, default=None,
                        help="the SLM's source GGUF (checked like --gguf; 'source': the path the bundle recorded): "
                             "adds llama.cpp on it alone and as llama.cpp's draft model")
    parser.add_argument("--draft-tokens", type=int, default=4, help="llama.cpp draft model: tokens per draft")
    parser.add_argument("--slm-bundle", type=Path, default=None,
                        help="a second bundle whose SLM (e.g. a reduced-vocabulary head) runs the SLM modes again")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated names under --workload-dir")
    parser.add_argument("--workload-dir", type=Path, default=WORKLOAD_DIR)
    parser.add_argument("--prompts", type=int, default=None, help="use the first N prompts of each workload")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1,
                        help="generate each prompt N times per configuration and keep the fastest decode")
    parser.add_argument("--configs", default=None, help="comma-separated names or globs (full is always kept)")
    parser.add_argument("--activations", choices=("int8", "fp32"), default="int8",
                        help="edgeroute's int4 kernels: int8 activations (fast, the default) or fp32")
    parser.add_argument("--backend", choices=("auto", "onnxruntime", "native"), default="auto",
                        help="what runs edgeroute's models (Engine(backend=...))")
    parser.add_argument("--exact-steps", action="store_true",
                        help="the LLM's one-token steps run as two rows, so speculation reproduces full exactly")
    parser.add_argument("--skip-ratio", type=float, default=0.3)
    parser.add_argument("--threads", type=int, default=os.cpu_count(),
                        help="threads of both runtimes (llama.cpp n_threads; edgeroute's EDGEROUTE_THREADS)")
    parser.add_argument("--n-ctx", type=int, default=2048)
    parser.add_argument("--lookup-tokens", type=int, default=2,
                        help="llama.cpp prompt lookup: tokens per draft (2: llama-cpp-python's advice for CPU-only)")
    parser.add_argument("--no-llama", action="store_true", help="leave llama.cpp out")
    parser.add_argument("--no-rss", action="store_true", help="skip the peak-RSS probe processes")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 prompts, 24 tokens, fewer configurations")
    parser.add_argument("--profile-graphs", action="store_true", help="also time every ONNX Runtime call of a few decodes")
    parser.add_argument("--profile-configs", default=",".join(PROFILE_CONFIGS),
                        help="comma-separated configuration names to profile")
    parser.add_argument("--profile-only", action="store_true", help="only the per-graph profile (implies --profile-graphs)")
    parser.add_argument("--profile-prompts", type=int, default=3, help="templated prompts per profiled configuration")
    parser.add_argument("--json", type=Path, default=ROOT / "bench-results" / "run.json")
    parser.add_argument("--plots", type=Path, default=ROOT / "bench-results", help="directory for the PNG plots")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--from-json", type=Path, default=None,
                        help="print the tables and redraw the plots of an earlier run's JSON (runs nothing)")
    parser.add_argument("--rss-probe", choices=sorted(FOOTPRINTS), help=argparse.SUPPRESS)
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts = args.prompts or 2
        args.max_new_tokens = min(args.max_new_tokens, 24)
    args.slm_label = None if args.slm_bundle is None else args.slm_bundle.name
    # equal thread counts: ORT's pool is sized from this when the first session is created
    os.environ["EDGEROUTE_THREADS"] = str(args.threads)
    return args


def load_engines(args: argparse.Namespace) -> dict[bool, object]:
    """The engine (key False) and, with --slm-bundle, a view of it whose SLM is that bundle's
    (key True; the LLM sessions are shared, not loaded twice)."""
    import copy

    from edgeroute.bundle import Bundle
    from edgeroute.runtime import Engine
    from edgeroute.runtime.backend import open_model

    engine = Engine(args.bundle, activations=args.activations, exact_steps=args.exact_steps, backend=args.backend)
    engines = {False: engine}
    if args.slm_bundle is not None:
        alt = copy.copy(engine)
        alt._slm = open_model(Bundle.open(args.slm_bundle), "slm", engine.settings, exact_steps=False)[0]
        engines[True] = alt
    return engines


def slm_agreement(engines: dict[bool, object], alt_label: str | None, workloads: dict[str, list[dict]],
                  runs: dict) -> dict:
    """Teacher-forced agreement of each SLM with the LLM's greedy answers (full's tokens): the
    share of answer positions where the SLM's argmax (over its head, in token ids) is full's
    token; for a reduced head also the share where its rest column wins (no draft there)."""
    result: dict[str, dict[str, dict]] = {}
    for alt, engine in engines.items():
        slm = engine.slm
        if slm is None:
            continue
        label = f"slm[{alt_label}]" if alt else "slm"
        per_workload = {}
        for workload, prompts in workloads.items():
            matches = positions = rest = 0
            for index, prompt in enumerate(prompts):
                ids = engine.encode_prompt(prompt["messages"])
                answer = runs[workload]["full"][index]["tokens"]
                logits = slm.forward(slm.new_cache(len(ids) + len(answer)), ids + answer, all_logits=True)
                rows = logits[len(ids) - 1:len(ids) - 1 + len(answer)]
                vocab = slm.head_vocab
                chosen = rows.argmax(-1) if vocab is None else vocab.expand(rows).argmax(-1)
                matches += int((chosen == np.asarray(answer)).sum())
                positions += len(answer)
                rest += 0 if vocab is None else int(vocab.rest_wins(rows).sum())
            per_workload[workload] = {"tf_agreement": matches / positions if positions else None,
                                      "rest_wins": rest / positions if positions else None, "positions": positions}
        result[label] = per_workload
    return result


def answer_checks(engine, workloads: dict[str, list[dict]], runs: dict, configs: list[Config]) -> None:
    """Each run's answer text and its task check (against full's answer for json)."""
    for workload, prompts in workloads.items():
        for index, prompt in enumerate(prompts):
            full_answer = engine.decode(runs[workload]["full"][index]["tokens"])
            for config in configs:
                run = runs[workload][config.name][index]
                run["answer"] = engine.decode(run["tokens"])
                check = task_check(workload, prompt, run["answer"], None if config.name == "full" else full_answer)
                run["task"] = None if check is None else asdict(check)


def report_from_json(args: argparse.Namespace, console: Console) -> int:
    result = json.loads(args.from_json.read_text())
    configs = [Config(**c) for c in result["settings"]["configs"]]
    num_layers = result.get("num_layers", 30)
    summary, targets = result["summary"], result["targets"]
    if result.get("runs"):  # recompute with this version's summary and targets
        summary = {w: {c.name: summarize(runs[c.name], num_layers, result.get("rss", {}).get(c.footprint), runs["full"])
                       for c in configs if c.name in runs} for w, runs in result["runs"].items()}
        targets = evaluate_targets(summary, result.get("profile"))
    print_tables(summary, num_layers, console)
    if result.get("profile"):
        print_profile(result["profile"], console)
    print_targets(targets, console)
    if not args.no_plots:
        plots = make_plots(summary, configs, args.plots, console)
        console.print(f"wrote {', '.join(plots)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rss_probe:
        return rss_probe(args)
    console = Console(width=None if sys.stdout.isatty() else 240)
    if args.from_json:
        return report_from_json(args, console)
    if args.profile_only:
        profile = run_profile(args, load_engines(args), console)
        print_profile(profile, console)
        for t in evaluate_targets({}, profile):
            print(f"{'PASS' if t['pass'] else 'MISS'}: {t['target']}: {t['value']}")
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"machine": machine_info(), "profile": profile}, indent=1) + "\n")
            console.print(f"wrote {args.json}")
        return 0
    wall = time.perf_counter()
    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    workloads = load_workloads(args.workload_dir, names, args.prompts)
    configs = select_configs(args)
    if any(c.runtime == "llama" for c in configs):  # the bundle's own sources, or refuse (never another model)
        args.gguf = checked_gguf(args.bundle, "llm", None if str(args.gguf) in ("None", "source") else args.gguf)
        if args.slm_gguf is not None:
            args.slm_gguf = checked_gguf(args.bundle, "slm", None if str(args.slm_gguf) == "source" else args.slm_gguf)
    info = machine_info()
    console.print(f"edgeroute bench_run: {len(configs)} configurations x {sum(map(len, workloads.values()))} prompts, "
                  f"<= {args.max_new_tokens} new tokens, {info['cpu_count']} CPUs, load average "
                  f"{' '.join(f'{x:.1f}' for x in info['load_average'])}")

    engines = load_engines(args)
    engine = engines[False]
    num_layers = engine.llm.num_layers
    eos_ids = set(engine.eos_ids)
    runners = {alt: EdgerouteRunner(e) for alt, e in engines.items()}
    llamas = {c.name: LlamaRunner(args.slm_gguf if c.options["model"] == "slm" else args.gguf, args.threads, args.n_ctx,
                                  c.options["lookup"], num_layers, args.slm_gguf, c.options.get("draft", 0))
              for c in configs if c.runtime == "llama"}

    def generate(config: Config, workload: str, prompt: dict, ids: list[int], budget: int) -> Run:
        if config.runtime == "llama":
            return llamas[config.name].run(ids, eos_ids, budget)
        options = config.options
        if options.get("mode") == "auto":
            options = {**options, "task": WORKLOAD_TASKS.get(workload, "default")}
        return runners[config.alt_slm].run(prompt["messages"], options, budget)

    first_workload = next(iter(workloads))
    first = workloads[first_workload][0]
    first_ids = engine.encode_prompt(first["messages"])
    for config in configs:  # warm-up: first ONNX Runtime runs allocate, the SLM loads, llama.cpp warms
        generate(config, first_workload, first, first_ids, 8)

    runs: dict[str, dict[str, list[dict]]] = {w: defaultdict(list) for w in workloads}
    total = sum(len(p) for p in workloads.values())
    done, started = 0, time.perf_counter()
    for workload, prompts in workloads.items():
        for prompt in prompts:
            ids = engine.encode_prompt(prompt["messages"])
            k = done % len(configs)
            for config in configs[k:] + configs[:k]:  # rotate the order from prompt to prompt
                # best of --repeats (greedy: the same tokens each time; the fastest decode is the
                # one least disturbed by other work on the machine)
                run = min((generate(config, workload, prompt, ids, args.max_new_tokens) for _ in range(args.repeats)),
                          key=lambda r: r.decode_seconds)
                runs[workload][config.name].append({"prompt": prompt["id"], "prompt_tokens": len(ids), **asdict(run)})
            done += 1
            elapsed = time.perf_counter() - started
            full_run = runs[workload]["full"][-1]
            console.print(f"  [{done}/{total}] {workload} {prompt['id']}: full {len(full_run['tokens'])} tokens; "
                          f"{elapsed:.0f}s elapsed, ~{elapsed / done * (total - done):.0f}s to go")

    console.print("teacher-forced agreement ...")
    for workload, prompts in workloads.items():
        for index, prompt in enumerate(prompts):
            ids = engine.encode_prompt(prompt["messages"])
            full = runs[workload]["full"][index]["tokens"]
            others = {c.name: runs[workload][c.name][index]["tokens"] for c in configs if c.name != "full"}
            agreement = agreement_for_prompt(engine.llm, ids, full, others)
            for name, a in agreement.items():
                runs[workload][name][index]["agreement"] = {**a, "full_tokens": len(full)}

    answer_checks(engine, workloads, runs, configs)
    slm_tf = slm_agreement(engines, args.slm_label, workloads, runs) if engine.bundle.slm is not None else {}

    rss = {}
    if not args.no_rss:
        console.print("peak RSS probes (one process per runtime footprint) ...")
        longest = max((p for ps in workloads.values() for p in ps),
                      key=lambda p: len(engine.encode_prompt(p["messages"])))
        probe = {"messages": longest["messages"], "ids": engine.encode_prompt(longest["messages"]),
                 "eos_ids": sorted(eos_ids), "num_layers": num_layers}
        rss = measure_rss(args, sorted({c.footprint for c in configs}), probe, console)

    profile = run_profile(args, engines, console) if args.profile_graphs else None

    summary = {w: {c.name: summarize(runs[w][c.name], num_layers, rss.get(c.footprint), runs[w]["full"]) for c in configs}
               for w in workloads}
    targets = evaluate_targets(summary, profile)
    print_tables(summary, num_layers, console)
    if profile:
        print_profile(profile, console)
    print_slm_agreement(slm_tf, console)
    print_targets(targets, console)

    plots = [] if args.no_plots else make_plots(summary, configs, args.plots, console)
    info["load_average_after"] = os.getloadavg()
    result = {
        "settings": {"bundle": str(args.bundle), "gguf": str(args.gguf), "max_new_tokens": args.max_new_tokens,
                     "slm_bundle": str(args.slm_bundle) if args.slm_bundle else None,
                     "slm_gguf": str(args.slm_gguf) if args.slm_gguf else None, "draft_tokens": args.draft_tokens,
                     "prompts_per_workload": {w: len(p) for w, p in workloads.items()}, "llama_threads": args.threads,
                     "edgeroute_threads": int(os.environ["EDGEROUTE_THREADS"]),
                     "n_ctx": args.n_ctx, "activations": args.activations, "backend": args.backend,
                     "exact_steps": args.exact_steps,
                     "lookup_tokens": args.lookup_tokens,
                     "skip_ratio": args.skip_ratio,
                     "configs": [asdict(c) for c in configs]},
        "machine": info, "num_layers": num_layers, "wall_seconds": time.perf_counter() - wall, "summary": summary,
        "targets": targets, "slm_agreement": slm_tf, "rss": rss, "profile": profile, "plots": plots, "runs": runs,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1, default=float) + "\n")
    console.print(f"wrote {args.json}" + (f" and {', '.join(plots)}" if plots else "")
                  + f" in {result['wall_seconds']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
