"""Task-level checks of an answer: what teacher-forced agreement cannot see (an answer that
agrees with the LLM token by token on 98% of positions may still get the one number that
matters wrong, leave JSON unclosed or copy the prompt's instructions).

A prompt's check is its own assertions (promptfoo's vocabulary, see
:mod:`edgeroute.quality.assertions`), judged against the prompt's values, never against
``full``'s answer: a mode and ``full`` are both judged, and compared on the same prompts. A
prompt without assertions (open dialogue) has no automatic check: its verdict is ``None``.
"""

from __future__ import annotations

import json
import re

from edgeroute.calibration.prompts import ANSWER_TOKENS, ECHO_WORDS, CalibrationPrompt
from edgeroute.errors import InputError
from edgeroute.quality.assertions import Verdict, parse_assertion
from edgeroute.quality.cases import TaskCase
from edgeroute.runtime.profiles import load_profile

_WORD = re.compile(r"[A-Za-z0-9]+(?:[.,:][0-9]+)*")  # numbers keep their separators: 14:35, 21.5


def words(text: str) -> list[str]:
    return [w.lower() for w in _WORD.findall(text)]


def echoes_instructions(answer: str, instructions: str, window: int = ECHO_WORDS) -> bool:
    """The answer repeats ``window`` consecutive words of the instructions (all of them if
    shorter), matched on whole words (the benchmarks' check; built-in prompts carry the same
    rule as a ``not-regex`` assertion, :func:`edgeroute.calibration.prompts.echo_pattern`)."""
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


def task_response_format(task: str) -> dict | None:
    """The response_format the task's own profile runs with (the json profile constrains to a
    JSON object), so that a task's cases are judged as ``--profile TASK`` runs them."""
    try:
        return load_profile(task).decoding.get("response_format")
    except InputError:  # a user's task: no profile of that name
        return None


def prompt_case(prompt: CalibrationPrompt) -> TaskCase:
    """A built-in (or user) calibration prompt as a task case: one user turn, its assertions, the
    task profile's response_format and the answer length a right answer needs."""
    return TaskCase(prompt.id, prompt.task, [{"role": "user", "content": prompt.content}],
                    tuple(parse_assertion(a, prompt.id) for a in prompt.assertions),
                    task_response_format(prompt.task), ANSWER_TOKENS.get(prompt.task))


def task_verdict(prompt: CalibrationPrompt, answer: str) -> Verdict:
    """Does ``answer`` do the prompt's task? ``Verdict.passed`` is None where there is no check
    (or it could not run, e.g. a JavaScript check without node)."""
    return prompt_case(prompt).verdict(answer)
