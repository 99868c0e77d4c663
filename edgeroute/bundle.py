"""The bundle: a directory of ONNX graphs plus ``manifest.json``, the only contract between
export and runtime (see docs/bundle-format.md). Standard library only: the device reads it.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from edgeroute.arch import ArchConfig
from edgeroute.errors import BundleError, EdgerouteError
from edgeroute.files import atomic_write
from edgeroute.kv_formats import KV_DTYPES
from edgeroute.skip_options import SkipOptions

FORMAT_NAME = "edgeroute-bundle"
# 2 added graph flavours (``flavour`` per graph; ``*_ort`` graphs beside the portable ones) and
# the optional calibration section; a version-1 bundle is a version-2 bundle with portable
# graphs only and no calibration. 3 added ``target`` (what the graphs were written for: a
# runtime that predates it would look for graphs a tensorrt bundle does not have); a version-2
# bundle reads as a version-3 bundle of target "onnxruntime". Target "native" (no graphs, every
# model's native weights) needed no new version: a runtime that predates it refuses the target
# by name ("upgrade edgeroute or re-export")
FORMAT_VERSION = 3
OLDEST_FORMAT_VERSION = 1
PORTABLE = "portable"
MANIFEST = "manifest.json"
MODEL_ROLES = ("llm", "slm")
CALIBRATION_DIR = "calibration"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


# -- the one writer -----------------------------------------------------------------------------


def model_section(arch: ArchConfig, source: dict[str, Any], quantization: dict[str, Any],
                  graphs: list[dict[str, Any]], head_vocab: dict[str, Any] | None = None,
                  native: NativeWeights | None = None) -> dict[str, Any]:
    """One model's manifest entry (``models.llm`` / ``models.slm``); ``head_vocab`` only for a
    reduced-vocabulary SLM head, ``native`` only where the native backend can run the model."""
    section = {"arch": arch.to_dict(), "source": source, "quantization": quantization, "graphs": graphs}
    if head_vocab is not None:
        section["head_vocab"] = head_vocab
    if native is not None:
        section["native"] = native.to_dict()
    return section


def build_manifest(*, edgeroute_version: str, created: str, opset: int, tokenizer: dict[str, Any],
                   generation: dict[str, Any], models: dict[str, dict[str, Any]],
                   files: dict[str, dict[str, Any]], target: str | None = None,
                   calibration: Calibration | None = None) -> dict[str, Any]:
    """The whole manifest, as export writes it (see docs/bundle-format.md); ``target`` None:
    the default target."""
    target = target or DEFAULT_TARGET
    unknown = set(models) - set(MODEL_ROLES)
    if unknown or "llm" not in models:
        raise ValueError(f"a bundle holds an 'llm' and optionally an 'slm' model (got {sorted(models)})")
    if target not in TARGETS:
        raise ValueError(f"target {target!r} is not one of {', '.join(TARGETS)}")
    manifest = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "edgeroute_version": edgeroute_version,
                "created": created, "opset": opset, "target": target, "tokenizer": tokenizer,
                "generation": generation, "models": models, "files": files}
    if calibration is not None:
        manifest["calibration"] = calibration.to_dict()
    return manifest


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    """Write ``manifest.json`` atomically: a temporary file, fsync, then rename over the old one."""
    atomic_write(directory / MANIFEST, json.dumps(manifest, indent=1, allow_nan=False))  # strict JSON


# -- the calibration section ---------------------------------------------------------------------


@dataclass(frozen=True)
class RouterCalibration:
    """How one light path (``ngram`` or ``slm``) is routed on this bundle: a baseline router
    by name, or a trained one (``file``: an ONNX graph, features -> probability of divergence),
    and the threshold fitted against the budget. A calibration keys them by light path, and
    verified routing's (``route_check="verified"``) as ``slm:verified``."""

    light: str
    router: str  # a baseline's name (entropy, top1, margin, ngram) or "trained"
    threshold: float
    file: str | None = None
    features: str | None = None  # the runtime's feature set the trained graph reads
    figures: dict[str, Any] = field(default_factory=dict)

    def check(self) -> None:
        if self.light not in ("ngram", "slm"):
            raise ValueError(f"light path {self.light!r}")
        if not 0.0 <= float(self.threshold) <= 1.0:
            raise ValueError(f"threshold {self.threshold} outside [0, 1]")
        if (self.router == "trained") != (self.file is not None and self.features is not None):
            raise ValueError(f"router {self.router!r} with file {self.file!r} and features {self.features!r}")


