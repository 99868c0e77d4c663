"""Builds of libedgeroute timed against each other, paired in one process, on a model that
nobody has to carry: whole-model passes of M tokens after a context, per kernel set and
thread count. For judging a change to the library on a machine that has none of the
repository's bundles (a lent device, a board), or for a bisect.

Two steps; the second needs only this file, numpy and rich on the machine that runs it:

    python tools/bench_builds.py prepare KIT --commits 9921658,HEAD \\
        --layout bundles/qwen-pair/llm/native.bin --layout bundles/qwen-pair/slm/native.bin
    python tools/bench_builds.py run KIT --kernels avx512-vnni --threads 1,2 --contexts 32,1024 \\
        --m 1,4 --rounds 10 --passes 4 --json builds.json

A pass asks for the logits of every row, as a speculative verification does; ``--logits last``
asks for the last row's only, as a prompt's prefill does (``--m 64 --logits last``: a 64-token
prompt read after ``--contexts`` tokens).

``prepare`` builds each commit's library in a temporary git worktree with that commit's
``libedgeroute/build.py`` (a commit given twice is one build, timed as two: a null control),
the driver ``tools/native/bench_builds.c``, and per native weight file its layout: the GGUF
bytes before the tensor data and the tensor table, kilobytes where the file is a gigabyte. It
copies the compiler's libgomp beside them, for machines whose image lacks it.

``run`` writes a file of each layout with random codes (block scales 2^-9, norms 1, biases 0:
a product's time does not depend on its codes) and times the builds in one process per thread
count, their order rotated and reversed round by round. "x first" is the median of a build's
per-round time over the first build's, with quartiles. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DRIVER_SOURCE = REPO / "tools" / "native" / "bench_builds.c"
DRIVER = "bench_builds"
KIT_FILE = "kit.json"
# bytes of a block, and where its fp16 scale (and min scale) sit
BLOCKS = {"Q4_0": (18, 0, None), "Q4_1": (20, 0, 2), "Q5_0": (22, 0, None), "Q8_0": (34, 0, None),
          "Q4_K": (144, 0, 2), "Q6_K": (210, 208, None)}
SCALE = 2.0**-9


def _git(*args: str) -> str:
    done = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"git {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout.strip()


def _commit(name: str) -> str:
    done = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", "--quiet", f"{name}^{{commit}}"],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{name} is not a commit of {REPO}")
    return done.stdout.strip()


def build_library(commit: str, out: Path) -> None:
    """The library of ``commit``, built by that commit's own build script."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        _git("worktree", "add", "--detach", "--quiet", str(tree), commit)
        try:
            # the library's folder: libedgeroute/ since 2026-12-05, runtime/native/ before
            script = next((p for p in (tree / "libedgeroute" / "build.py", tree / "runtime" / "native" / "build.py")
                           if p.is_file()), tree / "libedgeroute" / "build.py")
            done = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True)
        finally:
            _git("worktree", "remove", "--force", str(tree))
    if done.returncode != 0:
        raise SystemExit(f"building {commit[:12]}'s library failed:\n{done.stderr[-3000:]}")


def _beside(stem: Path, suffix: str) -> Path:
    return stem.with_name(stem.name + suffix)  # a layout's name may hold dots


def write_layout(native_bin: Path, out: Path) -> dict:
    """``out``.head (the GGUF bytes before the tensor data) and ``out``.json (the tensor table)."""
    import gguf

    reader = gguf.GGUFReader(str(native_bin))
    with open(native_bin, "rb") as f:
        _beside(out, ".head").write_bytes(f.read(reader.data_offset))
    tensors = [{"name": t.name, "type": t.tensor_type.name, "offset": int(t.data_offset), "nbytes": int(t.n_bytes),
                "shape": [int(x) for x in t.shape]} for t in reader.tensors]
    embedding = next(t for t in tensors if t["name"] == "token_embd.weight")
    layout = {"source": str(native_bin), "size": native_bin.stat().st_size, "vocab": embedding["shape"][1],
              "tensors": tensors}
    _beside(out, ".json").write_text(json.dumps(layout))
    return layout


