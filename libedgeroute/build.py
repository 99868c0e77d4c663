"""Builds libedgeroute: the one description of its sources and compiler flags.

Used by the package build (``setup.py``: ``pip install .`` and the wheel put the library in
``edgeroute/``), by ``make`` (the C tests, the example, sanitizer and cross builds) and by the
tests. Standard library only. The library holds every kernel set of its architecture, each
source compiled with its own instruction-set flags, and picks among them at run time
(``src/dispatch.c``), so one x86-64 binary runs on any x86-64 CPU and one aarch64 binary on any
aarch64 CPU.

    python libedgeroute/build.py OUT.so [--cc CC] [--arch x86_64|aarch64] [--sanitize[=address|thread]] [--fuzzer]
    python libedgeroute/build.py OUT.so --arch aarch64 --cc aarch64-linux-gnu-gcc --glibc 2.28 --openmp LIBGOMP

With ``--glibc``, the build of a manylinux wheel (``make wheels``, tools/wheels.py): the sources
are compiled as always (GCC: its OpenMP calls are libgomp's), then linked by zig's clang (PyPI
``ziglang``) against the symbol stubs of that glibc, so the library asks for no symbol version
newer than it, and against ``--openmp``, a libgomp built for an older glibc, copied beside the
library and found there (runpath ``$ORIGIN``) under its own name: a board image without
libgomp1 loads it, and another libgomp already in the process is not taken for it.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
INCLUDE = HERE / "include"
SOURCES = ["src/errors.c", "src/dispatch.c", "src/formats.c", "src/pack.c", "src/layer.c", "src/gguf.c",
           "src/model.c", "src/standalone.c", "src/digest.c", "src/kernels/generic/kernels.c"]
# per kernel set: its sources and the instruction sets they are compiled for
KERNEL_SETS = {
    "x86_64": {"src/kernels/x86/avx2.c": ["-march=x86-64-v3", "-mtune=generic"],
               "src/kernels/x86/avx512_vnni.c": ["-march=x86-64-v4", "-mavx512vnni", "-mtune=generic"]},
    # Armv8.0 NEON (every aarch64 core); SDOT + fp16 (Neoverse N1, Cortex-A78AE: Orin); and SMMLA
    "aarch64": {"src/kernels/arm/neon.c": ["-march=armv8-a"],
                "src/kernels/arm/dotprod.c": ["-march=armv8.2-a+dotprod+fp16"],
                "src/kernels/arm/i8mm.c": ["-march=armv8.2-a+dotprod+fp16+i8mm"]},
}
# -ffp-contract=off: the compiler would otherwise contract multiplies and adds into FMAs
# differently in a kernel's tile-size specializations, and a row's bits would depend on the
# pass's length (speculative decoding compares them). -fno-trapping-math: the library reads no
# floating-point exception flags; it lets GCC vectorize loops with float comparisons (the SwiGLU
# gate's clamped exponential) and changes no value
COMMON = ["-std=gnu11", "-O3", "-fPIC", "-fopenmp", "-fvisibility=hidden", "-ffp-contract=off", "-fno-trapping-math",
          "-Wall", "-Wno-unused-function", f"-I{INCLUDE}", f"-I{HERE / 'src'}"]
SANITIZE = ["-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"]
# ThreadSanitizer (the sessions-in-parallel test): it cannot be combined with AddressSanitizer
SANITIZE_THREAD = ["-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=thread"]
LIBRARY_NAME = "libedgeroute.so"


def host_arch() -> str:
    machine = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)


def find_compiler(cc: str | None = None) -> str:
    compiler = cc or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise SystemExit("building libedgeroute needs a C compiler with OpenMP (gcc): none found (set CC)")
    return compiler


def zig_cc() -> list[str]:
    """zig's C compiler: PyPI ``ziglang`` (the dev extra) in this Python, else ``zig`` on PATH."""
    try:
        import ziglang  # noqa: F401
    except ImportError:
        zig = shutil.which("zig")
        if zig is None:
            raise SystemExit("a --glibc build links with zig: pip install ziglang (the dev extra)") from None
        return [zig, "cc"]
    return [sys.executable, "-m", "ziglang", "cc"]


