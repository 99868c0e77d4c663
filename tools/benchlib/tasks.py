"""Task-level checks of one answer: did it do the job, whatever its tokens?

Teacher-forced agreement hid answers that copied the prompt's instructions and JSON left
unclosed, so every benchmark row also counts:

- **templated** (a record or a short request -> a sentence): every value of the record appears
  in the answer (its words, case-insensitive; numbers exactly). A templated prompt that asks
  for JSON is checked as json.
- **json**: the answer holds one JSON object (a code fence around it is fine) with the asked
  keys, the prompt's listed values, and, for a mode compared with ``full``, full's keys and
  values.
- **no echo** (both): the answer does not repeat the prompt's instruction (any 8 consecutive
  words of it, or all of a shorter one).

Other workloads (grounded, open) have no task check.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from edgeroute.calibration.checks import echoes_instructions, parse_json_object, words

_RECORD_LINE = re.compile(r"^\s*([A-Za-z_]+):\s*(.+?)\s*$")
_QUOTED_KEY = re.compile(r'"([A-Za-z_]+)"')
_WORD = re.compile(r"[A-Za-z0-9]+(?:[.,:][0-9]+)*")


@dataclass(frozen=True)
class TaskCheck:
    kind: str  # templated | json
    passed: bool  # the task is done and nothing is echoed
    echo: bool  # the answer repeats the prompt's instruction
    reason: str = ""  # why it failed ("" when it passed)


def split_prompt(prompt: dict) -> tuple[str, str]:
    """(instruction, data) of a templated or json prompt: an explicit "instruction" /
    "command"; else the lines that are not ``key: value`` record lines vs the record; else the
    text before vs after the first ": "."""
    if "instruction" in prompt:
        return prompt["instruction"], prompt.get("command", "")
    content = prompt["messages"][-1]["content"]
    lines = content.splitlines()
    record = [line for line in lines if _RECORD_LINE.match(line)]
    if record:
        return "\n".join(line for line in lines if not _RECORD_LINE.match(line)), "\n".join(record)
    instruction, _, data = content.partition(": ")
    return instruction, data


def record_values(prompt: dict) -> list[str]:
    """What a templated answer must carry: the record's values (not its intent), or in a
    one-line request the numbers and capitalized words after the first word."""
    _, data = split_prompt(prompt)
    matches = [_RECORD_LINE.match(line) for line in data.splitlines()]
    if any(matches):
        return [m.group(2) for m in matches if m and m.group(1).lower() != "intent"]
    candidates = _WORD.findall(data)[1:]
    return [w for w in candidates if w[0].isdigit() or w[0].isupper()]


def _same(a, b) -> bool:
    if isinstance(a, str) and isinstance(b, str):
        return a.strip().lower() == b.strip().lower()
    return a == b


def expected_keys(prompt: dict) -> list[str]:
    return prompt.get("keys") or _QUOTED_KEY.findall(split_prompt(prompt)[0])


def is_json_prompt(prompt: dict, workload: str) -> bool:
    return workload == "json" or "JSON" in split_prompt(prompt)[0]


def check_json(prompt: dict, answer: str, full_answer: str | None) -> str:
    """"" when the answer passes the json check, else the reason."""
    value = parse_json_object(answer)
    if value is None:
        return "no JSON object"
    missing = [k for k in expected_keys(prompt) if k not in value]
    if missing:
        return f"missing keys {missing}"
    wrong = [k for k, v in prompt.get("values", {}).items() if not _same(value.get(k), v)]
    if wrong:
        return f"wrong values for {wrong}"
    reference = parse_json_object(full_answer) if full_answer is not None else None
    if reference is not None:
        if set(value) != set(reference):
            return f"keys {sorted(value)} differ from full's {sorted(reference)}"
        differ = [k for k in reference if not _same(value[k], reference[k])]
        if differ:
            return f"values of {differ} differ from full's"
    return ""


def check_templated(prompt: dict, answer: str) -> str:
    heard = set(words(answer))
    missing = [v for v in record_values(prompt) if not set(words(v)) <= heard]
    return f"missing {missing}" if missing else ""


def task_check(workload: str, prompt: dict, answer: str, full_answer: str | None = None) -> TaskCheck | None:
    """The task check of an answer to a templated or json prompt (None for other workloads).
    ``full_answer``: full's answer to the same prompt, for a json answer of another mode."""
    if workload not in ("templated", "json"):
        return None
    kind = "json" if is_json_prompt(prompt, workload) else "templated"
    reason = check_json(prompt, answer, full_answer) if kind == "json" else check_templated(prompt, answer)
    echo = echoes_instructions(answer, split_prompt(prompt)[0])
    if echo:
        reason = "; ".join(filter(None, [reason, "echoes the instruction"]))
    return TaskCheck(kind, not reason, echo, reason)
