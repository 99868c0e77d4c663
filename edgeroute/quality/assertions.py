"""promptfoo's assertion vocabulary (``contains``, ``icontains``, ``regex``, ``is-json``, ``python``,
...), each able to fail, and each negatable with a ``not-`` prefix (``not-contains``, ``not-regex``).

An assertion is checked against one output and gives a Verdict: passed True or False with a
reason that names the assertion and what was found, or None when the check could not run here
(a JavaScript check without node): that is reported as unjudged, never as a pass.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from jsonschema.exceptions import SchemaError, best_match
from jsonschema.validators import validator_for

from edgeroute.errors import InputError
from edgeroute.quality.sandbox import (
    STRICT_JSON,
    SandboxLimits,
    SandboxResult,
    compile_python_check,
    first_json,
    run_javascript,
    run_python,
)

ASSERTION_TYPES = ("equals", "contains", "icontains", "contains-all", "icontains-all", "contains-any", "icontains-any",
                   "starts-with", "regex", "is-json", "contains-json", "json-schema", "python", "javascript")
NEGATION = "not-"
ASSERTION_KEYS = ("type", "value")
_STRING_VALUED = ("equals", "contains", "icontains", "starts-with", "regex", "python", "javascript")
_LIST_VALUED = ("contains-all", "icontains-all", "contains-any", "icontains-any")
_OPTIONAL_SCHEMA = ("is-json", "contains-json")
SANDBOXED_TYPES = ("python", "javascript")  # run in a subprocess: the costly checks
_FENCED_WHOLE = re.compile(r"\A```[^\n`]*\n(.*?)\n?[ \t]*```\Z", re.DOTALL)


@dataclass(frozen=True)
class Assertion:
    type: str  # one of ASSERTION_TYPES, optionally prefixed with "not-"
    value: Any = None

    @property
    def negated(self) -> bool:
        return self.type.startswith(NEGATION)

    @property
    def base_type(self) -> str:
        return self.type.removeprefix(NEGATION)


@dataclass(frozen=True)
class Verdict:
    passed: bool | None  # None: the check could not run here (unjudged, never a pass)
    reason: str


def parse_assertion(data: dict[str, Any] | Assertion, where: str = "") -> Assertion:
    """An assertion from its JSON form ``{"type": ..., "value": ...}``, its value checked for the
    type (a regex compiled, a schema checked, Python code compiled). ``where`` (e.g.
    ``tasks.jsonl:3``) prefixes the error messages."""
    prefix = f"{where}: " if where else ""
    if isinstance(data, Assertion):
        data = {"type": data.type, "value": data.value}
    elif not isinstance(data, dict):
        raise InputError(f"{prefix}an assertion is an object like {{\"type\": \"contains\", \"value\": \"Paris\"}} "
                         f"(got {_short(data)})")
    unknown = sorted(set(data) - set(ASSERTION_KEYS))
    if unknown:
        raise InputError(f"{prefix}unknown key(s) {', '.join(map(repr, unknown))} in assertion {_short(data)}: an "
                         "assertion has only \"type\" and \"value\"")
    kind = data.get("type")
    if not isinstance(kind, str) or kind.removeprefix(NEGATION) not in ASSERTION_TYPES:
        known = [*ASSERTION_TYPES, *(NEGATION + name for name in ASSERTION_TYPES)]
        close = difflib.get_close_matches(str(kind), known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise InputError(f"{prefix}assertion type {kind!r} is unknown{hint}: use one of {', '.join(ASSERTION_TYPES)}, "
                         f"each may be negated with a {NEGATION!r} prefix")
    assertion = Assertion(kind, data.get("value"))
    _validate_value(assertion, f"{prefix}assertion {kind!r}")
    return assertion


def _validate_value(assertion: Assertion, name: str) -> None:
    base, value = assertion.base_type, assertion.value
    if base in _STRING_VALUED:
        # equals "" asks for an empty answer; an empty contains/regex/code would match anything
        if not isinstance(value, str) or (base != "equals" and not value.strip()):
            raise InputError(f"{name} needs a \"value\" that is a non-empty string (got {_short(value)})")
        if base == "regex":
            try:
                re.compile(value)
            except re.error as err:
                raise InputError(f"{name}: {value!r} is not a valid regular expression ({err}): escape special "
                                 "characters with a backslash (\\. for a dot)") from None
        if base == "python":
            try:
                compile_python_check(value)
            except SyntaxError as err:
                raise InputError(f"{name}: the Python check does not compile ({err}): give one expression over "
                                 "`output`, or a function body that uses `return`") from None
    elif base in _LIST_VALUED:
        if not isinstance(value, list) or not value or not all(isinstance(v, str) and v.strip() for v in value):
            raise InputError(f"{name} needs a \"value\" that is a non-empty list of non-empty strings "
                             f"(got {_short(value)})")
    elif base == "json-schema" or (base in _OPTIONAL_SCHEMA and value is not None):
        if not isinstance(value, dict):
            raise InputError(f"{name} needs a \"value\" that is a JSON schema object, e.g. {{\"type\": \"object\"}} "
                             f"(got {_short(value)})" + (": or leave \"value\" out" if base in _OPTIONAL_SCHEMA else ""))
        try:
            validator_for(value).check_schema(value)
        except SchemaError as err:
            raise InputError(f"{name}: {_short(value)} is not a valid JSON schema ({err.message})") from None


def check(assertion: Assertion, output: str, limits: SandboxLimits | None = None) -> Verdict:
    """Whether ``output`` passes ``assertion``; python/javascript checks run in the sandbox with
    ``limits`` (its defaults when None)."""
    assertion = parse_assertion(assertion)
    if not isinstance(output, str):
        raise InputError(f"the output to check must be a string (got {type(output).__name__})")
    found, observation = _OBSERVERS[assertion.base_type](assertion.value, output, limits or SandboxLimits())
    passed = None if found is None else False if found is FAILED_TO_RUN else found != assertion.negated
    shown = "" if assertion.value is None else f" {_short(assertion.value)}"
    return Verdict(passed, f"{assertion.type}{shown}: {observation}")


def check_all(assertions: Sequence[Assertion], output: str, limits: SandboxLimits | None = None) -> Verdict:
    """All must pass: the first failure's verdict, else the first unjudged one's, else a pass.
    An empty list raises ValueError: with nothing to check nothing could fail, and what "no
    check" means is the caller's decision."""
    assertions = list(assertions)
    if not assertions:
        raise ValueError("check_all needs at least one assertion: with nothing to check, nothing could fail")
    unjudged = None
    for assertion in assertions:
        verdict = check(assertion, output, limits)
        if verdict.passed is False:
            return verdict
        if verdict.passed is None and unjudged is None:
            unjudged = verdict
    if unjudged is not None:
        return unjudged
    if len(assertions) == 1:
        return verdict
    return Verdict(True, f"all {len(assertions)} assertions passed ({', '.join(a.type for a in assertions)})")


