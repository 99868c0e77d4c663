"""The figures the docs quote from an ``edgeroute eval --json`` report: per task and mode the
decode speed, its ratio to ``full`` and to llama.cpp (where llama.cpp ran the task), what
decoded the answers (``auto``'s choices), how many answers were ``full``'s text and how many
passed. A figure record's summary (tools/records.py) for its eval commands."""

from __future__ import annotations

from typing import Any

LLAMA_CPP = "llama.cpp"


def _mode(figures: dict[str, Any], llama: dict[str, Any] | None) -> dict[str, Any]:
    judged = figures["judged"]
    row = {"tok_s": round(figures["tok_s"], 1), "x_full": round(figures["speed_vs_full"], 2),
           "ran": figures.get("ran"), "same_as_full": f"{round(figures['same_as_full'] * figures['prompts'])}/"
                                                    f"{figures['prompts']}",
           "passed": f"{round(figures['task_pass'] * judged)}/{judged}" if judged else None}
    if llama is not None and llama["tok_s"] > 0:  # llama.cpp leaves out what it cannot run (a schema)
        row["x_llama_cpp"] = round(figures["tok_s"] / llama["tok_s"], 2)
    return row


def eval_summary(report: dict[str, Any]) -> dict[str, Any]:
    """Per task (and ``overall``) each mode's figures; llama.cpp's own speed beside them."""
    def modes(table: dict[str, dict[str, Any]]) -> dict[str, Any]:
        llama = table.get(LLAMA_CPP)
        return {name: (_mode(f, llama) if name != LLAMA_CPP else {"tok_s": round(f["tok_s"], 1)})
                for name, f in table.items()}

    return {"overall": modes(report["overall"]),
            "per_task": {task: modes(table) for task, table in report["per_task"].items()}}
