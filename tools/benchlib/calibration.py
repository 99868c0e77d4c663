"""The figures the docs quote from a calibrated bundle (``edgeroute inspect BUNDLE --json``): per
task what ``auto`` chose, its speed against ``full``, how often it wrote ``full``'s text and the
quality figures it was chosen on; what the draft trees replayed, ran and wrote. A figure
record's summary (tools/records.py) for its calibrate commands."""

from __future__ import annotations

from typing import Any

ROUTES = ("route/slm", "route/slm+verified")  # the lossy candidates the docs compare


def _count(figures: dict[str, Any], share: str) -> str:
    return f"{round(figures[share] * figures['prompts'])}/{figures['prompts']}"


def _task_row(profile: dict[str, Any]) -> dict[str, Any]:
    figures = profile["figures"]
    chosen, full = figures[profile["config"]], figures["full"]
    row = {"auto": profile["config"], "x_full": round(chosen["speed_vs_full"], 2),
           "same_as_full": _count(chosen, "same_as_full"), "n": chosen["prompts"],
           "full_task_pass": full.get("task_pass"), "full_pass_interval": full.get("pass_interval"),
           "loss_bound": chosen.get("loss_bound"), "lost": chosen.get("lost"), "gained": chosen.get("gained"),
           "candidates_x_full": {name: round(f["speed_vs_full"], 2) for name, f in figures.items() if name != "full"}}
    for name in ROUTES:
        if name in figures:
            f = figures[name]
            row[name] = {"x_full": round(f["speed_vs_full"], 2), "lost": f.get("lost"), "gained": f.get("gained"),
                         "differ": f.get("differ")}
    return row


def _trees(figures: dict[str, Any] | None, written: dict[str, Any] | None) -> dict[str, Any] | None:
    if not figures:
        return None
    return {"fitted": figures.get("shape"), "speedup_vs_linear": figures.get("speedup_vs_linear"),
            "curve": figures.get("curve"),
            "per_task": {task: fit["shape"] for task, fit in figures.get("per_task", {}).items()},
            "runtime": figures.get("runtime"), "written": written}


def calibration_summary(inspected: dict[str, Any]) -> dict[str, Any]:
    """The summary of ``inspect --json``'s calibration section (an uncalibrated bundle: an error)."""
    calibration = inspected.get("calibration")
    if not calibration:
        raise ValueError(f"{inspected.get('path', 'the bundle')} is not calibrated: no figures to summarize")
    per_task = {task: _task_row(profile) for task, profile in calibration["profiles"].items()}
    sped_up = [row["x_full"] for row in per_task.values() if row["auto"] != "full"]
    figures, decoding = calibration["figures"], calibration["decoding"]
    return {"per_task": per_task, "x_full_range": [min(sped_up), max(sped_up)] if sped_up else None,
            "trees": _trees(figures.get("trees"), decoding.get("lookup_tree")),
            "slm_trees": _trees(figures.get("slm_trees"), decoding.get("slm_tree")),
            "drafting_costs": figures.get("drafting", {}).get("costs"),
            "seconds": figures.get("seconds"), "answer_memory": decoding.get("answer_memory")}
