"""Every assertion type can fail: each passes a right answer and fails an empty one, gibberish, a
changed value or a truncated JSON; a "not-" prefix flips pass and fail (never unjudged); a bad
assertion is refused when it is read, not when it would have silently passed."""

from __future__ import annotations

import shutil

import pytest

from edgeroute.errors import InputError
from edgeroute.quality import sandbox
from edgeroute.quality.assertions import ASSERTION_TYPES, Assertion, Verdict, check, check_all, parse_assertion
from edgeroute.quality.sandbox import SandboxLimits

requires_node = pytest.mark.skipif(shutil.which("node") is None,
                                   reason="node is not installed: JavaScript assertions cannot be tested here")

ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"const": 42}}, "required": ["answer"]}

# type: (assertion, a passing output, failing outputs)
CASES = {
    "equals": ({"type": "equals", "value": "Paris"}, "  Paris\n", ["", "xq zzv", "Lyon", "Paris is the capital"]),
    "contains": ({"type": "contains", "value": "Paris"}, "The capital is Paris.",
                 ["", "xq zzv", "The capital is Lyon.", "the capital is paris"]),
    "icontains": ({"type": "icontains", "value": "Paris"}, "the capital is PARIS", ["", "xq zzv", "the capital is Lyon"]),
    "contains-all": ({"type": "contains-all", "value": ["airport", "Cork"]}, "Navigating to the airport in Cork.",
                     ["", "xq zzv", "Navigating to the airport in Dublin.", "the Airport in cork"]),
    "icontains-all": ({"type": "icontains-all", "value": ["airport", "Cork"]}, "the AIRPORT in cork",
                      ["", "xq zzv", "the airport in Dublin"]),
    "contains-any": ({"type": "contains-any", "value": ["yes", "Yes"]}, "Yes, it is.", ["", "xq zzv", "No.", "YES"]),
    "icontains-any": ({"type": "icontains-any", "value": ["yes", "sure"]}, "SURE thing", ["", "xq zzv", "No."]),
    "starts-with": ({"type": "starts-with", "value": "Sure"}, "  Sure, here it is", ["", "xq zzv", "I cannot. Sure"]),
    "regex": ({"type": "regex", "value": r"\b42\b"}, "The answer is 42.",
              ["", "xq zzv", "The answer is 43.", "The answer is 420."]),
    "is-json": ({"type": "is-json"}, '{"answer": 42}', ["", "xq zzv", '{"answer": 4', 'Here: {"answer": 42}']),
    "contains-json": ({"type": "contains-json"}, 'Here you go: {"answer": 42} done.', ["", "xq zzv", 'Here: {"answer": 4']),
    "json-schema": ({"type": "json-schema", "value": ANSWER_SCHEMA}, '```json\n{"answer": 42}\n```',
                    ["", "xq zzv", '{"answer": 43}', '{"answer": 4', '{"reply": 42}']),
    "python": ({"type": "python", "value": "'Paris' in output"}, "Paris", ["", "xq zzv", "Lyon"]),
    "javascript": ({"type": "javascript", "value": "output.includes('Paris')"}, "Paris", ["", "xq zzv", "Lyon"]),
}


def _cases():
    return [pytest.param(*CASES[name], id=name, marks=[requires_node] if name == "javascript" else [])
            for name in ASSERTION_TYPES]


def test_every_assertion_type_has_a_case():
    assert set(CASES) == set(ASSERTION_TYPES)


@pytest.mark.parametrize("data, right, wrongs", _cases())
def test_each_assertion_type_passes_a_right_answer(data, right, wrongs):
    verdict = check(parse_assertion(data), right)
    assert verdict.passed is True, verdict.reason


@pytest.mark.parametrize("data, right, wrongs", _cases())
def test_each_assertion_type_fails_empty_gibberish_and_changed_answers(data, right, wrongs):
    assertion = parse_assertion(data)
    for wrong in wrongs:
        verdict = check(assertion, wrong)
        assert verdict.passed is False, (wrong, verdict.reason)
        assert verdict.reason.startswith(data["type"]), verdict.reason


