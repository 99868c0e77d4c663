"""Task cases: a prompt (or a chat) and the assertions its answer must pass.

A task file is JSONL, one case a line, in the shape people write LLM checks in (promptfoo's
assertion names under ``assert``)::

    {"id": "nav-1", "task": "voice-command", "prompt": "Navigate to the airport in Cork.",
     "assert": [{"type": "icontains-all", "value": ["airport", "Cork"]},
                {"type": "not-regex", "value": "\\\\d"}]}

``messages`` (OpenAI-style ``[{"role", "content"}]``) may replace ``prompt``; ``task`` (default
``custom``) groups cases in reports and names the task profile a calibration writes;
``response_format`` (as ``edgeroute run`` takes it) constrains the answer; ``max_new_tokens`` caps it.
A case without assertions is refused: a check with nothing to check cannot fail; so is one whose
assertions an empty answer passes (``not-contains`` alone): it cannot tell silence from an answer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgeroute.errors import InputError
from edgeroute.files import read_user_text
from edgeroute.quality.assertions import SANDBOXED_TYPES, Assertion, Verdict, check_all, parse_assertion
from edgeroute.runtime.constraints import ResponseFormat

CASE_KEYS = {"id", "task", "prompt", "messages", "assert", "response_format", "max_new_tokens", "description"}
ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class TaskCase:
    id: str
    task: str
    messages: list[dict[str, str]]
    assertions: tuple[Assertion, ...] = ()  # none: no automatic check (only lossless modes are judged safe)
    response_format: dict[str, Any] | None = None
    max_new_tokens: int | None = None
    options: dict[str, Any] = field(default_factory=dict)  # decoding options the case always runs with

    def verdict(self, answer: str) -> Verdict:
        """Whether ``answer`` passes; ``passed`` None where there is nothing to check or a check
        could not run here (e.g. JavaScript without node)."""
        if not self.assertions:
            return Verdict(None, "no automatic check for this task")
        return check_all(self.assertions, answer)


def _messages(data: dict[str, Any], where: str) -> list[dict[str, str]]:
    if ("prompt" in data) == ("messages" in data):
        raise InputError(f"{where}: give either \"prompt\" (one user turn) or \"messages\" (a chat), not "
                         f"{'both' if 'prompt' in data else 'neither'}")
    if "prompt" in data:
        if not isinstance(data["prompt"], str) or not data["prompt"].strip():
            raise InputError(f"{where}: \"prompt\" must be a non-empty string")
        return [{"role": "user", "content": data["prompt"]}]
    messages = data["messages"]
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str) for m in messages):
        raise InputError(f"{where}: \"messages\" must be a non-empty list of {{\"role\": {'|'.join(ROLES)}, "
                         "\"content\": str}")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def parse_case(data: Any, where: str) -> TaskCase:
    if not isinstance(data, dict):
        raise InputError(f"{where}: a case is a JSON object like {{\"prompt\": ..., \"assert\": [...]}}")
    unknown = sorted(set(data) - CASE_KEYS)
    if unknown:
        raise InputError(f"{where}: unknown key(s) {', '.join(unknown)}; a case has {', '.join(sorted(CASE_KEYS))}")
    assertions = data.get("assert")
    if not isinstance(assertions, list) or not assertions:
        raise InputError(f"{where}: \"assert\" must be a non-empty list of assertions (a case with nothing to "
                         "check would always pass)")
    max_new_tokens = data.get("max_new_tokens")
    if max_new_tokens is not None and (not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool)
                                       or max_new_tokens < 1):
        raise InputError(f"{where}: \"max_new_tokens\" must be a positive integer (got {max_new_tokens!r})")
    response_format = data.get("response_format")
    if response_format is not None and not isinstance(response_format, dict):
        raise InputError(f"{where}: \"response_format\" must be an object as `edgeroute run` takes it")
    try:  # here, not when the case's turn comes in the middle of a run
        ResponseFormat.parse(response_format)
    except InputError as err:
        raise InputError(f"{where}: {err}") from None
    case_id = data.get("id", where)
    if isinstance(case_id, bool) or not isinstance(case_id, str | int) or not str(case_id).strip():
        raise InputError(f"{where}: \"id\" must be a non-empty string or a whole number (got {case_id!r})")
    task = data.get("task", "custom")
    if not isinstance(task, str) or not task.strip() or task == "default":
        raise InputError(f"{where}: \"task\" must be a non-empty string other than \"default\" (the profile over "
                         f"every task) (got {task!r})")
    checks = tuple(parse_assertion(a, f"{where}: assert[{i}]") for i, a in enumerate(assertions))
    if _passes_an_empty_answer(checks):
        raise InputError(f"{where}: an empty answer passes every assertion of this case, so it cannot tell a silent "
                         "or cut-off answer from a right one: add one that an empty answer fails (e.g. "
                         '{"type": "regex", "value": "\\\\S"} for "says something")')
    return TaskCase(str(case_id), task, _messages(data, where), checks, response_format, max_new_tokens)


def _passes_an_empty_answer(assertions: tuple[Assertion, ...]) -> bool:
    """Whether the empty answer passes them all (unjudged is no pass), unless one asks for it
    (``equals ""``): the string checks first, so a sandboxed check runs only where none of them
    failed it."""
    if any(a.type == "equals" and not a.value.strip() for a in assertions):
        return False
    return check_all(sorted(assertions, key=lambda a: a.base_type in SANDBOXED_TYPES), "").passed is True


def load_cases(path: str | Path) -> list[TaskCase]:
    """A JSONL task file (see the module docstring). Ids default to ``FILE:LINE`` and must be unique."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"task file {path} does not exist (or is not a file)")
    cases = []
    for number, line in enumerate(read_user_text(path, "task file").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path.name}:{number}"
        try:
            data = json.loads(line)
        except json.JSONDecodeError as err:
            raise InputError(f"{where} is not JSON ({err.msg} at column {err.colno})") from None
        cases.append(parse_case(data, where))
    if not cases:
        raise InputError(f"task file {path} holds no cases")
    seen: set[str] = set()
    for case in cases:
        if case.id in seen:
            raise InputError(f"task file {path}: id {case.id!r} is used twice")
        seen.add(case.id)
    return cases
