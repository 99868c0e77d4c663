"""The sandbox runs a check in a child process: its value comes back, and what a check must not do
(loop, allocate without end, write big files, open sockets, spawn processes, forge its result)
fails it with a reason that says so. No test ever addresses anything but 127.0.0.1."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from edgeroute.errors import InputError
from edgeroute.quality import sandbox
from edgeroute.quality.sandbox import SandboxLimits, code_block, first_json, run_javascript, run_python

requires_node = pytest.mark.skipif(shutil.which("node") is None,
                                   reason="node is not installed: the JavaScript sandbox cannot be tested here")

MODEL_ANSWER = """Here is the function:

```python
def reverse_string(s):
    return s[::-1]
```

It slices the string backwards."""

BUGGY_ANSWER = MODEL_ANSWER.replace("s[::-1]", "s[1:]")

TEST_MODEL_FUNCTION = """
namespace = {}
exec(code_block(output, "python"), namespace)
reverse_string = namespace["reverse_string"]
assert reverse_string("abc") == "cba"
assert reverse_string("") == ""
return True
"""


# --- Python: values and failures --------------------------------------------------------------

def test_python_expression_passes_when_truthy_and_fails_when_falsy():
    assert run_python("'Paris' in output", "The capital is Paris.").ok is True
    result = run_python("'Paris' in output", "The capital is Lyon.")
    assert result.ok is False and result.value is False and result.reason == "returned False"


def test_python_function_body_returns_its_value():
    result = run_python("words = output.split()\nreturn len(words)", "one two three")
    assert (result.ok, result.value, result.reason) == (True, 3, "returned 3")


def test_python_assertion_error_fails_naming_the_line():
    result = run_python("n = len(output)\nassert n > 10, 'too short'\nreturn True", "short")
    assert result.ok is False
    assert result.reason == "AssertionError: too short (line 2: assert n > 10, 'too short')"


def test_model_written_function_extracted_with_code_block_passes_its_asserts():
    result = run_python(TEST_MODEL_FUNCTION, MODEL_ANSWER)
    assert result.ok is True, result.reason


def test_model_written_function_with_a_bug_fails_its_asserts():
    result = run_python(TEST_MODEL_FUNCTION, BUGGY_ANSWER)
    assert result.ok is False
    assert result.reason.startswith("AssertionError (line 5: assert reverse_string(\"abc\") == \"cba\")"), result.reason


def test_python_check_that_does_not_compile_fails_saying_so():
    result = run_python("return (", "")
    assert result.ok is False and result.reason.startswith("the check does not compile"), result.reason


def test_grading_result_dict_gives_pass_and_reason():
    result = run_python("{'pass': False, 'reason': 'the answer names no city'}", "")
    assert (result.ok, result.reason) == (False, "the answer names no city")
    assert run_python("{'pass': True}", "").ok is True
    assert run_python("{'pass': 'yes'}", "").ok is False  # not a bool: refused, not read as truthy


def test_value_that_is_not_json_comes_back_as_its_repr():
    result = run_python("{3}", "")
    assert (result.ok, result.value) == (True, "{3}")


def test_exiting_the_interpreter_fails_the_check():
    assert run_python("import sys\nsys.exit(0)", "").ok is False
    result = run_python("import os\nos._exit(0)", "")
    assert result.ok is False and result.reason.startswith("the check exited without a result"), result.reason


def test_small_files_are_written_in_a_working_folder_that_is_removed_afterwards():
    body = "import os\nopen('note.txt', 'w').write('hi')\nassert open('note.txt').read() == 'hi'\nreturn os.getcwd()"
    result = run_python(body, "")
    assert result.ok is True, result.reason
    assert not Path(result.value).exists()


# --- Python: limits and refusals --------------------------------------------------------------

def test_python_infinite_loop_is_killed_at_the_wall_limit():
    start = time.monotonic()
    result = run_python("while True:\n    pass", "", SandboxLimits(seconds=1.0))
    assert (result.ok, result.reason) == (False, "timed out after 1.0 s")
    assert time.monotonic() - start < 10  # killed, not waited for (generous: the machine is shared)


def test_python_busy_loop_is_stopped_by_the_cpu_limit():
    result = run_python("while True:\n    pass", "", SandboxLimits(seconds=20.0, cpu_seconds=1))
    assert (result.ok, result.reason) == (False, "CPU time limit of 1 s exceeded")


def test_huge_allocation_fails_on_the_memory_limit():
    result = run_python("block = bytearray(4 * 1024**3)\nreturn True", "", SandboxLimits(memory_bytes=256 * 1024**2))
    assert (result.ok, result.reason) == (False, "memory limit of 256 MiB exceeded (MemoryError)")


def test_writing_a_10_mb_file_fails_on_the_file_size_limit():
    result = run_python("open('big.bin', 'wb').write(b'0' * 10_000_000)\nreturn True", "")
    assert result.ok is False and result.reason.startswith("file size limit of 1 MiB exceeded"), result.reason


@pytest.mark.parametrize(("body", "refused"), [
    ("import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)", "network"),
    ("import urllib.request\nurllib.request.urlopen('http://127.0.0.1:9', timeout=1)", "network"),
    ("import socket\ns = socket.socket()\ns.bind(('127.0.0.1', 0))", "network"),
    ("import subprocess\nsubprocess.run(['true'])", "process creation"),
    ("import os\nos.system('true')", "process creation"),
    ("import os\nos.fork()", "process creation"),
], ids=["socket", "urllib", "bind", "subprocess", "os.system", "fork"])
def test_network_and_process_creation_are_refused(body, refused):
    result = run_python(body + "\nreturn True", "")
    assert result.ok is False and result.reason.startswith(f"{refused} is disabled in the sandbox"), result.reason


def test_refused_network_fails_the_check_even_when_it_catches_the_error():
    body = "import socket\ntry:\n    socket.create_connection(('127.0.0.1', 9))\nexcept Exception:\n    pass\nreturn True"
    result = run_python(body, "")
    assert result.ok is False and result.reason.startswith("network is disabled in the sandbox"), result.reason


def test_printed_lines_cannot_forge_a_result():
    forged = '@@edgeroute-check-result-0123@@{"ok": true, "value": true, "reason": "forged"}'
    body = (f"import os, sys\nprint({forged!r})\nsys.__stdout__.write({forged!r} + '\\n')\n"
            f"os.write(1, b'\\n' + {forged!r}.encode() + b'\\n')\nreturn False")
    result = run_python(body, "")
    assert (result.ok, result.reason) == (False, "returned False")


def test_limits_refuse_values_that_are_not_positive():
    with pytest.raises(InputError, match=r"SandboxLimits.seconds must be a positive number \(got 0\)"):
        SandboxLimits(seconds=0)
    with pytest.raises(InputError, match="memory_bytes"):
        SandboxLimits(memory_bytes=-1)


# --- helpers ----------------------------------------------------------------------------------

def test_code_block_prefers_the_fence_tagged_with_the_language():
    text = "```bash\npip install x\n```\n\n```py\nprint(1)\n```"
    assert code_block(text, "python") == "print(1)"
    assert code_block(text) == "pip install x"


def test_code_block_takes_an_untagged_fence_and_falls_back_to_the_whole_text():
    assert code_block("```\nconst a = 1;\n```", "javascript") == "const a = 1;"
    assert code_block("  no fence here  ") == "no fence here"
    assert code_block("```python\ndef f():\n    return 1") == "def f():\n    return 1"  # a truncated answer


def test_first_json_prefers_a_fenced_block_over_an_earlier_bracket():
    assert first_json('As noted [1], here:\n```json\n{"a": 1}\n```') == {"a": 1}
    assert first_json('The result is {"a": [1, 2]} as asked.') == {"a": [1, 2]}
    assert first_json('truncated {"a": 1') is None


# --- JavaScript -------------------------------------------------------------------------------

@requires_node
def test_javascript_expression_passes_when_truthy_and_fails_when_falsy():
    assert run_javascript("output.includes('Paris')", "The capital is Paris.").ok is True
    result = run_javascript("output.includes('Paris');", "The capital is Lyon.")
    assert (result.ok, result.value, result.reason) == (False, False, "returned false")


@requires_node
def test_javascript_function_body_that_throws_fails_naming_the_line():
    result = run_javascript("const n = output.length;\nif (n < 10) throw new Error('too short');\nreturn true;", "short")
    assert result.ok is False
    assert result.reason == "Error: too short (line 2: if (n < 10) throw new Error('too short');)"


@requires_node
def test_javascript_model_written_function_extracted_with_code_block():
    answer = "Sure:\n```js\nfunction add(a, b) { return a + b; }\n```"
    body = 'const add = new Function(codeBlock(output, "javascript") + "\\nreturn add;")();\nreturn add(2, 3) === 5;'
    assert run_javascript(body, answer).ok is True
    assert run_javascript(body, answer.replace("a + b", "a - b")).ok is False
    assert run_javascript("firstJson(output).answer === 42", 'Here: {"answer": 42}').ok is True


@requires_node
def test_javascript_infinite_loop_is_killed_at_the_wall_limit():
    result = run_javascript("while (true) {}", "", SandboxLimits(seconds=1.0))
    assert (result.ok, result.reason) == (False, "timed out after 1.0 s")


@requires_node
@pytest.mark.parametrize("body, refused", [
    ("require('net')", "network is disabled in the sandbox"),
    ("require('node:child_process').execSync('true')", "process creation is disabled in the sandbox"),
    ("await fetch('http://127.0.0.1:9')", "network is disabled in the sandbox"),
    ("await import('node:net')", "dynamic import() is disabled in the sandbox"),
], ids=["net", "child_process", "fetch", "import"])
def test_javascript_network_and_processes_are_refused(body, refused):
    result = run_javascript(body, "")
    assert result.ok is False and result.reason.startswith(refused), result.reason


def test_javascript_is_unjudged_when_node_is_missing(monkeypatch):
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    result = run_javascript("true", "anything")
    assert (result.ok, result.reason) == (None, "node is not installed: JavaScript checks are skipped")
