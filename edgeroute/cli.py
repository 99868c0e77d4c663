"""`edgeroute` command line: argument parsing and printing over the Python API."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from edgeroute.cpu import cpu_signature, signature_difference
from edgeroute.errors import EdgerouteError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Export, inspect and run edge LLM bundles (SLM + router + 4-bit LLM as ONNX graphs).")
console = Console()
err_console = Console(stderr=True)


@contextmanager
def _clear_errors():
    try:
        yield
    except EdgerouteError as err:
        err_console.print(f"[bold red]error:[/] {err}")
        raise typer.Exit(2) from None


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


def _read_text(path: Path, what: str) -> str:
    try:
        return path.read_text()
    except OSError as err:
        raise EdgerouteError(f"cannot read the {what} file {path}: {err.strerror}") from None


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
    llm: str = typer.Option("smollm2", help="LLM source: HF checkpoint dir, .gguf file, 'smollm2' (packaged) "
                            "or a named source (`edgeroute sources`)"),
    slm: str = typer.Option("smollm2", help="SLM source sharing the LLM's tokenizer"),
    no_slm: bool = typer.Option(False, "--no-slm", help="export the LLM only"),
    slm_layers: int = typer.Option(None, help="keep the SLM's first N layers (default: all; 12 when cut from the LLM)"),
    quant: str = typer.Option("int4-gptq", help="int4-gptq | int4-rtn | fp16 | fp32 (quantized sources are carried over)"),
    slm_quant: str = typer.Option(None, help="the SLM's setting (default: --quant)"),
    target: str = typer.Option("onnxruntime", help="what the graphs are for: onnxruntime (quantized sources carried "
                               "over exactly) | tensorrt (TensorRT 10: int4 re-blocked to 64/128, fp16)"),
    block_size: int = typer.Option(None, help="int4 block size: 32, 64 or 128 (default 32; tensorrt: 64 or 128, "
                                   "default 64)"),
    head: str = typer.Option(None, help="LM head format for float sources: int8 (default) | int4 | fp16 | fp32; "
                             "tensorrt: fp16 (default) | int4, for every source"),
    slm_vocab: int = typer.Option(None, help="give the SLM a head over the N most frequent token ids of the "
                                  "calibration text (+ special and chat-template tokens); default: the whole vocabulary"),
    context_length: int = typer.Option(2048, help="KV capacity the runtime allocates"),
    calibration_tokens: int = typer.Option(2048, help="GPTQ calibration tokens"),
    parity_tokens: int = typer.Option(256, help="tokens of held-out text for the parity check (0: skip)"),
    native: bool = typer.Option(True, "--native/--no-native", help="GGUF sources: also store the blocks as they are "
                                "for the native CPU backend (the GGUF's size again on disk)"),
    out: Path = typer.Option(Path("bundles/smollm2-demo"), help="bundle directory to write"),
    force: bool = typer.Option(False, help="replace an existing bundle"),
) -> None:
    """Export an SLM and a 4-bit LLM to a bundle of ONNX graphs."""
    from edgeroute.export import ExportOptions, export_bundle

    options = ExportOptions(llm=llm, slm=None if no_slm else slm, slm_layers=slm_layers, quant=quant,
                            slm_quant=slm_quant, target=target, block_size=block_size, head=head, slm_vocab=slm_vocab,
                            context_length=context_length,
                            calibration_tokens=calibration_tokens, parity_tokens=parity_tokens, native=native, out=out,
                            force=force)
    with _clear_errors(), _progress_bars() as update:
        report = export_bundle(options, update)

    table = Table(title=f"bundle {report.out}")
    for column in ("model", "source", "layers", "size", "weights", "top-1 agreement", "max |Δlogit| rel"):
        table.add_column(column)
    for m in report.models:
        formats = "\n".join(f"{n}× {f}" for f, n in m.formats.items())
        table.add_row(m.role, m.source, str(m.layers), _mb(m.bytes), formats,
                      "-" if m.agreement is None else f"{m.agreement:.1%}",
                      "-" if m.max_rel_logit_diff is None else f"{m.max_rel_logit_diff:.2e}")
    console.print(table)
    console.print("time per stage: " + ", ".join(f"{k} {v:.1f}s" for k, v in report.seconds.items()))
    for note in report.notes:
        console.print(f"note: {note}")
    console.print("agreement: teacher-forced top-1 vs a torch forward of the source's float (dequantized) "
                  "weights, on held-out text")


@app.command()
def inspect(
    bundle: Path = typer.Argument(..., help="bundle directory"),
    tensorrt: bool = typer.Option(False, "--tensorrt", help="also list every node TensorRT 10's ONNX parser "
                                  "documents as unsupported (exit code 1 when there is one)"),
    tensorrt_report: Path = typer.Option(None, help="with --tensorrt: write every finding to this JSON file"),
) -> None:
    """Summarize a bundle and verify every file's checksum."""
    from edgeroute.bundle import Bundle

    with _clear_errors():
        b = Bundle.open(bundle, verify=True)
    m = b.manifest
    console.print(f"[bold]{bundle}[/]: format {m['format_version']}, edgeroute {m['edgeroute_version']}, "
                  f"opset {m['opset']}, target {b.target.name}, created {m['created']}")
    table = Table()
    for column in ("model", "family", "layers", "hidden", "heads (kv)", "vocab", "quantization", "graphs", "native",
                   "size", "source"):
        table.add_column(column)
    for role, entry in b.models.items():
        a, q = entry.arch, entry.quantization
        quant = q["method"] + (" (carried over)" if q.get("carried_over") else "") + f", head {q['head']}"
        native = _mb(m["files"][entry.native.file]["bytes"]) if entry.native else "-"
        table.add_row(role, a.family, str(a.num_layers), str(a.hidden_size), f"{a.num_heads} ({a.num_kv_heads})",
                      str(a.vocab_size), quant, str(len(entry.graphs)), native, _mb(b.total_bytes(f"{role}/")),
                      f"{entry.source['name']} ({entry.source['format']}, sha256 {entry.source['sha256'][:12]})")
    console.print(table)
    g = b.generation
    console.print(f"context {g['context_length']}, max new tokens {g['max_new_tokens']}; chat template: "
                  f"{'yes' if b.tokenizer.get('chat_format') else 'no'}")
    _print_calibration(b)
    console.print(f"[green]all {len(m['files'])} files match their sha256[/] ({_mb(b.total_bytes())})")
    if tensorrt and _print_tensorrt_findings(b, tensorrt_report):
        raise typer.Exit(1)


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
    console.print(f"calibration: {c.created}, budget: teacher-forced agreement >= {budget['tf_agreement']:.1%} "
                  f"({budget['bound']} bound), task-level pass no lower than full; data sha256 {c.data_sha256[:12]}")
    if c.device:
        difference = signature_difference(c.device, cpu_signature())
        backend = f", {c.device['backend']} backend" if c.device.get("backend") else ""
        backend += f", {c.device['kv_dtype']} KV cache" if c.device.get("kv_dtype") else ""
        console.print(f"timings taken on: {c.device['machine']} ({' '.join(c.device['isa']) or 'no listed ISA extensions'})"
                      + backend
                      + (f"; [yellow]{difference}[/]: timing-based choices may not be the fastest here" if difference else
                         "; this CPU is of the same kind"))
    table = Table(title="calibrated routers")
    for column in ("light path", "router", "threshold", "bound", "held-out TF agreement", "held-out LLM share"):
        table.add_column(column)
    for light, r in c.routers.items():
        f = r.figures

        def shown(value, spec: str) -> str:
            return "-" if value is None else format(value, spec)

        table.add_row(light, r.router, f"{r.threshold:.3f}", shown(1 - f.get("bound", {}).get("bound", 1), ".2%"),
                      shown(f.get("validation_tf_agreement"), ".2%"), shown(f.get("validation_llm_share"), ".0%"))
    console.print(table)
    table = Table(title="task profiles (mode auto)")
    for column in ("task", "configuration", "x full", "LLM share", "task pass (full)"):
        table.add_column(column, no_wrap=column == "configuration")  # names differ in their ends: shown whole
    for task, profile in c.profiles.items():
        f = profile["figures"][profile["config"]]
        full = profile["figures"]["full"]
        table.add_row(task, profile["config"], f"{f['speed_vs_full']:.2f}x", f"{f['llm_share']:.0%}",
                      f"{f['task_pass']:.0%} ({full['task_pass']:.0%})")
    console.print(table)


