"""Rotary position tables, computed once by the runtime and fed to the graphs.

The graphs take ``cos``/``sin`` of shape [T, 1, head_dim] (both halves, as transformers
builds them) for the T positions being run,
so the position encoding (incl. Llama 3 frequency scaling) lives in one numpy function
instead of in every layer graph.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None = None) -> np.ndarray:
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if not scaling or scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        return inv
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old_ctx / low, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        return np.where(medium, mid, scaled)
    raise ValueError(f"rope scaling {kind!r} is not supported (supported: default, linear, llama3)")


def rope_tables(positions: int, head_dim: int, theta: float,
                scaling: dict[str, Any] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin, float32 [positions, 1, head_dim]."""
    angles = np.outer(np.arange(positions, dtype=np.float64), inverse_frequencies(head_dim, theta, scaling))
    angles = np.concatenate([angles, angles], axis=1)
    return (np.cos(angles).astype(np.float32)[:, None, :], np.sin(angles).astype(np.float32)[:, None, :])