@pytest.mark.parametrize("data, right, wrongs", _cases())
def test_not_prefix_flips_pass_and_fail(data, right, wrongs):
    negated = parse_assertion({**data, "type": "not-" + data["type"]})
    verdict = check(negated, right)
    assert verdict.passed is False and verdict.reason.startswith("not-" + data["type"]), verdict.reason
    assert check(negated, wrongs[-1]).passed is True


def test_icontains_fails_on_an_answer_without_the_value():
    verdict = check(Assertion("icontains", "Paris"), "The capital of France is Lyon.")
    assert verdict == Verdict(False, "icontains 'Paris': not found in 'The capital of France is Lyon.'")


def test_negated_reason_says_what_was_found():
    verdict = check(parse_assertion({"type": "not-regex", "value": r"\d+"}), "Take exit 12 onto the N25.")
    assert verdict == Verdict(False, r"not-regex '\\d+': matched '12' at character 10")
    assert check(Assertion("not-contains", "sorry"), "I am sorry.").reason == "not-contains 'sorry': found 'sorry' at character 5"


def test_json_schema_failure_quotes_the_schema_error():
    verdict = check(Assertion("json-schema", ANSWER_SCHEMA), 'Result: {"answer": 43}')
    assert verdict.passed is False
    assert "42 was expected at $.answer" in verdict.reason, verdict.reason


def test_json_schema_checks_a_bare_json_answer():
    assert check(Assertion("json-schema", {"const": 42}), " 42\n").passed is True
    assert check(Assertion("json-schema", {"enum": ["yes", "no"]}), '"maybe"').passed is False


def test_is_json_accepts_one_fenced_block_and_checks_a_schema():
    assert check(Assertion("is-json"), '```json\n{"answer": 42}\n```').passed is True
    assert check(Assertion("is-json", ANSWER_SCHEMA), '{"answer": 42}').passed is True
    assert check(Assertion("is-json", ANSWER_SCHEMA), '{"answer": "42"}').passed is False



@pytest.mark.parametrize("output", ["NaN", "-Infinity", '{"answer": NaN}', '```json\n[1, Infinity]\n```'])
@pytest.mark.parametrize("data", [{"type": "is-json"}, {"type": "contains-json"},
                                  {"type": "json-schema", "value": {"type": ["number", "object", "array"]}}])
def test_json_assertions_fail_nan_and_infinity_which_are_not_json(data, output):
    """Python's json reads them; JSON.parse, and every consumer of the answer, refuses them."""
    verdict = check(parse_assertion(data), output)
    assert verdict.passed is False, verdict.reason

def test_contains_json_checks_a_schema():
    assert check(Assertion("contains-json", ANSWER_SCHEMA), 'Sure! {"answer": 42}').passed is True
    assert check(Assertion("contains-json", ANSWER_SCHEMA), 'Sure! {"answer": 41}').passed is False


def test_python_assertion_fails_with_the_sandbox_reason():
    verdict = check(Assertion("python", "assert len(output) > 100, 'too short'\nreturn True"), "short")
    assert verdict.passed is False and "AssertionError: too short" in verdict.reason, verdict.reason


# --- unjudged ---------------------------------------------------------------------------------

def test_javascript_is_unjudged_without_node_even_when_negated(monkeypatch):
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    for kind in ("javascript", "not-javascript"):
        verdict = check(Assertion(kind, "true"), "anything")
        assert verdict.passed is None and "node is not installed" in verdict.reason


def test_check_all_is_unjudged_when_one_could_not_run_and_none_failed(monkeypatch):
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    unjudged = Assertion("javascript", "true")
    assert check_all([Assertion("contains", "Paris"), unjudged], "Paris").passed is None
    failed = check_all([unjudged, Assertion("contains", "Paris")], "Lyon")
    assert failed.passed is False and failed.reason.startswith("contains 'Paris'")


# --- check_all --------------------------------------------------------------------------------

def test_check_all_with_no_assertions_raises():
    with pytest.raises(ValueError, match="at least one assertion"):
        check_all([], "anything")


