"""The TensorRT engine cache as the TensorRT backend reads it: the optimisation profiles and
their shape ranges, the cache keys (GPU, TensorRT version, bundle, build settings), and
:func:`find_engines`, which returns an entry's engines or says why it is stale. Building them is
the workstation side (:mod:`edgeroute.tensorrt.engines`, ``edgeroute build-engines``), which
writes what this module reads. Plain Python: no TensorRT import, tested without a GPU.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgeroute.bundle import Bundle, GraphEntry, attention_graph_name, sha256_file
from edgeroute.errors import EdgerouteError, InputError
from edgeroute.files import atomic_write
from edgeroute.runtime.memory import PREFILL_CHUNK

if TYPE_CHECKING:
    from edgeroute.runtime.profiles import Profile

PROFILES = ("prefill", "decode")  # the optimisation profiles, in their TensorRT index order
DIMENSIONS = ("tokens", "past", "total")  # the symbolic dimensions of the graphs' inputs (total = past + tokens)
DEFAULT_DECODE_TOKENS = 16  # one token, or a speculative verification pass (a draft of up to 8, + 1, with room)
DEFAULT_WORKSPACE_GIB = 1.0
META = "engines.json"
GIB = 1 << 30


@dataclass(frozen=True)
class EngineLimits:
    """What the engines must take: KV positions, and tokens per call in each profile."""

    context: int
    prefill_tokens: int
    decode_tokens: int
    workspace_bytes: int

    def check(self) -> None:
        if not (1 <= self.decode_tokens <= self.prefill_tokens and 1 <= self.prefill_tokens <= self.context):
            raise InputError(f"engine limits need 1 <= decode_tokens ({self.decode_tokens}) <= prefill_tokens "
                             f"({self.prefill_tokens}) <= context ({self.context}): fix the profile's 'engines' "
                             "or 'memory.default_context'")


def engine_limits(bundle: Bundle, profile: Profile) -> EngineLimits:
    """The device profile's limits: its context (at most the bundle's; the bundle's when it
    gives none) and its ``engines`` section (defaults: a prefill chunk, 16 decode tokens)."""
    bundle_context = int(bundle.generation["context_length"])
    context = min(profile.context_length or bundle_context, bundle_context)
    engines = profile.engines
    limits = EngineLimits(context, min(int(engines.get("prefill_tokens", PREFILL_CHUNK)), context),
                          int(engines.get("decode_tokens", DEFAULT_DECODE_TOKENS)),
                          int(float(engines.get("workspace_gib", DEFAULT_WORKSPACE_GIB)) * GIB))
    limits.check()
    return limits


Range = tuple[int, int, int]  # TensorRT's (min, opt, max) of one dimension


def dimension_ranges(limits: EngineLimits) -> dict[str, dict[str, Range]]:
    """Per optimisation profile, each symbolic dimension's (min, opt, max). The past runs from
    empty (the first prefill) to a full cache less a token; total = past + tokens never exceeds
    the context. Decode tunes for a cache half full."""
    c = limits.context
    prefill, decode = limits.prefill_tokens, limits.decode_tokens
    return {
        "prefill": {"tokens": (1, prefill, prefill), "past": (0, 0, c - 1), "total": (1, prefill, c)},
        "decode": {"tokens": (1, 1, decode), "past": (0, c // 2, c - 1), "total": (1, c // 2 + 1, c)},
    }


def input_shapes(graph: GraphEntry, ranges: dict[str, Range]) -> dict[str, tuple[tuple[int, ...], ...]]:
    """Each input's (min, opt, max) shapes in one profile, from its symbolic shape in the
    manifest; an input with a dimension the ranges do not know is an error naming it."""
    shapes = {}
    for spec in graph.inputs:
        dims = []
        for dim in spec["shape"]:
            if isinstance(dim, int):
                dims.append((dim, dim, dim))
            elif dim in ranges:
                dims.append(ranges[dim])
            else:
                raise EdgerouteError(f"graph {graph.name} input {spec['name']} has a dimension {dim!r} that no "
                                     f"optimisation profile sets (known: {', '.join(ranges)}): re-export the bundle")
        shapes[spec["name"]] = tuple(tuple(d[i] for d in dims) for i in range(3))
    return shapes


GRAPH_KINDS = ("embed", "layer", "attn", "mlp", "kv", "head")


def engine_graphs(bundle: Bundle, role: str, kinds: tuple[str, ...] = GRAPH_KINDS) -> list[GraphEntry]:
    """The graphs the runtime runs for ``role``'s model on the bundle's target: embed, head,
    and per layer the target's default attention variant, mlp and kv (``kinds``: only these;
    ``full`` decoding needs embed, layer and head). A bundle whose target is not TensorRT's is
    refused (its graphs hold what TensorRT's parser rejects)."""
    unknown = set(kinds) - set(GRAPH_KINDS)
    if unknown or not kinds:
        raise InputError(f"graph kinds {sorted(unknown) or 'none'}: choose from {', '.join(GRAPH_KINDS)}")
    if bundle.target.name != "tensorrt":
        raise InputError(f"bundle {bundle.path} was exported for --target {bundle.target.name}, whose graphs TensorRT "
                         f"cannot parse (`edgeroute inspect {bundle.path} --tensorrt` lists why): export it again with "
                         "--target tensorrt")
    entry = bundle.models[role]
    flavour, kv_dtype = bundle.target.attention_variants[0]
    names = [kind for kind in ("embed", "head") if kind in kinds]
    for i in range(entry.num_layers):
        names += [attention_graph_name(kind, i, flavour, kv_dtype) for kind in ("layer", "attn") if kind in kinds]
        names += [attention_graph_name(kind, i) for kind in ("mlp", "kv") if kind in kinds]
    return [entry.graphs[name] for name in names]


def bundle_hash(bundle: Bundle) -> str:
    """The sha256 over every listed file's path and sha256: any re-export or calibration changes it."""
    digest = hashlib.sha256()
    for rel, meta in sorted(bundle.manifest["files"].items()):
        digest.update(f"{rel}\0{meta['sha256']}\n".encode())
    return digest.hexdigest()


def choose_profile(tokens: int, limits: EngineLimits) -> int:
    """The optimisation profile (its index in PROFILES) a call over ``tokens`` new tokens runs
    in: decode up to ``decode_tokens`` (a step, a draft's verification), prefill beyond, up to
    ``prefill_tokens``; more is refused (the runtime runs long prompts in passes of at most that)."""
    if not 1 <= tokens <= limits.prefill_tokens:
        raise InputError(f"a call over {tokens} tokens is outside what the engines take (1..{limits.prefill_tokens}, "
                         "the prefill profile's limit): run longer inputs in passes, or rebuild the engines with a "
                         "profile of larger engines.prefill_tokens")
    return PROFILES.index("decode" if tokens <= limits.decode_tokens else "prefill")


@dataclass(frozen=True)
class CacheKey:
    gpu: str  # name and compute capability, e.g. "NVIDIA H200 (sm_90)"
    tensorrt: str  # TensorRT version
    bundle: str  # bundle_hash
    limits: EngineLimits
    precision: str = "strongly typed: fp16 activations, int4 weight-only (as the graphs say)"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:20]


