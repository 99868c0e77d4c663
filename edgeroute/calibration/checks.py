"""Task-level checks of an answer: what teacher-forced agreement cannot see (an answer that
agrees with the LLM token by token on 93% of positions may still leave JSON unclosed or copy
the prompt's instructions). Each check compares with the prompt and with ``full``'s answer."""

from __future__ import annotations

import json
import re

from edgeroute.calibration.prompts import CalibrationPrompt

ECHO_WORDS = 6  # this many consecutive words of the instructions in an answer is an echo


def _words(text: str) -> list[str]:
    return re.findall(r"[\w.']+", text.lower())


def echoes_instructions(answer: str, instructions: str) -> bool:
    words, said = _words(instructions), " ".join(_words(answer))
    n = min(ECHO_WORDS, len(words))
    return n > 0 and any(" ".join(words[i:i + n]) in said for i in range(len(words) - n + 1))


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
