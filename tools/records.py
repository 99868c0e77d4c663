"""The figure records: every figure of README.md and docs/benchmarks.md stands on a small JSON
record under ``docs/records/`` that says what was measured, where, from which commit, with
which command, the raw samples and the summary the figure quotes.

    python -m tools.records list                 # each record: status, make target, command
    python -m tools.records run NAME [NAME ...]  # run a record's command(s) here, rewrite the record
    python -m tools.records run --pending        # every pending record in sequence (`make records`)
    python -m tools.records check                # the docs' figures against the records (what the test runs)

A record (``docs/records/NAME.json``):

- ``figure``: what the docs quote from it; ``docs``: where; ``status``: ``measured`` (the
  samples are in the record, or in committed raw data it names) or ``pending`` (no raw data
  in the tree: the figure as the docs state it waits for ``run``);
- ``date``, ``machine`` (CPU model, cores, memory), ``cpu_flags`` (the ISA flags that pick
  kernels), ``commit`` (the tree that measured; ``-dirty`` when it had changes);
- ``command``: the command(s) that regenerate it, as a list; ``{out}`` stands for the JSON file
  the tool writes (``run`` puts a temporary path there); ``make``: the make target that runs them;
- ``samples``: the raw samples (the tool's JSON, or what was taken from committed raw data);
  ``summary``: the figures the docs quote; ``source``: where the samples came from (the tool's
  output, or ``raw`` files under docs/measured and the ``study`` that reported them).

What counts as a figure (:data:`FIGURE`): a number followed by a unit (``x``, ``%``, ``ms``,
``s``, ``tok/s``, ``t/s``, ``GB/s``, ``MB``, ``MiB``, ``GB``, ``GiB``), in the prose and tables
of the two files, outside fenced code blocks and inline code. Each paragraph or table row that
holds one must link a record (a table's rows may share the link of the paragraph right above
the table). A link to a pending record must say so in its text (``[record: pending](...)``),
and a link to a measured one must not (once ``run`` has measured a record, the figures beside
its links are restated from its summary).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECORDS = REPO / "docs" / "records"
DOCS = (REPO / "README.md", REPO / "docs" / "benchmarks.md")
REQUIRED = ("figure", "docs", "status", "date", "machine", "cpu_flags", "commit", "command", "make", "samples",
            "summary", "source")
MEASURED_NON_EMPTY = ("date", "machine", "cpu_flags", "commit", "samples", "summary")
STATUSES = ("measured", "pending")
KERNEL_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                "avx512_bf16", "avx_vnni", "amx_tile", "amx_int8", "asimd", "asimddp", "i8mm")

UNIT = r"(?:tok/s|t/s|GB/s|GiB|MiB|GB|MB|ms|s|x|%)"
FIGURE = re.compile(r"(?<![\w./])\d+(?:[.,]\d+)*\s?" + UNIT + r"(?![\w/])")
LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]+)\)")
INLINE_CODE = re.compile(r"`[^`]*`")


# -- the docs' figures -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Block:
    """A paragraph, a table row or a heading of a markdown file, outside fenced code."""

    line: int  # 1-based, the block's first line
    kind: str  # "paragraph", "row", "heading"
    text: str
    caption: str = ""  # a row: the paragraph right above its table


def blocks(text: str) -> list[Block]:
    out: list[Block] = []
    fenced = False
    paragraph: list[str] = []
    start = 0
    last_paragraph = ""
    in_table = False

    def flush() -> None:
        nonlocal paragraph, last_paragraph
        if paragraph:
            joined = "\n".join(paragraph)
            out.append(Block(start, "paragraph", joined))
            last_paragraph = joined
            paragraph = []

    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            flush()
            fenced = not fenced
            last_paragraph, in_table = "", False
            continue
        if fenced:
            continue
        if not stripped:
            flush()
            if in_table:
                last_paragraph, in_table = "", False
            continue
        if stripped.startswith("#"):
            flush()
            out.append(Block(number, "heading", stripped))
            last_paragraph, in_table = "", False
        elif stripped.startswith("|"):
            if not in_table:
                flush()
                in_table = True
            out.append(Block(number, "row", stripped, last_paragraph))
        else:
            if not paragraph:
                start = number
            paragraph.append(stripped)
    flush()
    return out


def figures_in(text: str) -> list[str]:
    """The figures of a piece of markdown, inline code and link targets left out."""
    text = INLINE_CODE.sub(" ", text)
    text = LINK.sub(lambda m: m.group(1), text)
    return [m.group(0) for m in FIGURE.finditer(text)]


def record_links(text: str, doc: Path) -> list[tuple[str, Path]]:
    """(link text, path) of every link in ``text`` to a record under docs/records/."""
    links = []
    for label, target in LINK.findall(text):
        path = (doc.parent / target.split("#")[0]).resolve()
        if path.suffix == ".json" and RECORDS.resolve() in path.parents:
            links.append((label, path))
    return links


def check_doc(doc: Path, text: str | None = None) -> list[str]:
    """What is wrong with ``doc``'s figures: a figure without a record, a link to a record that is
    missing or incomplete, a pending record not marked so. Empty: every figure stands on a record."""
    text = doc.read_text() if text is None else text
    problems = []
    for block in blocks(text):
        found = figures_in(block.text)
        own = record_links(block.text, doc)
        links = own or (record_links(block.caption, doc) if block.kind == "row" else [])
        if found and not links:
            problems.append(f"{doc.name}:{block.line}: {', '.join(found[:4])} with no record "
                            f"({block.text[:80]!r})")
        for label, path in own:
            problems += [f"{doc.name}:{block.line}: {p}" for p in check_record(path, label)]
    return problems


# -- the records ---------------------------------------------------------------------------------

def load(path: Path) -> dict:
    return json.loads(path.read_text())


def dump(record: dict) -> str:
    """A record as text: one field a line, the samples on one compact line at the end (raw
    samples are many numbers; a line each would make the folder long for nothing)."""
    head = {k: v for k, v in record.items() if k != "samples"}
    text = json.dumps(head, indent=1)
    samples = json.dumps(record.get("samples"), separators=(",", ":"))
    return text[:-2] + f',\n "samples": {samples}\n}}\n'


def check_record(path: Path, label: str | None = None) -> list[str]:
    """What is wrong with one record (and the text of a link to it)."""
    if not path.is_file():
        return [f"record {path.relative_to(REPO) if REPO in path.parents else path} does not exist"]
    try:
        record = load(path)
    except json.JSONDecodeError as err:
        return [f"record {path.name} is not JSON: {err}"]
    name = path.name
    problems = [f"record {name} has no {key!r}" for key in REQUIRED if key not in record]
    if problems:
        return problems
    if record["status"] not in STATUSES:
        problems.append(f"record {name}: status {record['status']!r} is not one of {', '.join(STATUSES)}")
    if record["status"] == "measured":
        problems += [f"record {name} is measured but its {key!r} is empty" for key in MEASURED_NON_EMPTY
                     if record[key] in (None, "", [], {})]
        for raw in (record.get("source") or {}).get("raw", []):
            if not (REPO / raw).is_file():
                problems.append(f"record {name} stands on {raw}, which is not in the tree")
    if label is not None and record["status"] == "pending" and "pending" not in label:
        problems.append(f"the link to pending record {name} does not say 'pending' ({label!r})")
    if label is not None and record["status"] == "measured" and "pending" in label:
        problems.append(f"record {name} is measured now: restate the figures beside it from its summary and drop "
                        f"'pending' from the link ({label!r})")
    if not isinstance(record["command"], list) or not record["command"]:
        problems.append(f"record {name}: command is not a list of commands")
    return problems


# -- commands: parsed without running ---------------------------------------------------------------

class _Parsed(Exception):
    def __init__(self, namespace: object) -> None:
        self.namespace = namespace


class CommandError(ValueError):
    """A record's command that does not parse."""


