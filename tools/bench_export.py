"""Benchmark `edgeroute export` of the demo bundle (default options) on this machine.

Runs the export in a subprocess to a temporary directory, measures its wall time, its peak
resident memory (``getrusage(RUSAGE_CHILDREN).ru_maxrss`` after the wait: the largest RSS of
the export process and anything it waited for) and the time per stage the export prints, then
prints a table with PASS/MISS against the targets (< 5 minutes, < 4 GB on the 2-core CI
machine) and writes the figures as JSON.

    python tools/bench_export.py                       # -> bench-results/export.json
    python tools/bench_export.py --json out.json -- --quant int4-rtn   # extra export options
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

TARGET_SECONDS = 5 * 60
TARGET_BYTES = 4 * 1024**3
STAGE_LINE = re.compile(r"time per stage:(?P<stages>.*)")
STAGE = re.compile(r"\s*(?P<name>[^,]+?) (?P<seconds>\d+(?:\.\d+)?)s\s*(?:,|$)")


def parse_stages(stdout: str) -> dict[str, float]:
    """``time per stage: load 1.2s, quantize 0.3s, ...`` -> {"load": 1.2, ...}."""
    match = STAGE_LINE.search(stdout)
    if match is None:
        return {}
    return {m["name"]: float(m["seconds"]) for m in STAGE.finditer(match["stages"].strip())}


def run_export(out: Path, extra: list[str], log: Path) -> dict:
    cmd = [sys.executable, "-m", "edgeroute.cli", "export", "--out", str(out), *extra]
    env = {**os.environ, "COLUMNS": "200"}  # keep rich from wrapping the stage line
    start = time.perf_counter()
    with open(log, "w") as log_file:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=log_file, text=True, env=env)
    wall = time.perf_counter() - start
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # KiB on Linux
    with open(log, "a") as log_file:
        log_file.write(proc.stdout)
    return {"command": cmd, "returncode": proc.returncode, "wall_seconds": wall,
            "peak_rss_bytes": peak_kib * 1024, "stages": parse_stages(proc.stdout), "stdout": proc.stdout}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=Path("bench-results/export.json"), help="where to write the figures")
    parser.add_argument("export_args", nargs="*", help="extra `edgeroute export` options (after --)")
    args = parser.parse_args(argv)
    console = Console()

    with tempfile.TemporaryDirectory(prefix="edgeroute-bench-") as tmp:
        log = Path(tmp) / "export.log"
        console.print(f"exporting the demo bundle ({' '.join(args.export_args) or 'default options'}) ...")
        result = run_export(Path(tmp) / "bundle", args.export_args, log)
        bundle_bytes = sum(f.stat().st_size for f in (Path(tmp) / "bundle").rglob("*") if f.is_file())
        if result["returncode"] != 0:
            console.print(f"[bold red]export failed (exit {result['returncode']})[/]; last lines of its output:")
            console.print("\n".join(log.read_text().splitlines()[-30:]), markup=False, highlight=False)

    ok = result["returncode"] == 0
    time_pass = ok and result["wall_seconds"] < TARGET_SECONDS
    mem_pass = ok and result["peak_rss_bytes"] < TARGET_BYTES
    verdict = {True: "[green]PASS[/]", False: "[red]MISS[/]"} if ok else {False: "[red]export failed[/]"}

    table = Table(title=f"edgeroute export, demo bundle ({os.cpu_count()} CPU cores, {platform.machine()})")
    for column in ("measure", "value", "target", ""):
        table.add_column(column)
    table.add_row("wall time", f"{result['wall_seconds']:.1f} s", f"< {TARGET_SECONDS / 60:.0f} min", verdict[time_pass])
    table.add_row("peak RSS", f"{result['peak_rss_bytes'] / 1024**3:.2f} GiB", f"< {TARGET_BYTES / 1024**3:.0f} GiB",
                  verdict[mem_pass])
    for name, seconds in result["stages"].items():
        table.add_row(f"  stage: {name}", f"{seconds:.1f} s", "", "")
    table.add_row("bundle size", f"{bundle_bytes / 1e6:,.1f} MB", "", "")
    console.print(table)

    record = {
        "benchmark": "export",
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "command": result["command"][1:],
        "returncode": result["returncode"],
        "wall_seconds": round(result["wall_seconds"], 2),
        "peak_rss_bytes": result["peak_rss_bytes"],
        "stage_seconds": result["stages"],
        "bundle_bytes": bundle_bytes,
        "targets": {"wall_seconds": TARGET_SECONDS, "peak_rss_bytes": TARGET_BYTES},
        "pass": {"wall_seconds": time_pass, "peak_rss_bytes": mem_pass},
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(record, indent=1) + "\n")
    console.print(f"wrote {args.json}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
