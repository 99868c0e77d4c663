"""Judging answers on the device: promptfoo-style assertions (``assertions``) and the sandbox that
runs Python and JavaScript checks in a child process with limits (``sandbox``).

Device-side: the standard library, numpy and jsonschema only (node for JavaScript checks, when
installed).
"""

from edgeroute.quality.assertions import ASSERTION_TYPES, Assertion, Verdict, check, check_all, parse_assertion
from edgeroute.quality.sandbox import (
    SandboxLimits,
    SandboxResult,
    code_block,
    first_json,
    run_javascript,
    run_python,
)

__all__ = ["ASSERTION_TYPES", "Assertion", "SandboxLimits", "SandboxResult", "Verdict", "check", "check_all", "code_block",
           "first_json", "parse_assertion", "run_javascript", "run_python"]
