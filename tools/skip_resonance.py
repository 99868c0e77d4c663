"""The resonance table (FreeToken 5.2): does a skip threshold fitted on the float model carry
over to the quantized one, or do quantization and skipping errors compound?

Both bundles are observed on the same teacher-forced answers (the int4 model's greedy ones,
to calibration prompts: never the benchmark workloads). Thresholds are fitted on the first half
of the prompts and measured on the second, against the float model's own top-1 tokens:

    (a) int4, no skipping
    (b) fp32, skipping with the threshold fitted on fp32
    (c) int4, skipping with fp32's threshold
    (d) int4, skipping with a threshold re-fitted on int4 (what `edgeroute calibrate` does)

    python tools/skip_resonance.py --int4 bundles/smollm2-demo --fp32 bundles/smollm2-fp32 --budget 0.9
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from edgeroute.calibration.prompts import TASKS, builtin_prompts
from edgeroute.calibration.skipping import FREE_LAYERS, SCORERS, SkipObservations, fit_skip, observe_skips, outcomes
from edgeroute.calibration.thresholds import BudgetUnreachable
from edgeroute.runtime.engine import Engine
from edgeroute.skip_options import SkipOptions


def answers(engine: Engine, prompts: int, tokens: int) -> list[tuple[list[int], list[int]]]:
    """The int4 model's greedy answers to calibration prompts, the tasks taken in turn."""
    by_task = {task: [p for p in builtin_prompts() if p.task == task] for task in TASKS}
    chosen = [by_task[TASKS[i % len(TASKS)]][i // len(TASKS)] for i in range(prompts)]
    sequences = []
    for prompt in chosen:
        messages = [{"role": "user", "content": prompt.content}]
        generation = engine.generate(messages, mode="full", max_new_tokens=tokens)
        if len(generation.tokens) > 1:
            sequences.append((engine.encode_prompt(messages), generation.tokens))
    return sequences


def row(observations: SkipObservations, scorer: str, threshold: float | None, reference: np.ndarray) -> dict:
    if threshold is None:
        return {"agreement_vs_fp32": float((observations.full_tokens == reference).mean()), "skipped_share": 0.0}
    wrong, skipped = outcomes(observations, scorer, np.asarray([threshold]), reference)
    own, _ = outcomes(observations, scorer, np.asarray([threshold]))
    return {"threshold": threshold, "agreement_vs_fp32": float(1 - wrong.mean()),
            "agreement_vs_own_full": float(1 - own.mean()), "skipped_share": float(skipped.mean())}


def fitted(observations: SkipObservations, scorer: str, budget: float) -> float | None:
    try:
        return fit_skip(observations, scorer, budget).choice.threshold
    except BudgetUnreachable:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--int4", type=Path, required=True)
    parser.add_argument("--fp32", type=Path, required=True)
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--answer-tokens", type=int, default=32)
    parser.add_argument("--budget", type=float, default=0.9, help="teacher-forced agreement the fits must keep")
    parser.add_argument("--granularity", default="layer", choices=["layer", "mlp"])
    parser.add_argument("--json", type=Path, default=Path("bench-results/skip-resonance.json"))
    args = parser.parse_args(argv)

    quantized, full = Engine(args.int4, slm=False), Engine(args.fp32, slm=False)
    options = SkipOptions(granularity=args.granularity, max_free_layers=FREE_LAYERS)
    with Progress() as bars:
        task = bars.add_task("int4 answers", total=None)
        sequences = answers(quantized, args.prompts, args.answer_tokens)
        observed = {}
        for name, engine in (("int4", quantized), ("fp32", full)):
            bars.update(task, description=f"{name} observations", total=len(sequences), completed=0)
            observed[name] = observe_skips(engine.llm, sequences, options,
                                           lambda _, done, total: bars.update(task, completed=done))
    half = len(sequences) // 2
    fit_part = {name: o.subset(np.arange(len(sequences)) < half) for name, o in observed.items()}
    test = {name: o.subset(np.arange(len(sequences)) >= half) for name, o in observed.items()}
    reference = test["fp32"].full_tokens
    results = {"budget": args.budget, "granularity": args.granularity, "prompts": len(sequences),
               "test_positions": len(reference), "int4": str(args.int4), "fp32": str(args.fp32), "rows": {}}
    table = Table(title=f"skip resonance: {args.int4.name} vs {args.fp32.name}, {args.granularity} skips of "
                        f"{FREE_LAYERS} layers, budget {args.budget:.0%} (fitted on {half} prompts, "
                        f"measured on {len(sequences) - half})")
    for column in ("scorer", "configuration", "threshold", "agreement vs fp32", "vs own full", "skipped work"):
        table.add_column(column)
    for scorer in SCORERS:
        fp32_threshold, int4_threshold = (fitted(fit_part[name], scorer, args.budget) for name in ("fp32", "int4"))
        rows = {"(a) int4, no skip": row(test["int4"], scorer, None, reference),
                "(b) fp32, fitted on fp32": row(test["fp32"], scorer, fp32_threshold, reference)
                if fp32_threshold is not None else None,
                "(c) int4, fp32's threshold": row(test["int4"], scorer, fp32_threshold, reference)
                if fp32_threshold is not None else None,
                "(d) int4, re-fitted on int4": row(test["int4"], scorer, int4_threshold, reference)
                if int4_threshold is not None else None}
        results["rows"][scorer] = rows
        for label, figures in rows.items():
            if figures is None:
                table.add_row(scorer, label, "unreachable", "", "", "")
                continue
            table.add_row(scorer, label, f"{figures.get('threshold', float('nan')):.3f}",
                          f"{figures['agreement_vs_fp32']:.1%}", f"{figures.get('agreement_vs_own_full', 1.0):.1%}",
                          f"{figures['skipped_share']:.1%}")
    Console().print(table)
    results["score_medians"] = {scorer: {name: [round(float(v), 4) for v in np.median(o.scores[scorer], axis=0)]
                                         for name, o in observed.items()} for scorer in SCORERS}
    results["points"] = observed["int4"].points
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1))
    plot(results, args.json.with_suffix(".png"))
    plot_scores(observed, args.json.with_name(args.json.stem + "-scores.png"))
    return 0


