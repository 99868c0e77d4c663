"""Whether a tool call's arguments rest on what the driver said.

The runtime holds a call to its tool's schema, but not to the command: the pair fills an
optional argument the driver never gave ("remind me to call the dentist" set for 10:00, "turn the
temperature down to 18" on the driver's side only) and answers a command the car has no
function for with one whose arguments it makes up ("roll down the windows": navigate home). An
argument is *said* when the words heard (the command, and the driver's earlier commands the chat
keeps, for a follow-up such as "call her again") hold it:

- a value of an enum: the value's words, or one of ``SAID_AS`` ("back" for the rear);
- a number, or a string with a pattern (a time of day): any number said, in digits or words
  ("one degree warmer", "at noon"): a number the driver did not say is made up, whatever it is;
- any other string: one of its words of three letters or more, not one as common as "the" (or
  its digits), compared without case or a plural's "s": "nearest pharmacy" for "navigate to
  the nearest pharmacy".

An optional argument not said is left out (the tool's default applies: all zones, a reminder
without a time); a required one not said leaves the call unrun (``Grounding.unsaid``). The check
is of words, not of meaning: a paraphrase the driver did not use ("mom" for "my mother") is not
said, and a word said in another sense is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

NUMBER_WORDS = {"zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
                "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty",
                "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety", "hundred", "half", "quarter",
                "noon", "midday", "midnight", "o'clock"}
# words too common to show that a value was said ("the" of "navigate to the home" in "roll down the windows")
COMMON_WORDS = {"the", "and", "for", "you", "your", "with", "from", "this", "that", "some", "please", "our", "about",
                "into", "its", "are", "can", "what", "there", "here"}
# the words a driver says for an enum value besides the value's own
SAID_AS = {"rear": {"back"}, "all": {"every", "everywhere", "whole", "everyone"}}
WORD = re.compile(r"[^\W_]+(?:'[^\W_]+)?")


def _stem(word: str) -> str:
    return word[:-1] if len(word) > 3 and word.endswith("s") and not word.endswith("ss") else word


def said_words(text: str) -> set[str]:
    """The words of ``text`` as the check compares them (lowercase, a plural's "s" dropped)."""
    return {_stem(word) for word in WORD.findall(text.lower())}


def says_a_number(text: str) -> bool:
    return bool(re.search(r"\d", text)) or bool(said_words(text) & NUMBER_WORDS)


def is_said(schema: dict[str, Any], value: Any, heard: str) -> bool:
    """Whether ``value`` of an argument with ``schema`` is in the words ``heard``."""
    words = said_words(heard)
    if "enum" in schema:
        return bool((said_words(str(value).replace("_", " ")) | SAID_AS.get(str(value), set())) & words)
    if schema.get("type") in ("number", "integer") or "pattern" in schema:
        return says_a_number(heard)
    if isinstance(value, str):
        own = {word for word in said_words(value) if (len(word) >= 3 or word.isdigit()) and word not in COMMON_WORDS}
        return bool(own & words)
    return True  # booleans, objects: nothing in words to hold them to


@dataclass
class Grounding:
    """A call's arguments held to what was heard: those to run it with, those left out, and the
    required one not said (then the call is not run)."""

    arguments: dict[str, Any]
    left_out: list[str] = field(default_factory=list)
    unsaid: str | None = None


def ground(parameters: dict[str, Any], arguments: dict[str, Any], heard: str) -> Grounding:
    """Hold ``arguments`` of a tool with JSON-schema ``parameters`` to the words ``heard``."""
    properties, required = parameters.get("properties", {}), set(parameters.get("required", []))
    kept, left_out = {}, []
    for key, value in arguments.items():
        if is_said(properties.get(key, {}), value, heard):
            kept[key] = value
        elif key in required:
            return Grounding(dict(arguments), left_out, unsaid=key)
        else:
            left_out.append(key)
    return Grounding(kept, left_out)