def _dry_argparse(module_name: str, argv: list[str]) -> argparse.Namespace:
    """``module_name``'s ``main`` up to its ``parse_args``: the arguments parsed, nothing run."""
    module = importlib.import_module(module_name)
    main = getattr(module, "main", None)
    if main is None:
        raise CommandError(f"{module_name} has no main()")
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    saved_argv = sys.argv
    argparse.ArgumentParser.parse_args = parse_then_stop
    try:
        with open(os.devnull, "w") as devnull, contextlib.redirect_stderr(devnull):
            if inspect.signature(main).parameters:
                main(argv)
            else:
                sys.argv = [module_name, *argv]
                main()
    except _Parsed as parsed:
        return parsed.namespace
    except SystemExit as err:
        raise CommandError(f"{module_name} refuses the arguments {argv} (exit {err.code})") from None
    finally:
        argparse.ArgumentParser.parse_args = original
        sys.argv = saved_argv
    raise CommandError(f"{module_name}.main() returned before parsing its arguments")


def _dry_cli(argv: list[str]):
    """``edgeroute`` with ``argv`` parsed by click (its options and the command's), nothing run."""
    import click
    import typer

    from edgeroute.cli import app

    group = typer.main.get_command(app)
    if not argv:
        raise CommandError("edgeroute without a command")
    name, rest = argv[0], list(argv[1:])
    context = group.context_class(group, info_name="edgeroute")
    command = group.get_command(context, name)
    if command is None:
        raise CommandError(f"edgeroute has no command {name!r}")
    refused, exits = [click.exceptions.ClickException], [click.exceptions.Exit]
    with contextlib.suppress(ImportError):  # typer's own copy of click, where it carries one
        from typer._click import exceptions as vendored

        refused.append(vendored.ClickException)
        exits += [getattr(vendored, name) for name in ("Exit", "Abort") if hasattr(vendored, name)]
    try:
        return command.make_context(name, rest, parent=context)
    except tuple(refused) as err:
        raise CommandError(f"edgeroute {' '.join(argv)}: {err.format_message()}") from None
    except tuple(exits) as err:
        raise CommandError(f"edgeroute {' '.join(argv)} exits (code {err.exit_code}) instead of parsing") from None


