"""Tool calls (OpenAI function calling): tools in, typed calls out, always parseable.

- :func:`parse_tools` checks tools in the OpenAI shape (``{"type": "function", "function":
  {"name", "description", "parameters"}}``, the parameters a JSON schema that compiles) and
  :func:`parse_tool_choice` the choice: "auto", "required", "none" or ``{"type": "function",
  "function": {"name": ...}}``.
- :func:`tool_grammar` is the Lark grammar (llguidance) an answer must fit: free text, and
  wherever the model opens a call, a JSON object ``{"name": ..., "arguments": ...}`` valid
  against that tool's parameters, written as the chat template writes calls; a call therefore
  always parses and validates. With special-token markup (Qwen2.5's ``<tool_call>``) free text
  cannot contain it; with text markup, free text excludes it.
- Fenced calls: under ``auto``, models whose template has special-token markup often write a
  call as a Markdown JSON block instead (Qwen2.5-Coder: a fence, then the object pretty-printed).
  There, a fence followed by ``{"name": "`` (:data:`FENCED_CALL`) opens a call too, as the
  lazy grammar triggers of llama.cpp's tool parsers do: what follows must be a valid call of
  one of the tools, in any JSON layout. Free text may still hold other fenced blocks.
- :func:`split_tool_calls` turns the answer into its content and :class:`ToolCall` objects;
  :class:`ContentFilter` lets a stream show the content only (a voice app must not speak JSON);
  :class:`CallNames` tells a stream each call's name as soon as it is decoded, before its
  arguments (OpenAI's streamed calls send the name in their first delta the same way).

The constraint is the same object as a ``response_format``'s, so every lossless mode gives the
calls ``full`` gives.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from edgeroute.chat_format import ToolFormat
from edgeroute.errors import InputError
from edgeroute.runtime.constraints import json_schema_error
from edgeroute.runtime.text_stream import stop_prefix

TOOL_CHOICES = ("auto", "required", "none")
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
# a call's JSON as templates render it (Python's separators), so the model writes what it saw
CALL_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# a fenced call's arguments as the model lays them out (pretty-printed)
FENCED_LAYOUT = {"whitespace_flexible": True}
# what opens a fenced call: a Markdown fence (json or untagged) and the start of {"name": "
_BLANK = r"[ \t\n]*"
FENCED_CALL = rf'```(?:json)?{_BLANK}\{{{_BLANK}"name"{_BLANK}:{_BLANK}"'
FENCED_OPENING = re.compile(FENCED_CALL)
# text that may still grow into FENCED_CALL (a stream holds it back until it does or cannot)
FENCED_PREFIX = re.compile(rf'`{{1,2}}|```(j(s(o(n)?)?)?)?|'
                           rf'```(json)?{_BLANK}(\{{{_BLANK}("(n(a(m(e("{_BLANK}(:{_BLANK})?)?)?)?)?)?)?)?')
FENCE_END = re.compile(rf"{_BLANK}```")
# an assistant message's tool call as OpenAI's API writes it (what check_tool_calls asks for)
CALL_SHAPE = '{"id": ..., "type": "function", "function": {"name": ..., "arguments": "<JSON object as text>"}}'


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any]

    def to_message(self) -> dict[str, Any]:
        """The call as an OpenAI assistant message's ``tool_calls`` entry (arguments as JSON text)."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}