# Each observer says whether the assertion's condition holds (None: could not tell) and what it
# saw: the same words serve a pass, a failure and a negated assertion's failure.
Observation = tuple[Any, str]  # True | False | None (could not tell) | FAILED_TO_RUN
FAILED_TO_RUN = object()  # a sandboxed check that errored: a failure even under "not-"


def _equals(value: str, output: str, limits: SandboxLimits) -> Observation:
    if output.strip() == value.strip():
        return True, "the output equals it"
    return False, f"the output is {_short(output.strip())}"


def _contains(value: str, output: str, ignore_case: bool) -> Observation:
    haystack, needle = (output.lower(), value.lower()) if ignore_case else (output, value)
    at = haystack.find(needle)
    if at >= 0:
        return True, f"found {_short(output[at:at + len(value)])} at character {at}"
    return False, f"not found in {_short(output)}"


def _contains_all(values: list[str], output: str, ignore_case: bool) -> Observation:
    haystack = output.lower() if ignore_case else output
    missing = [v for v in values if (v.lower() if ignore_case else v) not in haystack]
    if not missing:
        return True, f"all {len(values)} found"
    return False, f"missing {', '.join(_short(v) for v in missing)} in {_short(output)}"


def _contains_any(values: list[str], output: str, ignore_case: bool) -> Observation:
    haystack = output.lower() if ignore_case else output
    present = [v for v in values if (v.lower() if ignore_case else v) in haystack]
    if present:
        return True, f"found {_short(present[0])}"
    return False, f"none found in {_short(output)}"


