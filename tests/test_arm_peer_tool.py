"""tools/arm_llama_cpp_peer.py (native kernels vs llama.cpp's aarch64 build under qemu): its
command parses, its log and table helpers, and the counting plugin's simulated cache."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "arm_llama_cpp_peer.py"


def load():
    spec = importlib.util.spec_from_file_location("arm_llama_cpp_peer", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_command_parses():
    done = subprocess.run([sys.executable, str(TOOL), "--help"], capture_output=True, text=True, check=True)
    for flag in ("--llama-cpp", "--model", "--cpus", "--cache", "--json", "--markdown"):
        assert flag in done.stdout


def test_every_cpu_has_a_native_set_and_a_checked_march():
    tool = load()
    assert set(tool.CPUS) == {"cortex-a57", "neoverse-n1", "max"}
    for kernels, march in tool.CPUS.values():
        assert kernels in ("neon", "dotprod", "i8mm") and march in tool.FEATURES


def test_repacked_and_table():
    tool = load()
    log = ("ggml_repack_tensor: repack tensor blk.0.attn_q.weight with q4_K_8x4\n"
           "ggml_repack_tensor: repack tensor blk.1.attn_q.weight with q4_K_8x4\n"
           "ggml_repack_tensor: repack tensor blk.0.ffn_down.weight with q6_K_8x4\n")
    assert tool.repacked(log) == {"q4_K -> q4_K_8x4": 2, "q6_K -> q6_K_8x4": 1}
    row = {"model": "m", "cpu": "max", "native_kernels": "i8mm", "llama_cpp_march": "armv8.6-a+dotprod+fp16+i8mm",
           "native": {"instructions": 40e6, "cache_miss_bytes": 97e6},
           "llama_cpp": {"instructions": 50e6, "cache_miss_bytes": 98e6}, "instructions_ratio": 1.25,
           "fetched_ratio": 97 / 98, "weight_bytes_per_token": 96.4e6, "native_tokens": [1], "llama_cpp_tokens": [1]}
    table = tool.markdown([row], 4 << 20)
    assert "| m | max | i8mm |" in table and "| 40.0 | 50.0 | 1.25x |" in table and "4 MiB" in table


@pytest.mark.skipif(not (shutil.which("qemu-aarch64") and shutil.which("aarch64-linux-gnu-gcc")),
                    reason="needs qemu-aarch64 and aarch64-linux-gnu-gcc")
def test_plugin_cache_counts_what_misses(tmp_path):
    """A buffer read twice: what fits the simulated cache is fetched once, what does not twice; and
    the block profile names the function that ran."""
    sys.path.insert(0, str(REPO / "tools"))
    import arm_instruction_counts as arm

    source = tmp_path / "sweep.c"
    source.write_text("#include <stdlib.h>\n#include <stdint.h>\nint main(int c, char **v) {\n"
                      "  size_t n = strtoull(v[1], 0, 0) / 8; volatile uint64_t *b = aligned_alloc(64, n * 8);\n"
                      "  uint64_t s = 0; for (int r = 0; r < 2; r++) for (size_t i = 0; i < n; i++) s += b[i];\n"
                      "  return (int)(s & 1); }\n")
    program = tmp_path / "sweep"
    subprocess.run(["aarch64-linux-gnu-gcc", "-O1", str(source), "-o", str(program)], check=True)
    plugin = arm.build_plugin(tmp_path)
    fetched = {}
    for size in (1 << 20, 8 << 20):
        counts, _, _, _ = arm.counted(plugin, "cortex-a57", program, [str(size)], {}, cache=4 << 20)
        fetched[size] = counts["cache_miss_bytes"]
        assert counts["mem_bytes"] >= 2 * size
    assert 1 << 20 <= fetched[1 << 20] < (1 << 20) * 1.2
    assert 2 * (8 << 20) <= fetched[8 << 20] < 2 * (8 << 20) * 1.1
    counts, _, err, _ = arm.counted(plugin, "cortex-a57", program, [str(1 << 20)], {})
    assert set(counts) == {"instructions"} and not re.search("cache_miss", err)
    profile = tmp_path / "profile.txt"
    counts, _, _, _ = arm.counted(plugin, "cortex-a57", program, [str(1 << 20)], {}, profile=profile)
    by_function = arm.symbol_profile(profile)
    assert sum(by_function.values()) == counts["instructions"]
    assert max(by_function, key=by_function.get) == "sweep:main"


def test_instruction_counts_summary_names_each_set_and_the_python_backends():
    sys.path.insert(0, str(REPO / "tools"))
    import arm_instruction_counts as arm

    rows = [{"kernels": "generic", "per_token": 1200e6}, {"kernels": "dotprod", "per_token": 40e6},
            {"kernels": "python: onnxruntime (portable)", "per_token": 54e6},
            {"kernels": "python: native (native dotprod)", "per_token": 36e6}]
    summary = arm.summary(rows)
    assert summary["million_instructions_per_token"]["dotprod"] == 40.0
    assert summary["fewer_than_generic"] == {"dotprod": 30.0, "python: onnxruntime (portable)": 22.22,
                                             "python: native (native dotprod)": 33.33}
    assert summary["native_fewer_than_onnxruntime"] == 1.5
    assert "native_fewer_than_onnxruntime" not in arm.summary(rows[:2]) and "fewer_than_generic" not in arm.summary(rows[1:])
