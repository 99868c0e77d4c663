"""Device and task profiles: data (JSON), not code, validated when loaded.

A device profile chooses execution providers (and their options), may choose the attention
graphs' flavour (``attention``: auto, portable or ort, see ``OrtModel``) and the KV caches'
element type (``kv_dtype``: auto, float32, float16 or int8) and the threads (``threads``: the
board's cores, used where the caller sets none), and may declare the memory the process can
use, the device's default context and its memory bandwidth (``memory.bandwidth_gbs``, the
published peak that ``edgeroute bench`` holds decode against), and the TensorRT engines' limits
(``engines``: tokens per prefill and per decode call, build workspace; see
edgeroute/tensorrt/engines.py); a task profile chooses decoding settings.
``--profile jetson-orin-nano-8gb,templated`` merges several, later ones winning; a profile
may ``extend`` another.

Where they are found, first match wins: ``$EDGEROUTE_PROFILES``, the package's own copy
(``edgeroute/profiles/`` in an installed wheel: setuptools maps the repository's top-level
``profiles/`` there), and the top-level ``profiles/`` of a source checkout.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgeroute.errors import InputError
from edgeroute.kv_formats import KV_DTYPE_CHOICES
from edgeroute.runtime.attention import ATTENTION_CHOICES
from edgeroute.runtime.decoding import DecodeOptions

if TYPE_CHECKING:
    from importlib.abc import Traversable

GIB = 1 << 30
FIELDS = {"name": str, "description": str, "extends": str, "providers": list, "attention": str, "kv_dtype": str,
          "decoding": dict, "memory": dict, "engines": dict, "threads": int}
MEMORY_FIELDS = {"usable_gib": (int, float), "default_context": int, "bandwidth_gbs": (int, float), "note": str}
ENGINE_FIELDS = {"prefill_tokens": int, "decode_tokens": int, "workspace_gib": (int, float)}


@dataclass
class Profile:
    names: list[str] = field(default_factory=list)
    providers: list[Any] | None = None  # names, or [name, {options}] pairs as onnxruntime takes them
    attention: str = "auto"  # the attention graphs' flavour
    kv_dtype: str = "auto"  # the KV caches' element type (auto: the backend's default)
    decoding: dict[str, Any] = field(default_factory=dict)
    memory_budget: int | None = None  # bytes the process may use (CPU and GPU share it on Jetson)
    context_length: int | None = None  # the device's default context
    bandwidth_gbs: float | None = None  # the device's peak memory bandwidth, GB/s (1e9 bytes)
    threads: int | None = None  # the device's cores (None: every core the OS lists)
    engines: dict[str, Any] = field(default_factory=dict)  # TensorRT engine limits (ENGINE_FIELDS)


def profile_roots() -> list[Traversable]:
    roots: list[Traversable] = []
    if os.environ.get("EDGEROUTE_PROFILES"):
        roots.append(Path(os.environ["EDGEROUTE_PROFILES"]))
    packaged = resources.files("edgeroute") / "profiles"
    checkout = Path(__file__).resolve().parents[2] / "profiles"
    roots += [root for root in (packaged, checkout) if root.is_dir()]
    return roots


def known_profiles() -> dict[str, Traversable]:
    """Profile name -> file, over every root (kind folders: devices/, tasks/)."""
    found: dict[str, Traversable] = {}
    for root in profile_roots():
        for kind in sorted((k for k in root.iterdir() if k.is_dir()), key=lambda k: k.name):
            for file in sorted((f for f in kind.iterdir() if f.name.endswith(".json")), key=lambda f: f.name):
                found.setdefault(file.name[:-len(".json")], file)
    return found


def _find(name: str) -> Traversable:
    path = Path(name)
    if path.suffix == ".json" and path.is_file():
        return path
    known = known_profiles()
    if name not in known:
        raise InputError(f"profile {name!r} not found; known profiles: {', '.join(sorted(known)) or 'none'}")
    return known[name]


def _check_providers(providers: list[Any], source: str) -> None:
    for p in providers:
        pair = isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], dict)
        if not (isinstance(p, str) or pair):
            raise InputError(f"profile {source}: provider {p!r} must be a name or a [name, {{options}}] pair")


def _check_memory(memory: dict[str, Any], source: str) -> None:
    for key, value in memory.items():
        if key not in MEMORY_FIELDS:
            raise InputError(f"profile {source}: unknown memory key {key!r} (known: {', '.join(MEMORY_FIELDS)})")
        if not isinstance(value, MEMORY_FIELDS[key]) or isinstance(value, bool):
            raise InputError(f"profile {source}: memory.{key} has the wrong type ({value!r})")
    # NaN passes every comparison, and infinity is no memory size: both are refused by name
    if not 0 < memory.get("usable_gib", 1) < math.inf or memory.get("default_context", 1) < 1:
        raise InputError(f"profile {source}: memory.usable_gib must be a finite number > 0 and "
                         f"memory.default_context >= 1 (got {memory})")
    if not 0 < memory.get("bandwidth_gbs", 1) < math.inf:
        raise InputError(f"profile {source}: memory.bandwidth_gbs must be a finite number > 0 "
                         f"(got {memory['bandwidth_gbs']})")


def _check_engines(engines: dict[str, Any], source: str) -> None:
    for key, value in engines.items():
        if key not in ENGINE_FIELDS:
            raise InputError(f"profile {source}: unknown engines key {key!r} (known: {', '.join(ENGINE_FIELDS)})")
        if not isinstance(value, ENGINE_FIELDS[key]) or isinstance(value, bool) or value <= 0:
            raise InputError(f"profile {source}: engines.{key} must be a positive number (got {value!r})")


def validate_profile(data: Any, source: str) -> None:
    """Raise an InputError naming the file, the key and the value when a profile is malformed."""
    if not isinstance(data, dict):
        raise InputError(f"profile {source} must be a JSON object")
    for key, value in data.items():
        if key not in FIELDS:
            raise InputError(f"profile {source}: unknown key {key!r} (known: {', '.join(FIELDS)})")
        if not isinstance(value, FIELDS[key]) or (FIELDS[key] is int and isinstance(value, bool)):
            raise InputError(f"profile {source}: {key!r} must be a JSON {FIELDS[key].__name__} (got {value!r})")
    if data.get("threads", 1) < 1:
        raise InputError(f"profile {source}: threads must be >= 1 (got {data['threads']})")
    _check_providers(data.get("providers", []), source)
    if data.get("attention", "auto") not in ATTENTION_CHOICES:
        raise InputError(f"profile {source}: attention {data['attention']!r} is not one of "
                         f"{', '.join(ATTENTION_CHOICES)}")
    if data.get("kv_dtype", "auto") not in KV_DTYPE_CHOICES:
        raise InputError(f"profile {source}: kv_dtype {data['kv_dtype']!r} is not one of "
                         f"{', '.join(KV_DTYPE_CHOICES)}")
    _check_memory(data.get("memory", {}), source)
    _check_engines(data.get("engines", {}), source)


def _check_decoding(decoding: dict[str, Any], source: str) -> None:
    """The decoding options (merged over those of the profile it extends) as DecodeOptions
    checks them without a bundle: a wrong value fails here, naming the file, not when an engine
    starts with it."""
    try:
        DecodeOptions().updated(**decoding).check()
    except (InputError, TypeError) as err:
        raise InputError(f"profile {source}: decoding: {err}") from err


def _read(name: str, seen: tuple[str, ...] = ()) -> dict[str, Any]:
    """One profile's data, validated, with the profile it extends merged underneath."""
    if name in seen:
        raise InputError(f"profile {name!r} extends itself (through {' -> '.join(seen)})")
    file = _find(name)
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise InputError(f"profile {file} is not valid JSON: {err}") from err
    validate_profile(data, str(file))
    if "extends" in data:
        data = _merged(_read(data["extends"], (*seen, name)), data)
    _check_decoding(data.get("decoding", {}), str(file))
    return data


