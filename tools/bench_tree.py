"""Tree speculation against linear speculation, ``full`` and llama.cpp (issue 46), paired.

One process holds every runtime: for each bundle, an edgeroute engine (native backend) per
thread count and kernel set, and llama.cpp on the bundle's own source GGUF (``checked_gguf``:
never another model) per thread count, plus llama.cpp with the SLM's GGUF as its draft model
where the SLM has a GGUF of its own. Each round runs every prompt of every workload through
every configuration, the (threads, kernels) groups and the configurations in an order that
rotates from prompt to prompt, so load from other work hits all of them alike. Every edgeroute
configuration must give ``full``'s tokens (greedy speculation is exact; the tool stops if one
does not); llama.cpp's own tokens are recorded and compared, not required.

A sample is one generation: decode tok/s (tokens after the first over the time after the first),
LLM passes, tokens per pass (the acceptance length: new tokens / passes) and seconds per pass.
The table gives, per bundle, workload, threads and kernel set, the median over samples of each
configuration's tok/s and of its paired ratios (against ``full`` and llama.cpp on the same
prompt in the same round).

The ``memory`` configurations draft from an answer memory (``edgeroute.runtime.answer_memory``)
that holds ``full``'s answers to the prompts run before in the same round, across workloads: an
assistant that has answered those requests before. It starts empty each round and never holds
the prompt being run, so the first prompts of a round draft from little. Every other
configuration runs without one (a calibrated bundle's own memory is set aside), so ``ngram
linear`` is the prompt's lookup alone.

    python tools/bench_tree.py --kernels auto avx2   # both bundles, five workloads: ~2.5-3 h alone on a 2-core box
    python tools/bench_tree.py --bundles bundles/qwen-pair --workloads templated json intents open grounded \\
        --prompts 0 --rounds 1 --max-new-tokens 64 --threads 2 --configs "ngram linear" "ngram memory" \\
        "ngram+slm linear" "ngram+slm memory"   # the answer memory on whole workloads: ~18 min
    python tools/bench_tree.py --bundles bundles/smollm2-demo --workloads templated --prompts 1 \\
        --rounds 1 --max-new-tokens 8 --threads 1 --out /tmp/tree-smoke   # a smoke run

Writes ``tree.json`` (machine, commit, command, samples, summary), ``tree.md`` (the table) and
``tree.png`` (tok/s over llama.cpp's per configuration) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tools.*, when run as a script
from tools.bench_run import WORKLOAD_DIR, EdgerouteRunner, LlamaRunner, load_workloads, machine_info  # noqa: E402
from tools.benchlib.llama import checked_gguf  # noqa: E402
from tools.benchlib.metrics import tokens_per_second  # noqa: E402
from tools.records import commit  # noqa: E402

WORKLOADS = ("templated", "open", "json", "grounded", "intents")  # intents: the voice-command workload
BUNDLES = (str(ROOT / "bundles" / "smollm2-demo"), str(ROOT / "bundles" / "qwen-pair"))
LLAMA_DRAFT_TOKENS = 4  # llama.cpp's draft model drafts this many tokens (bench_run's default)


MEMORY_LIGHTS = ("ngram", "ngram+slm")  # the light paths whose lookup drafts from an answer memory


def configs(branches: int, tree_nodes: int | None) -> dict[str, dict]:
    """Each edgeroute configuration's session options: full, each light path linear and as trees,
    and the lookup's linear drafts with the answer memory (``memory``: not a session option; the
    engine's memory is set for the run)."""
    tree = {"draft_branches": branches, "draft_tree_nodes": tree_nodes}
    named = {"full": {"mode": "full"}}
    for light in ("ngram", "slm", "ngram+slm"):
        named[f"{light} linear"] = {"mode": "speculate", "light": light}
        named[f"{light} tree"] = {"mode": "speculate", "light": light, **tree}
    for light in MEMORY_LIGHTS:
        named[f"{light} memory"] = {"mode": "speculate", "light": light, "memory": True}
    return named


def sample(run, **where) -> dict:
    passes = max(run.llm_calls, 1)
    return {**where, "tokens": len(run.tokens), "decode_seconds": run.decode_seconds, "ttft": run.ttft,
            "tokens_per_second": tokens_per_second(vars(run)), "llm_passes": run.llm_calls,
            "tokens_per_pass": len(run.tokens) / passes,
            # the first pass runs the prompt too (it is in the TTFT): decode's passes are the others
            "seconds_per_pass": run.decode_seconds / max(run.llm_calls - 1, 1),
            "drafted": run.drafted, "accepted": run.accepted}


