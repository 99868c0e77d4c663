"""`edgeroute` command line: argument parsing and printing over the Python API."""

from __future__ import annotations

import sys
import warnings
from contextlib import contextmanager
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from edgeroute.cpu import cpu_signature, signature_difference
from edgeroute.errors import EdgerouteError
from edgeroute.files import atomic_write, check_output_folder

BUILTIN_EVAL_PER_TASK = 12  # eval --tasks builtin: held-out prompts per task unless --per-task says

# Plain click help: rich's help panels spend a third of 80 columns on borders and type columns.
app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="Export, calibrate and run edge LLM bundles (SLM + 4-bit LLM as ONNX graphs).")
console = Console()
err_console = Console(stderr=True)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """The runtime's warnings (a calibration taken on another CPU, unmeasured skipping) as one
    line on stderr, as the CLI's errors are, not as a Python source location."""
    err_console.print(f"[bold yellow]warning:[/] {escape(str(message))}")


@contextmanager
def _clear_errors():
    shown = warnings.showwarning
    warnings.showwarning = _show_warning
    try:
        yield
    except EdgerouteError as err:
        err_console.print(f"[bold red]error:[/] {escape(str(err))}", soft_wrap=True)  # [brackets] are text; a path unbroken
        raise typer.Exit(2) from None
    finally:
        warnings.showwarning = shown


@contextmanager
def _progress_bars():
    """A ``progress(task, done, total)`` callback drawing one rich bar per task."""
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err_console, transient=False) as progress:
        tasks: dict[str, int] = {}

        def update(task: str, done: int, total: int) -> None:
            if task not in tasks:
                tasks[task] = progress.add_task(task, total=total)
            progress.update(tasks[task], completed=done, total=total)

        yield update


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def _fields(title: str, pairs: list[tuple[str, str]]) -> None:
    """A block of ``key: value`` lines; long values wrap under themselves, never cut."""
    grid = Table.grid(padding=(0, 1))
    grid.add_column(no_wrap=True, style="dim")
    grid.add_column(overflow="fold")
    for key, value in pairs:
        grid.add_row(f"{key}:", Text(value))
    console.print(Text(f"\n{title}", style="bold"))
    console.print(grid)


def _quantization(q: dict) -> str:
    """What a model's weights are, as inspect says it: the method export ran, or, where the
    source's own quantized blocks were carried over (the requested method then did nothing),
    their kinds with their tensor counts ('int4/b32+offset (gguf:Q4_K)' in the graphs: Q4_K)."""
    if not q.get("carried_over"):
        return f"{q['method']}, head {q['head']}"
    kinds: dict[str, int] = {}
    for name, count in q.get("formats", {}).items():
        kind = name.rpartition("(")[2].rstrip(")").removeprefix("gguf:") if "(" in name else name
        if kind not in ("F32", "F16"):  # norms and biases stay float
            kinds[kind] = kinds.get(kind, 0) + count
    listed = ", ".join(f"{kind} ({count})" for kind, count in sorted(kinds.items()))
    return f"{listed} carried over from the source; head {q['head']}"


def _json_path(path: Path | None) -> Path | None:
    """--json FILE, checked before the work whose results it takes: a folder is refused, and so is
    a path whose folder cannot be made or written."""
    if path is not None and path.is_dir():
        raise EdgerouteError(f"--json {path} is a folder: give a file path, e.g. --json {path / 'results.json'}")
    if path is not None:
        check_output_folder(path, "--json")
    return path


def _write_json(path: Path, data, what: str) -> None:
    import json

    with _clear_errors():
        try:  # an earlier report stays whole where this one cannot be written
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(path, json.dumps(data, indent=1))
        except OSError as err:
            raise EdgerouteError(f"cannot write {path}: {err.strerror}") from None
    console.print(f"{what}: {path}")


def _read_text(path: Path, what: str) -> str:
    try:
        return path.read_text()
    except OSError as err:
        raise EdgerouteError(f"cannot read the {what} file {path}: {err.strerror}") from None


def _logit_bias(text: str | None) -> dict | None:
    """``--logit-bias``'s JSON object (its entries are checked as the API's ``logit_bias``)."""
    import json

    if text is None:
        return None
    usage = "--logit-bias takes a JSON object of token ids and biases, e.g. '{\"1234\": 5}'"
    try:
        bias = json.loads(text)
    except json.JSONDecodeError as err:
        raise EdgerouteError(f"{usage} ({err.msg} at character {err.pos} of {text!r:.60})") from None
    if not isinstance(bias, dict):
        raise EdgerouteError(f"{usage} (got {text!r:.60})")
    return bias


def _response_format(json_schema: Path | None, regex: str | None, grammar: Path | None) -> dict | None:
    """The ``response_format`` that --json-schema FILE, --regex or --grammar FILE ask for."""
    import json

    given = [name for name, value in (("--json-schema", json_schema), ("--regex", regex), ("--grammar", grammar))
             if value is not None]
    if len(given) > 1:
        raise EdgerouteError(f"give one of --json-schema, --regex, --grammar (got {' and '.join(given)})")
    if json_schema is not None:
        try:
            schema = json.loads(_read_text(json_schema, "JSON schema"))
        except json.JSONDecodeError as err:
            raise EdgerouteError(f"the JSON schema file {json_schema} is not valid JSON: {err}") from None
        return {"type": "json_schema", "json_schema": {"schema": schema}}
    if regex is not None:
        return {"type": "regex", "regex": regex}
    if grammar is not None:
        return {"type": "grammar", "grammar": _read_text(grammar, "grammar")}
    return None


