"""Instructions retired and bytes fetched from memory per decoded token on emulated Arm CPUs:
libedgeroute's native kernels against llama.cpp's own aarch64 build, on the same GGUFs.

The method of tools/arm_instruction_counts.py (whose helpers this uses): one thread, greedy, an
fp16 KV cache, the bundle's prompt ids, per decoded token = (count(N + K) - count(N)) / K under
``qemu-aarch64 -cpu CPU`` with tools/qemu/insn_count.c, here also following every load and
store through a simulated last-level cache (``--cache``, 4 MiB by default) so that the bytes a
decode step fetches from memory are measured rather than computed from the file.

For each CPU model the native side runs the kernel set ``auto`` takes there (cortex-a57: neon,
neoverse-n1: dotprod, max: i8mm) through examples/c/generate.c on the bundle's native weights;
llama.cpp runs tools/qemu/llama_greedy.c against libllama on the GGUF the bundle was exported
from (the tool checks that its blocks are the bundle's), its CPU backend cross-built with
``GGML_CPU_ARM_ARCH`` for that CPU (armv8-a / armv8.2-a+dotprod+fp16 /
armv8.6-a+dotprod+fp16+i8mm: what llama.cpp's own ARM variants take there, without SVE). The
llama.cpp source tree is an argument (``pip download llama-cpp-python --no-deps --no-binary
:all:`` vendors one under vendor/llama.cpp); its builds are kept under ``--build-dir``.

    python tools/arm_llama_cpp_peer.py --llama-cpp build-native/llama.cpp-src \\
        [--model smollm2=bundles/smollm2-demo:4:8] [--model qwen2.5-coder-1.5b=bundles/qwen-pair:2:2] \\
        [--cpus cortex-a57,neoverse-n1,max] [--cache 4194304] [--profile-cpu neoverse-n1]
        [--json OUT.json] [--markdown OUT.md]

With ``--profile-cpu`` it also counts, on that CPU model, where each side's instructions per token
go by function (the plugin's block profile, named through the libraries' symbol tables).
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import arm_instruction_counts as arm  # noqa: E402

REPO = arm.REPO
# CPU model -> (the native kernel set auto takes there, llama.cpp's -march for its CPU backend)
CPUS = {
    "cortex-a57": ("neon", "armv8-a"),
    "neoverse-n1": ("dotprod", "armv8.2-a+dotprod+fp16"),
    "max": ("i8mm", "armv8.6-a+dotprod+fp16+i8mm"),
}
# what llama.cpp's system info must say for each -march (its compile-time CPU features)
FEATURES = {"armv8-a": {"DOTPROD": "0", "MATMUL_INT8": "0"},
            "armv8.2-a+dotprod+fp16": {"DOTPROD": "1", "MATMUL_INT8": "0"},
            "armv8.6-a+dotprod+fp16+i8mm": {"DOTPROD": "1", "MATMUL_INT8": "1"}}
DEFAULT_MODELS = ["smollm2=bundles/smollm2-demo:4:8", "qwen2.5-coder-1.5b=bundles/qwen-pair:2:2"]
TOOLCHAIN = """set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
"""


def build_llama_cpp(source: Path, root: Path, marches: list[str], jobs: int = 2) -> dict[str, Path]:
    """llama.cpp cross-built for aarch64: libllama once (with the first -march), and for each
    -march its ggml libraries (the CPU backend is the only part -march changes). Returns the
    library folder per -march; run with LD_LIBRARY_PATH=<that folder>:<the first one's>."""
    arm.need("aarch64-linux-gnu-g++")
    root.mkdir(parents=True, exist_ok=True)
    toolchain = root / "aarch64-toolchain.cmake"
    if not toolchain.exists() or toolchain.read_text() != TOOLCHAIN:
        toolchain.write_text(TOOLCHAIN)
    folders = {}
    for i, march in enumerate(marches):
        tree = root / f"llama-{march.replace('+', '_')}"
        if not (tree / "build.ninja").exists():
            subprocess.run(["cmake", "-S", str(source), "-B", str(tree), "-G", "Ninja",
                            f"-DCMAKE_TOOLCHAIN_FILE={toolchain}", "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF",
                            f"-DGGML_CPU_ARM_ARCH={march}", "-DBUILD_SHARED_LIBS=ON", "-DGGML_OPENMP=OFF",
                            "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=OFF",
                            "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_CURL=OFF"], check=True, stdout=subprocess.DEVNULL)
        subprocess.run(["ninja", "-C", str(tree), f"-j{jobs}", "llama" if i == 0 else "ggml"], check=True,
                       stdout=subprocess.DEVNULL)
        folders[march] = tree / "bin"
    return folders


def build_driver(source: Path, base: Path, out: Path) -> Path:
    """tools/qemu/llama_greedy.c linked against the first tree's libllama."""
    subprocess.run([arm.need("aarch64-linux-gnu-gcc"), "-std=gnu11", "-O2", f"-I{source / 'include'}",
                    f"-I{source / 'ggml' / 'include'}", str(REPO / "tools" / "qemu" / "llama_greedy.c"), "-o", str(out),
                    f"-L{base}", "-lllama", "-lggml", "-lggml-base"], check=True)
    return out