@dataclass(frozen=True)
class Calibration:
    """What ``edgeroute calibrate`` measured and chose: routers per light path, the decoding
    configuration per task profile (the fastest that met the budget), and provenance."""

    created: str
    edgeroute_version: str
    data_sha256: str  # of the calibration prompts and settings
    budget: dict[str, Any]  # tf_agreement, task_pass, bound (method, delta, value)
    routers: dict[str, RouterCalibration]
    profiles: dict[str, dict[str, Any]]  # task -> decoding overrides (mode, light, ...) + figures
    figures: dict[str, Any] = field(default_factory=dict)
    # fitted defaults of every mode: draft_confidence, draft_tokens + max_draft_tokens, skip, lookup_tree, slm_tree;
    # answer_memory: the file of answers speculation's lookup drafts from (edgeroute.runtime.answer_memory)
    decoding: dict[str, Any] = field(default_factory=dict)
    # the CPU the timings were taken on (edgeroute.cpu.cpu_signature); empty before it was recorded
    device: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Calibration:
        routers = {light: RouterCalibration(**entry) for light, entry in data["routers"].items()}
        for key, router in routers.items():
            router.check()
            if key.partition(":")[0] != router.light or key.partition(":")[2] not in ("", "verified"):
                raise ValueError(f"router entry {key!r} is for light path {router.light!r} (entries: the light path, "
                                 "or LIGHT:verified for verified routing)")
        profiles = data["profiles"]
        if not isinstance(profiles, dict) or not all(isinstance(p, dict) and "mode" in p for p in profiles.values()):
            raise ValueError("every task profile needs a 'mode'")
        confidence = data.get("decoding", {}).get("draft_confidence", 0.0)
        if not isinstance(confidence, (int, float)) or not 0.0 <= confidence < 1.0:
            raise ValueError(f"decoding.draft_confidence must be a number within [0, 1) (got {confidence!r})")
        lengths = [data.get("decoding", {}).get(key) for key in ("draft_tokens", "max_draft_tokens")]
        if lengths != [None, None] and not (all(isinstance(n, int) and not isinstance(n, bool) for n in lengths)
                                            and 1 <= lengths[0] <= lengths[1]):
            raise ValueError("decoding.draft_tokens and max_draft_tokens go together, as integers with "
                             f"1 <= draft_tokens <= max_draft_tokens (got {lengths[0]!r}, {lengths[1]!r})")
        device = data.get("device", {})
        if not (isinstance(device, dict) and isinstance(device.get("machine", ""), str)
                and isinstance(device.get("isa", []), list) and all(isinstance(f, str) for f in device.get("isa", []))
                and isinstance(device.get("backend", ""), str) and device.get("kv_dtype", "float32") in KV_DTYPES):
            raise ValueError("device must be {'machine': str, 'isa': [str, ...], 'backend': str, 'kv_dtype': "
                             f"{' | '.join(KV_DTYPES)}}} (got {device!r})")
        for key in ("lookup_tree", "slm_tree"):
            tree = data.get("decoding", {}).get(key)
            if tree is None:
                continue
            branches, nodes = (tree.get(k) if isinstance(tree, dict) else None
                               for k in ("draft_branches", "draft_tree_nodes"))
            whole = [isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in (branches, nodes)]
            if not (whole[0] and (nodes is None or whole[1])):
                raise ValueError(f"decoding.{key} must be {{'draft_branches': int >= 1, 'draft_tree_nodes': "
                                 f"int >= 1 or null}} (got {tree!r})")
        memory = data.get("decoding", {}).get("answer_memory")
        if memory is not None and not (isinstance(memory, str) and memory.startswith(f"{CALIBRATION_DIR}/")):
            raise ValueError(f"decoding.answer_memory must name a file under {CALIBRATION_DIR}/ (got {memory!r})")
        skip = data.get("decoding", {}).get("skip")
        if skip is not None:
            options = {k: v for k, v in skip.items() if k != "speed_vs_full"}
            try:
                SkipOptions(**options).validate(None)
            except (TypeError, EdgerouteError) as err:
                raise ValueError(f"decoding.skip is not a valid skip setting: {err}") from None
        return cls(**{**data, "routers": routers})


