"""The CPU a calibration's timings were taken on, and whether this one is of the same kind.

``edgeroute calibrate`` fits choices to measured timings (the draft length, the configuration
``--mode auto`` picks per task), and those timings move with the instruction sets the kernels
use: on 2 cores a verification row of the Qwen 1.5B cost 20 ms with AVX2 and 6-8 ms with
AVX-512 VNNI, which turned the fitted drafts from 1 token into 2-3. So the calibration records
the machine and the speed-relevant instruction sets, and the runtime warns when a bundle runs
on a CPU that differs in them (the quality budget still holds there; only "fastest" may not).
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

from edgeroute.errors import InputError

# instruction sets that change which int8 / int4 / float kernels ONNX Runtime and llama.cpp run
# (x86 names as in /proc/cpuinfo "flags", Arm names as in its "Features")
SPEED_FLAGS = frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
                         "avx512_fp16", "avx_vnni", "amx_int8", "amx_bf16", "asimd", "asimddp", "asimdhp", "i8mm",
                         "bf16", "sve", "sve2"})
CPUINFO = Path("/proc/cpuinfo")
DEVICE_TREE_MODEL = Path("/proc/device-tree/model")  # the board's name on Arm boards (Jetson included)
# Arm's "CPU implementer" / "CPU part" codes of the cores that matter here (the kernel prints no name)
ARM_PARTS = {("0x41", "0xd0c"): "Neoverse N1", ("0x41", "0xd40"): "Neoverse V1", ("0x41", "0xd4f"): "Neoverse V2",
             ("0x41", "0xd84"): "Neoverse V3", ("0x41", "0xd83"): "Neoverse V3AE", ("0x41", "0xd42"): "Cortex-A78AE",
             ("0x41", "0xd41"): "Cortex-A78", ("0x41", "0xd0b"): "Cortex-A76", ("0x41", "0xd08"): "Cortex-A72",
             ("0x41", "0xd07"): "Cortex-A57", ("0x41", "0xd03"): "Cortex-A53", ("0x41", "0xd05"): "Cortex-A55"}


def _processors() -> list[dict[str, str]]:
    """/proc/cpuinfo as one dict per processor (Linux; empty where it is missing)."""
    try:
        text = CPUINFO.read_text()
    except OSError:
        return []
    blocks = []
    for block in text.split("\n\n"):
        fields = {}
        for line in block.splitlines():
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
        if fields.get("processor"):
            blocks.append(fields)
    return blocks


def _cpu_flags() -> set[str]:
    """The flags of the first processor listed (Linux; empty where /proc/cpuinfo is missing)."""
    first = (_processors() or [{}])[0]
    return set((first.get("flags") or first.get("Features") or "").split())


def thread_count(threads: int | None = None, device: int | None = None) -> int:
    """The threads a runtime uses: ``threads``, else $EDGEROUTE_THREADS, else a device profile's
    (``device``: the board's cores, at most the CPUs the OS lists), else every CPU the OS lists
    (hyperthreads included).

    An explicit count (``threads`` or $EDGEROUTE_THREADS) outside 1..the CPUs online is an
    InputError naming it, the CPUs and the fix; libedgeroute's er_model_open refuses the same.
    Refused rather than clamped: threads beyond the CPUs only take turns on them (each forward
    waits at the kernels' barriers for the descheduled ones), and a clamp would run and report
    another count than the one asked for. A device profile's count describes its board, not a
    request, and is taken up to the CPUs here."""
    listed = os.cpu_count() or 1  # the CPUs online (sysconf(_SC_NPROCESSORS_ONLN) on Linux)
    given = "threads"
    if threads is None and (text := os.environ.get("EDGEROUTE_THREADS", "").strip()):
        given = "$EDGEROUTE_THREADS"
        try:
            threads = int(text)
        except ValueError:
            raise InputError(f"$EDGEROUTE_THREADS must be a whole number of threads (got {text!r})") from None
    if threads is None:
        return min(device or listed, listed)
    if not isinstance(threads, int) or isinstance(threads, bool) or not 1 <= threads <= listed:
        raise InputError(f"{given} must be a whole number within 1..{listed}, the CPUs online (got {threads!r}): "
                         f"give at most {listed}, or leave it unset to use all {listed}")
    return threads


def _model_name(processors: list[dict[str, str]]) -> str:
    """x86: the "model name"; Arm: the core names from their part codes, e.g. "8x Cortex-A78AE"."""
    if processors and processors[0].get("model name"):
        return processors[0]["model name"]
    parts: dict[str, int] = {}
    for fields in processors:
        code = (fields.get("CPU implementer", "?"), fields.get("CPU part", "?"))
        name = ARM_PARTS.get(code, f"implementer {code[0]} part {code[1]}")
        parts[name] = parts.get(name, 0) + 1
    return ", ".join(f"{n}x {name}" for name, n in parts.items()) or platform.processor() or "unknown"


def _physical_cores(processors: list[dict[str, str]]) -> int | None:
    """Cores without hyperthreads: distinct (physical id, core id) pairs on x86; on Arm, where
    a core runs one thread, the processors listed."""
    pairs = {(f.get("physical id"), f.get("core id")) for f in processors if "core id" in f}
    return len(pairs) or len(processors) or None


def describe_cpu() -> dict[str, Any]:
    """What ``edgeroute bench`` prints about the CPU: ``cpu_signature()`` plus "model" (the CPU's
    name), "family" (x86's family and model numbers; None elsewhere), "board" (the device tree's
    model, e.g. a Jetson's; None elsewhere), "cores" (physical) and "threads" (the OS's logical CPUs)."""
    processors = _processors()
    try:
        board: str | None = DEVICE_TREE_MODEL.read_text().strip("\x00\n ") or None
    except OSError:
        board = None
    return {**cpu_signature(), "model": _model_name(processors), "family": _family(processors), "board": board,
            "cores": _physical_cores(processors), "threads": os.cpu_count()}


def _family(processors: list[dict[str, str]]) -> str | None:
    """x86: "family F model M" from /proc/cpuinfo, which a VM passes through where it names the CPU
    only "AMD EPYC" (family 25 model 1 is Zen 3, 25/17 Zen 4); None elsewhere."""
    first = processors[0] if processors else {}
    if "cpu family" not in first or "model" not in first:
        return None
    return f"family {first['cpu family']} model {first['model']}"


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
