"""libedgeroute's matrix products one by one: every (format, shape) a bundle's native weights
hold, timed alone per kernel set and pass length M, against the bytes they read.

    python tools/bench_kernels.py BUNDLE [--role llm] [--kernels avx2,avx512-vnni] [--m 1,2,4,8]
        [--threads 1] [--seconds 0.4] [--json out.json]

Each case runs in its own process (tools/native/bench_kernels.c built with the library's
sources), the fastest of its trials: a kernel's own cost, with the activations quantized and
the weights packed beforehand, as in a model. Per token: the sum over a token's products
(each matrix once; the tied head too). GB/s: the bytes a product reads (packed where the kernel
set packs) over its time; with M rows those bytes serve M tokens.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
NATIVE = REPO / "libedgeroute"
DRIVER = REPO / "tools" / "native" / "bench_kernels.c"
FORMATS = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14}


def _native_build():
    spec = importlib.util.spec_from_file_location("native_build", NATIVE / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_driver(out: Path) -> Path:
    """The driver linked statically with the library's objects (it calls internal kernels)."""
    build = _native_build()
    compiler = build.find_compiler()
    with tempfile.TemporaryDirectory() as tmp:
        objects = []
        for i, (source, own) in enumerate([*build.compile_units(build.host_arch()), (DRIVER, [])]):
            obj = Path(tmp) / f"{i}-{source.stem}.o"
            build.run([compiler, *build.COMMON, *own, "-c", str(source), "-o", str(obj)], quiet=True)
            objects.append(str(obj))
        build.run([compiler, *build.COMMON, *objects, "-o", str(out), "-lm"], quiet=True)
    return out


def matrix_cases(bundle: Path, role: str) -> Counter:
    """(format, rows, cols) -> how many such products one token runs."""
    import gguf

    reader = gguf.GGUFReader(str(bundle / role / "native.bin"))
    cases: Counter = Counter()
    for tensor in reader.tensors:
        name = tensor.tensor_type.name
        if name in FORMATS and (tensor.name.startswith("blk.") or tensor.name in ("output.weight", "token_embd.weight")):
            cols, rows = (int(x) for x in tensor.shape)
            cases[(name, rows, cols)] += 1
    names = {t.name for t in reader.tensors}
    if "output.weight" in names:  # untied: the embedding is a lookup, not a product
        embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
        cols, rows = (int(x) for x in embedding.shape)
        cases[(embedding.tensor_type.name, rows, cols)] -= 1
    return +cases


def kernel_ids() -> dict[str, int]:
    sys.path.insert(0, str(REPO))
    from edgeroute.runtime.backends.native import header_constants

    constants = header_constants()
    return {name: constants[f"ER_KERNELS_{name.replace('-', '_').upper()}"]
            for name in ("generic", "avx2", "avx512-vnni") if f"ER_KERNELS_{name.replace('-', '_').upper()}" in constants}


UNSUPPORTED = 3  # the driver's exit status where this CPU does not run the kernel set


def time_case(driver: Path, kernels: int, case: tuple[str, int, int], m: int, threads: int,
              seconds: float) -> tuple[float, int] | None:
    """The product's fastest time in ms and the bytes it reads; None where this CPU does not run
    the kernel set. Any other failure of the driver is an error, not a skipped case."""
    fmt, rows, cols = case
    done = subprocess.run([str(driver), str(kernels), str(FORMATS[fmt]), str(rows), str(cols), str(m), str(threads),
                           str(seconds)], capture_output=True, text=True)
    if done.returncode == UNSUPPORTED:
        return None
    if done.returncode != 0:
        raise RuntimeError(f"bench_kernels {fmt} {rows}x{cols} M={m}: exit {done.returncode}: {done.stderr.strip()}")
    ms, read = done.stdout.split()
    return float(ms), int(read)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--role", default="llm")
    parser.add_argument("--kernels", default="avx2,avx512-vnni")
    parser.add_argument("--m", default="1,2,4,8")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=0.4)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    passes = [int(x) for x in args.m.split(",")]
    ids = kernel_ids()
    cases = matrix_cases(args.bundle, args.role)
    results = []
    console = Console(width=max(Console().width, 120))
    with tempfile.TemporaryDirectory() as tmp:
        driver = build_driver(Path(tmp) / "bench_kernels")
        for name in args.kernels.split(","):
            table = Table(title=f"{args.bundle.name}/{args.role}: {name}, {args.threads} thread(s), ms per product")
            for column in ["format", "rows x cols", "per token", *(f"M={m}" for m in passes), "GB/s M=1",
                           *(f"M={m} / M=1" for m in passes[1:])]:
                table.add_column(column, justify="right")
            totals = dict.fromkeys(passes, 0.0)
            for case, count in sorted(cases.items()):
                timed = {m: time_case(driver, ids[name], case, m, args.threads, args.seconds) for m in passes}
                if any(t is None for t in timed.values()):
                    console.print(f"[yellow]{name} does not run {case} here: skipped[/]")
                    break
                for m in passes:
                    totals[m] += count * timed[m][0]
                ms1, read = timed[passes[0]]
                results.append({"kernels": name, "format": case[0], "rows": case[1], "cols": case[2], "count": count,
                                "threads": args.threads, "bytes": read,
                                "ms": {str(m): timed[m][0] for m in passes}})
                table.add_row(case[0], f"{case[1]} x {case[2]}", str(count), *(f"{timed[m][0]:.3f}" for m in passes),
                              f"{read / ms1 / 1e6:.1f}", *(f"{timed[m][0] / ms1:.2f}" for m in passes[1:]))
            else:
                table.add_row("all", "", "1 token", *(f"{totals[m]:.2f}" for m in passes), "",
                              *(f"{totals[m] / totals[passes[0]]:.2f}" for m in passes[1:]), style="bold")
                results.append({"kernels": name, "format": "all", "threads": args.threads,
                                "ms": {str(m): totals[m] for m in passes}})
                console.print(table)
    if args.json:
        args.json.write_text(json.dumps({"bundle": str(args.bundle), "role": args.role, "results": results}, indent=1))


if __name__ == "__main__":
    main()