def split_env(command: str, out: str = "record-out.json") -> tuple[dict[str, str], list[str]]:
    """(the VAR=value assignments before the command, its argv), ``{out}`` replaced by ``out``."""
    argv = shlex.split(command.replace("{out}", out))
    env = {}
    while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", argv[0]):
        name, value = argv.pop(0).split("=", 1)
        env[name] = value
    return env, argv


def split(command: str, out: str = "record-out.json") -> list[str]:
    return split_env(command, out)[1]


def parse_command(command: str):
    """Parse one record command as its tool would (argparse or the edgeroute CLI) without running
    it; raises :class:`CommandError` where it does not parse."""
    argv = split(command, str(Path(tempfile.gettempdir()) / "record-out.json"))
    if not argv:
        raise CommandError(f"empty command {command!r}")
    if argv[0] in ("python", "python3"):
        if argv[1:2] == ["-m"] and len(argv) > 2:
            module, rest = argv[2], argv[3:]
        elif len(argv) > 1 and argv[1].endswith(".py"):
            module, rest = argv[1][:-3].replace("/", "."), argv[2:]
        else:
            raise CommandError(f"{command!r}: python -m MODULE or python FILE.py")
        if not module.startswith("tools."):
            raise CommandError(f"{command!r}: record commands run tools/ modules or the edgeroute CLI")
        return _dry_argparse(module, rest)
    if argv[0] == "edgeroute":
        return _dry_cli(argv[1:])
    raise CommandError(f"{command!r}: not a tools/ module nor the edgeroute CLI")


# -- running a record -----------------------------------------------------------------------------

def machine() -> dict:
    from edgeroute.cpu import describe_cpu

    info = {"cpu": describe_cpu(), "platform": platform.platform(), "python": platform.python_version(),
            "load_average": list(os.getloadavg())}
    with contextlib.suppress(OSError):
        mem = next(line for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal"))
        info["memory_gib"] = round(int(mem.split()[1]) / 2**20, 1)
    return info


def cpu_flags() -> list[str]:
    with contextlib.suppress(OSError, StopIteration):
        line = next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith(("flags", "Features")))
        present = set(line.split(":", 1)[1].split())
        return [flag for flag in KERNEL_FLAGS if flag in present]
    return []


def commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "HEAD")
    # the records themselves are not the tree that measured: a run of several rewrites them in turn
    changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)docs/records")
    return f"{head}-dirty" if changed else head


def _output(out: Path, stdout: str):
    if out.is_dir():
        files = sorted(out.glob("*.json"))
        if len(files) == 1:  # a tool that writes its JSON beside its table and plot
            return json.loads(files[0].read_text())
        return {f.name: json.loads(f.read_text()) for f in files} if files else None
    if out.is_file():
        return json.loads(out.read_text())
    with contextlib.suppress(json.JSONDecodeError):
        return json.loads(stdout)
    return {"stdout_tail": stdout[-4000:]}


