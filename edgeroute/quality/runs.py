"""Runs of decoding configurations over task cases, and what they add up to: pass rates with
their bounds against ``full``, speed and LLM share. Shared by ``edgeroute eval`` and the
runtime runs of ``edgeroute calibrate``.

When a configuration may stand in for ``full`` (:func:`eligibility`):
- a lossless one (speculation) when its answers are the same text as ``full``'s on every case;
- any other where every case has a check that ran and the one-sided bound on the share of
  cases ``full`` passes and it fails stays within the tolerance (:mod:`edgeroute.quality.bounds`);
  where some case has no check, the bound on the share of cases whose text differs from
  ``full``'s must stay within it instead (a difference there cannot be judged harmless).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from edgeroute.errors import UnmeasuredQualityWarning
from edgeroute.quality.bounds import compare_paired, interval, upper_bound
from edgeroute.quality.cases import TaskCase

Progress = Callable[[str, int, int], None]
DEFAULT_CONFIDENCE = 0.95
DEFAULT_TOLERANCE = 0.05  # the share of cases a mode may lose against full, at the confidence
LOSSLESS_MODES = ("full", "speculate")  # the same tokens as full by construction (greedy)


@dataclass
class RunConfig:
    """A named decoding configuration: options for every case, and per task options that replace them."""

    name: str
    options: dict[str, Any]
    per_task: dict[str, dict[str, Any]] = field(default_factory=dict)

    def options_for(self, task: str) -> dict[str, Any]:
        return {**self.options, **self.per_task.get(task, {})}


def run_cases(engine, cases: Sequence[TaskCase], configs: Sequence[RunConfig], max_new_tokens: int,
              progress: Progress | None = None, keep_text: bool = False) -> dict[str, list[dict[str, Any]]]:
    """Every configuration on every case, interleaved case by case (machine noise hits all alike);
    the first configuration's answer is the reference ``same_as_full`` compares with."""
    runs: dict[str, list[dict[str, Any]]] = {c.name: [] for c in configs}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnmeasuredQualityWarning)  # measuring it is what these runs do
        for done, case in enumerate(cases):
            if progress is not None:
                progress("runtime runs", done, len(cases))
            reference = None
            for config in configs:
                # the task keys what the engine's answer memory drafts from (and what mode auto reads)
                options = {"task": case.task, **config.options_for(case.task), **case.options}
                if case.response_format is not None:
                    options["response_format"] = case.response_format
                if options.get("mode", "").partition("+")[0] == "route" and options.get("response_format") is not None:
                    options.setdefault("protect_format", True)  # format tokens never come from the light path
                session = engine.session(max_new_tokens=case.max_new_tokens or max_new_tokens, **options)
                generation = session.generate(case.messages)
                reference = generation.text if reference is None else reference
                verdict = case.verdict(generation.text)
                row = {"case": case.id, "task": case.task, "ran": session.options.label,
                       "tokens": generation.stats.new_tokens, "seconds": generation.stats.decode_seconds,
                       "llm_tokens": generation.stats.llm_tokens, "pass": verdict.passed, "reason": verdict.reason,
                       "same_as_full": generation.text == reference}
                if keep_text:
                    row["text"] = generation.text
                runs[config.name].append(row)
    if progress is not None:
        progress("runtime runs", len(cases), len(cases))
    return runs


def _tok_s(rows: Sequence[dict[str, Any]]) -> float:
    steps = sum(max(r["tokens"] - 1, 0) for r in rows)  # the first token comes with the prefill
    return steps / max(sum(r["seconds"] for r in rows), 1e-9)


def summarize(rows: Sequence[dict[str, Any]], full: Sequence[dict[str, Any]],
              confidence: float = DEFAULT_CONFIDENCE) -> dict[str, Any]:
    """A configuration's rows against ``full``'s on the same cases: what decoded them (``auto``'s
    choices), speed, LLM share, the pass rate over judged cases with its interval, and the paired
    loss bound."""
    judged = [i for i, (r, f) in enumerate(zip(rows, full, strict=True))
              if r["pass"] is not None and f["pass"] is not None]
    comparison = compare_paired([bool(rows[i]["pass"]) for i in judged], [bool(full[i]["pass"]) for i in judged],
                                confidence)
    low, high = interval(comparison.passed, comparison.n, confidence) if judged else (0.0, 1.0)
    differ = sum(not r["same_as_full"] for r in rows)
    return {"prompts": len(rows), "ran": sorted({r["ran"] for r in rows if "ran" in r}), "judged": len(judged),
            "tok_s": _tok_s(rows),
            "speed_vs_full": _tok_s(rows) / max(_tok_s(full), 1e-9),
            "llm_share": sum(r["llm_tokens"] for r in rows) / max(sum(r["tokens"] for r in rows), 1),
            "task_pass": comparison.passed / comparison.n if judged else None,
            "full_task_pass": comparison.full_passed / comparison.n if judged else None,
            "pass_interval": [low, high], "confidence": confidence, "lost": comparison.lost,
            "gained": comparison.gained, "loss_bound": comparison.loss_bound if judged else 1.0,
            "same_as_full": sum(bool(r["same_as_full"]) for r in rows) / max(len(rows), 1), "differ": differ,
            "differ_bound": upper_bound(differ, len(rows), confidence) if rows else 1.0}


def is_lossless(config: RunConfig, task: str) -> bool:
    return config.options_for(task).get("mode", "full") in LOSSLESS_MODES


def eligibility(name: str, figures: dict[str, Any], tolerance: float = DEFAULT_TOLERANCE,
                lossless: bool = False) -> tuple[bool, str]:
    """May configuration ``name`` (with ``figures`` from :func:`summarize`; ``lossless``: a mode
    that keeps full's tokens by construction) stand in for full? And why."""
    n = figures["prompts"]
    if name == "full":
        return True, "the reference"
    if lossless and n and figures["differ"] == 0:
        return True, f"lossless: the same text as full on all {n} prompts"
    if figures["judged"] < n:
        bound = (f"{n - figures['judged']} of {n} prompts have no check, and its text differs from full's on "
                 f"{figures['differ']}; bound on the share that differs {figures['differ_bound']:.1%} at "
                 f"{figures['confidence']:.1%}")
        ok = figures["differ_bound"] <= tolerance
    else:
        bound = (f"lost {figures['lost']} of {figures['judged']} prompts full passed; bound on the loss "
                 f"{figures['loss_bound']:.1%} at {figures['confidence']:.1%}")
        ok = figures["loss_bound"] <= tolerance
    return ok, f"{bound} {'<=' if ok else '>'} {tolerance:.0%}"
