"""The figures the docs quote from decode benchmarks: a figure record's summary
(tools/records.py) for ``edgeroute bench --json`` (each role and context: every backend's decode
speed and native's ratio to llama.cpp) and for ``tools/bench_passes.py``, whose JSON has none of
its own, and the summary ``tools/bench_llama_passes.py`` writes and prints (a 4-token pass
against a one-token one: medians, and the quartiles of the per-round ratio where rounds were
paired)."""

from __future__ import annotations

from typing import Any

import numpy as np


def bench_summary(report: dict[str, Any]) -> dict[str, Any]:
    """Per "<role> ctx <n>": ``<backend>_tok_s`` for each backend that ran and, where native
    and llama.cpp both did, ``native_x_llama_cpp``."""
    summary: dict[str, dict[str, Any]] = {}
    for record in report["records"]:
        row = summary.setdefault(f"{record['role']} ctx {record['context']}", {})
        row[f"{record['backend'].replace('.', '_')}_tok_s"] = round(record["decode_tok_s"], 1)
    for row in summary.values():
        if row.get("native_tok_s") and row.get("llama_cpp_tok_s"):
            row["native_x_llama_cpp"] = round(row["native_tok_s"] / row["llama_cpp_tok_s"], 2)
    return summary


def llama_passes_summary(result: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's 1- and 4-token passes, timed in alternating rounds."""
    m1, m4 = np.asarray(result["m1_ms"]), np.asarray(result["m4_ms"])
    ratios = m4 / m1
    return {"threads": result["threads"], "logits": result["logits"], "m1_ms_median": round(float(np.median(m1)), 1),
            "m4_ms_median": round(float(np.median(m4)), 1), "m4_over_m1_median": round(float(np.median(ratios)), 2),
            "quartiles": [round(float(q), 2) for q in np.percentile(ratios, [25, 75])]}


def passes_summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """edgeroute's passes (medians over repeats, every length in each repeat), per thread count."""
    return {f"{r['kernels_run']}, {r['threads']} thread(s)": {
        "m1_ms": round(r["pass_ms"][0], 1), "m4_ms": round(r["pass_ms"][3], 1),
        "m4_over_m1": round(r["pass_ms"][3] / r["pass_ms"][0], 2), "slm_step_ms": round(r["slm_step_ms"], 1)}
        for r in records}
