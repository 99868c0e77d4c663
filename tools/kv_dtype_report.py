"""What a narrower KV cache (fp16, int8) changes: agreement with the fp32 cache, teacher-forced
and generated.

For each model of a bundle (LLM, SLM), on the same ids of the held-out evaluation text in
windows of ``--window`` tokens (long windows: the cache's rounding accumulates over context):

- teacher-forced top-1 agreement of each narrower cache's model with the fp32-cache one, and
  each one's perplexity and next-token accuracy;

and for the LLM, greedy ``full`` answers to the templated and json workloads' prompts with
each cache: identical answers, the position of the first difference, and each answer's task
check (templated: the record's values appear; json: parses with full's keys and values).

``--floor-kernels avx2`` (native backend) adds the noise floor: the fp32 cache on another kernel
set, the same arithmetic summed in another order, teacher-forced against the default set. A
narrower cache whose agreement is no lower than that floor changes no more than fp32 itself
does between CPUs.

``--backend`` names the runtime (ONNX Runtime's portable graphs: fp16; or the native kernels:
fp16 and int8). Speed and memory over context length are bench_context.py's (runtimes
``edgeroute:portable:float16``, ``edgeroute:native:float16``, ``edgeroute:native:int8``).

    python tools/kv_dtype_report.py --bundle bundles/smollm2-demo --out bench-results/kv-dtype-smollm2.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib.metrics import common_prefix  # noqa: E402
from benchlib.tasks import task_check  # noqa: E402

from edgeroute.bundle import Bundle  # noqa: E402
from edgeroute.runtime import Engine  # noqa: E402
from edgeroute.runtime.backend import open_model  # noqa: E402
from edgeroute.runtime.evaluate import teacher_forced, tokenize_text  # noqa: E402
from edgeroute.runtime.options import EngineOptions  # noqa: E402
from edgeroute.texts import evaluation_text  # noqa: E402

WORKLOADS = Path(__file__).resolve().parent / "workloads"


NARROW = {"onnxruntime": ("float16",), "native": ("float16", "int8")}  # the caches each backend keeps


def teacher_forced_figures(bundle: Bundle, role: str, tokens: int, window: int, backend: str,
                           floor_kernels: str | None = None) -> dict:
    """Each cache's run; with ``floor_kernels``, also the fp32 cache on that native kernel set
    (reported as the cache "float32@KERNELS")."""
    ids = tokenize_text(bundle, evaluation_text(), tokens)
    models = {kv_dtype: lambda kv_dtype=kv_dtype: open_model(bundle, role, EngineOptions(backend=backend,
                                                                                      kv_dtype=kv_dtype))[0]
              for kv_dtype in ("float32", *NARROW[backend])}
    if floor_kernels:
        from edgeroute.runtime.backends.native import NativeModel

        models[f"float32@{floor_kernels}"] = lambda: NativeModel(bundle, role, kv_dtype="float32", kernels=floor_kernels)
    runs = {}
    for name, model in models.items():
        start = time.perf_counter()
        runs[name] = teacher_forced(model(), ids, window)
        print(f"{role} {name}: {len(ids)} tokens teacher-forced in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return {"positions": len(runs["float32"]), "window": window, "caches": list(runs),
            **{f"agreement_{name}": run.agreement(runs["float32"]) for name, run in runs.items() if name != "float32"},
            **{f"{kind}_{name}": getattr(run, kind) for kind in ("perplexity", "accuracy") for name, run in runs.items()}}


def generation_figures(bundle: Bundle, max_new_tokens: int, per_workload: int, backend: str) -> dict:
    engines = {kv_dtype: Engine(bundle, kv_dtype=kv_dtype, slm=False, backend=backend)
               for kv_dtype in ("float32", *NARROW[backend])}
    rows = []
    for workload in ("templated", "json"):
        prompts = json.loads((WORKLOADS / f"{workload}.json").read_text())["prompts"][:per_workload]
        for prompt in prompts:
            answers = {k: e.generate(prompt["messages"], mode="full", max_new_tokens=max_new_tokens)
                       for k, e in engines.items()}
            wide = answers["float32"]
            checks = {k: task_check(workload, prompt, a.text, wide.text) for k, a in answers.items()}
            rows.append({"workload": workload, "id": prompt["id"], "tokens": len(wide.tokens),
                         **{f"identical_{k}": wide.tokens == answers[k].tokens for k in NARROW[backend]},
                         **{f"first_difference_{k}": common_prefix(wide.tokens, answers[k].tokens)
                            for k in NARROW[backend]},
                         **{f"pass_{k}": c.passed for k, c in checks.items()}})
    return {"answers": len(rows), **{f"identical_{k}": sum(r[f"identical_{k}"] for r in rows) for k in NARROW[backend]},
            **{f"task_pass_{k}": sum(r[f"pass_{k}"] for r in rows) for k in answers}, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=4096, help="evaluation-text tokens teacher-forced")
    parser.add_argument("--window", type=int, default=2048, help="tokens per fresh cache")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per generated answer")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per workload (templated, json)")
    parser.add_argument("--backend", choices=("onnxruntime", "native"), default="onnxruntime")
    parser.add_argument("--floor-kernels", choices=("avx2", "generic"),
                        help="native: add the fp32 cache on this kernel set (the noise floor)")
    parser.add_argument("--out", type=Path, default=Path("bench-results/kv-dtype.json"))
    args = parser.parse_args(argv)
    if args.floor_kernels and args.backend != "native":
        parser.error("--floor-kernels compares native kernel sets: add --backend native")
    bundle = Bundle.open(args.bundle)
    figures = {"bundle": str(args.bundle), "backend": args.backend, "teacher_forced": {}}
    for role in bundle.models:
        figures["teacher_forced"][role] = teacher_forced_figures(bundle, role, args.tokens, args.window, args.backend,
                                                                 args.floor_kernels)
    figures["generation"] = generation_figures(bundle, args.max_new_tokens, args.prompts, args.backend)

    table = Table(title=f"narrower KV caches vs fp32: {args.bundle} on {args.backend}")
    for column in ("model", "cache", "positions", "top-1 agreement with fp32", "perplexity", "accuracy"):
        table.add_column(column)
    for role, f in figures["teacher_forced"].items():
        for dtype in f["caches"]:
            agreement = f"{f[f'agreement_{dtype}']:.2%}" if dtype != "float32" else "-"
            table.add_row(role, dtype, str(f["positions"]), agreement, f"{f[f'perplexity_{dtype}']:.3f}",
                          f"{f[f'accuracy_{dtype}']:.2%}")
    console = Console()
    console.print(table)
    g = figures["generation"]
    n = g["answers"]
    console.print(f"LLM greedy answers (full, {args.max_new_tokens} tokens): task pass fp32 {g['task_pass_float32']}/{n}; "
                  + "; ".join(f"{k}: {g[f'identical_{k}']}/{n} identical, task pass {g[f'task_pass_{k}']}/{n}"
                              for k in NARROW[args.backend]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