def _starts_with(value: str, output: str, limits: SandboxLimits) -> Observation:
    text = output.lstrip()
    if text.startswith(value):
        return True, "the output starts with it"
    return False, f"the output starts with {_short(text[:len(value) + 20])}" if text else "the output is empty"


def _regex(value: str, output: str, limits: SandboxLimits) -> Observation:
    match = re.search(value, output)
    if match:
        return True, f"matched {_short(match.group(0))} at character {match.start()}"
    return False, f"no match in {_short(output)}"


def _is_json(schema: dict | None, output: str, limits: SandboxLimits) -> Observation:
    text = output.strip()
    fenced = _FENCED_WHOLE.match(text)
    try:
        data = STRICT_JSON.decode(fenced.group(1) if fenced else text)
    except ValueError as err:
        return False, f"the output is not JSON ({err}): {_short(output)}"
    return _matches(data, schema, "the output is JSON")


def _contains_json(schema: dict | None, output: str, limits: SandboxLimits) -> Observation:
    data = first_json(output)
    if data is None:
        return False, f"no JSON object or array in {_short(output)}"
    return _matches(data, schema, f"found JSON {_short(data)}")


def _json_schema(schema: dict, output: str, limits: SandboxLimits) -> Observation:
    """The whole output when it is JSON (a bare ``42`` or ``"yes"`` too), else its first JSON
    object or array."""
    text = output.strip()
    fenced = _FENCED_WHOLE.match(text)
    try:
        data = STRICT_JSON.decode(fenced.group(1) if fenced else text)
    except ValueError:
        data = first_json(output)
        if data is None:
            return False, f"no JSON value in {_short(output)}"
    return _matches(data, schema, f"JSON {_short(data)}")


def _matches(data: Any, schema: dict | None, seen: str) -> Observation:
    if schema is None:
        return True, seen
    error = best_match(validator_for(schema)(schema).iter_errors(data))
    if error is None:
        return True, f"{seen} matches the schema"
    where = f" at {error.json_path}" if error.json_path != "$" else ""
    return False, f"{seen} does not match the schema: {error.message}{where}"


def _sandboxed(result: SandboxResult) -> Observation:
    # a check that raised, timed out or hit a limit said nothing about the output: no negation passes it
    return (result.ok if result.returned or result.ok is None else FAILED_TO_RUN), result.reason


def _python(body: str, output: str, limits: SandboxLimits) -> Observation:
    return _sandboxed(run_python(body, output, limits))


def _javascript(body: str, output: str, limits: SandboxLimits) -> Observation:
    return _sandboxed(run_javascript(body, output, limits))


_OBSERVERS: dict[str, Callable[[Any, str, SandboxLimits], Observation]] = {
    "equals": _equals,
    "contains": lambda value, output, limits: _contains(value, output, ignore_case=False),
    "icontains": lambda value, output, limits: _contains(value, output, ignore_case=True),
    "contains-all": lambda value, output, limits: _contains_all(value, output, ignore_case=False),
    "icontains-all": lambda value, output, limits: _contains_all(value, output, ignore_case=True),
    "contains-any": lambda value, output, limits: _contains_any(value, output, ignore_case=False),
    "icontains-any": lambda value, output, limits: _contains_any(value, output, ignore_case=True),
    "starts-with": _starts_with,
    "regex": _regex,
    "is-json": _is_json,
    "contains-json": _contains_json,
    "json-schema": _json_schema,
    "python": _python,
    "javascript": _javascript,
}


def _short(value: Any, limit: int = 60) -> str:
    if isinstance(value, str):
        text = repr(value)
    else:
        try:
            text = json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError):
            text = repr(value)
    return text if len(text) <= limit else text[:limit - 1] + "\u2026"
