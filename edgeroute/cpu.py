"""The CPU a calibration's timings were taken on, and whether this one is of the same kind.

``edgeroute calibrate`` fits choices to measured timings (the draft length, the configuration
``--mode auto`` picks per task), and those timings move with the instruction sets the kernels
use: on 2 cores a verification row of the Qwen 1.5B cost 20 ms with AVX2 and 6-8 ms with
AVX-512 VNNI, which turned the fitted drafts from 1 token into 2-3. So the calibration records
the machine and the speed-relevant instruction sets, and the runtime warns when a bundle runs
on a CPU that differs in them (the quality budget still holds there; only "fastest" may not).
"""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

# instruction sets that change which int8 / int4 / float kernels ONNX Runtime and llama.cpp run
# (x86 names as in /proc/cpuinfo "flags", Arm names as in its "Features")
SPEED_FLAGS = frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
                         "avx512_fp16", "avx_vnni", "amx_int8", "amx_bf16", "asimd", "asimddp", "asimdhp", "i8mm",
                         "bf16", "sve", "sve2"})
CPUINFO = Path("/proc/cpuinfo")


def _cpu_flags() -> set[str]:
    """The flags of the first processor listed (Linux; empty where /proc/cpuinfo is missing)."""
    try:
        lines = CPUINFO.read_text().splitlines()
    except OSError:
        return set()
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def cpu_signature() -> dict[str, Any]:
    """{"machine": e.g. "x86_64" or "aarch64", "isa": the speed-relevant instruction sets, sorted}."""
    return {"machine": platform.machine(), "isa": sorted(_cpu_flags() & SPEED_FLAGS)}


def signature_difference(recorded: dict[str, Any], here: dict[str, Any]) -> str | None:
    """How ``here`` differs from ``recorded`` in words, or None when they are of one kind."""
    if recorded.get("machine") != here.get("machine"):
        return f"calibrated on {recorded.get('machine')}, running on {here.get('machine')}"
    missing = sorted(set(recorded.get("isa", [])) - set(here.get("isa", [])))
    extra = sorted(set(here.get("isa", [])) - set(recorded.get("isa", [])))
    if not missing and not extra:
        return None
    parts = ([f"this CPU lacks {' '.join(missing)}"] if missing else []) + \
            ([f"this CPU adds {' '.join(extra)}"] if extra else [])
    return f"calibrated on a CPU with other instruction sets: {'; '.join(parts)}"