@app.command()
def export(
    llm: str = typer.Option("smollm2", help="LLM (HF dir, GGUF or name)"),
    slm: str = typer.Option("smollm2", help="SLM with the LLM's tokenizer"),
    no_slm: bool = typer.Option(False, "--no-slm", help="export the LLM only"),
    slm_layers: int = typer.Option(None, help="keep the SLM's first N layers"),
    quant: str = typer.Option("int4-gptq", show_default=False, help="int4-gptq (default)|int4-rtn|fp16|fp32"),
    slm_quant: str = typer.Option(None, help="the SLM's --quant (default: the LLM's)"),
    target: str = typer.Option("onnxruntime", show_default=False, help="onnxruntime (default)|tensorrt|native"),
    block_size: int = typer.Option(None, help="int4 block: 32|64|128 (tensorrt: 64|128)"),
    head: str = typer.Option(None, help="LM head: int8|int4|fp16|fp32; tensorrt fp16|int4"),
    slm_vocab: int = typer.Option(None, help="SLM head over the N most frequent ids"),
    context_length: int = typer.Option(2048, help="KV capacity of a session"),
    calibration_tokens: int = typer.Option(2048, help="GPTQ calibration tokens"),
    parity_tokens: int = typer.Option(256, help="parity check tokens (0: skip)"),
    native: bool = typer.Option(True, "--native/--no-native", help="keep GGUF blocks for native"),
    out: Path = typer.Option(Path("bundles/smollm2-demo"), show_default=False, help="bundle to write (bundles/smollm2-demo)"),
    force: bool = typer.Option(False, "--force", help="replace an existing bundle"),
) -> None:
    """Export an SLM and a 4-bit LLM to a bundle. Guide: docs/guide/export.md."""
    from edgeroute.export import ExportOptions, export_bundle

    options = ExportOptions(llm=llm, slm=None if no_slm else slm, slm_layers=slm_layers, quant=quant,
                            slm_quant=slm_quant, target=target, block_size=block_size, head=head, slm_vocab=slm_vocab,
                            context_length=context_length,
                            calibration_tokens=calibration_tokens, parity_tokens=parity_tokens, native=native, out=out,
                            force=force)
    with _clear_errors(), _progress_bars() as update:
        try:
            report = export_bundle(options, update)
        except OSError as err:  # a full disk, a source or device gone mid-way
            raise EdgerouteError(f"the export stopped: {err}. An interrupted export writes no bundle and leaves one "
                                 f"already at {out} as it was") from None

    console.print(f"[bold]bundle {escape(str(report.out))}[/]")
    for m in report.models:
        agreement = "-" if m.agreement is None else f"{m.agreement:.1%}"
        logits = "-" if m.max_rel_logit_diff is None else f"{m.max_rel_logit_diff:.2e}"
        _fields(m.role, [("source", m.source), ("layers", str(m.layers)), ("size", _mb(m.bytes)),
                         ("weights", ", ".join(f"{n}x {f}" for f, n in m.formats.items())),
                         ("top-1 agreement", agreement), ("max |dlogit| rel", logits)])
    console.print("time per stage: " + ", ".join(f"{k} {v:.1f}s" for k, v in report.seconds.items()))
    for note in report.notes:
        console.print(f"note: {escape(note)}")
    console.print("agreement: teacher-forced top-1 vs a torch forward of the source's float (dequantized) "
                  "weights, on held-out text")


@app.command()
def inspect(
    bundle: Path = typer.Argument(..., help="bundle directory"),
    as_json: bool = typer.Option(False, "--json", help="print the summary as JSON"),
    tensorrt: bool = typer.Option(False, "--tensorrt", help="lint for TensorRT 10 (exit 1 on findings)"),
    tensorrt_report: Path = typer.Option(None, help="--tensorrt: every finding to this JSON"),
) -> None:
    """Summarize a bundle and verify every file's checksum."""
    import json

    from edgeroute.bundle import Bundle

    with _clear_errors():
        b = Bundle.open(bundle, verify=True)
    summary = b.summary()
    if any(m["native_bytes"] for m in summary["models"].values()):
        summary["native_here"] = _native_here()
    if as_json:
        print(json.dumps(summary, indent=2))
        return
    console.print(f"[bold]{escape(str(bundle))}[/]: format {summary['format_version']}, "
                  f"edgeroute {summary['edgeroute_version']}, opset {summary['opset']}, target {b.target.name}, "
                  f"created {summary['created']}")
    for role, m in summary["models"].items():
        s, q = m["source"], m["quantization"]
        quant = _quantization(q)
        _fields(role, [("family", m["family"]), ("layers", str(m["layers"])), ("hidden", str(m["hidden"])),
                       ("heads (kv)", f"{m['heads']} ({m['kv_heads']})"), ("vocab", str(m["vocab"])),
                       ("quantization", quant), ("graphs", str(m["graphs"])),
                       ("native", _mb(m["native_bytes"]) if m["native_bytes"] else "-"), ("size", _mb(m["bytes"])),
                       ("source", f"{s['name']} ({s['format']})"), ("source sha256", s["sha256"])])
    g = summary["generation"]
    console.print(f"context {g['context_length']}, max new tokens {g['max_new_tokens']}; chat template: "
                  f"{'yes' if summary['chat_template'] else 'no'}")
    if "native_here" in summary:
        console.print(f"native backend on this CPU: {summary['native_here']}")
    _print_calibration(b)
    console.print(f"[green]all {summary['files']} files match their sha256[/] ({_mb(summary['bytes'])})")
    if tensorrt and _print_tensorrt_findings(b, tensorrt_report):
        raise typer.Exit(1)