def bench_bundle(bundle: str, args: argparse.Namespace, workloads: dict[str, list[dict]], samples: list[dict],
                 log) -> None:
    from edgeroute.runtime import AnswerMemory, Engine

    named = configs(args.branches, args.tree_nodes)
    # The memory holds full's answers to the round's earlier prompts (every workload): what an
    # assistant that learns as it answers has seen. It never holds the prompt being run, and it
    # starts empty each round, so a prompt's own answer from an earlier round is never drafted.
    memory = AnswerMemory(learning=False)
    gguf = checked_gguf(bundle, "llm")
    slm_gguf = checked_gguf(bundle, "slm")
    groups = [(threads, kernels) for threads in args.threads for kernels in args.kernels]
    engines = {group: Engine(bundle, backend="native", threads=group[0], kernels=group[1]) for group in groups}
    engine = engines[groups[0]]
    runners = {group: EdgerouteRunner(e) for group, e in engines.items()}
    eos_ids, layers = set(engine.eos_ids), engine.llm.num_layers
    llamas = {threads: {"llama.cpp": LlamaRunner(gguf, threads, args.n_ctx, 0, layers)} for threads in args.threads}
    if slm_gguf != gguf:  # the demo's SLM is a cut of the LLM: no GGUF of its own to draft with
        for threads in args.threads:
            llamas[threads]["llama.cpp+draft-slm"] = LlamaRunner(gguf, threads, args.n_ctx, 0, layers, slm_gguf,
                                                                 LLAMA_DRAFT_TOKENS)
    keep = None if args.configs is None else {*args.configs, "full", "llama.cpp"}  # every ratio pairs with these
    names = [name for name in [*named, *llamas[args.threads[0]]] if keep is None or name in keep]

    def generate(group, name: str, prompt: dict, ids: list[int], budget: int):
        if name in named:
            options = dict(named[name])
            engines[group].answer_memory = memory if options.pop("memory", False) else None
            return runners[group].run(prompt["messages"], options, budget)
        return llamas[group[0]][name].run(ids, eos_ids, budget)

    first = next(iter(workloads.values()))[0]
    for group in groups:  # warm-up: the first runs allocate, the SLM loads, llama.cpp warms
        for name in names:
            generate(group, name, first, engine.encode_prompt(first["messages"]), 8)
    turn = 0
    for round_ in range(args.rounds):
        memory.clear()
        for workload, prompts in workloads.items():
            for prompt in prompts:
                ids = engine.encode_prompt(prompt["messages"])
                for group in groups[turn % len(groups):] + groups[:turn % len(groups)]:
                    order = names[turn % len(names):] + names[:turn % len(names)]
                    turn += 1
                    runs = {name: generate(group, name, prompt, ids, args.max_new_tokens) for name in order}
                    full = runs["full"].tokens
                    for name, run in runs.items():
                        if name in named and run.tokens != full:
                            raise SystemExit(f"{bundle} {workload} {prompt['id']} {group}: {name} decoded other "
                                             "tokens than full (speculation must be exact)")
                        samples.append(sample(run, bundle=bundle, workload=workload, prompt=prompt["id"],
                                              round=round_, threads=group[0], kernels=engines[group].llm.kernels,
                                              config=name, identical=run.tokens == full))
                memory.remember(None, [t for t in full if t not in eos_ids])
                log(f"{bundle} round {round_ + 1}/{args.rounds} {workload} {prompt['id']}")


def order(name: str) -> int:
    """A configuration's place in the table: full, each light path linear then as trees, llama.cpp's."""
    names = [*configs(2, None), "llama.cpp", "llama.cpp+draft-slm"]
    return names.index(name)


