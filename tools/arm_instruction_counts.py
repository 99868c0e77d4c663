"""Instructions retired per decoded token on an emulated Arm CPU: the aarch64 libedgeroute's
kernel sets against its generic C kernels, on a bundle's native weights (a proxy for speed where
no Arm hardware is at hand: qemu cannot time Arm code, but it can count what runs).

Cross-builds the aarch64 library and the C example (examples/c/generate.c) with
aarch64-linux-gnu-gcc, builds the counting plugin (tools/qemu/insn_count.c) for the host, and
runs the example under ``qemu-aarch64 -cpu CPU -plugin``, one thread, greedy, an fp16 cache:
once decoding N tokens and once N + K; per decoded token = (count(N + K) - count(N)) / K, so
loading, packing and the prompt cancel out. Also checks that every kernel set decodes the same
tokens, and prints the bytes of weights one decode step reads.

With ``--passes 1,2,4,8`` it also counts what one pass of P rows costs (a verification pass
of P - 1 drafts, or a prefill): the prompt's first P ids prefilled in one pass and one token
taken, count(P) - count(1) added to the one-row cost (a decode step's count), so a pass's cost
per row shows how far a multi-row pass reuses the weights it loads.

    python tools/arm_instruction_counts.py [--bundle bundles/smollm2-demo] [--cpu neoverse-n1]
        [--kernels generic,neon,dotprod] [--decode 4] [--extra 8] [--passes 1,2,4,8] [--profile]
        [--json OUT.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NATIVE = REPO / "libedgeroute"
SYSROOT = Path("/usr/aarch64-linux-gnu")
PROMPT = "Three tips for staying awake on a long drive:"


def need(tool: str) -> str:
    found = shutil.which(tool)
    if not found:
        raise SystemExit(f"{tool} not found (Debian: apt-get install gcc-aarch64-linux-gnu qemu-user)")
    return found


def build(tmp: Path) -> tuple[Path, Path]:
    """The aarch64 library + example, and the host plugin."""
    builder = load_tool(NATIVE / "build.py")
    cross = need("aarch64-linux-gnu-gcc")
    library = builder.build(tmp / "lib" / "libedgeroute.so", cc=cross, arch="aarch64", quiet=True)
    example = tmp / "generate"
    subprocess.run([cross, "-std=gnu11", "-O2", f"-I{NATIVE / 'include'}", str(REPO / "examples" / "c" / "generate.c"),
                    "-o", str(example), f"-L{library.parent}", "-ledgeroute", "-lm", "-fopenmp"], check=True)
    return example, build_plugin(tmp)


def build_plugin(directory: Path) -> Path:
    """tools/qemu/insn_count.c built for the host (qemu loads it)."""
    plugin = directory / "libinsn_count.so"
    subprocess.run([shutil.which("cc") or need("gcc"), "-shared", "-fPIC", "-O2",
                    str(REPO / "tools" / "qemu" / "insn_count.c"), "-o", str(plugin)], check=True)
    return plugin


def prompt_ids(bundle: Path) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(bundle / "tokenizer.json")).encode(PROMPT).ids


def counted_run(example: Path, plugin: Path, cpu: str, bundle: Path, kernels: str, tokens: int,
                ids: list[int]) -> tuple[int, list[int], float]:
    """(instructions retired, the tokens decoded, seconds) of one run of the example."""
    counts, tokens_out, seconds, _ = counted_example(example, plugin, cpu, bundle, kernels, tokens, ids)
    return counts["instructions"], tokens_out, seconds


def counted_example(example: Path, plugin: Path, cpu: str, bundle: Path, kernels: str, tokens: int, ids: list[int],
                    cache: int = 0, profile: Path | None = None) -> tuple[dict[str, int], list[int], float, str]:
    """counted() of one run of the C example on ``kernels``, checked to have run them."""
    counts, out, err, seconds = counted(plugin, cpu, example, [str(bundle), "-n", str(tokens), "-k", kernels, "-t", "1",
                                                               "-c", "f16", *map(str, ids)],
                                        {"LD_LIBRARY_PATH": str(example.parent / "lib"), "OMP_NUM_THREADS": "1"}, cache, profile)
    ran = re.search(r"^(\S+) kernels", err, re.M)
    if not ran or ran.group(1) != kernels:
        raise SystemExit(f"asked for the {kernels} kernels, the example ran {ran.group(1) if ran else '?'}: {err}")
    return counts, [int(t) for t in out.split()], seconds, err


def counted(plugin: Path, cpu: str, program: Path, arguments: list[str], env: dict[str, str],
            cache: int = 0, profile: Path | None = None) -> tuple[dict[str, int], str, str, float]:
    """One run of an aarch64 program under ``qemu-aarch64 -cpu CPU`` with the counting plugin:
    ({"instructions": N, and with ``cache`` (bytes of a simulated last-level cache) "mem_bytes",
    "cache_miss_bytes"}, stdout, stderr, seconds). With ``profile`` the plugin writes its block
    profile there (symbol_profile() reads it)."""
    options = "".join([f",cache={cache}" if cache else "", f",profile={profile}" if profile else ""])
    command = [need("qemu-aarch64"), "-cpu", cpu, "-L", str(SYSROOT), "-plugin", f"{plugin}{options}",
               *(x for k, v in env.items() for x in ("-E", f"{k}={v}")), str(program), *arguments]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)}\n{done.stderr}")
    count = re.search(r"insn_count: (\d+)", done.stderr)
    if not count:
        raise SystemExit(f"the plugin printed no count (qemu without plugin support?): {done.stderr}")
    counts = {"instructions": int(count.group(1))}
    for name in ("mem_bytes", "cache_miss_bytes") if cache else ():
        counts[name] = int(re.search(rf"{name}: (\d+)", done.stderr).group(1))
    return counts, done.stdout, done.stderr, seconds


def symbol_profile(path: Path) -> dict[str, int]:
    """Instructions per function ("library:function") of a run counted with a profile: each block's
    host address placed in the guest file qemu mapped there, that file's offset turned into the
    ELF address its LOAD segment gives it, the nearest symbol at or below (nm; static functions
    included where the file keeps its symbol table)."""
    import bisect
    import collections

    maps, blocks, in_blocks = [], [], False
    for line in path.read_text().splitlines():
        if line == "blocks":
            in_blocks = True
        elif in_blocks:
            haddr, insns, execs = line.split()
            blocks.append((int(haddr, 16), int(insns) * int(execs)))
        else:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/"):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                maps.append((start, end, int(fields[2], 16), fields[5]))
    maps.sort()
    symbols: dict[str, tuple[list[int], list[str], list[tuple[int, int, int]]]] = {}

    def table(file: str):
        if file not in symbols:
            nm = subprocess.run(["aarch64-linux-gnu-nm", "--defined-only", "-n", "-C", file], capture_output=True,
                                text=True).stdout
            if not nm.strip():  # stripped (the sysroot's libc): its dynamic symbols
                nm = subprocess.run(["aarch64-linux-gnu-nm", "-D", "--defined-only", "-n", "-C", file],
                                    capture_output=True, text=True).stdout
            rows = [(int(a, 16), n) for a, t, n in (line.split(maxsplit=2) for line in nm.splitlines() if line.count(" ") >= 2)
                    if t.lower() in "tw"]
            heads = subprocess.run(["aarch64-linux-gnu-readelf", "-lW", file], capture_output=True, text=True).stdout
            loads = [(int(o, 16), int(v, 16), int(fs, 16)) for o, v, fs in
                     re.findall(r"^\s*LOAD\s+0x([0-9a-f]+) 0x([0-9a-f]+) 0x[0-9a-f]+ 0x([0-9a-f]+)", heads, re.M)]
            symbols[file] = ([a for a, _ in rows], [n for _, n in rows], loads)
        return symbols[file]

    totals: collections.Counter = collections.Counter()
    starts = [m[0] for m in maps]
    for haddr, count in blocks:
        i = bisect.bisect_right(starts, haddr) - 1
        if i < 0 or haddr >= maps[i][1]:
            totals["?"] += count
            continue
        start, _, offset, file = maps[i]
        at = haddr - start + offset
        addresses, names, loads = table(file)
        at = next((at - o + v for o, v, size in loads if o <= at < o + size), at)
        j = bisect.bisect_right(addresses, at) - 1
        totals[f"{Path(file).name}:{names[j] if j >= 0 else '?'}"] += count
    return dict(totals)


def load_tool(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def counted_python_run(root: Path, plugin: Path, library: Path, cpu: str, bundle: Path, backend: str, tokens: int,
                       ids: list[int]) -> tuple[int, list[int], float, str]:
    """(instructions, tokens, seconds, what ran) of tools/qemu/greedy_steps.py in the emulated
    aarch64 Python of ``root``: the runtime as a Python program runs it, interpreter included."""
    arm_python = load_tool(REPO / "tools" / "qemu" / "arm_python.py")
    command = arm_python.command(root, cpu, [str(REPO / "tools" / "qemu" / "greedy_steps.py"), str(bundle),
                                             "--backend", backend, "--tokens", str(tokens), *map(str, ids)],
                                 env={"EDGEROUTE_NATIVE_LIB": str(library), "OMP_NUM_THREADS": "1"}, plugin=plugin)
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    count = re.search(r"insn_count: (\d+)", done.stderr)
    if done.returncode != 0 or not count:
        raise SystemExit(f"{' '.join(command)}\n{done.stderr}")
    ran, decoded = done.stdout.splitlines()[-2:]
    return int(count.group(1)), [int(t) for t in decoded.split()], seconds, ran


def weight_bytes_per_token(bundle: Path) -> dict[str, int]:
    """Bytes of weight blocks one decode step reads: every matrix in full, the embedding's one row
    (with tied embeddings the head is the embedding matrix, read in full)."""
    import gguf

    reader = gguf.GGUFReader(str(bundle / "llm" / "native.bin"))
    matrices = {t.name: t for t in reader.tensors if len(t.shape) == 2}
    embed = matrices["token_embd.weight"]
    layers = sum(int(t.n_bytes) for name, t in matrices.items() if name.startswith("blk."))
    head = matrices.get("output.weight", embed)
    return {"layers": layers, "head": int(head.n_bytes), "embedding_row": int(embed.n_bytes) // int(embed.shape[1]),
            "total": layers + int(head.n_bytes) + int(embed.n_bytes) // int(embed.shape[1])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", type=Path, default=REPO / "bundles" / "smollm2-demo")
    parser.add_argument("--cpu", default="neoverse-n1")
    parser.add_argument("--kernels", default="generic,neon,dotprod")
    parser.add_argument("--decode", type=int, default=4, help="tokens of the shorter run (N)")
    parser.add_argument("--extra", type=int, default=8, help="further tokens of the longer run (K)")
    parser.add_argument("--passes", default="", help="pass lengths P to count (comma-separated; 1 is added)")
    parser.add_argument("--python-rootfs", type=Path,
                        help="an emulated aarch64 Python (tools/qemu/arm_python.py build DIR): also count the runtime "
                             "run from Python on --python-backends")
    parser.add_argument("--python-backends", default="onnxruntime,native")
    parser.add_argument("--profile", action="store_true",
                        help="also say where each set's instructions per token go, by function (symbol_profile)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    if platform.machine() not in ("x86_64", "AMD64"):
        print("note: meant for an x86-64 host emulating aarch64", file=sys.stderr)
    ids = prompt_ids(args.bundle)
    passes = sorted({1, *(int(p) for p in args.passes.split(",") if p)}) if args.passes else []
    if passes and passes[-1] > len(ids):
        raise SystemExit(f"the prompt has {len(ids)} tokens: passes up to {len(ids)}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        example, plugin = build(Path(tmp))
        for kernels in args.kernels.split(","):
            runs = []
            for n in (args.decode, args.decode + args.extra):
                profile = Path(tmp) / f"profile-{kernels}-{n}.txt" if args.profile else None
                counts, tokens, seconds, _ = counted_example(example, plugin, args.cpu, args.bundle, kernels, n, ids,
                                                             profile=profile)
                runs.append((counts["instructions"], tokens, seconds, symbol_profile(profile) if profile else {}))
            (short, _, t0, by_short), (long, tokens, t1, by_long) = runs
            row = {"kernels": kernels, "instructions_short": short, "instructions_long": long,
                   "per_token": (long - short) / args.extra, "tokens": tokens, "qemu_seconds": t0 + t1}
            if args.profile:  # per token by function, the dearest 14
                per = {f: (by_long[f] - by_short.get(f, 0)) / args.extra for f in by_long}
                row["profile"] = sorted(((f, v) for f, v in per.items() if v > 0), key=lambda fv: -fv[1])[:14]
            if passes:
                one, _, _ = counted_run(example, plugin, args.cpu, args.bundle, kernels, 1, ids[:1])
                row["passes"] = {p: row["per_token"] + counted_run(example, plugin, args.cpu, args.bundle, kernels, 1,
                                                                   ids[:p])[0] - one for p in passes}
            rows.append(row)
            print(f"  {kernels}: {(long - short) / args.extra / 1e6:.1f} M instructions per token "
                  f"({t0 + t1:.0f} s under qemu)", file=sys.stderr)
        for backend in args.python_backends.split(",") if args.python_rootfs else []:
            library = example.parent / "lib" / "libedgeroute.so"
            runs = [counted_python_run(args.python_rootfs, plugin, library, args.cpu, args.bundle, backend, n, ids)
                    for n in (args.decode, args.decode + args.extra)]
            (short, _, t0, ran), (long, tokens, t1, _) = runs
            rows.append({"kernels": f"python: {backend} ({ran})", "instructions_short": short, "instructions_long": long,
                         "per_token": (long - short) / args.extra, "tokens": tokens, "qemu_seconds": t0 + t1})
            print(f"  python {backend} ({ran}): {(long - short) / args.extra / 1e6:.1f} M instructions per token "
                  f"({t0 + t1:.0f} s under qemu)", file=sys.stderr)
    generic = next((r for r in rows if r["kernels"] == "generic"), None)
    weights = weight_bytes_per_token(args.bundle)
    print(f"instructions retired per decoded token, qemu-aarch64 -cpu {args.cpu}, {args.bundle.name}, 1 thread, "
          f"fp16 cache, prompt of {len(ids)} tokens, (count({args.decode + args.extra}) - count({args.decode})) / "
          f"{args.extra}")
    width = max(10, *(len(r["kernels"]) for r in rows))
    print(f"{'kernels':<{width}} {'M instr/token':>14} {'vs generic':>11} {'same tokens':>12}")
    for r in rows:
        r["vs_generic"] = generic["per_token"] / r["per_token"] if generic else None
        r["same_tokens_as_first"] = r["tokens"] == rows[0]["tokens"]
        ratio = f"{r['vs_generic']:.2f}x" if generic else "-"
        print(f"{r['kernels']:<{width}} {r['per_token'] / 1e6:>14.1f} {ratio:>11} {str(r['same_tokens_as_first']):>12}")
    for r in (r for r in rows if "profile" in r):
        print(f"{r['kernels']}, M instructions per token by function:")
        for function, count in r["profile"]:
            print(f"  {count / 1e6:>8.1f}  {function}")
    if passes:
        print("one pass of P rows (prefill of P tokens, one logits row): M instructions, and per row")
        print(f"{'kernels':<10} " + " ".join(f"{'P=' + str(p):>16}" for p in passes))
        for r in (r for r in rows if "passes" in r):  # the C example's rows
            print(f"{r['kernels']:<10} " + " ".join(f"{r['passes'][p] / 1e6:>7.1f} ({r['passes'][p] / p / 1e6:>5.1f}/row)"
                                                   for p in passes))
    print(f"weights read per decoded token: {weights['total'] / 1e6:.1f} MB (layers {weights['layers'] / 1e6:.1f}, "
          f"head {weights['head'] / 1e6:.1f}, one embedding row {weights['embedding_row']} B)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"cpu": args.cpu, "bundle": str(args.bundle.name), "prompt_tokens": len(ids),
                                         "decode": args.decode, "extra": args.extra, "threads": 1, "kv": "float16",
                                         "weight_bytes_per_token": weights, "results": rows,
                                         "summary": summary(rows)}, indent=1) + "\n")


def summary(rows: list[dict]) -> dict:
    """What the docs quote: millions of instructions per token by kernel set, each set's ratio to
    the generic kernels, and in the emulated Python the native backend's to ONNX Runtime's."""
    per_token = {r["kernels"]: r["per_token"] for r in rows}
    result: dict = {"million_instructions_per_token": {k: round(v / 1e6, 1) for k, v in per_token.items()}}
    if "generic" in per_token:
        result["fewer_than_generic"] = {k: round(per_token["generic"] / v, 2) for k, v in per_token.items()
                                        if k != "generic"}
    in_python = {r["kernels"].split(" ")[1]: r["per_token"] for r in rows if r["kernels"].startswith("python: ")}
    if {"onnxruntime", "native"} <= in_python.keys():
        result["native_fewer_than_onnxruntime"] = round(in_python["onnxruntime"] / in_python["native"], 2)
    return result


if __name__ == "__main__":
    main()