def _merged(base: dict[str, Any], data: dict[str, Any]) -> dict[str, Any]:
    """A profile's data over the data of the profile it extends (the dicts merged key by key)."""
    merged = {**base, **data}
    for key in ("decoding", "memory", "engines"):
        merged[key] = {**base.get(key, {}), **data.get(key, {})}
    return merged


def load_profile(spec: str) -> Profile:
    """The profiles ``spec`` names (comma-separated), merged in order; their decoding options
    are checked together too (each may be valid alone and conflict with another's)."""
    profile = Profile()
    names = [n.strip() for n in spec.split(",") if n.strip()]
    for name in names:
        data = _read(name)
        profile.names.append(data.get("name", name))
        if "providers" in data:
            profile.providers = [tuple(p) if isinstance(p, list) else p for p in data["providers"]]
        profile.attention = data.get("attention", profile.attention)
        profile.kv_dtype = data.get("kv_dtype", profile.kv_dtype)
        profile.threads = data.get("threads", profile.threads)
        profile.decoding.update(data.get("decoding", {}))
        profile.engines.update(data.get("engines", {}))
        memory = data.get("memory", {})
        if "usable_gib" in memory:
            profile.memory_budget = int(memory["usable_gib"] * GIB)
        if "default_context" in memory:
            profile.context_length = memory["default_context"]
        if "bandwidth_gbs" in memory:
            profile.bandwidth_gbs = float(memory["bandwidth_gbs"])
    if len(names) > 1:
        _check_decoding(profile.decoding, " + ".join(str(_find(name)) for name in names) + " combined")
    return profile