def test_check_all_returns_the_first_failure():
    assertions = [Assertion("contains", "airport"), Assertion("icontains", "cork"), Assertion("not-regex", r"\d")]
    assert check_all(assertions, "The airport in Cork").passed is True
    verdict = check_all(assertions, "The airport in Dublin, gate 4")
    assert verdict.passed is False and verdict.reason.startswith("icontains 'cork'"), verdict.reason


# --- parse errors -----------------------------------------------------------------------------

@pytest.mark.parametrize("data, message", [
    ({"type": "icontain", "value": "x"}, r"assertion type 'icontain' is unknown \(did you mean 'icontains'\?\)"),
    ({"value": "x"}, "assertion type None is unknown"),
    ({"type": "contains"}, "needs a \"value\" that is a non-empty string"),
    ({"type": "contains", "value": ""}, "needs a \"value\" that is a non-empty string"),
    ({"type": "contains", "value": ["a"]}, "needs a \"value\" that is a non-empty string"),
    ({"type": "contains-all", "value": "a"}, "non-empty list of non-empty strings"),
    ({"type": "icontains-any", "value": []}, "non-empty list of non-empty strings"),
    ({"type": "regex", "value": "(unclosed"}, "'\\(unclosed' is not a valid regular expression"),
    ({"type": "json-schema"}, "needs a \"value\" that is a JSON schema object"),
    ({"type": "json-schema", "value": {"type": "colour"}}, "is not a valid JSON schema"),
    ({"type": "is-json", "value": "object"}, "or leave \"value\" out"),
    ({"type": "python", "value": "return ("}, "the Python check does not compile"),
    ({"type": "contains", "vale": "Paris"}, "unknown key\\(s\\) 'vale'"),
    ({"type": "contains", "value": "Paris", "weight": 2}, "unknown key\\(s\\) 'weight'"),
    ("contains Paris", "an assertion is an object"),
], ids=["unknown-type", "no-type", "missing-value", "empty-value", "list-for-string", "string-for-list", "empty-list",
        "bad-regex", "missing-schema", "bad-schema", "schema-not-object", "python-syntax", "typo-key", "extra-key", "not-object"])
def test_bad_assertions_are_refused_when_read(data, message):
    with pytest.raises(InputError, match=message):
        parse_assertion(data, "tasks.jsonl:3")


def test_parse_errors_say_where():
    with pytest.raises(InputError, match=r"^tasks.jsonl:3: assert\[0\]: assertion 'regex'"):
        parse_assertion({"type": "regex", "value": "["}, "tasks.jsonl:3: assert[0]")


def test_check_refuses_an_assertion_built_without_parsing():
    with pytest.raises(InputError, match="unknown"):
        check(Assertion("contain", "x"), "x")



@pytest.mark.parametrize("kind", ["python", "javascript"])
def test_a_negated_check_whose_grading_result_has_no_boolean_pass_still_fails(kind):
    if kind == "javascript" and shutil.which("node") is None:
        pytest.skip("node is not installed")
    for malformed in ('{"pass": "false"}', '{"pass": 1}'):
        body = f"return {malformed}" if kind == "python" else f"return {malformed};"
        for negated in (kind, f"not-{kind}"):
            verdict = check(parse_assertion({"type": negated, "value": body}), "any answer at all")
            assert verdict.passed is False and "not a bool" in verdict.reason, (negated, verdict.reason)

@pytest.mark.parametrize("kind", ["python", "javascript"])
def test_a_negated_check_that_errors_or_times_out_still_fails(kind):
    if kind == "javascript" and shutil.which("node") is None:
        pytest.skip("node is not installed")
    raising = "throw new Error('boom')" if kind == "javascript" else "1 / 0"
    verdict = check(parse_assertion({"type": f"not-{kind}", "value": raising}), "anything")
    assert verdict.passed is False and ("boom" in verdict.reason or "ZeroDivisionError" in verdict.reason)
    looping = "while (true) {}" if kind == "javascript" else "while True:\n    pass"
    verdict = check(parse_assertion({"type": f"not-{kind}", "value": looping}), "x", SandboxLimits(seconds=1.5))
    assert verdict.passed is False and "timed out" in verdict.reason
    falsy = "false" if kind == "javascript" else "False"
    assert check(parse_assertion({"type": f"not-{kind}", "value": falsy}), "x").passed is True
