"""``edgeroute eval``: a task set (your own JSONL, or the built-in held-out set) through several
decoding modes of one bundle; per mode the pass rate with its confidence interval, the bound on
what it loses against ``full`` on the same cases, tok/s and the LLM share.

Device-side: the engine, the sandbox and numpy; matplotlib only for the PNG, llama-cpp-python
only for the ``llama.cpp`` row (the bundle's own source GGUF, greedy, the same prompt ids).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from edgeroute.cpu import cpu_signature
from edgeroute.errors import InputError
from edgeroute.plots import png_path, pyplot
from edgeroute.quality.cases import TaskCase
from edgeroute.quality.runs import (
    DEFAULT_CONFIDENCE,
    DEFAULT_TOLERANCE,
    LOSSLESS_MODES,
    Progress,
    RunConfig,
    eligibility,
    is_lossless,
    run_cases,
    summarize,
)

MODES = ("full", "slm", "speculate", "route", "skip", "route+skip", "speculate+skip", "auto")
LIGHTS = ("ngram", "slm", "ngram+slm")
LLAMA_CPP = "llama.cpp"
DEFAULT_MODES = "full,speculate/ngram,speculate/slm,route/slm"


def parse_modes(text: str) -> list[RunConfig]:
    """``full,speculate/slm,route/ngram,auto,...``: a mode, and after a slash its light path.
    ``full`` always runs, first: every other mode is judged against it."""
    configs = [RunConfig("full", {"mode": "full"})]
    for part in (part.strip() for part in text.split(",")):
        mode, _, light = (piece.strip() for piece in part.partition("/"))
        name = f"{mode}/{light}" if light else mode  # "speculate/" and "speculate" are one row
        if not name or name == "full" or any(c.name == name for c in configs):
            continue
        if mode not in MODES:
            raise InputError(f"mode {mode!r} is not one of {', '.join(MODES)} (in --modes {text!r})")
        if light and light not in LIGHTS:
            raise InputError(f"light path {light!r} is not one of {', '.join(LIGHTS)} (in --modes {text!r})")
        configs.append(RunConfig(name, {"mode": mode, **({"light": light} if light else {})}))
    return configs


@dataclass
class EvalReport:
    """What :func:`evaluate` measured: per configuration over all cases and per task."""

    bundle: str
    machine: dict[str, Any]
    backend: str
    max_new_tokens: int
    confidence: float
    tolerance: float
    cases: int
    configs: list[str]
    overall: dict[str, dict[str, Any]]  # config -> summarize() over every case
    per_task: dict[str, dict[str, dict[str, Any]]]  # task -> config -> summarize()
    runs: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # config -> one row per case
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _auto_config(engine, cases: Sequence[TaskCase]) -> RunConfig:
    """mode auto with each case's task profile, ``default`` for tasks the bundle was not calibrated for."""
    profiles = engine.bundle.calibration.profiles if engine.bundle.calibration is not None else {}
    if not profiles:
        raise InputError(f"mode auto needs a calibrated bundle; {engine.bundle.path} is uncalibrated: run "
                         "`edgeroute calibrate` first, or leave auto out of --modes")
    tasks = {c.task for c in cases}
    return RunConfig("auto", {"mode": "auto", "task": "default"},
                     {t: {"task": t if t in profiles else "default"} for t in tasks})


def _auto_lossless(engine, tasks: Sequence[str]) -> bool:
    """Does auto run a lossless mode on every one of ``tasks`` (their profiles' chosen modes)?"""
    profiles = engine.bundle.calibration.profiles
    return all((profiles[t] if t in profiles else profiles["default"]).get("mode") in LOSSLESS_MODES for t in tasks)