def summarize(argv: list[str], result: object) -> object:
    """A command's summary: the tool's own ``summary`` section; for ``edgeroute inspect --json``
    of a calibrated bundle, the calibration's figures (tools/benchlib/calibration.py); for
    ``edgeroute eval --json``, each task's and mode's (tools/benchlib/evaluation.py); for
    ``edgeroute bench --json`` and tools/bench_passes.py, theirs (tools/benchlib/decoding.py)."""
    if isinstance(result, dict) and "summary" in result:
        return result["summary"]
    from tools.benchlib import decoding

    tool = argv[2] if len(argv) > 2 and argv[1] == "-m" else Path(argv[1]).stem if len(argv) > 1 else None
    if tool in ("tools.bench_passes", "bench_passes") and isinstance(result, list):
        return decoding.passes_summary(result)
    command = argv[1] if Path(argv[0]).name == "edgeroute" and len(argv) > 1 else None
    if command == "bench" and isinstance(result, dict) and "records" in result:
        return decoding.bench_summary(result)
    if command == "inspect" and isinstance(result, dict) and result.get("calibration"):
        from tools.benchlib.calibration import calibration_summary

        return calibration_summary(result)
    if command == "eval" and isinstance(result, dict) and "per_task" in result:
        from tools.benchlib.evaluation import eval_summary

        return eval_summary(result)
    return "the tool writes no summary section: its figures are in the samples"


def run_record(path: Path) -> dict:
    """Run ``path``'s commands here in sequence and rewrite it as measured: the tools' JSON as
    the samples, their ``summary`` sections as the summary (restate the docs from them)."""
    from edgeroute.files import atomic_write

    record = load(path)
    samples, summary = {}, {}
    started = time.time()
    with tempfile.TemporaryDirectory(prefix=f"record-{path.stem}-") as tmp:
        for i, command in enumerate(record["command"]):
            out = Path(tmp) / f"out{i}"
            if "{out}" in command and "tools.bench_sessions" in command:  # it writes a folder of JSON
                out.mkdir()
            env, argv = split_env(command, str(out))
            if argv[0] in ("python", "python3"):
                argv[0] = sys.executable
            elif argv[0] == "edgeroute":
                argv = [str(Path(sys.executable).parent / "edgeroute"), *argv[1:]]
            print(f"[{path.stem}] {command}", flush=True)
            done = subprocess.run(argv, cwd=REPO, stdout=subprocess.PIPE, text=True, env={**os.environ, **env})
            if done.returncode != 0:
                raise SystemExit(f"{path.stem}: {command!r} failed (exit {done.returncode})")
            result = _output(out, done.stdout)
            samples[command] = result
            summary[command] = summarize(argv, result)
    record.update(status="measured", date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), machine=machine(),
                  cpu_flags=cpu_flags(), commit=commit(), samples=samples, summary=summary,
                  source={"tool_output": "samples", "wall_seconds": round(time.time() - started, 1),
                          "before": record.get("source")})
    atomic_write(path, dump(record))
    return record


def all_records() -> list[Path]:
    return sorted(RECORDS.glob("*.json"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser("list", help="each record: status, make target, command")
    run = sub.add_parser("run", help="run records' commands here and rewrite them")
    run.add_argument("names", nargs="*", help="record names (file stems)")
    run.add_argument("--pending", action="store_true", help="every pending record, in sequence")
    sub.add_parser("check", help="the docs' figures against the records; the commands parsed")
    args = parser.parse_args(argv)
    if args.action == "list":
        for path in all_records():
            record = load(path)
            minutes = record.get("estimated_minutes")
            print(f"{path.stem:28s} {record['status']:9s} {record['make']:22s} "
                  f"{f'~{minutes} min' if minutes else '':8s} {record['figure'][:60]}")
        return 0
    if args.action == "check":
        problems = [p for doc in DOCS for p in check_doc(doc)]
        for path in all_records():
            problems += check_record(path)
            for command in load(path)["command"]:
                try:
                    parse_command(command)
                except CommandError as err:
                    problems.append(f"{path.name}: {err}")
        print("\n".join(problems) or "every figure stands on a record; every command parses")
        return 1 if problems else 0
    names = [p.stem for p in all_records() if load(p)["status"] == "pending"] if args.pending else args.names
    if args.pending and not names:
        print("no record is pending: every figure's record is measured (make bench-* measures one again)")
        return 0
    if not names:
        parser.error("give record names or --pending")
    for name in names:
        path = RECORDS / f"{name}.json"
        if not path.is_file():
            parser.error(f"no record {name} (python -m tools.records list)")
        run_record(path)
        print(f"wrote {path.relative_to(REPO)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
