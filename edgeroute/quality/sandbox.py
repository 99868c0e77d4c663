"""Run a check (user-written, or model-written code under test) in a child process with limits.

What it guards against: code that does by accident what a check must not do here. It loops
(killed at a wall-clock and a CPU-time limit, with its whole process group), allocates without
end (an address-space limit for Python, a V8 heap limit for node), writes large files (a file
size limit; the working directory, ``HOME`` and ``TMPDIR`` are a fresh temporary folder that is
removed afterwards), opens sockets (Python: an audit hook refuses connect/bind/name lookups and
sends; node: ``net``, ``dns``, ``http(s)``, ``tls``, ``dgram``, ``fetch`` and dynamic ``import()``
are refused) or spawns processes (Python: the audit hook refuses fork/exec/spawn/``subprocess``;
node: ``child_process``, ``cluster`` and ``worker_threads`` are refused).

What it does not guard against: a determined adversary. The child runs as the same user with
the same file permissions (it can read, and write small files, wherever that user can); Python
code can load ``ctypes`` and call libc directly, which no audit hook sees, and node code can
reach internals the runner did not think to block. Run checks you would not run on your own
machine in a container or VM instead.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import json
import math
import os
import re
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import types
from dataclasses import dataclass
from pathlib import Path

from edgeroute.errors import InputError

MiB = 1024 * 1024
RESULT_VALUE_LIMIT = 16 * 1024  # characters of a check's value sent back; beyond this, a truncated repr
STDERR_TAIL = 2000  # bytes of the child's stderr kept for "exited without a result" reasons


@dataclass(frozen=True)
class SandboxLimits:
    seconds: float = 5.0  # wall clock, startup included
    cpu_seconds: int = 5  # RLIMIT_CPU
    memory_bytes: int = 512 * MiB  # RLIMIT_AS for Python; node's --max-old-space-size
    file_bytes: int = 1 * MiB  # RLIMIT_FSIZE: any one file the check writes, its stdout included

    def __post_init__(self) -> None:
        for name in ("seconds", "cpu_seconds", "memory_bytes", "file_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise InputError(f"SandboxLimits.{name} must be a positive number (got {value!r}): "
                                 f"leave it out for the default {getattr(SandboxLimits, name)!r}")


@dataclass(frozen=True)
class SandboxResult:
    ok: bool | None  # True: ran and the value was truthy; False: falsy, raised, timed out, hit a limit; None: could not run
    value: object  # the check's value (JSON-able) when it ran, else None
    reason: str  # short and human: "returned False", "AssertionError (line 3: ...)", "timed out after 5.0 s"
    # the check ran to a verdict (not an error, a limit, a refusal, a "pass" that is no bool): what negation may flip
    returned: bool = False


# code_block, first_json and compile_python_check run in the parent (assertions) and, as source
# text (inspect.getsource), in the Python child: one definition for both. They may use only
# ast, json, re and textwrap, and builtins in their annotations.


def code_block(text: str, language: str | None = None) -> str:
    """The first fenced (```) block's content, dedented; with ``language``, the first block tagged
    with it (``python``/``py``, ``javascript``/``js``, ...) or untagged, else the first block. A
    text with no fence comes back whole, stripped. An unclosed fence (a truncated answer) runs to
    the end of the text."""
    aliases = {"python": ("python", "py", "python3"), "javascript": ("javascript", "js", "node", "nodejs")}
    fence = re.compile(r"^[ \t]*```[ \t]*([^\s`]*)[^\n]*\n(.*?)(?:^[ \t]*```|\Z)", re.MULTILINE | re.DOTALL)
    blocks = [(tag.lower(), content) for tag, content in fence.findall(text)]
    if not blocks:
        return text.strip()
    chosen = blocks[0][1]
    if language:
        wanted = aliases.get(language.lower(), (language.lower(),))
        chosen = next((content for tag, content in blocks if not tag or tag in wanted), chosen)
    return textwrap.dedent(chosen).strip("\n")


def _not_json(constant: str) -> object:
    raise ValueError(f"{constant} is not JSON")


# JSON as parsers other than Python's read it: NaN and Infinity, which Python's json reads, raise ValueError
STRICT_JSON = json.JSONDecoder(parse_constant=_not_json)


def first_json(text: str) -> object:
    """The first JSON object or array in ``text`` (a fenced block's first, so a footnote such as
    ``[1]`` before it does not win), or None when there is none. NaN and Infinity, which
    Python's json reads, are not JSON: a value holding them is none."""
    candidates = [code_block(text, "json"), text] if "```" in text else [text]
    for candidate in candidates:
        for start in re.finditer(r"[{\[]", candidate):
            try:
                return STRICT_JSON.raw_decode(candidate, start.start())[0]
            except ValueError:
                continue
    return None


def compile_python_check(body: str) -> types.CodeType:
    """A check as a module defining ``_check(output)``: a single expression becomes its return
    value, anything else is its body (``return`` gives the value). Line numbers are the body's.
    Raises SyntaxError."""
    source = textwrap.dedent(body)
    try:
        expression = ast.parse(source, "<check>", mode="eval").body
        statements = [ast.copy_location(ast.Return(value=expression), expression)]
    except SyntaxError:
        statements = ast.parse(source, "<check>").body
    if not statements:
        raise SyntaxError("the check is empty")
    module = ast.parse("def _check(output):\n    pass\n")
    module.body[0].body = statements
    return compile(module, "<check>", "exec")


# The Python child's own part (the helpers above are prepended to it). It reads the request
# from stdin, so no user text is ever part of a source file or a command line.
_PYTHON_CHILD_MAIN = r'''
class SandboxViolation(RuntimeError):
    """Raised by the audit hook: the check tried something the sandbox refuses."""


REFUSED_EVENTS = {
    "network": frozenset({"socket.connect", "socket.bind", "socket.getaddrinfo", "socket.gethostbyname",
                          "socket.gethostbyaddr", "socket.getnameinfo", "socket.sendto", "socket.sendmsg"}),
    "process creation": frozenset({"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
                                   "os.fork", "os.forkpty", "pty.spawn", "os.startfile"}),
}


class Discard(io.TextIOBase):
    """The check's own prints: nobody reads them, and they must not fill the result's channel."""

    def writable(self):
        return True

    def write(self, text):
        return len(text)


def short_repr(value, limit=200):
    try:
        text = repr(value)
    except Exception:
        text = f"<{type(value).__name__} without a repr>"
    return text if len(text) <= limit else text[:limit - 1] + "\u2026"


def jsonable(value, dumps):
    try:
        if len(dumps(value)) <= RESULT_VALUE_LIMIT:
            return value
    except (TypeError, ValueError, RecursionError):
        pass
    return short_repr(value, RESULT_VALUE_LIMIT)


def judge(value):
    # (ok, reason, verdict): a GradingResult whose "pass" is no bool is no verdict on the output,
    # so a negated check may not flip it into a pass
    if isinstance(value, dict) and "pass" in value:  # promptfoo's GradingResult
        if not isinstance(value["pass"], bool):
            return False, f"the check returned a 'pass' that is not a bool: {short_repr(value['pass'], 80)}", False
        return value["pass"], str(value.get("reason") or ("passed" if value["pass"] else "failed")), True
    return bool(value), f"returned {short_repr(value)}", True


def describe(error, lines, limits):
    if isinstance(error, MemoryError):
        return f"memory limit of {limits['memory']} exceeded (MemoryError)"
    if isinstance(error, OSError) and error.errno == errno.EFBIG:
        return f"file size limit of {limits['file']} exceeded ({error})"
    text = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    frames = [frame for frame in traceback.extract_tb(error.__traceback__) if frame.filename == "<check>"]
    if frames and 0 < frames[-1].lineno <= len(lines):
        text += f" (line {frames[-1].lineno}: {lines[frames[-1].lineno - 1].strip()})"
    return text


def sandbox_main():
    # Taken before user code runs, so a check that patches json.dumps or os.write cannot forge the result.
    dumps, write, exit_now = json.dumps, os.write, os._exit
    request = json.loads(sys.stdin.buffer.read().decode("utf-8"))
    marker, body, output, limits = request["marker"], request["code"], request["output"], request["limits"]
    sys.stdout = sys.stderr = Discard()

    def report(ok, value, reason, returned=False):
        line = dumps({"ok": ok, "value": jsonable(value, dumps), "reason": reason, "returned": returned})
        write(1, f"\n{marker}{line}\n".encode())
        exit_now(0)  # threads or atexit handlers the check left behind do not get to run on

    try:
        code = compile_python_check(body)
    except SyntaxError as error:
        report(False, None, f"the check does not compile: {error}")
    violations = []

    def refuse(event, args):
        for kind, events in REFUSED_EVENTS.items():
            if event in events:
                violations.append(f"{kind} is disabled in the sandbox ({event})")
                raise SandboxViolation(violations[-1])

    namespace = {"__name__": "__check__", "__builtins__": __builtins__, "output": output,
                 "code_block": code_block, "first_json": first_json}
    sys.addaudithook(refuse)
    try:
        exec(code, namespace)
        value = namespace["_check"](output)
        ok, reason, returned = judge(value)
    except BaseException as error:  # SystemExit and KeyboardInterrupt are a failed check too
        ok, value, reason, returned = False, None, describe(error, body.splitlines(), limits), False
    if violations:  # even when the check caught the refusal: what it did was not what it meant to do
        ok, reason, returned = False, violations[0], False
    report(ok, value, reason, returned)


sandbox_main()
'''


@functools.cache
def _python_child_source() -> str:
    header = ("from __future__ import annotations\n\n"
              "import ast\nimport errno\nimport io\nimport json\nimport os\nimport re\nimport sys\n"
              "import textwrap\nimport traceback\nimport types\n\n"
              f"RESULT_VALUE_LIMIT = {RESULT_VALUE_LIMIT}\n\n\n")
    helpers = "\n\n".join(inspect.getsource(f) for f in (code_block, first_json, compile_python_check))
    return header + helpers + _PYTHON_CHILD_MAIN


# The node child: guards, the same helpers, one check, one result line. Written into the
# check's temporary folder and run as the main script; the request comes on stdin.
_JAVASCRIPT_CHILD = r'''"use strict";
const fs = require("fs");
const util = require("util");
const vm = require("vm");
const Module = require("module");

// Taken before user code runs, so a check that patches them cannot forge the result.
const writeSync = fs.writeSync;
const stringify = JSON.stringify;
const exitNow = process.exit.bind(process);
const request = JSON.parse(fs.readFileSync(0, "utf8"));
const VALUE_LIMIT = __VALUE_LIMIT__;

const REFUSED = {
  net: "network", dns: "network", http: "network", https: "network", http2: "network", tls: "network",
  dgram: "network", child_process: "process creation", cluster: "process creation",
  worker_threads: "worker threads", inspector: "the inspector",
};
const violations = [];

class SandboxError extends Error {}
SandboxError.prototype.name = "SandboxError";

function refuse(kind, what) {
  violations.push(`${kind} is disabled in the sandbox (${what})`);
  throw new SandboxError(violations[violations.length - 1]);
}

function refusedKind(name) {
  const bare = String(name).replace(/^node:/, "").split("/")[0];
  return Object.prototype.hasOwnProperty.call(REFUSED, bare) ? REFUSED[bare] : null;
}

const originalLoad = Module._load;
Module._load = function load(name, ...rest) {
  const kind = refusedKind(name);
  if (kind) refuse(kind, `require("${name}")`);
  return originalLoad.call(this, name, ...rest);
};
if (typeof process.getBuiltinModule === "function") {
  const originalGet = process.getBuiltinModule;
  process.getBuiltinModule = function getBuiltinModule(name) {
    const kind = refusedKind(name);
    if (kind) refuse(kind, `process.getBuiltinModule("${name}")`);
    return originalGet.call(process, name);
  };
}
for (const name of ["binding", "_linkedBinding", "dlopen"]) {
  process[name] = () => refuse("native bindings", `process.${name}`);
}
for (const name of ["fetch", "WebSocket", "EventSource"]) {
  Object.defineProperty(globalThis, name, { value: () => refuse("network", name), writable: true, configurable: true });
}
for (const method of Object.keys(console)) {
  if (typeof console[method] === "function") console[method] = () => {};  // nobody reads the check's prints
}

const ALIASES = { python: ["python", "py", "python3"], javascript: ["javascript", "js", "node", "nodejs"] };

function codeBlock(text, language) {
  text = String(text);
  const fence = /^[ \t]*```[ \t]*([^\s`]*)[^\n]*\n([\s\S]*?)(?:^[ \t]*```|(?![\s\S]))/gm;
  const blocks = [...text.matchAll(fence)].map((match) => [match[1].toLowerCase(), match[2]]);
  if (blocks.length === 0) return text.trim();
  let chosen = blocks[0][1];
  if (language) {
    const wanted = ALIASES[String(language).toLowerCase()] || [String(language).toLowerCase()];
    const preferred = blocks.find(([tag]) => tag === "" || wanted.includes(tag));
    if (preferred) chosen = preferred[1];
  }
  return chosen.replace(/^\n+|\n+$/g, "");
}

function closingBracket(text, start) {
  let depth = 0;
  let inString = false;
  for (let i = start; i < text.length; i++) {
    const c = text[i];
    if (inString) {
      if (c === "\\") i++;
      else if (c === '"') inString = false;
    } else if (c === '"') inString = true;
    else if (c === "{" || c === "[") depth++;
    else if (c === "}" || c === "]") {
      depth--;
      if (depth === 0) return i;
    }
  }
  return -1;
}

function firstJson(text) {
  text = String(text);
  const candidates = text.includes("```") ? [codeBlock(text, "json"), text] : [text];
  for (const candidate of candidates) {
    for (let start = 0; start < candidate.length; start++) {
      if (candidate[start] !== "{" && candidate[start] !== "[") continue;
      const end = closingBracket(candidate, start);
      if (end < 0) continue;
      try {
        return JSON.parse(candidate.slice(start, end + 1));
      } catch (error) {
        // not JSON from this bracket: try the next one
      }
    }
  }
  return null;
}

function short(value, limit = 200) {
  const text = util.inspect(value, { depth: 2, breakLength: Infinity });
  return text.length <= limit ? text : text.slice(0, limit - 1) + "\u2026";
}

function jsonable(value) {
  let text;
  try {
    text = stringify(value);
  } catch (error) {
    text = undefined;
  }
  if (text === undefined) return value === undefined ? null : short(value, VALUE_LIMIT);
  return text.length <= VALUE_LIMIT ? JSON.parse(text) : short(value, VALUE_LIMIT);
}

// [ok, reason, verdict]: a GradingResult whose "pass" is no boolean is no verdict on the output,
// so a negated check may not flip it into a pass
function judge(value) {
  if (value !== null && typeof value === "object" && !Array.isArray(value) && "pass" in value) {  // GradingResult
    if (typeof value.pass !== "boolean") {
      return [false, `the check returned a "pass" that is not a boolean: ${short(value.pass, 80)}`, false];
    }
    return [value.pass, value.reason ? String(value.reason) : value.pass ? "passed" : "failed", true];
  }
  return [Boolean(value), `returned ${short(value)}`, true];
}

let checkLines = [];
const PARAMETERS = ["output", "require", "codeBlock", "firstJson"];

function compileCheck(body) {
  // Line 1 of either form is the wrapper, so the check's line n is the source's line n + 1.
  const expression = body.trim().replace(/;+$/, "");
  try {
    checkLines = expression.split("\n");
    return vm.compileFunction(`return (async () => (\n${expression}\n))();`, PARAMETERS, { filename: "check.js" });
  } catch (error) {
    if (!(error instanceof SyntaxError)) throw error;
  }
  checkLines = body.split("\n");
  return vm.compileFunction(`return (async () => {\n${body}\n})();`, PARAMETERS, { filename: "check.js" });
}

function describe(error) {
  if (error && error.code === "ERR_VM_DYNAMIC_IMPORT_CALLBACK_MISSING") {
    return "dynamic import() is disabled in the sandbox: use require()";
  }
  if (error && error.code === "EFBIG") return `file size limit of ${request.limits.file} exceeded (${error.message})`;
  if (!(error instanceof Error)) return `threw ${short(error)}`;
  let text = error.message ? `${error.name}: ${error.message}` : error.name;
  const at = /check\.js:(\d+):\d+/.exec(String(error.stack));
  const line = at ? Number(at[1]) - 1 : 0;
  if (line >= 1 && line <= checkLines.length) text += ` (line ${line}: ${checkLines[line - 1].trim()})`;
  return text;
}

let reported = false;
function report(ok, value, reason, returned = false) {
  if (reported) return;
  reported = true;
  writeSync(1, `\n${request.marker}${stringify({ ok, value: jsonable(value), reason, returned })}\n`);
  exitNow(0);  // timers the check left behind do not keep it running
}
process.on("exit", () => {
  report(false, null, "the check ended without returning (process.exit, or a promise that never settled)");
});

(async () => {
  let check;
  try {
    check = compileCheck(String(request.code));
  } catch (error) {
    report(false, null, `the check does not compile: ${error.name}: ${error.message}`);
    return;
  }
  let ok = false;
  let value = null;
  let reason;
  let returned = false;
  try {
    value = await check(request.output, require, codeBlock, firstJson);
    [ok, reason, returned] = judge(value);
  } catch (error) {
    [ok, value, reason] = [false, null, describe(error)];
  }
  if (violations.length) [ok, reason, returned] = [false, violations[0], false];
  report(ok, value, reason, returned);
})();
'''


def run_python(body: str, output: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run a Python check over ``output``: a single expression (``"'Paris' in output"``) or a
    function body that returns its value. ``code_block`` and ``first_json`` are in scope."""
    with tempfile.TemporaryDirectory(prefix="edgeroute-check-", ignore_cleanup_errors=True) as folder:
        command = [sys.executable, "-I", "-B", "-c", _python_child_source()]
        return _run_child(command, Path(folder), body, output, limits, limit_address_space=True)


def run_javascript(body: str, output: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run a JavaScript check over ``output`` with node: an expression or a function body that
    returns its value (``await`` allowed); ``codeBlock``, ``firstJson`` and ``require`` are in
    scope. ``ok`` None when node is not installed."""
    node = shutil.which("node")
    if node is None:
        return SandboxResult(None, None, "node is not installed: JavaScript checks are skipped")
    with tempfile.TemporaryDirectory(prefix="edgeroute-check-", ignore_cleanup_errors=True) as folder:
        runner = Path(folder) / "check.js"
        runner.write_text(_JAVASCRIPT_CHILD.replace("__VALUE_LIMIT__", str(RESULT_VALUE_LIMIT)))
        # No RLIMIT_AS: V8 reserves far more address space than it uses and does not start under one.
        command = [node, f"--max-old-space-size={max(1, limits.memory_bytes // MiB)}", str(runner)]
        return _run_child(command, Path(folder), body, output, limits, limit_address_space=False)


def _size(n: int) -> str:
    return f"{n // MiB} MiB" if n % MiB == 0 else f"{n} bytes"


def _lower_limit(which: int, value: int, hard: int | None = None) -> None:
    """setrlimit that never asks for more than the current hard limit (which only root may raise)."""
    _, current_hard = resource.getrlimit(which)
    wanted_hard = value if hard is None else hard
    if current_hard != resource.RLIM_INFINITY:
        value, wanted_hard = min(value, current_hard), min(wanted_hard, current_hard)
    resource.setrlimit(which, (value, wanted_hard))


def _apply_limits(limits: SandboxLimits, limit_address_space: bool) -> None:
    """Runs in the child between fork and exec."""
    cpu = math.ceil(limits.cpu_seconds)
    _lower_limit(resource.RLIMIT_CPU, cpu, cpu + 1)  # SIGXCPU at the soft limit, SIGKILL a second later
    if limit_address_space:
        _lower_limit(resource.RLIMIT_AS, int(limits.memory_bytes))
    _lower_limit(resource.RLIMIT_FSIZE, int(limits.file_bytes))
    _lower_limit(resource.RLIMIT_CORE, 0)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is already gone
        os.killpg(pgid, signal.SIGKILL)


def _run_child(command: list[str], folder: Path, body: str, output: str, limits: SandboxLimits,
               *, limit_address_space: bool) -> SandboxResult:
    marker = f"@@edgeroute-check-result-{secrets.token_hex(16)}@@"
    request = json.dumps({"code": body, "output": output, "marker": marker,
                          "limits": {"memory": _size(int(limits.memory_bytes)), "file": _size(int(limits.file_bytes))}})
    # -I ignores PYTHON* variables (PYTHONHASHSEED included), so the environment holds only where
    # to find programs and where a check's home and temporary files go: inside the folder.
    env = {"PATH": os.environ.get("PATH", os.defpath), "HOME": str(folder), "TMPDIR": str(folder)}
    # stdout and stderr go to files, not pipes: the child's RLIMIT_FSIZE caps them, so a check
    # that prints without end cannot fill this process's memory.
    with tempfile.TemporaryFile() as stdout, tempfile.TemporaryFile() as stderr:
        process = subprocess.Popen(command, cwd=folder, env=env, stdin=subprocess.PIPE, stdout=stdout, stderr=stderr,
                                   start_new_session=True,
                                   preexec_fn=functools.partial(_apply_limits, limits, limit_address_space))
        timed_out = False
        try:
            process.communicate(request.encode(), timeout=limits.seconds)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            _kill_group(process.pid)  # on a timeout, and any process the check left behind
            process.communicate()
        stdout.seek(0)
        out = stdout.read(int(limits.file_bytes) + 4096).decode("utf-8", "replace")
        stderr.seek(0, os.SEEK_END)
        stderr.seek(max(0, stderr.tell() - STDERR_TAIL))
        err = stderr.read().decode("utf-8", "replace")
    return _interpret(out, err, process.returncode, timed_out, marker, limits)


def _interpret(out: str, err: str, returncode: int, timed_out: bool, marker: str, limits: SandboxLimits) -> SandboxResult:
    lines = [line[len(marker):] for line in out.splitlines() if line.startswith(marker)]
    if len(lines) > 1:
        return SandboxResult(False, None, "the check wrote more than one result line: a forged result")
    if lines:
        try:
            data = json.loads(lines[0])
            return SandboxResult(bool(data["ok"]), data.get("value"), str(data["reason"]), data.get("returned") is True)
        except (ValueError, KeyError, TypeError):
            return SandboxResult(False, None, "the check's result line was cut off (it wrote past the file size limit?)")
    if timed_out:
        return SandboxResult(False, None, f"timed out after {limits.seconds} s")
    if "heap out of memory" in err or "Reached heap limit" in err:
        return SandboxResult(False, None, f"memory limit of {_size(int(limits.memory_bytes))} exceeded (JavaScript heap)")
    if returncode < 0:
        return SandboxResult(False, None, _signal_reason(-returncode, limits))
    last = err.strip().splitlines()[-1][:200] if err.strip() else ""
    reason = f"the check exited without a result (exit code {returncode})" + (f": {last}" if last else "")
    return SandboxResult(False, None, reason)


def _signal_reason(number: int, limits: SandboxLimits) -> str:
    if number == signal.SIGXCPU:
        return f"CPU time limit of {math.ceil(limits.cpu_seconds)} s exceeded"
    if number == signal.SIGXFSZ:
        return f"file size limit of {_size(int(limits.file_bytes))} exceeded"
    if number == signal.SIGKILL:
        return "killed (SIGKILL: the CPU time hard limit, or the system ran out of memory)"
    try:
        name = signal.Signals(number).name
    except ValueError:
        name = f"signal {number}"
    return f"crashed ({name})"