def _native_here() -> str:
    """Which native kernels a bundle's native weights would run on here, or why none."""
    from edgeroute.errors import NativeBackendUnavailable
    from edgeroute.runtime.backends.native import native_kernels

    try:
        return f"the {native_kernels()} kernels"
    except NativeBackendUnavailable as error:
        return f"unavailable ({error})"


def _runs_on(model) -> str:
    """What runs a model's layers, for the stats line: "native dotprod kernels", "portable"."""
    return f"native {model.kernels} kernels" if model.kernels else model.flavour


def _print_tensorrt_findings(b, report: Path | None) -> int:
    """The TensorRT lint's findings as a table (and every one into ``report``); their count."""
    import dataclasses
    import json

    from edgeroute.tensorrt.lint import RULES, grouped, lint_bundle

    findings = lint_bundle(b)
    if report is not None:
        report.write_text(json.dumps([dataclasses.asdict(f) | {"kind": f.kind} for f in findings], indent=1))
    if not findings:
        console.print(f"[green]TensorRT: no node of the {sum(len(e.graphs) for e in b.models.values())} graphs "
                      "breaks a rule[/]")
        return 0
    table = Table(title=f"TensorRT 10: {len(findings)} findings (kinds: parser = documented unsupported, builder "
                        "= blocked quantization, target = the tensorrt target's fp16)")
    for column in ("rule", "kind", "op", "nodes", "graphs", "first node", "why"):
        table.add_column(column)
    for group in grouped(findings):
        first = group.findings[0]
        table.add_row(group.rule, group.kind, group.op, str(len(group.findings)), str(group.graphs),
                      f"{first.graph}: {first.node}", first.detail)
    console.print(table)
    console.print("rules: " + "; ".join(f"{rule} ({kind}): {what}" for rule, (kind, what) in RULES.items()))
    return len(findings)


def _print_calibration(b) -> None:
    c = b.calibration
    if c is None:
        console.print("calibration: [yellow]uncalibrated[/] (routing and skipping use uncalibrated defaults; "
                      f"run `edgeroute calibrate {b.path}`)")
        return
    budget = c.budget
    loss = (f"a task profile loses at most {budget['task_loss']:.0%} of full's task passes "
            f"({budget['confidence']:.0%} bound, {budget.get('held_out', {}).get('prompts', '?')} held-out prompts)"
            if "task_loss" in budget else "task profiles chosen by the checks of an older calibration (re-calibrate)")
    console.print(f"calibration: {c.created}, budget: teacher-forced agreement >= {budget['tf_agreement']:.1%} "
                  f"({budget['bound']} bound); {loss}; data sha256 {c.data_sha256[:12]}")
    if c.device:
        difference = signature_difference(c.device, cpu_signature())
        backend = f", {c.device['backend']} backend" if c.device.get("backend") else ""
        backend += f", {c.device['kv_dtype']} KV cache" if c.device.get("kv_dtype") else ""
        console.print(f"timings taken on: {c.device['machine']} ({' '.join(c.device['isa']) or 'no listed ISA extensions'})"
                      + backend
                      + (f"; [yellow]{difference}[/]: timing-based choices may not be the fastest here" if difference else
                         "; this CPU is of the same kind"))
    memory_file = c.decoding.get("answer_memory")
    if memory_file:
        from edgeroute.runtime.answer_memory import AnswerMemory

        tasks = AnswerMemory.load(b.path / memory_file, learning=False).tasks()
        console.print(f"answer memory: {sum(tasks.values())} answers ({', '.join(f'{t} {n}' for t, n in tasks.items())}) "
                      "that speculation's prompt lookup drafts from")
    table = Table(title="calibrated routers (held out: validation prompts)")
    for column in ("light", "router", "threshold", "bound", "held-out TF agr.", "held-out LLM"):
        table.add_column(column)
    for light, r in c.routers.items():
        f = r.figures

        def shown(value, spec: str) -> str:
            return "-" if value is None else format(value, spec)

        table.add_row(light, r.router, f"{r.threshold:.3f}", shown(1 - f.get("bound", {}).get("bound", 1), ".2%"),
                      shown(f.get("validation_tf_agreement"), ".2%"), shown(f.get("validation_llm_share"), ".0%"))
    console.print(table)
    table = Table(title="task profiles (mode auto), judged on held-out prompts")
    for column in ("task", "configuration", "x full", "pass (full)", "n", "loss bound"):
        table.add_column(column, overflow="fold", no_wrap=column == "configuration")  # names differ in their ends
    reasons = []
    for task, profile in c.profiles.items():
        f = profile["figures"][profile["config"]]
        quality = profile.get("quality", {})
        passed = "no check" if f.get("task_pass") is None else \
            f"{f['task_pass']:.0%} ({f.get('full_task_pass', profile['figures']['full']['task_pass']):.0%})"
        bound = f"{quality['loss_bound']:.1%}" if quality.get("judged") else "-"
        table.add_row(task, profile["config"], f"{f['speed_vs_full']:.2f}x", passed,
                      str(f.get("judged", f.get("prompts", "-"))), bound)
        if quality.get("why"):
            reasons.append(f"{task}: {profile['config']}, {quality['why']}")
    console.print(table)
    for reason in reasons:
        console.print(reason)


