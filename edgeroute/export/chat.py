"""Turn a Jinja chat template into plain strings the device can concatenate.

The runtime must not need a template engine, so at export time we render the template
around marker strings and keep the pieces between them (``chat_format`` in the manifest).
The pieces are then checked against the real template on a multi-turn conversation; a
template they cannot reproduce gets no chat format (the runtime then says chat is
unavailable) rather than a silently different prompt. Tools are taken apart the same way
(``chat_format["tools"]``); a template without tools, or whose tool prompts the pieces cannot
reproduce, gets none, and the runtime uses the documented fallback format.
"""

from __future__ import annotations

import json
from typing import Any

from edgeroute.chat_format import ToolFormat, dump_json, format_messages

MARK = ["\x01A\x01", "\x01B\x01", "\x01C\x01", "\x01D\x01"]


def render(template: str, messages: list[dict[str, Any]], add_generation_prompt: bool,
           tools: list[dict[str, Any]] | None = None) -> str:
    import jinja2

    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = lambda message: (_ for _ in ()).throw(ValueError(message))
    env.filters["tojson"] = _tojson
    return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                            bos_token="", eos_token="", tools=tools)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    """Hugging Face's ``tojson`` (transformers' chat templates): plain json.dumps, unlike Jinja's
    own filter (sorted keys, HTML-escaped)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def derive_chat_format(template: str | None) -> dict[str, Any] | None:
    if not template:
        return None
    try:
        a, b, c, d = MARK
        plain = render(template, [{"role": "user", "content": a}], True)
        default_prefix, user_suffix = plain.split(a)
        with_system = render(template, [{"role": "system", "content": b}, {"role": "user", "content": a}], True)
        system_prefix, rest = with_system.split(b)
        system_to_user = rest.split(a)[0]
        turns = render(template, [{"role": "user", "content": a}, {"role": "assistant", "content": c},
                                  {"role": "user", "content": d}], True)
        assistant_to_user = turns.split(c)[1].split(d)[0]
        chat_format = {"default_prefix": default_prefix, "system_prefix": system_prefix,
                       "system_to_user": system_to_user, "user_suffix": user_suffix,
                       "assistant_to_user": assistant_to_user}
        probe = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
                 {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "Name a color"}]
        for messages in (probe, probe[1:]):
            if format_messages(chat_format, messages) != render(template, messages, True):
                return None
    except Exception:  # a template we cannot take apart: no chat format, said so at run time
        return None
    tools = derive_tool_format(template, chat_format)
    return {**chat_format, "tools": tools.to_dict()} if tools is not None else chat_format


def _probe_tool(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": f"Probe {name}.",
                                             "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}


def _probe_call(name: str, value: str) -> dict[str, Any]:
    # two keys out of order: a template that reorders them (sorted JSON) is caught
    return {"type": "function", "function": {"name": name, "arguments": {"x": value, "a": 1}}}


def _between(text: str, start: str, end: str) -> str:
    return text.split(start, 1)[1].split(end, 1)[0]


def derive_tool_format(template: str, chat_format: dict[str, str]) -> ToolFormat | None:
    """The template's tool pieces, or None where it has no tools (it renders none of them) or
    the pieces do not reproduce it on a conversation with calls and results."""
    a, b, c, _ = MARK
    one, two = _probe_tool("probe_one"), _probe_tool("probe_two")
    first, second = _probe_call("probe_one", "\x01E\x01"), _probe_call("probe_two", "\x01F\x01")
    first_body, second_body = (dump_json({"name": call["function"]["name"], "arguments": call["function"]["arguments"]})
                               for call in (first, second))
    results = ["\x01G\x01", "\x01H\x01"]
    try:
        listed = render(template, [{"role": "system", "content": b}, {"role": "user", "content": a}], True, [one, two])
        if dump_json(one) not in listed:
            return None  # the template ignores tools
        system_part = _between(listed, b, a)
        tools_prefix, rest = system_part.split(dump_json(one), 1)
        tools_separator, rest = rest.split(dump_json(two), 1)
        tools_suffix = rest.removesuffix(chat_format["system_to_user"])
        no_system = render(template, [{"role": "user", "content": a}], True, [one])
        default_system = no_system.split(tools_prefix, 1)[0].removeprefix(chat_format["system_prefix"])
        conversation = [{"role": "user", "content": a}, {"role": "assistant", "content": c, "tool_calls": [first, second]},
                        *({"role": "tool", "content": r} for r in results)]
        turns = render(template, conversation, True, [one])
        before_first, between_calls = _between(turns, c, first_body), _between(turns, first_body, second_body)
        bare = render(template, [{"role": "user", "content": a}, {"role": "assistant", "content": "",
                                                                   "tool_calls": [first]}], False, [one])
        call_open = _between(bare, a + chat_format["user_suffix"], first_body)
        call_close = between_calls.removesuffix(before_first)
        after_calls = _between(turns, second_body, results[0]).removeprefix(call_close)
        response_open = after_calls.removeprefix(chat_format["assistant_to_user"])
        between_results = _between(turns, results[0], results[1])
        response_close = turns.split(results[1], 1)[1].removesuffix(chat_format["user_suffix"])
        fmt = ToolFormat(tools_prefix, tools_separator, tools_suffix, default_system, call_open, call_close,
                         before_first.removesuffix(call_open), response_open,
                         response_close, between_results.removeprefix(response_close).removesuffix(response_open))
        with_tools = {**chat_format, "tools": fmt.to_dict()}
        for system in ([{"role": "system", "content": "Be brief."}], []):
            probe = [*system, {"role": "user", "content": "Hi"},
                     {"role": "assistant", "content": "", "tool_calls": [_probe_call("probe_one", "a b")]},
                     {"role": "tool", "content": "{\"ok\": true}"}, {"role": "assistant", "content": "Done."},
                     {"role": "user", "content": "And now?"},
                     {"role": "assistant", "content": "Both.", "tool_calls": [first, second]},
                     *({"role": "tool", "content": r} for r in results)]
            if format_messages(with_tools, probe, [one, two]) != render(template, probe, True, [one, two]):
                return None
        return fmt
    except Exception:  # a template we cannot take apart: the runtime's fallback format
        return None
