"""Turn a Jinja chat template into plain strings the device can concatenate.

The runtime must not need a template engine, so at export time we render the template
around marker strings and keep the pieces between them (``chat_format`` in the manifest).
The pieces are then checked against the real template on a multi-turn conversation; a
template they cannot reproduce gets no chat format (the runtime then says chat is
unavailable) rather than a silently different prompt.
"""

from __future__ import annotations

from typing import Any

from edgeroute.chat_format import format_messages

MARK = ["\x01A\x01", "\x01B\x01", "\x01C\x01", "\x01D\x01"]


def render(template: str, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    import jinja2

    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = lambda message: (_ for _ in ()).throw(ValueError(message))
    return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                            bos_token="", eos_token="")


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
        return chat_format
    except Exception:  # a template we cannot take apart: no chat format, said so at run time
        return None