@app.command()
def run(
    bundle: Path = typer.Argument(..., help="bundle directory"),
    prompt: str = typer.Option(None, help="a prompt (one user chat turn when the bundle has a chat template)"),
    chat: bool = typer.Option(False, "--chat", help="interactive chat; the KV caches persist across turns"),
    raw: bool = typer.Option(False, help="send the prompt as plain text, without the chat template"),
    mode: str = typer.Option(None, help="full (default) | slm | route | speculate | skip | route+skip | speculate+skip"
                             " | auto (the calibrated choice for the task profile)"),
    light: str = typer.Option(None, help="light path for route/speculate: ngram (default) | slm | ngram+slm "
                                         "(speculate: prompt lookup where its match is long enough, else the SLM)"),
    profile: str = typer.Option(None, help="device or task profile (name in profiles/ or a JSON file)"),
    context_length: int = typer.Option(None, help="KV capacity per session (default: the device profile's, at most "
                                                  "the bundle's)"),
    no_slm: bool = typer.Option(False, "--no-slm", help="never load the bundle's SLM (less memory)"),
    backend: str = typer.Option("auto", help="auto | native (edgeroute's CPU kernels over the bundle's GGUF blocks) "
                                "| onnxruntime | onnxruntime-cuda (TensorRT and CUDA providers); auto: native where "
                                "the bundle has native weights and the settings allow, else ONNX Runtime"),
    attention: str = typer.Option(None, help="attention graphs: auto | portable | ort (default: the device "
                                             "profile's, else auto)"),
    kv_dtype: str = typer.Option(None, help="KV cache element type: auto (int8 on the native AVX-512 VNNI kernels, "
                                            "float16 on the other native ones, float32 on ONNX Runtime) | float32 | "
                                            "float16 (half the memory; native or portable attention) | int8 (0.28x; "
                                            "native backend only); default: the device profile's, else auto"),
    exact_steps: bool = typer.Option(False, "--exact-steps", help="run the LLM's one-token steps as two rows: "
                                     "`full` then gives exactly the tokens `speculate` gives (~10%% slower full)"),
    system: str = typer.Option(None, help="system prompt that opens the conversation (chat template only)"),
    context_policy: str = typer.Option("error", help="a turn that does not fit the context: error | drop_oldest "
                                                     "(forget the oldest exchanges, keep the system prompt)"),
    max_tokens: int = typer.Option(None, help="maximum new tokens (default: the bundle's)"),
    temperature: float = typer.Option(None, help="0 (default): greedy"),
    top_p: float = typer.Option(None),
    seed: int = typer.Option(None),
    stop: list[str] = typer.Option(None, help="stop string (repeatable)"),
    router: str = typer.Option(None, help="entropy | top1 | margin | ngram | always"),
    route_threshold: float = typer.Option(None, help="call the LLM above this router score"),
    draft_tokens: int = typer.Option(None, help="initial speculative draft length"),
    draft_confidence: float = typer.Option(None, help="speculate --light slm: end a draft before a token the SLM "
                                                      "gives less probability than this (default: calibrated, else 0)"),
    lookup_min_match: int = typer.Option(None, help="speculate --light ngram+slm: draft by lookup where the "
                                                    "sequence's suffix matched at least this many tokens"),
    lookup_tokens: int = typer.Option(None, help="speculate --light ngram+slm: tokens per lookup draft"),
    importance_threshold: float = typer.Option(None, help="skip when a token's importance is below this"),
    skip_ratio: float = typer.Option(None, help="cap on the skipped share of layer work"),
    max_free_layers: int = typer.Option(None),
    re_eval_interval: int = typer.Option(None),
    granularity: str = typer.Option(None, help="layer | mlp"),
    kv_cache_reduction: bool = typer.Option(None),
    json_schema: Path = typer.Option(None, help="answer with JSON valid against this JSON schema file"),
    regex: str = typer.Option(None, help="answer with text matching this regular expression"),
    grammar: Path = typer.Option(None, help="answer with text of this grammar file (Lark or GBNF)"),
    trace: Path = typer.Option(None, help="write one JSON line per generated token"),
) -> None:
    """Generate text from a bundle on ONNX Runtime (no torch). With --json-schema, --regex or
    --grammar every token fits the structure; an answer cut by --max-tokens before the structure
    is complete is reported as an error (exit code 3)."""
    import json

    from edgeroute.bundle import Bundle
    from edgeroute.runtime import Engine
    from edgeroute.runtime.profiles import load_profile

    overrides = {k: v for k, v in dict(
        mode=mode, light=light, max_new_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
        stop=tuple(stop or ()), router=router, route_threshold=route_threshold, draft_tokens=draft_tokens,
        draft_confidence=draft_confidence, lookup_min_match=lookup_min_match, lookup_tokens=lookup_tokens,
        importance_threshold=importance_threshold, skip_ratio=skip_ratio, max_free_layers=max_free_layers,
        re_eval_interval=re_eval_interval, granularity=granularity, kv_cache_reduction=kv_cache_reduction,
    ).items() if v is not None}
    with _clear_errors():
        if not prompt and not chat:
            raise EdgerouteError("give --prompt 'What is the capital of France?' or --chat")
        settings = load_profile(profile) if profile else None
        structure = _response_format(json_schema, regex, grammar)
        if structure is not None:
            overrides["response_format"] = structure
        opened = Bundle.open(bundle)
        if context_length is None and settings and settings.context_length:
            context_length = min(settings.context_length, int(opened.generation["context_length"]))
        engine = Engine(opened, providers=settings.providers if settings else None, context_length=context_length,
                        memory_budget=settings.memory_budget if settings else None, slm=not no_slm,
                        attention=attention or (settings.attention if settings else "auto"), exact_steps=exact_steps,
                        kv_dtype=kv_dtype or (settings.kv_dtype if settings else "auto"), backend=backend)
        decoding = {**(settings.decoding if settings else {}), **overrides}
        if mode == "auto" and "task" not in decoding:
            raise EdgerouteError("--mode auto picks the calibrated configuration of a task profile: add "
                                 "--profile TASK (voice-command, templated, json, grounded, dialogue, code)")
        if raw or not engine.bundle.tokenizer.get("chat_format"):
            if system is not None:
                raise EdgerouteError("--system needs the bundle's chat template: drop --raw")
            session = engine.session(**decoding)
        else:
            session = engine.chat(system=system, context_policy=context_policy, **decoding)
        trace_file = open(trace, "w") if trace else None  # noqa: SIM115 - closed below

        def on_token(record) -> None:
            if trace_file is not None:
                trace_file.write(json.dumps(record.to_dict()) + "\n")

        def turn(text: str) -> None:
            for piece in session.stream(text, on_token=on_token):
                sys.stdout.write(piece)
                sys.stdout.flush()
            sys.stdout.write("\n")
            err_console.print(f"[dim]{session.last.stats.summary(session.options.mode, engine.llm.num_layers)} "
                              f"({engine.llm.flavour}, {engine.llm.kv_dtype} KV cache)[/]")
            if session.last.finish_reason == "incomplete":
                incomplete.append(session.last)
                err_console.print("[bold red]error:[/] the answer is incomplete: it ended before the response format's "
                                  "structure was complete, so it is not valid output; raise --max-tokens")

        incomplete = []
        try:
            if prompt:
                turn(prompt)
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
                if text.strip():
                    turn(text)
        finally:
            if trace_file is not None:
                trace_file.close()
    if incomplete:
        raise typer.Exit(3)


