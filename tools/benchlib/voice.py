"""The voice benchmark's measures (tools/bench_voice.py): tool-call correctness against the
expected calls of a spoken command, and latency percentiles per configuration.

A command's ``expect`` is a list of calls ``{"name": ..., "arguments": {...}}`` (empty: the
model must answer in words and call nothing). An expected argument value may be a list of
accepted alternatives. Values are compared normalised: strings lowercased, punctuation and
a leading article ("the", "a", "an") or "to" dropped, times as HH:MM; numbers (or strings
that are numbers) by value. An argument the command did not expect is accepted only where the
tool's schema gives it a default and the call passes exactly that default (``zone: "all"``);
any other is wrong, as is a missing, extra or different call.

A command that expects words is right only when nothing was called and the answer is words a
speaker can say (``words_errors``): at least two words of letters; no markup (braces, brackets,
tags, underscores, backslashes, asterisks, hashes, backquotes) and no JSON key; not the prompt
said back (every word one of the system prompt's: "no list, no markdown"). A call written out as
text, the tool list echoed or a markdown list is wrong. What the words mean is judged where the
command says (``"assert"``): promptfoo-style assertions (edgeroute.quality.assertions), or
``"declines"`` for a command the car cannot do or a fact it cannot know (a function it lacks, the
weather, the time): the words must say so (``DECLINES``: "sorry", "can't", "unable", "don't
have", ...), not claim it was done or make an answer up. That is a keyword check: an answer that
apologizes and then claims the action anyway would pass it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgeroute.quality.assertions import Assertion, check_all, parse_assertion

LEADING = ("the ", "a ", "an ", "to ")
TIME = re.compile(r"^(\d{1,2})(?::(\d{2}))?\s*(am|pm|a m|p m)?$")


def normalise(value: Any) -> Any:
    """A value as the comparison sees it (see the module's docstring)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return float(value)
    if not isinstance(value, str):
        return value
    text = value.strip().lower()
    try:
        return float(text)
    except ValueError:
        pass
    text = re.sub(r"(?<=\d)\.(?=\d)", "<dot>", text)  # 3.5 keeps its point, 8:30 its colon
    text = re.sub(r"(?<=\d):(?=\d)", "<colon>", text)
    text = re.sub(r"[^\w\s<>]", " ", text).replace("<dot>", ".").replace("<colon>", ":")
    text = " ".join(text.split())
    changed = True
    while changed:
        changed = False
        for word in LEADING:
            if text.startswith(word):
                text, changed = text[len(word):], True
    if (match := TIME.match(text)) and (match.group(2) is not None or match.group(3)):
        hour, minute = int(match.group(1)), int(match.group(2) or 0)
        if (match.group(3) or "").replace(" ", "") == "pm" and hour < 12:
            hour += 12
        return f"{hour:02d}:{minute:02d}"
    return text


def same_value(got: Any, want: Any) -> bool:
    wanted = want if isinstance(want, list) else [want]
    return any(normalise(got) == normalise(option) for option in wanted)


@dataclass
class CallCheck:
    right_tool: bool  # the same tools called (by name, as a multiset)
    right_arguments: bool  # and every argument right (no call wanted: the words as judged): the whole answer is right
    reason: str  # what was wrong ("" when right)

    @property
    def ok(self) -> bool:
        return self.right_tool and self.right_arguments


def _parameters(tools: list[dict[str, Any]], name: str) -> dict[str, Any]:
    for tool in tools:
        function = tool.get("function", tool)
        if function.get("name") == name:
            return function.get("parameters", {})
    return {}


def _call_parts(call: Any) -> tuple[str, dict[str, Any]]:
    if isinstance(call, dict):
        return call["name"], call.get("arguments") or {}
    return call.name, call.arguments or {}


def argument_errors(got: dict[str, Any], want: dict[str, Any], parameters: dict[str, Any]) -> list[str]:
    """What is wrong with one call's arguments against the expected ones."""
    if not isinstance(got, dict):
        return [f"arguments are not an object: {got!r}"]
    errors = []
    for key, value in want.items():
        if key not in got:
            errors.append(f"{key} missing (want {value!r})")
        elif not same_value(got[key], value):
            errors.append(f"{key}={got[key]!r} (want {value!r})")
    properties = parameters.get("properties", {})
    for key, value in got.items():
        if key in want:
            continue
        default = properties.get(key, {}).get("default")
        if default is None or not same_value(value, default):
            errors.append(f"unexpected {key}={value!r}")
    return errors


WORD = re.compile(r"[^\W\d_]{2,}")  # two letters or more
MARKUP = re.compile(r"[{}\[\]<>_\\*#`]")
JSON_KEY = re.compile(r'"[^"]*"\s*:')


# the words of an assistant that cannot do it, or does not know
DECLINES = Assertion("regex", r"(?i)\b(sorry|unable|not able|can(no|['’])t|can not|(do|does)(n['’]t| not) "
                              r"(have|know|support)|no (access|way|information)|not (possible|available|sure))")


def word_assertions(spec: str | list[dict[str, Any]] | None) -> list[Assertion]:
    """A command's ``assert``: None (any words), "declines", or promptfoo-style assertions."""
    if spec is None:
        return []
    if spec == "declines":
        return [DECLINES]
    if isinstance(spec, str):
        raise ValueError(f'a command\'s "assert" is "declines" or a list of assertions (got {spec!r})')
    return [parse_assertion(item) for item in spec]


def _stems(text: str) -> set[str]:
    return {word.rstrip("s") for word in WORD.findall(text.lower())}


def words_errors(answer: str, prompt: str = "") -> list[str]:
    """Why ``answer`` is not words a speaker can say (empty when it is); ``prompt``: the system
    prompt, which an answer must not merely repeat."""
    errors = []
    said = _stems(answer)
    if said and said <= _stems(prompt):
        errors.append(f"the prompt said back ({answer.strip()[:40]!r})")
    if len(WORD.findall(answer)) < 2:
        errors.append(f"no words said ({answer.strip()[:40]!r})")
    if markup := sorted(set(MARKUP.findall(answer))):
        errors.append(f"markup {''.join(markup)!r} in the words")
    if key := JSON_KEY.search(answer):
        errors.append(f"a JSON key {key.group()!r} in the words")
    return errors


def check_calls(expect: list[dict[str, Any]], calls: list[Any], tools: list[dict[str, Any]],
                answer: str = "", prompt: str = "", says: Sequence[Assertion] = ()) -> CallCheck:
    """Judge one answer's tool calls (``ToolCall`` objects or dicts) against the expected ones;
    where no call is expected, ``answer`` (what was said): speakable (``words_errors``) and
    passing ``says`` (``word_assertions``)."""
    got = [_call_parts(c) for c in calls]
    want = [(e["name"], e.get("arguments") or {}) for e in expect]
    if sorted(name for name, _ in got) != sorted(name for name, _ in want):
        return CallCheck(False, False, f"called {[n for n, _ in got] or 'nothing'}, want {[n for n, _ in want] or 'nothing'}")
    if not want:
        errors = words_errors(answer, prompt)
        if not errors and says and not (verdict := check_all(says, answer)).passed:
            errors.append(f"the words fail {verdict.reason}")
        return CallCheck(True, not errors, "; ".join(errors))
    remaining = list(got)
    problems = []
    for name, arguments in want:  # each expected call against the first of its name that matches, else the first
        candidates = [i for i, (n, _) in enumerate(remaining) if n == name]
        errors_by = {i: argument_errors(remaining[i][1], arguments, _parameters(tools, name)) for i in candidates}
        best = next((i for i in candidates if not errors_by[i]), candidates[0])
        if errors_by[best]:
            problems.append(f"{name}: {'; '.join(errors_by[best])}")
        remaining.pop(best)
    return CallCheck(True, not problems, " | ".join(problems))


def unasked_actions(expect: list[dict[str, Any]], calls: list[Any], harmless: Sequence[str] = ()) -> list[str]:
    """The calls of ``calls`` no expected call accounts for, leaving out the ``harmless`` tools
    (those that only read or speak): what the car did that the driver did not ask for."""
    wanted = [e["name"] for e in expect]
    unasked = []
    for name, _ in map(_call_parts, calls):
        if name in wanted:
            wanted.remove(name)
        elif name not in harmless:
            unasked.append(name)
    return unasked


def percentiles(values: list[float | None], qs: tuple[float, ...] = (50, 95)) -> dict[str, float | None]:
    """``p50``, ``p95``, ... of the values that exist (None where none do)."""
    present = [v for v in values if v is not None]
    return {f"p{q:g}": float(np.percentile(present, q)) if present else None for q in qs}