def _llama_rows(engine, cases: Sequence[TaskCase], max_new_tokens: int, threads: int | None) -> list[dict[str, Any]]:
    """llama.cpp on the bundle's source GGUF: the same prompt ids as the engine's, greedy, its own
    kernels; the answer decoded with the bundle's tokenizer and judged by the same checks."""
    from edgeroute.cpu import thread_count
    from edgeroute.measure.bench import LlamaCppCase, source_gguf

    llm = engine.bundle.models["llm"]
    case_model = LlamaCppCase(source_gguf(engine.bundle, "llm"), thread_count(threads),
                              int(engine.bundle.generation["context_length"]))
    if case_model.layers != llm.num_layers:
        raise InputError(f"the LLM is the first {llm.num_layers} of its GGUF's {case_model.layers} layers: llama.cpp "
                         "would run another model")
    rows = []
    for case in cases:
        if case.response_format is not None:
            rows.append({"case": case.id, "task": case.task, "tokens": 0, "seconds": 0.0, "llm_tokens": 0,
                         "pass": None, "reason": "llama.cpp row: response_format is not applied", "same_as_full": False})
            continue
        ids = engine.encode_prompt(case.messages)
        case_model.llm.reset()
        logits = case_model.prefill(ids)
        tokens, start = [int(logits.argmax())], time.perf_counter()
        while tokens[-1] not in engine.eos_ids and len(tokens) < (case.max_new_tokens or max_new_tokens):
            logits = case_model.step(logits)  # feeds the argmax of the logits it is given
            tokens.append(int(logits.argmax()))
        seconds = time.perf_counter() - start
        text = engine.decode([t for t in tokens if t not in engine.eos_ids])
        verdict = case.verdict(text)
        rows.append({"case": case.id, "task": case.task, "tokens": len(tokens), "seconds": seconds,
                     "llm_tokens": len(tokens), "pass": verdict.passed, "reason": verdict.reason,
                     "same_as_full": False, "text": text})
    return rows


def eval_configs(modes: str | Sequence[RunConfig], max_new_tokens: int, confidence: float,
                 tolerance: float = DEFAULT_TOLERANCE) -> list[RunConfig]:
    """The configurations ``modes`` names, ``full`` first (every other mode is judged against its
    answers), once the settings are valid: :func:`evaluate` checks them, and the CLI before it
    loads the bundle."""
    if not 0.5 <= confidence < 1.0:
        raise InputError(f"confidence must be within [0.5, 1) (got {confidence})")
    # a tolerance of 1 or more lets a mode that loses every case replace full
    if not 0.0 <= tolerance < 1.0:
        raise InputError(f"the task loss (tolerance) must be within [0, 1) (got {tolerance})")
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be at least 1 (got {max_new_tokens!r})")
    configs = parse_modes(modes) if isinstance(modes, str) else list(modes)
    if not configs or configs[0].name != "full":
        configs = [RunConfig("full", {"mode": "full"}), *(c for c in configs if c.name != "full")]
    return configs


def evaluate(engine, cases: Sequence[TaskCase], modes: str | Sequence[RunConfig] = DEFAULT_MODES,
             max_new_tokens: int = 64, confidence: float = DEFAULT_CONFIDENCE, tolerance: float = DEFAULT_TOLERANCE,
             llama_cpp: bool = False, threads: int | None = None, progress: Progress | None = None) -> EvalReport:
    """Run ``cases`` through each mode of ``engine`` (an :class:`edgeroute.runtime.Engine`),
    interleaved case by case, and judge every answer. ``modes``: as :func:`parse_modes` reads
    them, or configurations. ``llama_cpp``: also run the bundle's source GGUF on llama.cpp."""
    if not cases:
        raise InputError("no task cases to evaluate")
    configs = [_auto_config(engine, cases) if c.name == "auto" else c
               for c in eval_configs(modes, max_new_tokens, confidence, tolerance)]
    runs = run_cases(engine, cases, configs, max_new_tokens, progress, keep_text=True)
    notes = []
    if llama_cpp:
        from edgeroute.measure.bench import Unavailable

        try:
            import llama_cpp as _  # noqa: F401 - only whether it is installed

            runs[LLAMA_CPP] = _llama_rows(engine, cases, max_new_tokens, threads)
            for row, reference in zip(runs[LLAMA_CPP], runs["full"], strict=True):
                row["same_as_full"] = row.get("text") == reference["text"]
        except ImportError:
            notes.append("llama.cpp: llama-cpp-python is not installed (pip install 'edgeroute[bench]'): no row")
        except (InputError, Unavailable) as err:
            notes.append(f"llama.cpp: {err}: no row")
    names = list(runs)
    overall = {name: summarize(runs[name], runs["full"], confidence) for name in names}
    tasks = sorted({c.task for c in cases})
    per_task = {task: {name: summarize([r for r in runs[name] if r["task"] == task],
                                       [r for r in runs["full"] if r["task"] == task], confidence) for name in names}
                for task in tasks}
    by_name = {c.name: c for c in configs}
    for task, task_figures in (("default", overall), *per_task.items()):
        for name, figures in task_figures.items():
            lossless = _auto_lossless(engine, tasks if task == "default" else [task]) if name == "auto" \
                else name != LLAMA_CPP and is_lossless(by_name[name], task)
            figures["eligible"], figures["why"] = (False, "another runtime: compared for speed and pass rate only") \
                if name == LLAMA_CPP else eligibility(name, figures, tolerance, lossless)
    return EvalReport(str(engine.bundle.path), cpu_signature(), engine.llm.flavour, max_new_tokens, confidence, tolerance,
                      len(cases), names, overall, per_task, runs, notes)