def plot_scores(observed: dict[str, SkipObservations], path: Path) -> None:
    """Each scorer's importance distribution, fp32 vs int4, per decision point (the quantile
    band 10-90% and the median): how far quantization moves what a threshold is compared with."""
    from edgeroute.plots import pyplot

    plt = pyplot()

    figure, axes = plt.subplots(1, len(SCORERS), figsize=(6 * len(SCORERS), 4), squeeze=False)
    for ax, scorer in zip(axes[0], SCORERS, strict=True):
        for name, colour in (("fp32", "tab:blue"), ("int4", "tab:orange")):
            scores = observed[name].scores[scorer]
            low, median, high = np.quantile(scores, [0.1, 0.5, 0.9], axis=0)
            points = observed[name].points
            ax.fill_between(points, low, high, color=colour, alpha=0.25)
            ax.plot(points, median, color=colour, label=f"{name} (median, 10-90%)")
        ax.set_xlabel("decision point (layer)")
        ax.set_ylabel(f"{scorer} importance")
        ax.set_title(f"{scorer} scores, fp32 vs int4")
        ax.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot(results: dict, path: Path) -> None:
    from edgeroute.plots import pyplot

    plt = pyplot()

    figure, axes = plt.subplots(1, len(results["rows"]), figsize=(6 * len(results["rows"]), 4), squeeze=False)
    for ax, (scorer, rows) in zip(axes[0], results["rows"].items(), strict=True):
        labels = [label.split(")")[0] + ")" for label in rows]
        agreement = [r["agreement_vs_fp32"] if r else 0 for r in rows.values()]
        skipped = [r["skipped_share"] if r else 0 for r in rows.values()]
        x = np.arange(len(labels))
        ax.bar(x - 0.2, agreement, 0.4, label="agreement with fp32 (top-1)")
        ax.bar(x + 0.2, skipped, 0.4, label="layer work skipped")
        ax.axhline(results["budget"], color="grey", linestyle="--", linewidth=1)
        ax.set_xticks(x, labels)
        ax.set_title(f"{scorer} scorer (missing bar: no threshold meets the budget)")
        ax.set_ylim(0, 1)
    axes[0][0].legend(loc="center left")
    figure.suptitle("(a) int4 no skip, (b) fp32 fitted on fp32, (c) int4 with fp32's threshold, "
                    "(d) int4 re-fitted")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


if __name__ == "__main__":
    raise SystemExit(main())