def prepare(kit: Path, commits: list[str], layouts: list[str]) -> dict:
    resolved = [(name, _commit(name)) for name in commits]  # every input checked before anything is built
    sources = []
    for spec in layouts:
        name, _, path = spec.rpartition("=")
        native_bin = Path(path)
        if not native_bin.is_file():
            raise SystemExit(f"{native_bin}: no such native weight file")
        sources.append((name or native_bin.parent.name, native_bin))
    kit.mkdir(parents=True, exist_ok=True)
    builds, built = [], {}
    for name, commit in resolved:
        library = f"lib-{commit[:12]}.so"
        if commit not in built:
            print(f"building {name} ({commit[:12]})", flush=True)
            build_library(commit, kit / library)
            built[commit] = library
        repeats = sum(b["commit"] == commit for b in builds)
        builds.append({"name": f"{name} #{repeats + 1}" if repeats else name, "commit": commit, "library": library})
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise SystemExit("no C compiler (cc or gcc) to build the driver")
    subprocess.run([compiler, "-std=gnu11", "-O2", f"-I{REPO / 'libedgeroute' / 'include'}", str(DRIVER_SOURCE),
                    "-o", str(kit / DRIVER), "-ldl"], check=True)
    gomp = subprocess.run([compiler, "-print-file-name=libgomp.so.1"], capture_output=True, text=True).stdout.strip()
    if os.path.isabs(gomp) and os.path.isfile(gomp):
        shutil.copy(gomp, kit / "libgomp.so.1")
    for name, native_bin in sources:
        write_layout(native_bin, kit / name)
    description = {"builds": builds, "layouts": [name for name, _ in sources]}
    (kit / KIT_FILE).write_text(json.dumps(description, indent=1))
    return description