def parse_tools(tools: Sequence[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The tools, checked (each one's parameters compiled, so a bad schema is refused when the
    tools are given, by the tool's name); each keeps the caller's dict (the prompt lists it as given)."""
    if not tools:
        return []
    if isinstance(tools, (str, dict)) or not all(isinstance(t, dict) for t in tools):
        raise InputError('tools must be a list of {"type": "function", "function": {"name": ..., "parameters": {...}}}')
    names = []
    for i, tool in enumerate(tools):
        function = tool.get("function")
        if tool.get("type") != "function" or not isinstance(function, dict):
            raise InputError(f'tool {i} is not {{"type": "function", "function": {{...}}}} (got keys {sorted(tool)})')
        name = function.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise InputError(f"tool {i} has name {name!r}: 1-64 letters, digits, underscores or dashes")
        if name in TOOL_CHOICES:  # tool_choice's own words
            raise InputError(f"tool {i} is named {name!r}, a word tool_choice reserves: rename it")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise InputError(f"tool {name}: parameters must be a JSON schema of an object (got {parameters!r:.60})")
        if (problem := json_schema_error(_call_schema(tool))) is not None:
            raise InputError(f"tool {name}: its parameters are not a JSON schema that compiles ({problem:.300}): "
                             "fix the schema")
        names.append(name)
    if len(set(names)) != len(names):
        raise InputError(f"tool names must differ (got {', '.join(names)})")
    return list(tools)


def check_tool_calls(calls: Any, where: str) -> None:
    """An InputError naming ``where`` (the message) and the shape expected unless ``calls`` is a
    list of OpenAI tool calls, each ``{"function": {"name": ..., "arguments": ...}}`` (its "id"
    and "type" optional here) with the arguments a JSON object, as JSON text (OpenAI's form) or a
    dict: rendering one of another shape failed with only Python's words ('function', "string
    indices must be integers")."""
    if not isinstance(calls, list | tuple):
        raise InputError(f"{where}: tool_calls must be a list of {CALL_SHAPE} (got {type(calls).__name__})")
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise InputError(f"{where}: tool call {i} is not {CALL_SHAPE} (got {call!r:.80})")
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            with contextlib.suppress(json.JSONDecodeError):  # text that is not JSON is refused below
                arguments = json.loads(arguments)
        if not isinstance(arguments, dict):
            raise InputError(f"{where}: tool call {i} ({name}) has arguments {function.get('arguments')!r:.80}: give a "
                             """JSON object, as text ('{"celsius": 21}', OpenAI's form) or a dict""")


def parse_tool_choice(choice: str | dict[str, Any] | None, tools: list[dict[str, Any]]) -> str | None:
    """"auto", "required" or "none", or the name of the one tool to call. None: no tools."""
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        function = choice.get("function") if choice.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None  # "function": "f" is a common slip
        if not isinstance(name, str):
            raise InputError(f'tool_choice {choice!r} is not {{"type": "function", "function": {{"name": ...}}}}')
        if name not in {t["function"]["name"] for t in tools}:
            raise InputError(f"tool_choice names {name!r}, which is not one of the tools")
        return name
    if choice not in TOOL_CHOICES:
        # a bare tool name is the CLI's --tool-choice NAME; the API names a tool as OpenAI does
        if isinstance(choice, str) and choice in {t["function"]["name"] for t in tools}:
            raise InputError(f"tool_choice {choice!r} is not one of {', '.join(TOOL_CHOICES)}: to call that tool give "
                             + json.dumps({"type": "function", "function": {"name": choice}}))
        raise InputError(f"tool_choice {choice!r} is not one of {', '.join(TOOL_CHOICES)} or "
                         '{"type": "function", "function": {"name": ...}}')
    if not tools:
        if choice == "required":
            raise InputError("tool_choice 'required' needs tools: give tools=[...]")
        return None
    return choice


def _call_schema(tool: dict[str, Any]) -> dict[str, Any]:
    function = tool["function"]
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    # an $id makes the parameters their own document: their "#/$defs/..." references (pydantic's
    # model_json_schema writes them) resolve against them, not against this wrapper
    parameters = {"$id": f"urn:edgeroute:tool:{function['name']}", **parameters}
    return {"type": "object", "properties": {"name": {"const": function["name"]}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


def _lark_string(text: str) -> str:
    return json.dumps(text)  # a JSON string literal is a Lark string literal


def fenced_calls(choice: str | None, fmt: ToolFormat, special: Callable[[str], int | None]) -> bool:
    """Whether an answer under ``choice`` may make fenced calls (``auto``, special-token markup)."""
    return choice == "auto" and special(fmt.call_open.strip()) is not None


def tool_grammar(tools: list[dict[str, Any]], choice: str, fmt: ToolFormat, special: Callable[[str], int | None]) -> str:
    """The Lark grammar of an answer under ``choice`` ("auto", "required", "none" or a tool's
    name). ``special`` gives the id of a markup string that is one special token (None if not)."""
    chosen = [t for t in tools if t["function"]["name"] == choice] or tools
    schema = {"anyOf": [_call_schema(t) for t in chosen]} if len(chosen) > 1 else _call_schema(chosen[0])
    open_text, close_text = fmt.call_open.strip(), fmt.call_close.strip()
    open_id = special(open_text)
    rules = [f"call_json: %json {json.dumps({**schema, 'x-guidance': CALL_LAYOUT})}",
             f"close: {_markup(fmt.call_close, close_text, special(close_text))}",
             f"open: {_markup(fmt.call_open, open_text, open_id)}",
             f"separator: {_lark_string(fmt.call_separator)}"]
    if open_id is not None and fenced_calls(choice, fmt, special):
        # free text cannot produce the special token that opens a call, nor a fenced call's opening
        # but as one: it ends lazily there, and a tool's name and arguments follow
        rules += [f"TEXT: /(.|\\n)*/ & ~/(.|\\n)*{FENCED_CALL}(.|\\n)*/", f"fence_open[lazy]: /(.|\\n)*{FENCED_CALL}/",
                  "fenced_call: " + " | ".join(f"fenced_{i}" for i in range(len(tools))),
                  'FENCED_ARGUMENTS: /[ \\t\\n]*,[ \\t\\n]*"arguments"[ \\t\\n]*:[ \\t\\n]*/',
                  "FENCE_CLOSE: /[ \\t\\n]*\\}[ \\t\\n]*```/"]
        for i, tool in enumerate(tools):
            function = tool["function"]
            parameters = function.get("parameters", {"type": "object", "properties": {}})
            name = _lark_string(function["name"] + '"')  # the name's closing quote: its opening one ended fence_open
            rules += [f"fenced_{i}: {name} FENCED_ARGUMENTS arguments_{i} FENCE_CLOSE",
                      f"arguments_{i}: %json {json.dumps({**parameters, 'x-guidance': FENCED_LAYOUT})}"]
        auto = "(TEXT open call_json close | fence_open fenced_call)* TEXT"
    elif open_id is not None:  # free text cannot produce the special token that opens a call
        rules.append("TEXT: /(.|\\n)*/")
        auto = "TEXT (open call_json close TEXT)*"
    else:  # free text must not contain the opening markup; the text before a call ends lazily at it
        rules += [f"TEXT: /(.|\\n)*/ & ~/(.|\\n)*{_regex(open_text)}(.|\\n)*/",
                  f"pre[lazy]: /(.|\\n)*{_regex(fmt.call_open)}/"]
        auto = "TEXT | (pre call_json close)+ TEXT"
    # after the calls, blank space may end the answer as well as the end-of-turn token does (a
    # model that writes the separator must not be forced into another call), a little of it. A
    # named tool's one call ends the answer at its close: the grammar forces the end-of-turn token
    rules.append("BLANK: /[ \\t\\n]{1,2}/")
    start = {"none": "TEXT", "auto": auto, "required": "open call_json close (separator open call_json close)* BLANK?"}
    return "\n".join(["%llguidance {}", f"start: {start.get(choice, 'open call_json close')}", *rules]) + "\n"


def _regex(text: str) -> str:
    """A literal in a Lark regex (/.../ on one line: newlines escaped)."""
    return re.escape(text).replace("\\\n", "\\n").replace("/", "\\/")


def _markup(whole: str, text: str, token: int | None) -> str:
    """A markup piece in Lark: its special token with the whitespace around it as text, or all text."""
    if token is None:
        return _lark_string(whole)
    before, after = whole.split(text, 1)
    return " ".join([*([_lark_string(before)] if before else []), f"<[{token}]>",
                     *([_lark_string(after)] if after else [])])


def split_tool_calls(text: str, fmt: ToolFormat, new_id: Callable[[], str],
                     fenced: bool = False) -> tuple[str, list[ToolCall]]:
    """The answer's content (before its first call) and its calls, from the raw text (markup
    included; with ``fenced``, fenced calls too). The grammar made every call parse; a call cut
    short (the token budget ran out) is dropped and ends the content."""
    open_text, close_text = fmt.call_open.strip(), fmt.call_close.strip()
    calls: list[ToolCall] = []
    first, at = None, 0
    while True:
        markup = text.find(open_text, at)
        fence = FENCED_OPENING.search(text, at) if fenced else None
        if markup < 0 and fence is None:
            break
        if fence is not None and (markup < 0 or fence.start() < markup):
            opening = fence.start()
            try:
                data, body_end = json.JSONDecoder().raw_decode(text, text.index("{", opening))
            except json.JSONDecodeError:
                data, body_end = None, opening
            closed = FENCE_END.match(text, body_end) if data is not None else None
            after = closed.end() if closed else -1
        else:
            opening = markup
            body, closed, _ = text[markup + len(open_text):].partition(close_text)
            data = json.loads(body) if closed else None
            after = markup + len(open_text) + len(body) + len(close_text)
        first = opening if first is None else first
        if not closed:
            break
        calls.append(ToolCall(new_id(), data["name"], data["arguments"]))
        at = after
    if first is None:
        return text, calls
    return text[:first].removesuffix(fmt.call_separator).rstrip(), calls


class ContentFilter:
    """What a stream may show of an answer with tools: the text before the first call. Text
    that may begin a call's opening markup (or, with ``fenced``, a fenced call's) is held back
    until it is known not to."""

    def __init__(self, fmt: ToolFormat, open_token: int | None, fenced: bool = False) -> None:
        self.opening, self.open_token, self.fenced = fmt.call_open.strip(), open_token, fenced
        self.pending, self.calling = "", False

    def push(self, token: int, text: str) -> str:
        if self.calling:
            return ""
        if token == self.open_token:
            self.calling = True
            self.pending = ""
            return ""
        self.pending += text
        at = self.pending.find(self.opening)
        if self.fenced and (fence := FENCED_OPENING.search(self.pending)) and (at < 0 or fence.start() < at):
            at = fence.start()
        if at >= 0:
            self.calling = True
            return self.pending[:at].rstrip()
        keep = stop_prefix(self.pending, (self.opening,))
        if self.fenced:  # from the first backtick that may still open a fenced call
            ticks = (i for i, c in enumerate(self.pending) if c == "`" and FENCED_PREFIX.fullmatch(self.pending, i))
            keep = max(keep, len(self.pending) - next(ticks, len(self.pending)))
        # a separator before a call is not content either: hold trailing whitespace back too
        keep = max(keep, len(self.pending) - len(self.pending[:len(self.pending) - keep].rstrip()))
        released, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
        return released

    def flush(self) -> str:
        released, self.pending = ("" if self.calling else self.pending), ""
        return released


class CallNames:
    """The name of each call in a streamed answer, as soon as its closing quote is decoded
    (a voice app can say what it is about to do while the arguments are still being written)."""

    def __init__(self, fmt: ToolFormat, open_token: int | None, close_token: int | None, fenced: bool = False) -> None:
        self.markup = {open_token: fmt.call_open.strip(), close_token: fmt.call_close.strip()}
        self.markup.pop(None, None)
        openings = [re.escape(fmt.call_open.strip()) + rf'{_BLANK}\{{{_BLANK}"name"{_BLANK}:{_BLANK}"']
        if fenced:
            openings.append(FENCED_CALL)
        self.named = re.compile(f"(?:{'|'.join(openings)})([A-Za-z0-9_-]{{1,64}})\"")
        self.text, self.told = "", 0

    def push(self, token: int, text: str) -> str | None:
        """The name completed by this token, if any."""
        self.text += self.markup.get(token, text)
        names = self.named.findall(self.text)
        if len(names) <= self.told:
            return None
        self.told += 1
        return names[self.told - 1]