def compile_units(arch: str) -> list[tuple[Path, list[str]]]:
    if arch not in KERNEL_SETS:
        raise SystemExit(f"libedgeroute builds for {', '.join(KERNEL_SETS)}, not {arch}")
    units = [(HERE / source, []) for source in SOURCES]
    return units + [(HERE / source, flags) for source, flags in KERNEL_SETS[arch].items()]


def build(out: Path, cc: str | None = None, arch: str | None = None, sanitize: bool | str = False,
          extra: list[str] | None = None, quiet: bool = False, glibc: str | None = None,
          openmp: Path | None = None, plain_kernel_sets: bool = False) -> Path:
    """Compiles and links the library to ``out``; returns it. ``sanitize``: True or "address"
    (AddressSanitizer + UBSan), "thread" (ThreadSanitizer). ``glibc`` (e.g. "2.28", with
    ``openmp``: a libgomp whose file name is its soname): linked for that glibc, the libgomp copied
    beside ``out`` (see the module's docstring). ``plain_kernel_sets``: the SIMD kernel sets
    without the sanitizers and ``extra`` (the fuzzer's build: clang takes over 15 minutes and 5 GB
    on the AVX-512 set under them, and the fuzzer is after the file reader)."""
    compiler, arch = find_compiler(cc), arch or host_arch()
    if (glibc is None) != (openmp is None):
        raise SystemExit("--glibc and --openmp go together: the OpenMP runtime a portable library carries")
    sanitizers = {False: [], True: SANITIZE, "address": SANITIZE, "thread": SANITIZE_THREAD}[sanitize]
    flags = COMMON + sanitizers + (extra or [])
    simd_sources = {HERE / source for source in KERNEL_SETS.get(arch, {})}
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        objects = []
        for i, (source, own) in enumerate(compile_units(arch)):
            obj = Path(tmp) / f"{i}-{source.stem}.o"
            unit = COMMON if plain_kernel_sets and source in simd_sources else flags
            run([*shlex.split(compiler), *unit, *own, "-c", str(source), "-o", str(obj)], quiet)
            objects.append(str(obj))
        staged = Path(tmp) / LIBRARY_NAME
        if glibc is None:
            run([*shlex.split(compiler), *flags, "-shared", *objects, "-o", str(staged), "-lm"], quiet)
        else:  # -z defs: a symbol this glibc lacks fails the link instead of the load on the board
            run([*zig_cc(), "-target", f"{arch}-linux-gnu.{glibc}", "-shared", *objects, str(openmp), "-o", str(staged),
                 "-lm", "-Wl,-z,defs", "-Wl,-rpath,$ORIGIN"], quiet)
            shutil.copyfile(openmp, out.parent / openmp.name)
        os.replace(staged, out) if out.parent.stat().st_dev == staged.parent.stat().st_dev else shutil.move(staged, out)
    return out


def run(command: list[str], quiet: bool) -> None:
    if not quiet:
        print(" ".join(command), file=sys.stderr)
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)}\n{done.stderr}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--cc")
    parser.add_argument("--arch", choices=sorted(KERNEL_SETS))
    parser.add_argument("--sanitize", nargs="?", const="address", choices=("address", "thread"),
                        help="address: AddressSanitizer + UBSan (the default); thread: ThreadSanitizer (tests)")
    parser.add_argument("--fuzzer", action="store_true", help="clang's libFuzzer coverage (make fuzz-native)")
    parser.add_argument("--glibc", help="link for this glibc with zig (a manylinux wheel's library), e.g. 2.28")
    parser.add_argument("--openmp", type=Path, help="with --glibc: the libgomp to carry (its file name its soname)")
    args = parser.parse_args()
    extra = ["-fsanitize=fuzzer-no-link"] if args.fuzzer else None
    print(build(args.out, args.cc, args.arch, args.sanitize or False, extra, quiet=True, glibc=args.glibc,
                openmp=args.openmp, plain_kernel_sets=args.fuzzer))


if __name__ == "__main__":
    main()