def llama_cpp_run(driver: Path, plugin: Path, cpu: str, folders: list[Path], gguf: Path, march: str, tokens: int,
                  ids: list[int], cache: int, profile: Path | None = None) -> tuple[dict[str, int], list[int], float, str]:
    """counted() of one llama_greedy run, checked to have run the CPU backend built for ``march``."""
    counts, out, err, seconds = arm.counted(plugin, cpu, driver, [str(gguf), str(tokens), *map(str, ids)],
                                            {"LD_LIBRARY_PATH": ":".join(map(str, folders))}, cache, profile)
    info = dict(re.findall(r"(\w+) = (\w+)", next((line for line in err.splitlines() if line.startswith("system_info")), "")))
    if any(info.get(k, "0") != v for k, v in FEATURES[march].items()):
        raise SystemExit(f"asked for llama.cpp's {march} CPU backend, it reports {info}")
    return counts, [int(t) for t in out.split()], seconds, err


def repacked(err: str) -> dict[str, int]:
    """llama.cpp's repacking as its log says: {"q4_K -> q4_K_8x4": tensors, ...}."""
    kinds = collections.Counter()
    for _name, kind in re.findall(r"repack tensor (\S+) with (\S+)", err):
        kinds[f"{kind.rsplit('_', 1)[0]} -> {kind}"] += 1
    return dict(kinds)


def same_blocks(bundle: Path, gguf: Path) -> bool:
    """Whether the bundle's native weights hold the GGUF's blocks (names, types and bytes)."""
    import gguf as gg

    def blocks(path: Path) -> dict[str, tuple[str, int]]:
        return {t.name: (t.tensor_type.name, int(t.n_bytes)) for t in gg.GGUFReader(str(path)).tensors}

    return blocks(bundle / "llm" / "native.bin") == blocks(gguf)


def native_profile_run(example: Path, plugin: Path, cpu: str, bundle: Path, kernels: str, ids: list[int], tokens: int,
                       profile: Path):
    return arm.counted_example(example, plugin, cpu, bundle, kernels, tokens, ids, profile=profile)


def profiled(run, decode: int, extra: int, folder: Path, top: int = 14) -> list[tuple[str, float]]:
    """Instructions per decoded token by function, the ``top`` dearest: run(tokens, profile=path)
    twice (N and N + K tokens) and the difference of each function's count / K."""
    runs = []
    for n in (decode, decode + extra):
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"profile-{n}.txt"
        run(tokens=n, profile=path)
        runs.append(arm.symbol_profile(path))
    per = {k: (runs[1].get(k, 0) - runs[0].get(k, 0)) / extra for k in runs[1]}
    return sorted(((k, v) for k, v in per.items() if v > 0), key=lambda kv: -kv[1])[:top]


