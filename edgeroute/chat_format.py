"""Chat prompts from the manifest's ``chat_format`` pieces (no template engine on the device).

A conversation with tools (OpenAI function calling) is rendered with the pieces of a
:class:`ToolFormat`: the model's own, taken apart from its chat template at export (Qwen2.5's
``<tool_call>`` JSON blocks), or :data:`FALLBACK_TOOL_FORMAT` for a model whose template has no
tools (the same markup, introduced in the system prompt by our own words).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class ToolFormat:
    """Where tools, calls and results go in a prompt.

    System: ``system + tools_prefix + (tools_separator).join(json(tool)) + tools_suffix``, with
    ``default_system`` as the system text when the conversation has none. An assistant turn:
    its content, then each call as ``call_open + json({"name", "arguments"}) + call_close``, all
    joined by ``call_separator``. Tool results: a user turn of ``response_open + content +
    response_close`` each, joined by ``response_separator``."""

    tools_prefix: str
    tools_separator: str
    tools_suffix: str
    default_system: str
    call_open: str
    call_close: str
    call_separator: str
    response_open: str
    response_close: str
    response_separator: str
    native: bool = True  # taken from the model's own template (False: the fallback)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ToolFormat:
        return cls(**data)

    def system(self, system: str | None, tools: list[dict[str, Any]]) -> str:
        text = self.default_system if system is None else system
        return text + self.tools_prefix + self.tools_separator.join(dump_json(t) for t in tools) + self.tools_suffix

    def call(self, name: str, arguments: Any) -> str:
        return self.call_open + dump_json({"name": name, "arguments": arguments}) + self.call_close

    def assistant(self, message: dict[str, Any]) -> str:
        calls = [self.call(c["function"]["name"], _arguments(c["function"]["arguments"]))
                 for c in message.get("tool_calls") or []]
        return self.call_separator.join(([message["content"]] if message.get("content") else []) + calls)

    def results(self, messages: list[dict[str, Any]]) -> str:
        return self.response_separator.join(self.response_open + m["content"] + self.response_close for m in messages)


def dump_json(value: Any) -> str:
    """JSON as Hugging Face chat templates write it (``tojson``: Python's separators, keys in the
    caller's order, text unescaped): a model's own calls in its prompt look like what it learned."""
    return json.dumps(value, ensure_ascii=False)


def _arguments(arguments: Any) -> Any:
    """OpenAI messages carry a call's arguments as a JSON string; templates render the object."""
    return json.loads(arguments) if isinstance(arguments, str) else arguments


# For a model whose template has no tools: the widely used "Hermes" markup (tools listed in
# <tools>, calls in <tool_call> blocks, results in <tool_response> blocks) in a user turn.
FALLBACK_TOOL_FORMAT = ToolFormat(
    tools_prefix=("\n\nYou can call functions. Their signatures are listed in <tools></tools> as JSON:\n<tools>\n"),
    tools_separator="\n",
    tools_suffix=('\n</tools>\n\nTo call one, write a JSON object with its name and arguments inside '
                  '<tool_call></tool_call> tags, one call per block:\n<tool_call>\n{"name": <function-name>, '
                  '"arguments": <arguments-object>}\n</tool_call>'),
    default_system="You are a helpful assistant.",
    call_open="<tool_call>\n", call_close="\n</tool_call>", call_separator="\n",
    response_open="<tool_response>\n", response_close="\n</tool_response>", response_separator="\n",
    native=False)


def tool_format(chat_format: dict[str, Any]) -> ToolFormat:
    """The bundle's own tool format, or the fallback."""
    data = chat_format.get("tools")
    return ToolFormat.from_dict(data) if data else FALLBACK_TOOL_FORMAT


def format_messages(chat_format: dict[str, Any], messages: list[dict[str, Any]],
                    tools: list[dict[str, Any]] | None = None) -> str:
    """Render a conversation (system?, user, assistant, user, ...) with the stored pieces. With
    ``tools``, the system turn lists them; an assistant turn may carry ``tool_calls`` and be
    followed by ``tool`` messages (their results, one user turn) instead of a user message."""
    fmt = tool_format(chat_format) if tools else None
    text, rest = "", list(messages)
    system = rest.pop(0)["content"] if rest and rest[0]["role"] == "system" else None
    first = len(messages) - len(rest)  # errors number the messages as given, the system one included
    if fmt is not None:
        text = chat_format["system_prefix"] + fmt.system(system, tools) + chat_format["system_to_user"]
    elif system is not None:
        text = chat_format["system_prefix"] + system + chat_format["system_to_user"]
    else:
        text = chat_format["default_prefix"]
    i, expected = 0, "user"
    while i < len(rest):
        message = rest[i]
        if expected == "user" and message["role"] == "tool":
            if fmt is None:
                raise ValueError(f"message {first + i} has role 'tool', but the conversation has no tools")
            results = [message]
            while i + 1 < len(rest) and rest[i + 1]["role"] == "tool":
                i += 1
                results.append(rest[i])
            text += fmt.results(results) + chat_format["user_suffix"]
        elif message["role"] != expected:
            raise ValueError(f"message {first + i} has role {message['role']!r}; expected {expected!r} "
                             "(an optional system message, then alternating user and assistant turns; "
                             "tool results in place of a user turn)")
        elif expected == "user":
            text += message["content"] + chat_format["user_suffix"]
        else:
            if message.get("tool_calls") and fmt is None:
                raise ValueError(f"message {first + i} calls tools, but the conversation has no tools")
            text += (fmt.assistant(message) if fmt is not None else message["content"]) + chat_format["assistant_to_user"]
        expected = "assistant" if expected == "user" else "user"
        i += 1
    return text