def _tools(path: Path | None, choice: str | None) -> tuple[list[dict], str | dict | None]:
    """--tools FILE (a JSON list of OpenAI tools, or {"tools": [...]}) and --tool-choice (a
    tool's name is the named choice)."""
    import json

    if path is None:
        if choice is not None:
            raise EdgerouteError("--tool-choice needs --tools FILE.json")
        return [], None
    try:
        data = json.loads(path.read_text())
    except OSError as err:
        raise EdgerouteError(f"cannot read --tools {path}: {err.strerror}") from None
    except json.JSONDecodeError as err:
        raise EdgerouteError(f"--tools {path} is not JSON ({err})") from None
    tools = data.get("tools") if isinstance(data, dict) else data
    if not isinstance(tools, list) or not tools:
        raise EdgerouteError(f'--tools {path} must hold a non-empty JSON list of tools (or {{"tools": [...]}})')
    if choice in (None, "auto", "required", "none"):
        return tools, choice
    return tools, {"type": "function", "function": {"name": choice}}


def _open_trace(path: Path):
    """--trace's file, open for writing (closed by the caller). Missing parent folders are
    created, as `mkdir -p` would: a trace is often sent to a fresh runs/DATE/ folder, and
    refusing after the model loaded would only make the user type the mkdir. A path that is
    a folder, or a parent that cannot be made, is an error naming it before any token."""
    if path.is_dir():
        raise EdgerouteError(f"--trace {path} is a folder: give a file path, e.g. --trace {path / 'trace.jsonl'}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return open(path, "w")  # noqa: SIM115 - the caller closes it
    except (FileExistsError, NotADirectoryError):
        raise EdgerouteError(f"cannot write the trace file {path}: part of {path.parent} is a file") from None
    except OSError as err:
        raise EdgerouteError(f"cannot write the trace file {path}: {err.strerror}") from None


@app.command()
def run(
    bundle: Path = typer.Argument(..., help="bundle directory"),
    prompt: str = typer.Option(None, help="one user turn (plain text with --raw)"),
    chat: bool = typer.Option(False, "--chat", help="interactive chat, caches kept per turn"),
    raw: bool = typer.Option(False, "--raw", help="send the prompt without the chat template"),
    system: str = typer.Option(None, help="system prompt opening the conversation"),
    context_policy: str = typer.Option("error", show_default=False, help="on overflow: error (default)|drop_oldest"),
    profile: str = typer.Option(None, help="device/task profiles: NAME[,NAME] or FILE"),
    mode: str = typer.Option(None, help="full|slm|route|speculate|skip|...|auto"),
    light: str = typer.Option(None, help="light path: ngram|slm|ngram+slm"),
    backend: str = typer.Option(None, help="auto|native|onnxruntime[-cuda]|tensorrt"),
    engine_cache: Path = typer.Option(None, help="tensorrt: build-engines' --cache"),
    kernels: str = typer.Option(None, help="native kernel set (default: the best here)"),
    kv_dtype: str = typer.Option(None, help="KV cache: auto|float32|float16|int8"),
    attention: str = typer.Option(None, help="ONNX Runtime graphs: auto|portable|ort"),
    threads: int = typer.Option(None, help="default $EDGEROUTE_THREADS, profile's, all"),
    context_length: int = typer.Option(None, help="KV capacity per session"),
    no_slm: bool = typer.Option(False, "--no-slm", help="never load the SLM (less memory)"),
    exact_steps: bool = typer.Option(False, "--exact-steps", help="ONNX Runtime: full == speculate exactly"),
    max_new_tokens: int = typer.Option(None, help="maximum new tokens"),
    temperature: float = typer.Option(None, help="sampling temperature (0: greedy)"),
    top_p: float = typer.Option(None, help="nucleus sampling mass"),
    seed: int = typer.Option(None, help="sampling seed"),
    stop: list[str] = typer.Option(None, help="stop string (repeatable)"),
    logit_bias: str = typer.Option(None, help='JSON {"token id": bias in [-100, 100]}'),
    router: str = typer.Option(None, help="entropy|top1|margin|ngram|always|llm-ratio"),
    route_threshold: float = typer.Option(None, help="route: call the LLM above this score"),
    route_check: str = typer.Option(None, help="route: ahead | verified"),
    draft_tokens: int = typer.Option(None, help="speculate: initial draft length"),
    draft_confidence: float = typer.Option(None, help="slm drafts end below this probability"),
    draft_branches: int = typer.Option(None, help="speculate: drafts as trees of N branches"),
    draft_tree_nodes: int = typer.Option(None, help="speculate: tokens a tree (default: per CPU)"),
    draft_rows: int = typer.Option(None, help="SLM drafts: lowest ids' head rows (0: all)"),
    lookup_min_match: int = typer.Option(None, help="ngram+slm: lookup after N matched tokens"),
    lookup_tokens: int = typer.Option(None, help="ngram+slm: tokens per lookup draft"),
    importance_threshold: float = typer.Option(None, help="skip below this importance"),
    skip_ratio: float = typer.Option(None, help="cap on the skipped share of layer work"),
    max_free_layers: int = typer.Option(None, help="longest run of skipped layers"),
    re_eval_interval: int = typer.Option(None, help="layers between skip decisions"),
    granularity: str = typer.Option(None, help="skip: layer|mlp"),
    kv_cache_reduction: bool = typer.Option(False, "--kv-cache-reduction", help="mask skipped layers' cache"),
    json_schema: Path = typer.Option(None, help="answer as JSON valid against this schema"),
    regex: str = typer.Option(None, help="answer matching this regular expression"),
    grammar: Path = typer.Option(None, help="answer in this grammar (Lark or GBNF)"),
    trace: Path = typer.Option(None, help="write one JSON line per token"),
    tools: Path = typer.Option(None, help="tools the model may call (OpenAI JSON list)"),
    tool_choice: str = typer.Option(None, help="auto|required|none|NAME; /result: auto"),
    memory: Path = typer.Option(None, help="speculate: draft from answers kept here"),
    no_memory: bool = typer.Option(False, "--no-memory", help="speculate: no answer memory"),
    no_verify: bool = typer.Option(False, "--no-verify", help="skip the files' and weights' checks"),
) -> None:
    """Generate text from a bundle, without torch. Every option: docs/guide/run.md."""
    import json

    from edgeroute.runtime import AnswerMemory, Engine, EngineOptions

    with _clear_errors():
        if not prompt and not chat:
            raise EdgerouteError("give --prompt 'What is the capital of France?' or --chat")
        decoding = {k: v for k, v in dict(
            mode=mode, light=light, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
            stop=tuple(stop) if stop else None, logit_bias=_logit_bias(logit_bias), router=router,
            route_threshold=route_threshold, route_check=route_check, draft_tokens=draft_tokens,
            draft_confidence=draft_confidence,
            draft_branches=draft_branches, draft_tree_nodes=draft_tree_nodes, draft_rows=draft_rows,
            lookup_min_match=lookup_min_match, lookup_tokens=lookup_tokens, importance_threshold=importance_threshold,
            skip_ratio=skip_ratio,
            max_free_layers=max_free_layers, re_eval_interval=re_eval_interval, granularity=granularity,
            kv_cache_reduction=kv_cache_reduction or None, response_format=_response_format(json_schema, regex, grammar),
        ).items() if v is not None}
        options = EngineOptions.from_profile(
            profile.split(",") if profile else None, decoding=decoding, backend=backend, kernels=kernels,
            kv_dtype=kv_dtype, attention=attention, threads=threads, context_length=context_length,
            engine_cache=str(engine_cache) if engine_cache else None,
            slm=False if no_slm else None, exact_steps=exact_steps or None)
        if options.decoding.mode == "auto" and options.decoding.task is None:
            raise EdgerouteError("--mode auto picks the calibrated configuration of a task profile: add "
                                 "--profile TASK (voice-command, templated, json, grounded, dialogue, code)")
        tool_list, choice = _tools(tools, tool_choice)
        if memory is not None and no_memory:
            raise EdgerouteError("--memory FILE and --no-memory contradict each other: give one")
        engine = Engine(bundle, options, verify=not no_verify)
        if no_memory:
            engine.answer_memory = None
        elif memory is not None:
            engine.answer_memory = AnswerMemory.kept_in(memory, engine.answer_memory)
        if raw or not engine.bundle.tokenizer.get("chat_format"):
            if system is not None or tool_list:
                raise EdgerouteError(f"{'--system' if system is not None else '--tools'} needs the bundle's chat "
                                     "template: drop --raw")
            session = engine.session()
        else:
            session = engine.chat(system=system, context_policy=context_policy, tools=tool_list)
        trace_file = _open_trace(trace) if trace else None

        def on_token(record) -> None:
            if trace_file is not None:
                trace_file.write(json.dumps(record.to_dict()) + "\n")

        # a tool's result is answered under "auto": "required" or a named tool would force another
        # call after every result, and the model would never say the outcome
        after_result = choice if choice in (None, "auto", "none") else "auto"

        def turn(text: str | list[dict], tool_choice: str | dict | None) -> None:
            for piece in session.stream(text, on_token=on_token, **({"tool_choice": tool_choice} if tool_list else {})):
                sys.stdout.write(piece)
                sys.stdout.flush()
            sys.stdout.write("\n")
            for call in session.last.tool_calls:  # one JSON line each, for scripts
                sys.stdout.write(json.dumps({"tool_call": {"id": call.id, "name": call.name,
                                                           "arguments": call.arguments}}) + "\n")
            sys.stdout.flush()  # the answer's end before the stats line on stderr
            if memory is not None:
                engine.answer_memory.save(memory)
            err_console.print(f"[dim]{session.last.stats.summary(session.options.mode, engine.llm.num_layers)} "
                              f"({_runs_on(engine.llm)}, {engine.llm.kv_dtype} KV cache)[/]")
            if session.last.finish_reason == "incomplete":
                incomplete.append(session.last)
                err_console.print("[bold red]error:[/] the answer is incomplete: it ended before the response format's "
                                  "structure was complete, so it is not valid output; raise --max-new-tokens")

        incomplete = []
        try:
            if prompt:
                turn(prompt, choice)
            while chat:
                try:
                    text = console.input("[bold]you>[/] ")
                except EOFError:
                    break
                if text.strip() in ("/exit", "/quit"):
                    break
                if text.strip() == "/reset":
                    session.reset()
                    continue
                if text.startswith("/result "):  # /result CALL_ID TEXT: a tool's result back to the model
                    _, call_id, result = (text.split(" ", 2) + [""])[:3]
                    turn([{"role": "tool", "tool_call_id": call_id, "content": result}], after_result)
                    continue
                if text.strip():
                    turn(text, choice)
        finally:
            if trace_file is not None:
                trace_file.close()
                err_console.print(f"[dim]trace: {escape(str(trace))} (read it with `edgeroute trace {escape(str(trace))}`)[/]",
                                  soft_wrap=True)
    if incomplete:
        raise typer.Exit(3)


@app.command()
def calibrate(
    bundle: Path = typer.Argument(..., help="bundle directory (written into)"),
    budget: float = typer.Option(0.97, help="agreement to guarantee"),
    prompts: Path = typer.Option(None, help="extra prompts, JSONL (id, task, content)"),
    builtin: bool = typer.Option(True, "--builtin/--no-builtin", help="use the built-in prompts"),
    work: Path = typer.Option(None, help="shards and report (BUNDLE-calibration)"),
    bound: str = typer.Option("crc", show_default=False, help="crc (default) | ltt (learn then test)"),
    delta: float = typer.Option(0.1, help="ltt's failure probability"),
    prompts_per_task: int = typer.Option(None, help="built-in prompts per task (default 40)"),
    answer_tokens: int = typer.Option(None, help="longest answer labelled (default 40)"),
    path_checks: int = typer.Option(None, help="SLM differences path-checked a prompt (8)"),
    validation_prompts: int = typer.Option(None, help="held-out prompts per task (default 60)"),
    task_loss: float = typer.Option(0.05, help="allowed loss vs full's passes"),
    confidence: float = typer.Option(0.95, help="of the loss bound"),
    eval_file: Path = typer.Option(None, "--eval", help="your task file (JSONL), judged too"),
    skip_prompts: int = typer.Option(None, help="answers for skipping (default 48, 0: off)"),
    executor: str = typer.Option("local", help="label shards on: local | ray"),
    address: str = typer.Option(None, help="ray: cluster (RAY_ADDRESS, else local)"),
    workers: int = typer.Option(None, help="ray: shards in flight (the CPUs allow)"),
    worker_cpus: int = typer.Option(1, help="ray: CPUs and threads per shard"),
) -> None:
    """Fit routing, drafting and skipping with a quality bound. Guide: docs/guide/calibrate.md."""
    from dataclasses import replace

    from edgeroute.bundle import Bundle
    from edgeroute.calibration.calibrate import CalibrateOptions
    from edgeroute.calibration.calibrate import calibrate as run_calibration

    options = CalibrateOptions(budget=budget, prompts=prompts, builtin=builtin, work=work, bound=bound, delta=delta,
                               task_loss=task_loss, confidence=confidence, eval_cases=eval_file, executor=executor,
                               address=address, workers=workers, worker_cpus=worker_cpus)
    labels = {k: v for k, v in dict(max_answer_tokens=answer_tokens, path_checks=path_checks).items() if v is not None}
    options.labels = replace(options.labels, **labels)
    if prompts_per_task is not None:
        options.builtin_per_task = prompts_per_task
    if validation_prompts is not None:
        options.validation_prompts_per_task = validation_prompts
    if skip_prompts is not None:
        options.skip_prompts = skip_prompts
    with _clear_errors(), _progress_bars() as update:
        report = run_calibration(bundle, options, update)
    for message in report.messages:
        console.print(f"note: {escape(message)}")
    _print_calibration(Bundle.open(bundle, verify=False))
    console.print("time: " + ", ".join(f"{k} {v:.0f}s" for k, v in report.seconds.items()))
    console.print(f"report: {escape(str(report.report))}")


@app.command("build-engines")
def build_engines(
    bundle: Path = typer.Argument(..., help="bundle directory (--target tensorrt)"),
    profile: str = typer.Option(..., help="device profile: context and engine limits"),
    cache: Path = typer.Option(None, help="engine cache (default: .BUNDLE.engines)"),
    role: str = typer.Option("llm", help="llm|slm"),
    kinds: str = typer.Option("embed,layer,attn,mlp,kv,head", show_default=False, help="graph kinds (default: all)"),
) -> None:
    """Build TensorRT engines for this GPU. Guide: docs/guide/gpu.md."""
    from edgeroute.bundle import Bundle
    from edgeroute.runtime.profiles import load_profile
    from edgeroute.tensorrt.engines import build_engines as build

    with _clear_errors(), _progress_bars() as update:
        report = build(Bundle.open(bundle, verify=True), load_profile(profile), cache, role, update,
                       _names(kinds))
    limits = report.key.limits
    done = "reused: built for this GPU, TensorRT and bundle" if report.reused else f"{len(report.built)} built"
    stale = f", {report.removed_stale} stale entries removed" if report.removed_stale else ""
    console.print(f"engines: {report.cache} ({done}{stale})")
    console.print(f"GPU {report.key.gpu}, TensorRT {report.key.tensorrt}; context {limits.context}, prefill "
                  f"<= {limits.prefill_tokens} tokens, decode <= {limits.decode_tokens}")
    console.print(f"time {report.seconds:.1f}s, peak host memory {_mb(report.peak_host_bytes)} "
                  f"({report.peak_per_parameter:.2f} bytes per parameter, {report.parameters / 1e6:,.0f}M parameters)")


def _numbers(text: str, what: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise EdgerouteError(f"{what} are whole numbers separated by commas, e.g. 32,1024 (got {text!r})") from None


def _names(text: str | None) -> tuple[str, ...] | None:
    return tuple(part.strip() for part in text.split(",") if part.strip()) if text is not None else None


def _floor_line(floor: dict) -> str:
    import statistics

    samples = floor["samples_gb_s"]
    if not samples:
        return "not measured"
    llc = f", last-level cache {floor['llc_bytes'] / 2**20:.0f} MiB" if floor.get("llc_bytes") else ""
    return (f"{statistics.median(samples):.1f} GB/s median, {min(samples):.1f}-{max(samples):.1f} over {len(samples)} "
            f"reads of {floor['bytes'] / 2**20:.0f} MiB by {floor['threads']} thread(s){llc}, one per round")


def _print_bench(report) -> None:
    """The CPU, then a table per model: each backend's medians per context."""
    cpu = report.cpu
    _fields("CPU", [("machine", cpu["machine"]), *([("board", cpu["board"])] if cpu["board"] else []),
                    ("model", cpu["model"]), ("cores (threads)", f"{cpu['cores']} ({cpu['threads']})"),
                    ("instruction sets", " ".join(cpu["isa"]) or "none listed"),
                    ("native kernels", report.kernels),
                    ("bench", f"{report.threads} thread{'s' * (report.threads != 1)}, {report.clock} clock, "
                              f"{report.steps} steps, median of {report.repeats}"),
                    ("bandwidth", f"{report.bandwidth_gbs:g} GB/s ({report.profile})" if report.bandwidth_gbs
                     else "unknown (no --profile with memory.bandwidth_gbs)"),
                    *([("floor (measured)", _floor_line(report.floor))] if report.floor else [])])
    share = report.bandwidth_gbs is not None
    floor = report.floor is not None
    models: dict[tuple[str, str], list] = {}
    for record in report.records:
        models.setdefault((record.bundle, record.role), []).append(record)
    for (bundle, role), records in models.items():
        table = Table(title=f"{bundle}: {role}", title_justify="left", box=None, padding=(0, 1))
        for column in ("backend", "ctx", "tok/s", "TTFT s", "prefill t/s", "MB/tok", "GB/s", *(["BW"] if share else []),
                       *(["floor"] if floor else [])):
            table.add_column(column, justify="left" if column == "backend" else "right", no_wrap=True)
        for r in records:
            known = r.step_bytes is not None
            table.add_row(r.backend, str(r.context), f"{r.decode_tok_s:.1f}", f"{r.ttft_s:.3f}", f"{r.prefill_tok_s:.0f}",
                          f"{r.step_bytes / 1e6:.0f}" if known else "-", f"{r.gb_s:.1f}" if known else "-",
                          *([f"{r.bandwidth_share:.0%}" if known else "-"] if share else []),
                          *([f"{r.floor_share:.0%}" if r.floor_share is not None else "-"] if floor else []))
        console.print()
        console.print(table)
        for backend, runs_on in {r.backend: r.runs_on for r in records}.items():
            console.print(Text(f"  {backend}: {runs_on}", style="dim"))
        floors = {r.context: r.floor_gb_s for r in records if r.floor_gb_s}
        if floors:
            console.print(Text("  floor read: " + ", ".join(f"{gb_s:.1f} GB/s at ctx {context}" for context, gb_s in
                                                          floors.items()) + " (median of its rounds)", style="dim"))
    skipped: dict[tuple[str, str], list[str]] = {}
    for skip in report.skipped:
        skipped.setdefault((skip.backend, skip.reason), []).append(f"{skip.bundle} {skip.role}")
    for (backend, reason), models in skipped.items():
        console.print(Text(f"skipped {backend} ({', '.join(models)}): {reason}"))
    for note in report.notes:
        console.print(Text(f"note: {note}"))


@app.command()
def bench(
    bundles: list[Path] = typer.Argument(..., help="bundle directories"),
    contexts: str = typer.Option("32,1024", help="contexts to decode at (prompt tokens)"),
    steps: int = typer.Option(16, help="decode steps timed per run"),
    repeats: int = typer.Option(3, help="runs per backend and context (median)"),
    threads: int = typer.Option(None, help="threads (default: the profile's, else all)"),
    profile: str = typer.Option(None, help="device profile: bandwidth and threads"),
    backends: str = typer.Option("native,onnxruntime,llama.cpp", show_default=False,
                                 help="native,onnxruntime,llama.cpp (default: all)"),
    roles: str = typer.Option(None, help="models: llm,slm (default: each one)"),
    kernels: str = typer.Option("auto", help="native kernel set"),
    clock: str = typer.Option("wall", help="wall|cpu (the process's CPU time)"),
    no_verify: bool = typer.Option(False, "--no-verify", help="skip the files' and weights' checks"),
    no_floor: bool = typer.Option(False, "--no-floor", help="skip the measured memory floor"),
    as_json: Path = typer.Option(None, "--json", help="write the records to this JSON file"),
) -> None:
    """Decode speed per backend and context vs memory bandwidth. Guide: docs/guide/bench.md."""
    import dataclasses

    from edgeroute.measure.bench import BenchOptions, run_bench

    with _clear_errors():
        _json_path(as_json)
        options = BenchOptions(contexts=_numbers(contexts, "contexts"), steps=steps, repeats=repeats, threads=threads,
                               clock=clock, profile=profile, backends=_names(backends) or (), roles=_names(roles),
                               kernels=kernels, verify=not no_verify, floor=not no_floor)
        report = run_bench(bundles, options, lambda line: err_console.print(Text(line, style="dim")))
    _print_bench(report)
    if as_json is not None:
        _write_json(as_json, {"options": dataclasses.asdict(options), **report.to_dict()}, "wrote")


@app.command("eval")
def eval_tasks(
    bundle: Path = typer.Argument(..., help="bundle directory"),
    tasks: str = typer.Option(..., help="task file (JSONL) | builtin"),
    modes: str = typer.Option("full,speculate/ngram,speculate/slm,route/slm", show_default=False,
                              help="full,MODE[/LIGHT],... (full,speculate/ngram,..)"),
    per_task: int = typer.Option(None, help="builtin: held-out prompts per task (12)"),
    max_new_tokens: int = typer.Option(64, help="maximum new tokens per answer"),
    confidence: float = typer.Option(0.95, help="of the intervals and the loss bound"),
    task_loss: float = typer.Option(0.05, help="loss bound a lossy mode may show"),
    profile: str = typer.Option(None, help="device profile: NAME or FILE"),
    backend: str = typer.Option(None, help="auto|native|onnxruntime[-cuda]|tensorrt"),
    threads: int = typer.Option(None, help="default $EDGEROUTE_THREADS, profile's, all"),
    llama_cpp: bool = typer.Option(False, "--llama-cpp", help="also the source GGUF on llama.cpp"),
    as_json: Path = typer.Option(None, "--json", help="write the report (every answer) as JSON"),
    plot: Path = typer.Option(None, help="PNG: pass rate against tok/s"),
) -> None:
    """Judge modes on your task cases: pass rates, bounds, speed.

    Guide: docs/guide/eval.md."""
    from edgeroute.plots import png_path
    from edgeroute.quality.cases import load_cases
    from edgeroute.quality.evaluation import eval_configs, evaluate, plot_report, print_report
    from edgeroute.runtime import Engine, EngineOptions

    with _clear_errors():
        if tasks == "builtin":
            from edgeroute.calibration.checks import prompt_case
            from edgeroute.calibration.prompts import held_out_prompts

            per_task = BUILTIN_EVAL_PER_TASK if per_task is None else per_task
            if per_task < 1:
                raise EdgerouteError(f"--per-task must be at least 1 (got {per_task})")
            cases = [prompt_case(p) for p in held_out_prompts(per_task)]
        elif per_task is not None:  # a task file runs every case it holds
            raise EdgerouteError(f"--per-task counts the built-in held-out prompts (--tasks builtin); {tasks} runs "
                                 "every case it holds: drop --per-task, or keep fewer cases in the file")
        else:
            cases = load_cases(tasks)
        if plot is not None:
            png_path(plot)
        _json_path(as_json)
        eval_configs(modes, max_new_tokens, confidence, task_loss)  # before the bundle loads
        engine = Engine(bundle, EngineOptions.from_profile(profile.split(",") if profile else None, backend=backend,
                                                           threads=threads))
        with _progress_bars() as update:
            report = evaluate(engine, cases, modes, max_new_tokens, confidence, task_loss, llama_cpp, threads, update)
    print_report(report, console)
    if as_json is not None:
        _write_json(as_json, report.to_dict(), "report")
    if plot is not None:
        with _clear_errors():
            console.print(f"plot: {plot_report(report, plot)}")


@app.command()
def trace(
    file: Path = typer.Argument(..., help="a trace from `edgeroute run --trace FILE`"),
    png: Path = typer.Option(None, help="PNG: the cost heatmap (source, LLM layers, time per token)"),
    turn: int = typer.Option(None, help="only this answer of a chat (1 = the first)"),
    no_text: bool = typer.Option(False, "--no-text", help="leave the coloured answer out"),
    as_json: Path = typer.Option(None, "--json", help="write the summary as JSON"),
) -> None:
    """Where each token came from and what it cost. Guide: docs/guide/run.md."""
    from edgeroute.measure.traces import plot_trace, print_trace, read_trace, split_turns
    from edgeroute.plots import png_path

    with _clear_errors():
        if png is not None:
            png_path(png)
        _json_path(as_json)
        tokens = read_trace(file)
        if turn is not None:
            turns = split_turns(tokens)
            if not 1 <= turn <= len(turns):
                raise EdgerouteError(f"--turn {turn}: {file} holds {len(turns)} answer(s)")
            tokens = turns[turn - 1]
        summary = print_trace(tokens, console, show_text=not no_text)
        if png is not None:
            title = file.name + (f", answer {turn}" if turn else "")
            console.print(f"heatmap: {plot_trace(tokens, png, title, summary=summary)}")
    if as_json is not None:
        _write_json(as_json, summary.to_dict(), "summary")


@app.command()
def sources(
    names: list[str] = typer.Argument(None, help="named sources (default: all)"),
    requirements: bool = typer.Option(False, "--requirements", help="print only their pip requirements"),
) -> None:
    """List the named model sources and whether they are ready."""
    from edgeroute.export.named_sources import NAMED_SOURCES, cache_dir, installed_distribution

    unknown = sorted(set(names or []) - set(NAMED_SOURCES))
    with _clear_errors():
        if unknown:
            raise EdgerouteError(f"unknown named source(s) {', '.join(unknown)}; known: {', '.join(NAMED_SOURCES)}")
    chosen = [NAMED_SOURCES[n] for n in names or NAMED_SOURCES]
    if requirements:
        print("\n".join(r for source in chosen for r in source.requirements()))
        return
    console.print(f"named sources (cache: {cache_dir()})")
    for source in chosen:
        installed = sum(installed_distribution(p) is not None for p in source.packages())
        _fields(source.name, [("model", source.description), ("size", _mb(source.size)),
                              ("part packages", f"{source.package_pattern.format('1..' + str(source.parts))}"
                                                f"=={source.version}"),
                              ("installed", f"{installed}/{source.parts}"),
                              ("assembled", "yes" if (cache_dir() / source.filename).is_file() else "no")])


if __name__ == "__main__":
    app()