def per_token(short: dict[str, int], long: dict[str, int], extra: int) -> dict[str, float]:
    return {k: (long[k] - short[k]) / extra for k in short}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp", type=Path, required=True, help="a llama.cpp source tree")
    parser.add_argument("--build-dir", type=Path, default=REPO / "build-native")
    parser.add_argument("--model", action="append",
                        help="NAME=BUNDLE:N:K, NAME a source `edgeroute sources` (or smollm2) resolves to the GGUF "
                             f"the bundle was exported from; N, K as in arm_instruction_counts (default {DEFAULT_MODELS})")
    parser.add_argument("--native-dir", type=Path, help="where the aarch64 libedgeroute is built (default: "
                                                         "BUILD_DIR/arm-native)")
    parser.add_argument("--cpus", default=",".join(CPUS))
    parser.add_argument("--cache", type=int, default=4 << 20, help="bytes of the simulated last-level cache")
    parser.add_argument("--jobs", type=int, default=2, help="parallel compile jobs of the llama.cpp builds")
    parser.add_argument("--profile-cpu", help="also count, on this CPU model, where each side's instructions per "
                                             "token go, by function (two more runs each)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path, help="write the table here too")
    args = parser.parse_args()
    from edgeroute.export.sources import resolve_source

    cpus = args.cpus.split(",")
    started = time.perf_counter()
    marches = list(dict.fromkeys(CPUS[c][1] for c in ["cortex-a57", *cpus]))  # the armv8-a tree holds libllama
    folders = build_llama_cpp(args.llama_cpp, args.build_dir, marches, args.jobs)
    base = folders[marches[0]]
    driver = build_driver(args.llama_cpp, base, args.build_dir / "llama_greedy")
    example, plugin = arm.build(args.native_dir or args.build_dir / "arm-native")
    rows = []
    for spec in args.model or DEFAULT_MODELS:
        name, rest = spec.split("=", 1)
        bundle, decode, extra = rest.rsplit(":", 2)
        bundle, decode, extra = Path(bundle), int(decode), int(extra)
        if not bundle.is_absolute():
            bundle = REPO / bundle
        gguf = resolve_source(name)
        if not same_blocks(bundle, gguf):
            raise SystemExit(f"{bundle}'s native weights are not {gguf}'s blocks: re-export the bundle from {name}")
        ids = arm.prompt_ids(bundle)
        weights = arm.weight_bytes_per_token(bundle)
        for cpu in cpus:
            kernels, march = CPUS[cpu]
            runs = [arm.counted_example(example, plugin, cpu, bundle, kernels, n, ids, args.cache)
                    for n in (decode, decode + extra)]
            native = per_token(runs[0][0], runs[1][0], extra)
            native_tokens = runs[1][1]
            lruns = [llama_cpp_run(driver, plugin, cpu, [folders[march], base], gguf, march, n, ids, args.cache)
                     for n in (decode, decode + extra)]
            llama = per_token(lruns[0][0], lruns[1][0], extra)
            row = {"model": name, "gguf": gguf.name, "cpu": cpu, "native_kernels": kernels, "llama_cpp_march": march,
                   "decode": decode, "extra": extra, "prompt_tokens": len(ids), "weight_bytes_per_token": weights["total"],
                   "native": native, "llama_cpp": llama, "native_tokens": native_tokens, "llama_cpp_tokens": lruns[1][1],
                   "llama_cpp_repacked": repacked(lruns[0][3]),
                   "instructions_ratio": llama["instructions"] / native["instructions"],
                   "fetched_ratio": native["cache_miss_bytes"] / llama["cache_miss_bytes"],
                   "qemu_seconds": sum(r[2] for r in runs + lruns)}
            if cpu == args.profile_cpu:
                folder = args.build_dir / "profiles" / f"{name}-{cpu}"
                folder.mkdir(parents=True, exist_ok=True)
                row["native_profile"] = profiled(
                    functools.partial(native_profile_run, example, plugin, cpu, bundle, kernels, ids), decode, extra,
                    folder / "native")
                row["llama_cpp_profile"] = profiled(
                    functools.partial(llama_cpp_run, driver, plugin, cpu, [folders[march], base], gguf, march,
                                      ids=ids, cache=0), decode, extra, folder / "llama-cpp")
            rows.append(row)
            print(f"  {name} {cpu}: native {kernels} {native['instructions'] / 1e6:.1f} M, llama.cpp {march} "
                  f"{llama['instructions'] / 1e6:.1f} M instructions per token; fetched "
                  f"{native['cache_miss_bytes'] / 1e6:.1f} / {llama['cache_miss_bytes'] / 1e6:.1f} MB "
                  f"({row['qemu_seconds']:.0f} s under qemu)", file=sys.stderr)
    table = markdown(rows, args.cache) + profiles(rows)
    print(table)
    elapsed = time.perf_counter() - started
    print(f"({elapsed:.0f} s in all, builds included)", file=sys.stderr)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"threads": 1, "kv": "float16", "cache_bytes": args.cache,
                                         "cache": "64-byte lines, 16 ways, LRU", "results": rows}, indent=1) + "\n")
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(table)


def markdown(rows: list[dict], cache: int) -> str:
    lines = ["| model | CPU | native set | llama.cpp -march | M instr/token native | llama.cpp | llama.cpp / native "
             "| MB fetched/token native | llama.cpp | native / llama.cpp | weights MB | same tokens |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        n, lc = r["native"], r["llama_cpp"]
        lines.append(f"| {r['model']} | {r['cpu']} | {r['native_kernels']} | {r['llama_cpp_march']} "
                     f"| {n['instructions'] / 1e6:.1f} | {lc['instructions'] / 1e6:.1f} | {r['instructions_ratio']:.2f}x "
                     f"| {n['cache_miss_bytes'] / 1e6:.1f} | {lc['cache_miss_bytes'] / 1e6:.1f} | {r['fetched_ratio']:.3f} "
                     f"| {r['weight_bytes_per_token'] / 1e6:.1f} | {r['native_tokens'] == r['llama_cpp_tokens']} |")
    return "\n".join(lines) + f"\n\n(MB fetched: 64-byte lines missing a simulated {cache >> 20} MiB 16-way LRU cache)\n"


def profiles(rows: list[dict]) -> str:
    out = []
    for r in (r for r in rows if "native_profile" in r):
        out.append(f"\nWhere the instructions per token go, {r['model']} on {r['cpu']} (M instructions per token, "
                   f"by function):\n\n| native {r['native_kernels']} | M | llama.cpp {r['llama_cpp_march']} | M |\n"
                   f"|---|---:|---|---:|")
        a, b = r["native_profile"], r["llama_cpp_profile"]
        for i in range(max(len(a), len(b))):
            left = f"`{a[i][0]}` | {a[i][1] / 1e6:.1f}" if i < len(a) else " | "
            right = f"`{b[i][0]}` | {b[i][1] / 1e6:.1f}" if i < len(b) else " | "
            out.append(f"| {left} | {right} |")
    return "\n".join(out) + ("\n" if out else "")


if __name__ == "__main__":
    main()