# the (flavour, KV cache dtype) variants of the attention graphs (layer_i, attn_i) an export
# writes; the first is the default, and an fp16 cache exists in the portable flavour only
ATTENTION_VARIANTS = ((PORTABLE, "float32"), ("ort", "float32"), (PORTABLE, "float16"))
@dataclass(frozen=True)
class Target:
    """What an export writes a bundle's graphs for (the manifest's ``target``). A new target is
    one more entry in ``TARGETS``; the export and the runtime read nothing else about it."""

    name: str
    description: str
    # the (flavour, KV cache dtype) variants of the attention graphs, the first the default
    attention_variants: tuple[tuple[str, str], ...]
    activations: str  # float32 | float16: what the graphs compute in (the residual stream stays float32)
    block_sizes: tuple[int, ...]  # the int4 block sizes it takes, the first the default
    # whether int4 blocks of a quantized source (GGUF, GPTQ checkpoint) are carried over exactly;
    # else they are re-blocked: re-quantized from their dequantized values
    # (and only then may the export write native weights: the GGUF's blocks as stored)
    carries_over: bool
    # whether int4 blocks quantized by the export (of float or dequantized weights) get a per-block
    # offset: min..max on the grid, an offset term beside a still symmetric DequantizeLinear
    offsets: bool
    # whether the bundle holds ONNX graphs; without them every model has native weights and only
    # the native backend runs it
    graphs: bool = True

    @property
    def kv_dtypes(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(kv for _, kv in self.attention_variants))


TARGETS = {
    "onnxruntime": Target("onnxruntime", "ONNX Runtime (CPU and GPU providers) and the native backend: quantized "
                          "sources carried over exactly", ATTENTION_VARIANTS, "float32", (32, 64, 128), True, False),
    # TensorRT 10's ONNX parser: see edgeroute/tensorrt/lint.py for the rules and their sources.
    # Offsets measured on SmolLM2 (re-blocked Q4_1, agreement with fp32): RTN b64 68.4% -> 77.0%
    "tensorrt": Target("tensorrt", "TensorRT 10 engines: int4 weight-only DequantizeLinear (symmetric, block 64 or "
                       "128), fp16 activations and KV cache, standard ops only; ONNX Runtime runs it too",
                       ((PORTABLE, "float16"),), "float16", (64, 128), False, True),
    # what a board that runs the native backend needs: the GGUF's blocks, the tokenizer and the
    # manifest (the pair: 1.0x its GGUFs, against 2.2x with the graphs beside them)
    "native": Target("native", "edgeroute's native backend only: the GGUF sources' blocks as stored, no ONNX graphs",
                     (), "float32", (32,), True, False, graphs=False),
}
DEFAULT_TARGET = "onnxruntime"


def bundle_target(name: str) -> Target:
    if name not in TARGETS:
        raise BundleError(f"the bundle's target {name!r} is not one this runtime knows ({', '.join(TARGETS)}): "
                          "upgrade edgeroute or re-export")
    return TARGETS[name]


def attention_graph_name(kind: str, layer: int | None, flavour: str = PORTABLE, kv_dtype: str = "float32") -> str:
    """``layer_003``, ``layer_003_ort``, ``layer_003_kv16``: a graph's name in the manifest."""
    name = kind if layer is None else f"{kind}_{layer:03d}"
    return name + ("" if flavour == PORTABLE else f"_{flavour}") + ("_kv16" if kv_dtype == "float16" else "")


@dataclass(frozen=True)
class GraphEntry:
    name: str
    kind: str  # embed | attn | mlp | kv | head
    layer: int | None
    file: str
    inputs: list[dict[str, Any]]
    outputs: list[dict[str, Any]]
    flavour: str = PORTABLE  # portable (standard ops) | ort (ONNX Runtime contrib ops)