def _figures_table(title: str, confidence: float) -> Table:
    """One row per mode, borderless and compact: it fits an 80-column terminal unfolded."""
    table = Table(title=title, title_justify="left", box=None, padding=(0, 1, 0, 0), header_style="bold")
    for column, justify in (("mode", "left"), (f"pass\n({confidence:.0%} CI)", "left"), ("lost/\ngained", "right"),
                            ("loss\nbound", "right"), ("same\ntext", "right"), ("tok/s", "right"),
                            ("x\nfull", "right"), ("LLM", "right"), ("for\nfull", "left")):
        table.add_column(column, justify=justify, no_wrap=True)
    return table


def _figures_row(table: Table, label: str, f: dict) -> None:
    if f["task_pass"] is None:
        passed = f"no check ({f['prompts']})"
    else:
        low, high = f["pass_interval"]
        passed = f"{f['task_pass'] * f['judged']:.0f}/{f['judged']} ({100 * low:.0f}-{high:.0%})"
    tok_s = f"{f['tok_s']:.1f}" if f["tok_s"] < 1000 else f"{f['tok_s']:.0f}"
    table.add_row(label, passed, f"{f['lost']}/{f['gained']}", f"{f['loss_bound']:.1%}" if f["judged"] else "-",
                  f"{f['same_as_full']:.0%}", tok_s, f"{f['speed_vs_full']:.2f}x", f"{f['llm_share']:.0%}",
                  "yes" if f["eligible"] else "no")


def print_report(report: EvalReport, console: Console) -> None:
    """The report as tables: every mode over all cases, then per task; eligibility reasons, and
    what auto ran, below. Text from outside (reasons, notes, task names) is escaped: rich would
    take its [brackets] for markup and drop them (pip install 'edgeroute[bench]')."""
    table = _figures_table(f"{report.cases} cases, {report.backend} backend, at most {report.max_new_tokens} new "
                           "tokens", report.confidence)
    for name, figures in report.overall.items():
        _figures_row(table, name, figures)
    console.print(table)
    for name, figures in report.overall.items():
        if name != "full":
            console.print(f"{name}: {'may' if figures['eligible'] else 'may not'} replace full: {escape(figures['why'])}")
        if figures.get("ran") and figures["ran"] != [name]:  # auto's choices, say
            ran = "; ".join(f"{task} {', '.join(f[name]['ran'])}" for task, f in report.per_task.items())
            console.print(f"{name} ran: {escape(ran)}")
    if len(report.per_task) > 1:
        table = _figures_table("per task", report.confidence)
        for task, figures in report.per_task.items():
            table.add_row(f"[bold]{escape(task)}[/]")
            for name, f in figures.items():
                _figures_row(table, f"  {name}", f)
        console.print(table)
    for note in report.notes:
        console.print(f"note: {escape(note)}")


def plot_report(report: EvalReport, path: str | Path) -> Path:
    """Pass rate (with its interval) against decode speed, one point per mode; full and llama.cpp marked."""
    path = png_path(path)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for name, figures in report.overall.items():
        if figures["task_pass"] is None:
            continue
        low, high = figures["pass_interval"]
        rate = figures["task_pass"]
        style = {"full": dict(marker="s", color="black"), LLAMA_CPP: dict(marker="^", color="tab:red")}.get(
            name, dict(marker="o"))
        ax.errorbar(figures["tok_s"], rate, yerr=[[rate - low], [high - rate]], capsize=4, linestyle="none",
                    label=f"{name} ({figures['judged']} judged)", **style)
    ax.set_xlabel("decode tok/s")
    ax.set_ylabel(f"task pass rate ({report.confidence:.0%} interval)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"{Path(report.bundle).name}: {report.cases} cases, {report.backend} backend", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