@app.command()
def calibrate(
    bundle: Path = typer.Argument(..., help="bundle directory (the calibration is written into it)"),
    budget: float = typer.Option(0.97, help="teacher-forced agreement with full to guarantee"),
    prompts: Path = typer.Option(None, help="extra prompts, JSONL: {\"id\", \"task\", \"content\"[, \"record\"]}"),
    builtin: bool = typer.Option(True, help="use the built-in calibration prompts"),
    work: Path = typer.Option(None, help="label shards and report (default: BUNDLE-calibration beside it)"),
    bound: str = typer.Option("crc", help="crc (conformal risk control) | ltt (learn then test)"),
    delta: float = typer.Option(0.1, help="ltt's failure probability"),
    prompts_per_task: int = typer.Option(None, help="built-in prompts per task (default 40; the set holds more)"),
    answer_tokens: int = typer.Option(None, help="longest LLM answer labelled per prompt (default 40)"),
    path_checks: int = typer.Option(None, help="divergent SLM positions per prompt given the path-following check "
                                               "(default 3)"),
    validation_prompts: int = typer.Option(None, help="held-out prompts per task run through the runtime "
                                                      "(default 6)"),
    skip_prompts: int = typer.Option(None, help="labelled answers observed with layer skipping (default 48; "
                                                "0: skipping is not calibrated)"),
) -> None:
    """Label, train routers, fit thresholds with a bound, confirm on held-out prompts, and write
    the result into the bundle as its defaults. Resumable: rerun after an interruption."""
    from dataclasses import replace

    from edgeroute.bundle import Bundle
    from edgeroute.calibration.calibrate import CalibrateOptions
    from edgeroute.calibration.calibrate import calibrate as run_calibration

    options = CalibrateOptions(budget=budget, prompts=prompts, builtin=builtin, work=work, bound=bound, delta=delta)
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
        console.print(f"note: {message}")
    _print_calibration(Bundle.open(bundle, verify=False))
    console.print("time: " + ", ".join(f"{k} {v:.0f}s" for k, v in report.seconds.items()))
    console.print(f"report: {report.report}")


