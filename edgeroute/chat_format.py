"""Chat prompts from the manifest's ``chat_format`` pieces (no template engine on the device)."""

from __future__ import annotations


def format_messages(chat_format: dict[str, str], messages: list[dict[str, str]]) -> str:
    """Render a conversation (system?, user, assistant, user, ...) with the stored pieces."""
    text, rest = "", list(messages)
    if rest and rest[0]["role"] == "system":
        text = chat_format["system_prefix"] + rest.pop(0)["content"] + chat_format["system_to_user"]
    else:
        text = chat_format["default_prefix"]
    for i, message in enumerate(rest):
        expected = "user" if i % 2 == 0 else "assistant"
        if message["role"] != expected:
            raise ValueError(f"message {i} has role {message['role']!r}; expected {expected!r} "
                             "(an optional system message, then alternating user and assistant turns)")
        text += message["content"]
        text += chat_format["user_suffix"] if expected == "user" else chat_format["assistant_to_user"]
    return text
