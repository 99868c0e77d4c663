"""Task-level checks of an answer: what teacher-forced agreement cannot see (an answer that
agrees with the LLM token by token on 93% of positions may still leave JSON unclosed or copy
the prompt's instructions). Each check compares with the prompt and with ``full``'s answer."""

from __future__ import annotations

import json
import re

from edgeroute.calibration.prompts import CalibrationPrompt

ECHO_WORDS = 8  # this many consecutive words of the instructions (all, if fewer) in an answer is an echo
_WORD = re.compile(r"[A-Za-z0-9]+(?:[.,:][0-9]+)*")  # numbers keep their separators: 14:35, 21.5


def words(text: str) -> list[str]:
    return [w.lower() for w in _WORD.findall(text)]


def echoes_instructions(answer: str, instructions: str, window: int = ECHO_WORDS) -> bool:
    """The answer repeats ``window`` consecutive words of the instructions (all of them if
    shorter), matched on whole words."""
    said, heard = words(instructions), f" {' '.join(words(answer))} "
    size = min(window, len(said))
    return size > 0 and any(f" {' '.join(said[i:i + size])} " in heard for i in range(len(said) - size + 1))


def parse_json_object(text: str) -> dict | None:
    """The first JSON object in ``text`` (a fenced code block is fine), or None."""
    start = text.find("{")
    if start < 0:
        return None
    try:
        value, _ = json.JSONDecoder().raw_decode(text[start:])
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def task_pass(prompt: CalibrationPrompt, answer: str, reference: str) -> bool:
    """Does ``answer`` do the task as well as the check can tell? ``reference`` is full's answer:
    json must parse and carry its keys and values; templated and grounded must contain every
    record value that full's answer contains; no answer may echo the prompt's instructions."""
    if prompt.instructions and echoes_instructions(answer, prompt.instructions) \
            and not echoes_instructions(reference, prompt.instructions):
        return False
    if prompt.task == "json":
        want = parse_json_object(reference)
        got = parse_json_object(answer)
        return got is not None and (want is None or got == want)
    values = [v for v in prompt.record.values() if v.lower() in reference.lower()]
    return all(v.lower() in answer.lower() for v in values)
