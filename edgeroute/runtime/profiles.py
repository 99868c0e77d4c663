"""Device and task profiles: data (JSON under ``profiles/``), not code.

A device profile chooses execution providers (and their options); a task profile chooses
decoding settings. ``--profile cpu,templated`` merges several, later ones winning.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgeroute.errors import InputError

PROFILE_DIRS = [Path(os.environ["EDGEROUTE_PROFILES"])] if os.environ.get("EDGEROUTE_PROFILES") else []
PROFILE_DIRS.append(Path(__file__).resolve().parents[2] / "profiles")


@dataclass
class Profile:
    names: list[str] = field(default_factory=list)
    providers: list[Any] | None = None  # names, or [name, {options}] pairs as onnxruntime takes them
    decoding: dict[str, Any] = field(default_factory=dict)


def _find(name: str) -> Path:
    path = Path(name)
    if path.suffix == ".json" and path.is_file():
        return path
    for root in PROFILE_DIRS:
        for candidate in root.glob(f"*/{name}.json"):
            return candidate
    known = sorted(p.stem for root in PROFILE_DIRS for p in root.glob("*/*.json"))
    raise InputError(f"profile {name!r} not found; known profiles: {', '.join(known) or 'none'}")


def load_profile(spec: str) -> Profile:
    profile = Profile()
    for name in [n.strip() for n in spec.split(",") if n.strip()]:
        path = _find(name)
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise InputError(f"profile {path} is not valid JSON: {err}") from err
        profile.names.append(data.get("name", name))
        if "providers" in data:
            profile.providers = [tuple(p) if isinstance(p, list) else p for p in data["providers"]]
        profile.decoding.update(data.get("decoding", {}))
    return profile