@app.command("build-engines")
def build_engines(
    bundle: Path = typer.Argument(..., help="bundle directory (exported with --target tensorrt)"),
    profile: str = typer.Option(..., help="device profile: its context and engines limits set the optimisation "
                                "profiles (name in profiles/ or a JSON file)"),
    cache: Path = typer.Option(None, help="engine cache directory (default: .BUNDLE.engines beside the bundle)"),
    role: str = typer.Option("llm", help="llm | slm"),
    kinds: str = typer.Option("embed,layer,attn,mlp,kv,head", help="graph kinds to build (full decoding needs "
                              "embed,layer,head; skipping also kv, attn, mlp)"),
) -> None:
    """Build TensorRT engines (fp16, int4 weight-only; prefill and decode profiles) for this GPU,
    cached by GPU, TensorRT version and bundle hash. Needs TensorRT and an NVIDIA GPU."""
    from edgeroute.bundle import Bundle
    from edgeroute.runtime.profiles import load_profile
    from edgeroute.tensorrt.engines import build_engines as build

    with _clear_errors(), _progress_bars() as update:
        report = build(Bundle.open(bundle, verify=True), load_profile(profile), cache, role, update,
                       tuple(k.strip() for k in kinds.split(",") if k.strip()))
    limits = report.key.limits
    done = "reused: built for this GPU, TensorRT and bundle" if report.reused else f"{len(report.built)} built"
    stale = f", {report.removed_stale} stale entries removed" if report.removed_stale else ""
    console.print(f"engines: {report.cache} ({done}{stale})")
    console.print(f"GPU {report.key.gpu}, TensorRT {report.key.tensorrt}; context {limits.context}, prefill "
                  f"<= {limits.prefill_tokens} tokens, decode <= {limits.decode_tokens}")
    console.print(f"time {report.seconds:.1f}s, peak host memory {_mb(report.peak_host_bytes)} "
                  f"({report.peak_per_parameter:.2f} bytes per parameter, {report.parameters / 1e6:,.0f}M parameters)")