# ggml formats of a native weight file (libedgeroute reads them): name -> (values, bytes) per block
NATIVE_FORMATS = {"F32": (1, 4), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q8_0": (32, 34),
                  "Q4_K": (256, 144), "Q6_K": (256, 210)}
NATIVE_ALIGNMENT = 64  # every tensor starts at a multiple of this offset


@dataclass(frozen=True)
class NativeTensor:
    format: str  # a NATIVE_FORMATS key
    shape: tuple[int, ...]  # (rows, cols) of a matrix (row-major blocks), (n,) of a vector
    offset: int
    bytes: int

    def check(self, name: str, file_bytes: int) -> None:
        if self.format not in NATIVE_FORMATS:
            raise ValueError(f"native tensor {name} has format {self.format!r}, not one of {', '.join(NATIVE_FORMATS)}")
        if len(self.shape) not in (1, 2) or min(self.shape) <= 0:
            raise ValueError(f"native tensor {name} has shape {list(self.shape)}: a vector or a matrix of positive sizes")
        values, block_bytes = NATIVE_FORMATS[self.format]
        cols = self.shape[-1]
        rows = self.shape[0] if len(self.shape) == 2 else 1
        if cols % values or self.bytes != rows * cols // values * block_bytes:
            raise ValueError(f"native tensor {name}: {self.bytes} bytes do not hold a {self.format} {self.shape}")
        if self.offset % NATIVE_ALIGNMENT or self.offset < 0 or self.offset + self.bytes > file_bytes:
            raise ValueError(f"native tensor {name} lies outside its file or is misaligned (offset {self.offset})")


@dataclass(frozen=True)
class NativeWeights:
    """A model's weights as the native backend reads them: GGUF blocks as stored in the source
    (llama's Q/K rows put back in rotate-half order), one file, tensors by GGUF name. The file
    is a GGUF (``container``) whose own header the C library reads; bundles written before it
    hold the bare blocks (no ``container``) and run on ONNX Runtime only."""

    file: str
    tensors: dict[str, NativeTensor]
    container: str | None = "gguf"

    def to_dict(self) -> dict[str, Any]:
        return {"file": self.file, "container": self.container, "alignment": NATIVE_ALIGNMENT,
                "tensors": {name: {**asdict(t), "shape": list(t.shape)} for name, t in self.tensors.items()}}

    @classmethod
    def from_dict(cls, data: dict[str, Any], files: dict[str, Any]) -> NativeWeights:
        if data["file"] not in files:
            raise ValueError(f"the native weight file {data['file']} is not listed in files")
        tensors = {name: NativeTensor(t["format"], tuple(int(v) for v in t["shape"]), int(t["offset"]), int(t["bytes"]))
                   for name, t in data["tensors"].items()}
        for name, tensor in tensors.items():
            tensor.check(name, int(files[data["file"]]["bytes"]))
        return cls(data["file"], tensors, data.get("container"))


@dataclass(frozen=True)
class ModelEntry:
    role: str
    arch: ArchConfig
    graphs: dict[str, GraphEntry]
    quantization: dict[str, Any]
    source: dict[str, Any]
    native: NativeWeights | None = None  # absent: the model runs on ONNX Runtime only
    target: Target = TARGETS[DEFAULT_TARGET]  # what the bundle's graphs were written for

    @property
    def num_layers(self) -> int:
        return self.arch.num_layers

    def has_attention(self, flavour: str, kv_dtype: str = "float32") -> bool:
        """Whether every layer's attention graphs exist in ``flavour`` with a ``kv_dtype`` cache."""
        return all(attention_graph_name(kind, i, flavour, kv_dtype) in self.graphs
                   for kind in ("layer", "attn") for i in range(self.num_layers))

    def graph(self, kind: str, layer: int | None = None, flavour: str = PORTABLE,
              kv_dtype: str = "float32") -> GraphEntry:
        name = attention_graph_name(kind, layer, flavour, kv_dtype)
        if name not in self.graphs:
            raise BundleError(f"the {self.role} model has no graph {name!r}: the bundle was made by another "
                              "edgeroute version; export it again")
        return self.graphs[name]


