"""The bundle: a directory of ONNX graphs plus ``manifest.json``, the only contract between
export and runtime (see docs/bundle-format.md). Standard library only: the device reads it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgeroute.arch import ArchConfig
from edgeroute.errors import BundleError

FORMAT_NAME = "edgeroute-bundle"
# 2: attention graphs come in flavours (``flavour`` per graph; ``*_ort`` graphs beside the
# portable ones); a version-1 bundle is a version-2 bundle with portable graphs only
FORMAT_VERSION = 2
OLDEST_FORMAT_VERSION = 1
PORTABLE = "portable"
MANIFEST = "manifest.json"
MODEL_ROLES = ("llm", "slm")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _flavour_suffix(flavour: str) -> str:
    return "" if flavour == PORTABLE else f"_{flavour}"


@dataclass(frozen=True)
class GraphEntry:
    name: str
    kind: str  # embed | attn | mlp | kv | head
    layer: int | None
    file: str
    inputs: list[dict[str, Any]]
    outputs: list[dict[str, Any]]
    flavour: str = PORTABLE  # portable (standard ops) | ort (ONNX Runtime contrib ops)


@dataclass(frozen=True)
class ModelEntry:
    role: str
    arch: ArchConfig
    graphs: dict[str, GraphEntry]
    quantization: dict[str, Any]
    source: dict[str, Any]

    @property
    def num_layers(self) -> int:
        return self.arch.num_layers

    def has_flavour(self, flavour: str) -> bool:
        """Whether every layer's attention graphs exist in ``flavour``."""
        return all(f"{kind}_{i:03d}{_flavour_suffix(flavour)}" in self.graphs
                   for kind in ("layer", "attn") for i in range(self.num_layers))

    def graph(self, kind: str, layer: int | None = None, flavour: str = PORTABLE) -> GraphEntry:
        name = (kind if layer is None else f"{kind}_{layer:03d}") + _flavour_suffix(flavour)
        if name not in self.graphs:
            raise BundleError(f"the {self.role} model has no graph {name!r}: the bundle was made by another "
                              "edgeroute version; export it again")
        return self.graphs[name]


class Bundle:
    """A verified bundle on disk. ``Bundle.open`` checks the format version and every file's
    size and sha256 against the manifest before anything else touches it."""

    def __init__(self, path: Path, manifest: dict[str, Any]) -> None:
        self.path = path
        self.manifest = manifest
        self.models: dict[str, ModelEntry] = {}
        for role, entry in manifest["models"].items():
            graphs = {g["name"]: GraphEntry(**g) for g in entry["graphs"]}
            self.models[role] = ModelEntry(role, ArchConfig.from_dict(entry["arch"]), graphs,
                                           entry["quantization"], entry["source"])

    @classmethod
    def open(cls, path: str | Path, verify: bool = True) -> Bundle:
        path = Path(path)
        if not path.exists():
            raise BundleError(f"bundle {path} does not exist: create one with `edgeroute export --out {path}`")
        manifest_path = path / MANIFEST
        if not manifest_path.is_file():
            raise BundleError(f"{path} is not a bundle (no {MANIFEST}); an interrupted export leaves no manifest: "
                              "export again")
        try:
            manifest = json.loads(manifest_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise BundleError(f"{manifest_path} is not valid JSON ({err}): the bundle is damaged, export again") from err
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
            raise BundleError(f"{manifest_path} is not an edgeroute bundle manifest")
        version = manifest.get("format_version")
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise BundleError(f"bundle format {version} is newer than this runtime ({FORMAT_VERSION}): "
                              "upgrade edgeroute or re-export with this version")
        if version < OLDEST_FORMAT_VERSION:
            raise BundleError(f"bundle format {version} is older than this runtime reads ({OLDEST_FORMAT_VERSION}): "
                              "re-export it")
        try:
            bundle = cls(path, manifest)
            bundle.check_files(hashes=verify)
        except (KeyError, TypeError, AttributeError, ValueError) as err:
            raise BundleError(f"{manifest_path} is malformed ({type(err).__name__}: {err}): the bundle is damaged, "
                              "export again") from err
        return bundle

    def check_files(self, hashes: bool = True) -> None:
        for rel, meta in self.manifest["files"].items():
            file = self.path / rel
            if not file.is_file():
                raise BundleError(f"bundle {self.path} is incomplete: {rel} is missing; export again")
            if file.stat().st_size != meta["bytes"]:
                raise BundleError(f"bundle file {rel} has {file.stat().st_size} bytes, the manifest says "
                                  f"{meta['bytes']}: the file is damaged; export again")
            if hashes and sha256_file(file) != meta["sha256"]:
                raise BundleError(f"bundle file {rel} fails its sha256 check: the file is damaged; export again")

    @property
    def llm(self) -> ModelEntry:
        return self.models["llm"]

    @property
    def slm(self) -> ModelEntry | None:
        return self.models.get("slm")

    @property
    def tokenizer(self) -> dict[str, Any]:
        return self.manifest["tokenizer"]

    @property
    def generation(self) -> dict[str, Any]:
        return self.manifest["generation"]

    def file(self, rel: str) -> Path:
        return self.path / rel

    def total_bytes(self, prefix: str = "") -> int:
        return sum(m["bytes"] for rel, m in self.manifest["files"].items() if rel.startswith(prefix))
