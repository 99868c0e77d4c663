"""Per-configuration figures from the benchmark's per-prompt runs (plain dicts, as in the JSON).

A run holds ``tokens``, ``ttft``, ``decode_seconds``, ``gaps``, ``llm_tokens``, ``llm_calls``,
``llm_layers_run``, ``drafted``, ``accepted``, ``fallbacks``, ``agreement`` (``prefix``,
``tf_matches``, ``tf_positions``, ``identical``, ``divergence_gap``, ``full_tokens``) and
``task`` (a :class:`~tools.benchlib.tasks.TaskCheck` as a dict, or None).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

NEAR_TIE = 1e-3  # a divergence whose relative logit gap is under this is a rounding difference


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def tokens_per_second(run: dict) -> float | None:
    """Decode rate of one run: the tokens after the first over the time after the first."""
    steps = len(run["tokens"]) - 1
    return steps / run["decode_seconds"] if steps > 0 and run["decode_seconds"] > 0 else None


def summarize(runs: list[dict], num_layers: int, rss: dict | None, full_runs: list[dict] | None = None) -> dict:
    ratios = []  # per prompt, against full's run of the same prompt (run next to it in time)
    for run, full in zip(runs, full_runs or [], strict=False):
        mine, theirs = tokens_per_second(run), tokens_per_second(full)
        if mine and theirs:
            ratios.append(mine / theirs)
    new = sum(len(r["tokens"]) for r in runs)
    decode_tokens = sum(max(len(r["tokens"]) - 1, 0) for r in runs)
    decode_seconds = sum(r["decode_seconds"] for r in runs)
    gaps = [g for r in runs for g in r["gaps"]]
    llm_tokens = sum(r["llm_tokens"] for r in runs)
    layers = sum(r["llm_layers_run"] for r in runs)
    drafted = sum(r["drafted"] for r in runs)
    agreements = [r["agreement"] for r in runs if r.get("agreement")]
    full_tokens = sum(a["full_tokens"] for a in agreements)
    tf_positions = sum(a["tf_positions"] for a in agreements)
    gaps_at_divergence = [a["divergence_gap"] for a in agreements if a["divergence_gap"] is not None]
    checks = [r["task"] for r in runs if r.get("task")]
    return {
        "prompts": len(runs), "new_tokens": new, "decode_tokens": decode_tokens, "decode_seconds": decode_seconds,
        "tokens_per_second": decode_tokens / decode_seconds if decode_seconds else None,
        "paired_median_vs_full": float(np.median(ratios)) if ratios else None,
        "ttft_mean": float(np.mean([r["ttft"] for r in runs])) if runs else None,
        "ttft_p50": percentile([r["ttft"] for r in runs], 50),
        "itl_p50": percentile(gaps, 50), "itl_p99": percentile(gaps, 99),
        "peak_rss_bytes": rss.get("peak_rss_bytes") if rss else None,
        "llm_share": llm_tokens / new if new else None,
        "layers_per_llm_token": layers / llm_tokens if llm_tokens else None,
        "llm_calls_per_token": sum(r["llm_calls"] for r in runs) / new if new else None,
        "saved_compute": 1 - layers / (num_layers * new) if new else None,
        "acceptance": sum(r["accepted"] for r in runs) / drafted if drafted else None,
        "fallbacks": sum(r["fallbacks"] for r in runs),
        "prefix_agreement": sum(a["prefix"] for a in agreements) / full_tokens if full_tokens else None,
        "tf_agreement": sum(a["tf_matches"] for a in agreements) / tf_positions if tf_positions else None,
        "identical": sum(a["identical"] for a in agreements),
        "divergences": len(gaps_at_divergence),
        "near_tie_divergences": sum(abs(g) < NEAR_TIE for g in gaps_at_divergence),
        "task_checked": len(checks),
        "task_pass_rate": sum(c["passed"] for c in checks) / len(checks) if checks else None,
        "task_echoes": sum(c["echo"] for c in checks),
    }


class GraphClock:
    """Collects ``OrtModel.timings`` calls: seconds and calls per phase (prefill / decode) and
    graph kind (prefixed per model, e.g. "slm.layer")."""

    def __init__(self) -> None:
        self.phase = "prefill"
        self.seconds: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.calls: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))

    def hook(self, prefix: str = ""):
        """A callable for ``OrtModel.timings`` that files each call under ``prefix + kind``."""
        def timings(kind: str, seconds: float) -> None:
            self.seconds[self.phase][prefix + kind] += seconds
            self.calls[self.phase][prefix + kind] += 1
        return timings

    def clear(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    def decode_profile(self, decode_seconds: float, decode_tokens: int) -> dict:
        """Time per graph kind in decode, and the share of decode time outside ONNX Runtime calls."""
        decode = self.seconds.get("decode", {})
        ort_seconds = sum(decode.values())
        return {
            "decode_tokens": decode_tokens, "decode_seconds": decode_seconds,
            "graphs": {kind: {"calls": self.calls["decode"][kind], "seconds": s} for kind, s in sorted(decode.items())},
            "ort_seconds": ort_seconds,
            "orchestration_seconds": decode_seconds - ort_seconds,
            "orchestration_share": (decode_seconds - ort_seconds) / decode_seconds if decode_seconds else None,
            "tokens_per_second": decode_tokens / decode_seconds if decode_seconds else None,
        }