def check_manifest_sections(manifest: dict[str, Any], manifest_path: Path) -> None:
    """The sections the runtime and ``summary`` read without looking: present and of their
    types (a model's own entries are checked as they are read). ``Bundle.open`` checks a file's
    manifest; a manifest built in code is the caller's."""
    tokenizer, generation, models = manifest.get("tokenizer"), manifest.get("generation"), manifest.get("models")

    def whole(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 1

    def strings(section: Any, *keys: str) -> bool:
        return isinstance(section, dict) and all(isinstance(section.get(key), str) for key in keys)

    def described(entry: Any) -> bool:  # what inspect shows of a model
        return (isinstance(entry, dict) and strings(entry.get("source"), "name", "format", "sha256")
                and strings(entry.get("quantization"), "method", "head")
                and isinstance(entry["quantization"].get("formats", {}), dict))

    rules = (
        (strings(manifest, "edgeroute_version", "created") and whole(manifest.get("opset")),
         "edgeroute_version and created are strings, opset a whole number"),
        (isinstance(tokenizer, dict) and tokenizer.get("file") in manifest.get("files", {}),
         "tokenizer.file names a file that files lists"),
        (isinstance(generation, dict) and whole(generation.get("context_length"))
         and whole(generation.get("max_new_tokens")),
         "generation holds context_length and max_new_tokens, whole numbers of at least 1"),
        (isinstance(models, dict) and "llm" in models and set(models) <= set(MODEL_ROLES)
         and all(described(entry) for entry in models.values()),
         "models holds an 'llm' and optionally an 'slm' model, each with its source's name, format and sha256 "
         "and its quantization's method, head and formats"),
    )
    for holds, rule in rules:
        if not holds:
            raise BundleError(f"{manifest_path} is malformed ({rule}): the bundle is damaged, export again")


class Bundle:
    """A verified bundle on disk. ``Bundle.open`` checks the format version and every file's
    size and sha256 against the manifest before anything else touches it."""

    def __init__(self, path: Path, manifest: dict[str, Any]) -> None:
        self.path = path
        self.manifest = manifest
        # whether the files are checked: their sha256 at open (Bundle.open), the native weights'
        # digest when the native backend opens them (libedgeroute); False only where asked
        self.verify = True
        self.models: dict[str, ModelEntry] = {}
        self.target = bundle_target(manifest.get("target", DEFAULT_TARGET))
        for role, entry in manifest["models"].items():
            graphs = {g["name"]: GraphEntry(**g) for g in entry["graphs"]}
            native = NativeWeights.from_dict(entry["native"], manifest["files"]) if "native" in entry else None
            if native is None and not self.target.graphs:
                raise BundleError(f"the {role} model of {path} has neither ONNX graphs nor native weights "
                                  f"(target {self.target.name}): the bundle is damaged, export again")
            self.models[role] = ModelEntry(role, ArchConfig.from_dict(entry["arch"]), graphs,
                                           entry["quantization"], entry["source"], native, self.target)
        self.calibration = self._read_calibration(manifest.get("calibration"))

    def _read_calibration(self, data: Any) -> Calibration | None:
        if data is None:
            return None
        try:
            calibration = Calibration.from_dict(data)
        except (KeyError, TypeError, AttributeError, ValueError) as err:
            raise BundleError(f"the calibration section of {self.path / MANIFEST} is corrupt "
                              f"({type(err).__name__}: {err}): run `edgeroute calibrate {self.path}` again") from err
        named = [router.file for router in calibration.routers.values()] + [calibration.decoding.get("answer_memory")]
        for file in named:
            if file is not None and file not in self.manifest["files"]:
                raise BundleError(f"the calibration of {self.path} names {file}, which the manifest does "
                                  f"not list: run `edgeroute calibrate {self.path}` again")
        return calibration

    @classmethod
    def open(cls, path: str | Path, verify: bool = True) -> Bundle:
        """The bundle at ``path``, its manifest checked and (``verify``, the default) every file's
        sha256; ``verify=False`` (the opt-out: e.g. ``--no-verify``) checks sizes only, and the
        native backend then skips the weights' digest too."""
        if not isinstance(path, str | os.PathLike):
            raise BundleError(f"a bundle is a directory path, got {type(path).__name__} {path!r}")
        path = Path(path)
        if not path.exists():
            raise BundleError(f"bundle {path} does not exist: create one with `edgeroute export --out {path}`")
        manifest_path = path / MANIFEST
        if manifest_path.exists() and not manifest_path.is_file():  # a FIFO would block the read forever
            raise BundleError(f"{manifest_path} is not a regular file (a folder, FIFO or device): the bundle is "
                              "damaged, export again")
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
        if not isinstance(version, int) or isinstance(version, bool):
            raise BundleError(f"{manifest_path}: format_version {version!r} is not a whole number: the bundle is "
                              "damaged, export again")
        if version > FORMAT_VERSION:
            raise BundleError(f"bundle format {version} is newer than this runtime ({FORMAT_VERSION}): "
                              "upgrade edgeroute or re-export with this version")
        if version < OLDEST_FORMAT_VERSION:
            raise BundleError(f"bundle format {version} is older than this runtime reads ({OLDEST_FORMAT_VERSION}"
                              f"-{FORMAT_VERSION}): re-export it")
        try:
            check_manifest_sections(manifest, manifest_path)
            bundle = cls(path, manifest)
            bundle.verify = verify
            bundle.check_files(hashes=verify)
        except BundleError:
            raise
        except (KeyError, TypeError, AttributeError, ValueError) as err:
            raise BundleError(f"{manifest_path} is malformed ({type(err).__name__}: {err}): the bundle is damaged, "
                              "export again") from err
        return bundle

    def check_files(self, hashes: bool = True) -> None:
        for rel, meta in self.manifest["files"].items():
            file = self.path / rel
            if file.exists() and not file.is_file():  # never opened: a FIFO would block the read forever
                raise BundleError(f"bundle file {rel} is not a regular file (a folder, FIFO or device): the bundle "
                                  "is damaged; export again")
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

    def summary(self) -> dict[str, Any]:
        """What ``edgeroute inspect`` shows (and prints with ``--json``): the format, each model's
        shape, quantization, sizes and source, the generation defaults and the calibration."""
        m = self.manifest
        models = {role: {"family": e.arch.family, "layers": e.arch.num_layers, "hidden": e.arch.hidden_size,
                         "heads": e.arch.num_heads, "kv_heads": e.arch.num_kv_heads, "vocab": e.arch.vocab_size,
                         "quantization": e.quantization, "graphs": len(e.graphs),
                         "native_bytes": m["files"][e.native.file]["bytes"] if e.native else None,
                         "bytes": self.total_bytes(f"{role}/"), "source": e.source}
                  for role, e in self.models.items()}
        return {"path": str(self.path), "format_version": m["format_version"], "edgeroute_version": m["edgeroute_version"],
                "opset": m["opset"], "created": m["created"], "models": models, "generation": self.generation,
                "chat_template": bool(self.tokenizer.get("chat_format")),
                "calibration": self.calibration.to_dict() if self.calibration else None,
                "files": len(m["files"]), "bytes": self.total_bytes()}

    def with_calibration(self, calibration: Calibration, files: dict[str, bytes]) -> Bundle:
        """Write ``calibration`` (and its ``files``, e.g. router graphs, under ``calibration/``)
        into this bundle atomically: the files first under content-addressed names, then a new
        manifest renamed over the old one. A crash before the rename leaves the old bundle
        valid; files of an earlier calibration are removed afterwards."""
        listed = {rel: meta for rel, meta in self.manifest["files"].items()
                  if not rel.startswith(f"{CALIBRATION_DIR}/")}
        for rel, data in files.items():
            if not rel.startswith(f"{CALIBRATION_DIR}/"):
                raise ValueError(f"calibration files live under {CALIBRATION_DIR}/ (got {rel})")
            atomic_write(self.path / rel, data)
            listed[rel] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        manifest = {**self.manifest, "format_version": FORMAT_VERSION, "files": listed,
                    "calibration": calibration.to_dict()}
        write_manifest(self.path, manifest)
        for stale in (self.path / CALIBRATION_DIR).glob("*"):
            if f"{CALIBRATION_DIR}/{stale.name}" not in listed:
                stale.unlink()
        return Bundle.open(self.path, verify=False)