def summarize(samples: list[dict]) -> list[dict]:
    """Per bundle, workload, threads, kernels and configuration: medians over samples, the ratios paired
    with full's and llama.cpp's run of the same prompt in the same round."""
    cells: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for s in samples:
        cells[(s["bundle"], s["workload"], s["threads"], s["kernels"], s["prompt"], s["round"])][s["config"]] = s
    rows: dict[tuple, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for key, by_config in cells.items():
        full, llama = by_config["full"]["tokens_per_second"], by_config["llama.cpp"]["tokens_per_second"]
        for name, s in by_config.items():
            row = rows[(*key[:4], name)]
            for field in ("tokens_per_second", "tokens_per_pass", "seconds_per_pass"):
                if s[field] is not None:
                    row[field].append(s[field])
            if s["tokens_per_second"] and full and llama:
                row["vs_full"].append(s["tokens_per_second"] / full)
                row["vs_llama"].append(s["tokens_per_second"] / llama)
            row["identical"].append(s["identical"])
    return [{"bundle": b, "workload": w, "threads": t, "kernels": k, "config": c, "samples": len(row["identical"]),
             "identical": sum(row["identical"]),
             **{field: statistics.median(values) if values else None for field, values in row.items()
                if field != "identical"}}
            for (b, w, t, k, c), row in sorted(rows.items(), key=lambda item: (*item[0][:4], order(item[0][4])))]


def markdown(summary: list[dict]) -> str:
    lines = ["| bundle | workload | threads | kernels | configuration | tok/s | x full | x llama.cpp | tokens/pass | "
             "ms/pass | identical |", "|" + "---|" * 11]
    def num(r: dict, key: str, spec: str, scale: float = 1.0) -> str:
        return format(r[key] * scale, spec) if r.get(key) is not None else "-"

    for r in summary:
        lines.append(f"| {Path(r['bundle']).name} | {r['workload']} | {r['threads']} | {r['kernels']} | {r['config']} | "
                     f"{num(r, 'tokens_per_second', '.1f')} | {num(r, 'vs_full', '.2f')} | {num(r, 'vs_llama', '.2f')} | "
                     f"{num(r, 'tokens_per_pass', '.2f')} | {num(r, 'seconds_per_pass', '.0f', 1000)} | "
                     f"{r['identical']}/{r['samples']} |")
    return "\n".join(lines) + "\n"


def plot(path: Path, summary: list[dict]) -> None:
    from edgeroute.plots import pyplot

    plt = pyplot()

    panels = sorted({(r["bundle"], r["threads"], r["kernels"]) for r in summary})
    figure, axes = plt.subplots(len(panels), 1, figsize=(9, 3.2 * len(panels)), squeeze=False)
    for axis, panel in zip(axes[:, 0], panels, strict=True):
        rows = [r for r in summary if (r["bundle"], r["threads"], r["kernels"]) == panel]
        workloads = sorted({r["workload"] for r in rows})
        names = list(dict.fromkeys(r["config"] for r in rows))
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            values = [next((r["vs_llama"] or 0 for r in rows if r["workload"] == w and r["config"] == name), 0)
                      for w in workloads]
            axis.bar([x + i * width for x in range(len(workloads))], values, width, label=name)
        axis.axhline(1.0, color="black", linewidth=0.8)
        axis.set_xticks([x + 0.4 - width / 2 for x in range(len(workloads))], workloads)
        axis.set_ylabel("decode tok/s / llama.cpp")
        axis.set_title(f"{Path(panel[0]).name}, {panel[1]} thread(s), {panel[2]} kernels", fontsize=9)
    axes[0, 0].legend(fontsize=7, ncol=3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundles", nargs="+", default=list(BUNDLES))
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--prompts", type=int, default=3, help="first N prompts of each workload (0: all)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--kernels", nargs="+", default=["auto"],
                        help="native kernel sets, each its own engine (auto, avx2: the forced AVX2 tier, ...)")
    parser.add_argument("--branches", type=int, default=3, help="the tree configurations' draft_branches")
    parser.add_argument("--tree-nodes", type=int, default=None, help="their draft_tree_nodes (default: one pass's rows)")
    parser.add_argument("--configs", nargs="+", default=None,
                        help="run only these configurations (full and llama.cpp always stay: the ratios pair with them)")
    parser.add_argument("--n-ctx", type=int, default=2048)
    parser.add_argument("--out", type=Path, default=ROOT / "bench-results" / "tree")
    args = parser.parse_args(argv)

    workloads = load_workloads(WORKLOAD_DIR, args.workloads, args.prompts)
    started = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - started:7.0f} s] {message}", flush=True)

    samples: list[dict] = []
    for bundle in args.bundles:
        bench_bundle(bundle, args, workloads, samples, log)
    summary = summarize(samples)
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"machine": machine_info(), "commit": commit(), "command": [sys.executable, *sys.argv],
              "wall_seconds": time.perf_counter() - started, "options": {k: str(v) if isinstance(v, Path) else v
                                                                         for k, v in vars(args).items()},
              "summary": summary, "samples": samples}
    (args.out / "tree.json").write_text(json.dumps(record, indent=1) + "\n")
    (args.out / "tree.md").write_text(markdown(summary))
    plot(args.out / "tree.png", summary)
    print(markdown(summary))
    log(f"wrote {args.out}/tree.json, tree.md, tree.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
