"""Judging answers, on the device: promptfoo-style assertions (``assertions``), the sandbox that
runs Python and JavaScript checks in a child process with limits (``sandbox``), task cases and
their files (``cases``), exact bounds on pass rates (``bounds``), runs of decoding modes over
cases (``runs``) and ``edgeroute eval`` (``evaluation``).

Device-side: the standard library, numpy, jsonschema and rich (node for JavaScript checks,
matplotlib for the plot, llama-cpp-python for its row, when installed).
"""

from edgeroute.quality.assertions import ASSERTION_TYPES, Assertion, Verdict, check, check_all, parse_assertion
from edgeroute.quality.bounds import PairedComparison, compare_paired, interval, lower_bound, upper_bound
from edgeroute.quality.cases import TaskCase, load_cases, parse_case
from edgeroute.quality.evaluation import EvalReport, evaluate, parse_modes, plot_report, print_report
from edgeroute.quality.runs import RunConfig, eligibility, run_cases, summarize
from edgeroute.quality.sandbox import (
    SandboxLimits,
    SandboxResult,
    code_block,
    first_json,
    run_javascript,
    run_python,
)

__all__ = ["ASSERTION_TYPES", "Assertion", "EvalReport", "PairedComparison", "RunConfig", "SandboxLimits",
           "SandboxResult", "TaskCase", "Verdict", "check", "check_all", "code_block", "compare_paired", "eligibility",
           "evaluate", "first_json", "interval", "load_cases", "lower_bound", "parse_assertion", "parse_case",
           "parse_modes", "plot_report", "print_report", "run_cases", "run_javascript", "run_python", "summarize",
           "upper_bound"]