def random_model(layout_stem: Path, out: Path) -> dict:
    """A native weight file of the layout at ``layout_stem`` with random codes."""
    import numpy as np

    layout = json.loads(_beside(layout_stem, ".json").read_text())
    head = _beside(layout_stem, ".head").read_bytes()
    data = np.random.default_rng(0).integers(0, 256, size=layout["size"], dtype=np.uint8)
    data[: len(head)] = np.frombuffer(head, dtype=np.uint8)
    scale = np.frombuffer(np.float16(SCALE).tobytes(), dtype=np.uint8)
    for t in layout["tensors"]:
        view = data[t["offset"] : t["offset"] + t["nbytes"]]
        if t["type"] in ("F32", "F16"):
            dtype = np.float32 if t["type"] == "F32" else np.float16
            value = 1.0 if "norm" in t["name"] else 0.0
            view[:] = np.frombuffer(np.full(t["nbytes"] // np.dtype(dtype).itemsize, value, dtype).tobytes(),
                                    dtype=np.uint8)
            continue
        if t["type"] not in BLOCKS:
            raise SystemExit(f"{t['name']}: tensor type {t['type']} is not one this tool fills")
        size, scale_at, min_at = BLOCKS[t["type"]]
        blocks = view.reshape(-1, size)
        for at in (scale_at, min_at):
            if at is not None:
                blocks[:, at : at + 2] = scale
    data.tofile(out)
    return layout


def _ratios(ms: list[list[float]]) -> list[dict]:
    import numpy as np

    first = np.array(ms[0])
    rows = []
    for build_ms in ms:
        ratio = np.array(build_ms) / first
        rows.append({"median_ms": float(np.median(build_ms)), "x_first": float(np.median(ratio)),
                     "q1": float(np.percentile(ratio, 25)), "q3": float(np.percentile(ratio, 75)), "ms": build_ms})
    return rows


def run(kit: Path, layouts: list[str] | None, kernels: str, threads: list[int], contexts: list[int], ms: list[int],
        rounds: int, passes: int, scratch: Path | None, logits: str = "every") -> dict:
    if not (kit / KIT_FILE).is_file():
        raise SystemExit(f"{kit} holds no {KIT_FILE}: run `prepare` into it first")
    description = json.loads((kit / KIT_FILE).read_text())
    builds = description["builds"]
    if len(builds) < 2:
        raise SystemExit(f"{kit} has {len(builds)} build(s): give prepare two commits or more (one twice is a null control)")
    unknown = sorted(set(layouts or []) - set(description["layouts"]))
    if unknown:
        raise SystemExit(f"no layout {', '.join(unknown)} in {kit} (it has {', '.join(description['layouts'])})")
    env = {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join(filter(None, [str(kit), os.environ.get("LD_LIBRARY_PATH")]))}
    results = []
    for name in layouts or description["layouts"]:
        with tempfile.TemporaryDirectory(dir=scratch) as tmp:
            model = Path(tmp) / f"{name}.bin"
            layout = random_model(kit / name, model)
            for t in threads:
                args = [str(kit / DRIVER), str(model), str(layout["vocab"]), kernels, str(t), ",".join(map(str, contexts)),
                        ",".join(map(str, ms)), str(rounds), str(passes), logits,
                        *[str(kit / b["library"]) for b in builds]]
                done = subprocess.run(args, capture_output=True, text=True, env=env)
                if done.returncode != 0:
                    raise SystemExit(done.stderr.strip() or f"{DRIVER} exited with {done.returncode}")
                for line in done.stdout.splitlines():
                    record = json.loads(line)
                    results.append({"layout": name, "threads": t, "ctx": record["ctx"], "m": record["m"],
                                    "builds": [{**b, **r} for b, r in zip(builds, _ratios(record["ms"]), strict=True)]})
    return {"kit": str(kit), "kernels": kernels, "rounds": rounds, "passes": passes, "logits": logits,
            "results": results, "summary": summary(results)}


def summary(results: list[dict]) -> dict:
    """Per layout, threads, context and pass length: each build's median ms a pass and its median
    per-round ratio to the first build's, with the quartiles (what a record quotes)."""
    return {f"{r['layout']} threads={r['threads']} ctx={r['ctx']} m={r['m']}":
            {b["name"]: {"ms": round(b["median_ms"], 3), "x_first": round(b["x_first"], 3),
                         "quartiles": [round(b["q1"], 3), round(b["q3"], 3)]} for b in r["builds"]}
            for r in results}


def print_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    names = [b["name"] for b in report["results"][0]["builds"]]
    rows = "every row's logits" if report["logits"] == "every" else "the last row's logits"
    table = Table(title=f"{report['kernels']}: ms a pass with {rows} (median of {report['rounds']} rounds of "
                        f"{report['passes']}), "
                        f"and x {names[0]} (median of per-round ratios, quartiles)")
    for column in ("layout", "threads", "ctx", "M", *names):
        table.add_column(column, justify="left" if column == "layout" else "right")
    for r in report["results"]:
        cells = [f"{r['builds'][0]['median_ms']:.2f}"]
        cells += [f"{b['median_ms']:.2f}  x{b['x_first']:.3f} ({b['q1']:.3f}-{b['q3']:.3f})" for b in r["builds"][1:]]
        table.add_row(r["layout"], str(r["threads"]), str(r["ctx"]), str(r["m"]), *cells)
    Console().print(table)


def _numbers(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of whole numbers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be at least 1")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    steps = parser.add_subparsers(dest="step", required=True)
    p = steps.add_parser("prepare", help="build the libraries, the driver and the layouts into KIT")
    p.add_argument("kit", type=Path)
    p.add_argument("--commits", required=True, help="comma-separated commits (the first is the reference)")
    p.add_argument("--layout", action="append", default=[], metavar="[NAME=]NATIVE_BIN",
                   help="a native weight file whose layout to keep (NAME: its parent folder's name by default)")
    r = steps.add_parser("run", help="time the kit's builds against each other")
    r.add_argument("kit", type=Path)
    r.add_argument("--layout", action="append", help="which of the kit's layouts (default: each)")
    r.add_argument("--kernels", default="avx2", help="a kernel set's name (every build must carry it)")
    r.add_argument("--threads", type=_numbers, default=[1])
    r.add_argument("--contexts", type=_numbers, default=[32])
    r.add_argument("--m", type=_numbers, default=[1, 4], help="tokens per pass")
    r.add_argument("--rounds", type=int, default=10)
    r.add_argument("--passes", type=int, default=4, help="passes per build per round")
    r.add_argument("--logits", choices=("every", "last"), default="every",
                   help="the logits of every row of a pass (a verification) or of its last (a prefill)")
    r.add_argument("--scratch", type=Path, help="where the random model file is written (default: the temp folder)")
    r.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    if args.step == "prepare":
        kit = prepare(args.kit, [c for c in args.commits.split(",") if c], args.layout)
        print(f"{args.kit}: {len(kit['builds'])} builds, layouts {', '.join(kit['layouts']) or 'none'}")
        return 0
    if args.rounds < 1 or args.passes < 1:
        parser.error("--rounds and --passes must be at least 1")
    report = run(args.kit, args.layout, args.kernels, args.threads, args.contexts, args.m, args.rounds, args.passes,
                 args.scratch, args.logits)
    print_table(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