def _slug(text: str) -> str:
    return "".join(ch if ch.isalnum() else "-" for ch in text).strip("-").lower()


class EngineCache:
    """Engines of one key under ``root/<digest>/``: ``engines.json`` (the key, the bundle's path,
    each engine file's sha256), written last, so an interrupted build leaves an entry that is
    never used. ``root`` may hold the engines of several bundles."""

    def __init__(self, root: Path, key: CacheKey, bundle_path: Path) -> None:
        self.root, self.key, self.bundle_path = Path(root), key, str(Path(bundle_path).resolve())
        self.directory = self.root / key.digest

    @property
    def timing_cache(self) -> Path:
        return self.root / f"timing-{_slug(self.key.gpu)}-{_slug(self.key.tensorrt)}.cache"

    def engine_path(self, graph: str) -> Path:
        return self.directory / f"{graph.replace('/', '__')}.engine"

    def recorded(self) -> dict[str, str]:
        """The engines (graph -> sha256) this entry records under this key; none where it has no
        record, or one under another key."""
        meta = _record(self.directory)
        return meta.get("engines", {}) if meta.get("key") == self.key.to_dict() else {}

    def _intact(self, graph: str, digest: str) -> bool:
        path = self.engine_path(graph)
        return path.is_file() and sha256_file(path) == digest

    def valid(self, graphs: list[str]) -> bool:
        """Whether every engine of ``graphs`` is there, under this key, intact."""
        engines = self.recorded()
        return all(graph in engines and self._intact(graph, engines[graph]) for graph in graphs)

    def stale_entries(self) -> list[Path]:
        """Other entries for the same bundle path: built from an older bundle there, or for
        another GPU, TensorRT or limits."""
        return [d for d in bundle_entries(self.root, self.bundle_path) if d != self.directory]

    def write_engine(self, graph: str, data: bytes) -> None:
        atomic_write(self.engine_path(graph), data)

    def commit(self, graphs: list[str]) -> None:
        """Record ``graphs`` (just written) beside the intact engines the entry already holds."""
        kept = {g: digest for g, digest in self.recorded().items() if g not in graphs and self._intact(g, digest)}
        meta = {"key": self.key.to_dict(), "bundle_path": self.bundle_path,
                "engines": {**kept, **{g: sha256_file(self.engine_path(g)) for g in graphs}},
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        atomic_write(self.directory / META, json.dumps(meta, indent=1))


def _record(entry: Path) -> dict[str, Any]:
    """An entry's engines.json (empty where it has none or cannot be read)."""
    try:
        return json.loads((entry / META).read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def bundle_entries(root: Path, bundle_path: str) -> list[Path]:
    """The entries under ``root`` recorded for the bundle at ``bundle_path`` (resolved)."""
    if not Path(root).is_dir():
        return []
    return sorted(d for d in Path(root).iterdir() if d.is_dir() and _record(d).get("bundle_path") == bundle_path)


def default_cache_root(bundle: Bundle) -> Path:
    """``.BUNDLE.engines`` beside the bundle."""
    return bundle.path.parent / f".{bundle.path.name}.engines"


def build_command(bundle: Bundle, role: str, cache_root: Path | None = None) -> str:
    """The ``edgeroute build-engines`` command line that builds every missing engine of ``role``
    (DEVICE: the device profile whose context and limits the engines take)."""
    command = f"edgeroute build-engines {bundle.path} --profile DEVICE"
    command += "" if role == "llm" else f" --role {role}"
    return command + ("" if cache_root is None else f" --cache {cache_root}")


def find_engines(bundle: Bundle, role: str, gpu: str, tensorrt: str, graphs: list[str],
                 cache_root: Path | None = None) -> EngineCache:
    """The cache entry that holds ``graphs`` (``role/name``, as built) of this bundle, built on
    ``gpu`` with TensorRT ``tensorrt``, intact: whatever limits it was built with (they are in
    its key). Without one, an InputError that says what is wrong (none built, built from
    another export of the bundle, for another GPU or TensorRT, some engines missing or damaged)
    and names the ``build-engines`` command."""
    root = Path(cache_root) if cache_root is not None else default_cache_root(bundle)
    command = build_command(bundle, role, cache_root)
    entries = bundle_entries(root, str(bundle.path.resolve()))
    if not entries:
        raise InputError(f"no TensorRT engines for the {role} model of {bundle.path} in {root}: build them on this "
                         f"GPU with `{command}`")
    reasons = []
    for entry in entries:
        recorded = _record(entry).get("key", {})
        try:
            limits = EngineLimits(**recorded["limits"])
        except (KeyError, TypeError):
            reasons.append(f"{entry.name}: no readable key")
            continue
        cache = EngineCache(root, CacheKey(gpu, tensorrt, bundle_hash(bundle), limits), bundle.path)
        if cache.directory == entry and cache.valid(graphs):
            return cache
        reasons.append(_why_stale(cache, recorded, entry, graphs))
    raise InputError(f"the TensorRT engines of {bundle.path} in {root} are stale ({'; '.join(reasons)}): rebuild them "
                     f"with `{command}`")


def _why_stale(cache: EngineCache, recorded: dict[str, Any], entry: Path, graphs: list[str]) -> str:
    expected = cache.key.to_dict()
    if recorded.get("bundle") != expected["bundle"]:
        return "built from another export of the bundle"
    for field, what in (("gpu", "GPU"), ("tensorrt", "TensorRT")):
        if recorded.get(field) != expected[field]:
            return f"built for {what} {recorded.get(field)}, this is {expected[field]}"
    if recorded != expected or cache.directory != entry:
        return "built under other settings"
    engines = cache.recorded()
    missing = [g for g in graphs if g not in engines]
    if missing:
        return f"{len(missing)} engines not built, e.g. {missing[0]}"
    return "an engine file was changed or damaged"


def gpu_identity() -> str:
    """The first GPU's name and compute capability (nvidia-smi), or a Jetson's model; an
    EdgerouteError where there is none."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout.splitlines()
        name, capability = (part.strip() for part in out[0].split(","))
        return f"{name} (sm_{capability.replace('.', '')})"
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        pass
    model = Path("/proc/device-tree/model")
    if model.is_file() and "jetson" in model.read_text(errors="replace").lower():
        return model.read_text(errors="replace").strip("\0 \n")
    raise EdgerouteError("no NVIDIA GPU found (nvidia-smi lists none, and this is no Jetson): engines are built on "
                         "the device that runs them")