@app.command()
def sources(
    names: list[str] = typer.Argument(None, help="named sources (default: all)"),
    requirements: bool = typer.Option(False, help="print only the pip requirements of their part packages"),
) -> None:
    """Named model sources (GGUFs shipped as PyPI part wheels) and whether they are ready."""
    from edgeroute.export.named_sources import NAMED_SOURCES, cache_dir, installed_distribution

    unknown = sorted(set(names or []) - set(NAMED_SOURCES))
    if unknown:
        console.print(f"[red]unknown named source(s) {unknown}; known: {sorted(NAMED_SOURCES)}[/]")
        raise typer.Exit(2)
    chosen = [NAMED_SOURCES[n] for n in names or NAMED_SOURCES]
    if requirements:
        print("\n".join(r for source in chosen for r in source.requirements()))
        return
    table = Table(title=f"named sources (cache: {cache_dir()})")
    for column in ("name", "model", "size", "part packages", "installed", "assembled"):
        table.add_column(column)
    for source in chosen:
        installed = sum(installed_distribution(p) is not None for p in source.packages())
        table.add_row(source.name, source.description, _mb(source.size),
                      f"{source.package_pattern.format('1')} .. {source.parts} =={source.version}",
                      f"{installed}/{source.parts}", "yes" if (cache_dir() / source.filename).is_file() else "no")
    console.print(table)


if __name__ == "__main__":
    app()
