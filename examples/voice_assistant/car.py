"""The car's tools (OpenAI function-calling dicts with JSON-schema parameters) and the car
state that executes them.

``CarState.dispatch(name, arguments)`` checks the arguments against the tool's schema (the
runtime constrains tool calls to it already; an app must not trust that blindly) and returns
the JSON-able result that goes back to the model as a ``role: "tool"`` message.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

ZONES = ["driver", "passenger", "rear", "all"]
TIME_PATTERN = r"^([01][0-9]|2[0-3]):[0-5][0-9]$"


def _tool(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": required, "additionalProperties": False}}}


CAR_TOOLS: list[dict[str, Any]] = [
    _tool("navigate", "Start route guidance to a destination.",
          {"destination": {"type": "string", "description": "an address, a place or a point of interest"}},
          ["destination"]),
    _tool("set_temperature", "Set the cabin temperature of a climate zone.",
          {"temperature_c": {"type": "number", "minimum": 16, "maximum": 30, "description": "degrees Celsius"},
           "zone": {"type": "string", "enum": ZONES, "default": "all", "description": "the zone; all when not said"}},
          ["temperature_c"]),
    _tool("call", "Phone a contact or a number.",
          {"contact": {"type": "string", "description": "a contact's name or a phone number"}},
          ["contact"]),
    _tool("play_media", "Play music, a radio station or a podcast.",
          {"query": {"type": "string", "description": "what to play: a song, an artist, a genre, a station"}},
          ["query"]),
    _tool("set_reminder", "Remind the driver of something, at a time of day when one is given.",
          {"text": {"type": "string", "description": "what to remind of"},
           "time": {"type": "string", "pattern": TIME_PATTERN, "description": "24-hour HH:MM"}},
          ["text"]),
]

# What the car knows and can read out: without it the pair made the time up ("The current time is
# 14:30."). A reading's answer is a sentence built from the car's value (``confirmation``), so
# with ``confirm="template"`` the figure said is the car's, never the model's.
STATUS_ITEMS = ["time", "date", "fuel", "range", "cabin_temperature", "outside_temperature", "route", "playing"]
STATUS_TOOL: dict[str, Any] = _tool(
    "car_status", "Read what the car knows now: the time, the date, the fuel level, the range left, the cabin or "
    "outside temperature, the route and arrival time, what is playing.",
    {"item": {"type": "string", "enum": STATUS_ITEMS, "description": "what to read"}}, ["item"])
STATUS_TOOL_NAME: str = STATUS_TOOL["function"]["name"]
TOOLS_BY_NAME = {tool["function"]["name"]: tool for tool in [*CAR_TOOLS, STATUS_TOOL]}

# Under tool_choice "required" every answer is a call, and a command no tool does (the weather,
# a joke, a function the car lacks) went to the nearest tool: "what's the weather like" played
# "weather". Offered beside the car's tools, this one lets the model answer in words inside the
# call grammar: the app never runs it, it speaks its ``text`` while the call is decoded
# (VoiceAssistant's ``words_tool``). Without the argument (the first version) the app asked a
# second generation for the words, and the pair wrote most of them as a call in text. The system
# prompt's line, the argument's description and the app's ``words_bias`` were chosen on
# tools/voice_commands_dev.json, then measured once on the held-out tools/voice_commands_unseen.json
# (docs/guide/voice.md: commands no tool does).
WORDS_TOOL: dict[str, Any] = _tool(
    "answer_in_words", "Reply to the driver in words: questions, small talk, and requests no other function can "
    "carry out.", {"text": {"type": "string", "description": "what to say: one or two short sentences; that you cannot, "
                                                          "when you cannot do or know it"}}, ["text"])
WORDS_TOOL_NAME: str = WORDS_TOOL["function"]["name"]
WORDS_TOOL_INSTRUCTION = (f"When no tool does what the driver asks, call {WORDS_TOOL_NAME} with your answer. The car "
                          "does only what its tools do, and you know only what the driver and the tools told you: when "
                          "you cannot do or know something, say so.")


def schema_errors(schema: dict[str, Any], value: Any, where: str = "arguments") -> list[str]:
    """What in ``value`` breaks ``schema`` (the subset the car's tools use: object, string,
    number, integer, enum, minimum, maximum, pattern, required, additionalProperties)."""
    kind = schema.get("type")
    if kind == "object":
        if not isinstance(value, dict):
            return [f"{where} must be an object"]
        properties = schema.get("properties", {})
        errors = [f"{where} lacks {key!r}" for key in schema.get("required", []) if key not in value]
        for key, item in value.items():
            if key in properties:
                errors += schema_errors(properties[key], item, f"{where}.{key}")
            elif schema.get("additionalProperties") is False:
                errors.append(f"{where} has an unknown key {key!r}")
        return errors
    if kind == "string" and not isinstance(value, str):
        return [f"{where} must be a string (got {value!r})"]
    if kind in ("number", "integer") and (isinstance(value, bool) or not isinstance(value, (int, float))
                                          or (kind == "integer" and not float(value).is_integer())):
        return [f"{where} must be a {kind} (got {value!r})"]
    errors = []
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{where} must be one of {', '.join(map(str, schema['enum']))} (got {value!r})")
    if "minimum" in schema and value < schema["minimum"]:
        errors.append(f"{where} must be at least {schema['minimum']} (got {value!r})")
    if "maximum" in schema and value > schema["maximum"]:
        errors.append(f"{where} must be at most {schema['maximum']} (got {value!r})")
    if "pattern" in schema and not re.search(schema["pattern"], value):
        errors.append(f"{where} must match {schema['pattern']} (got {value!r})")
    return errors


@dataclass
class CarState:
    """What the tools change (the route, the climate, the phone, the media, the reminders) and
    what the car reads out (``car_status``); ``clock`` gives the local time."""

    destination: str | None = None
    arrival: datetime | None = None
    temperature_c: dict[str, float] = field(default_factory=lambda: {"driver": 21.0, "passenger": 21.0, "rear": 21.0})
    calling: str | None = None
    playing: str | None = None
    reminders: list[dict[str, str | None]] = field(default_factory=list)
    fuel_percent: float = 62.0
    range_km: float = 410.0
    outside_c: float = 8.0
    clock: Callable[[], datetime] = datetime.now
    log: list[tuple[str, dict[str, Any], dict[str, Any]]] = field(default_factory=list)  # (tool, arguments, result)

    def dispatch(self, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
        """Run one tool call; the result (``{"ok": True, ...}`` or ``{"ok": False, "error": ...}``)
        is what the model reads back."""
        if name not in TOOLS_BY_NAME:
            result: dict[str, Any] = {"ok": False, "error": f"no tool named {name!r}"}
        elif errors := schema_errors(TOOLS_BY_NAME[name]["function"]["parameters"], arguments):
            result = {"ok": False, "error": "; ".join(errors)}
        else:
            result = getattr(self, f"_{name}")(**arguments)
        self.log.append((name, dict(arguments) if isinstance(arguments, dict) else arguments, result))
        return result

    def _navigate(self, destination: str) -> dict[str, Any]:
        eta_minutes = 12 + len(destination) % 20
        self.destination, self.arrival = destination, self.clock() + timedelta(minutes=eta_minutes)
        return {"ok": True, "destination": destination, "eta_minutes": eta_minutes}

    def _set_temperature(self, temperature_c: float, zone: str = "all") -> dict[str, Any]:
        for name in (self.temperature_c if zone == "all" else [zone]):
            self.temperature_c[name] = float(temperature_c)
        return {"ok": True, "zone": zone, "temperature_c": temperature_c}

    def _call(self, contact: str) -> dict[str, Any]:
        self.calling = contact
        return {"ok": True, "calling": contact}

    def _play_media(self, query: str) -> dict[str, Any]:
        self.playing = query
        return {"ok": True, "playing": query}

    def _set_reminder(self, text: str, time: str | None = None) -> dict[str, Any]:
        self.reminders.append({"text": text, "time": time})
        return {"ok": True, "reminder": text, "time": time}

    def _car_status(self, item: str) -> dict[str, Any]:
        now = self.clock()
        values: dict[str, dict[str, Any]] = {
            "time": {"time": f"{now:%H:%M}"},
            "date": {"date": f"{now:%A}, {now.day} {now:%B %Y}"},
            "fuel": {"fuel_percent": self.fuel_percent},
            "range": {"range_km": self.range_km},
            "cabin_temperature": {"temperature_c": dict(self.temperature_c)},
            "outside_temperature": {"outside_c": self.outside_c},
            "route": {"destination": self.destination,
                      "arrival": None if self.arrival is None else f"{self.arrival:%H:%M}"},
            "playing": {"playing": self.playing},
        }
        return {"ok": True, "item": item, **values[item]}


# what the car says it is doing, from a call's name alone (the app's ``acknowledge``): the
# confirmation's opening words, so the rest of it follows as one sentence
ACKNOWLEDGEMENTS = {"navigate": "Navigating", "set_temperature": "Setting", "call": "Calling", "play_media": "Playing",
                    "set_reminder": "Setting a reminder", STATUS_TOOL_NAME: "Let me see."}


# how the car names an argument the driver did not say
UNSAID_AS = {"temperature_c": "temperature", "destination": "destination", "contact": "name or number",
             "query": "music or station", "text": "reminder", "time": "time"}


def zone_words(zone: str) -> str:
    """A climate zone as the car says it: "the rear", "the driver side"."""
    return "the rear" if zone == "rear" else f"the {zone} side"


def acknowledgement(name: str) -> str:
    """What to say as soon as the model has chosen to call ``name``, before its arguments."""
    return ACKNOWLEDGEMENTS.get(name, "One moment")


def confirmation(name: str, arguments: dict[str, Any], result: dict[str, Any], acknowledged: bool = False) -> str:
    """What the car says it did, from the call and its result (the app's ``confirm="template"``:
    spoken as soon as the call ran, without waiting for the model's own words). ``acknowledged``:
    the call's :func:`acknowledgement` was said already; this is the rest of the sentence."""
    if "unsaid" in result or not result.get("ok"):
        # "unsaid": not run, the app held the call to what was said (VoiceAssistant's ground_arguments)
        sorry = (f"Sorry, I did not catch the {UNSAID_AS.get(result['unsaid'], result['unsaid'])}."
                 if "unsaid" in result else "Sorry, I could not do that.")
        # after "Navigating" the apology breaks off the sentence begun; after "Let me see." it is one of its own
        return f"... s{sorry[1:]}" if acknowledged and not acknowledgement(name).endswith(".") else sorry
    if name == STATUS_TOOL_NAME:  # a sentence of its own, whether "Let me see." came first or not
        return reading(result)
    if name == "navigate":
        rest = f"to {arguments['destination']}."
    elif name == "set_temperature":
        zone = arguments.get("zone", "all")
        where = "the temperature" if zone == "all" else zone_words(zone)
        rest = f"{where} to {arguments['temperature_c']:g} degrees."
    elif name == "call":
        rest = f"{arguments['contact']}."
    elif name == "play_media":
        rest = f"{arguments['query']}."
    elif name == "set_reminder":
        at = f" for {arguments['time']}" if arguments.get("time") else ""
        rest = f"to {arguments['text']}{at}."
    else:
        return "Done." if acknowledged else f"Done: {name}."
    return rest if acknowledged else f"{acknowledgement(name)} {rest}"


def reading(result: dict[str, Any]) -> str:
    """What the car says of a ``car_status`` result: the value it read, as a sentence."""
    item = result["item"]
    if item == "time":
        return f"It is {result['time']}."
    if item == "date":
        return f"Today is {result['date']}."
    if item == "fuel":
        return f"The tank is {result['fuel_percent']:g} percent full."
    if item == "range":
        return f"About {result['range_km']:g} kilometers of range are left."
    if item == "cabin_temperature":
        zones = result["temperature_c"]
        if len(set(zones.values())) == 1:
            return f"The cabin is set to {next(iter(zones.values())):g} degrees."
        said = ", ".join(f"{zone_words(zone)} is set to {value:g} degrees" for zone, value in zones.items())
        return f"{said[0].upper()}{said[1:]}."
    if item == "outside_temperature":
        return f"It is {result['outside_c']:g} degrees outside."
    if item == "route":
        if result["destination"] is None:
            return "No route is set."
        return f"We are going to {result['destination']}, arriving at {result['arrival']}."
    return f"Playing {result['playing']}." if result["playing"] else "Nothing is playing."
