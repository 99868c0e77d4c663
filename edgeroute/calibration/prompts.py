"""The built-in calibration prompts: task-tagged, written for calibration only (kept apart from
the benchmark workloads in tools/workloads/ and from the export's evaluation text).

Each task has a few templates and slot values; prompts are their deterministic combinations
(slot i of prompt n is ``values[(n * stride) % len(values)]``), so the set is data, stable
across runs, and large enough to label tens of thousands of positions. A user JSONL file adds
prompts of the same shape: ``{"id", "task", "content"[, "record"]}``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from edgeroute.errors import InputError

TASKS = ("voice-command", "templated", "json", "grounded", "dialogue", "code")
PER_TASK = 40

CITIES = ["Lyon", "Turin", "Porto", "Ghent", "Bergen", "Graz", "Malmo", "Bilbao", "Leeds", "Utrecht", "Krakow"]
STREETS = ["Oak Avenue", "Harbor Road", "Mill Lane", "Station Street", "King's Way", "Elm Court", "Bridge Row"]
NAMES = ["Anna", "Marco", "Sofia", "Tom", "Lena", "Ravi", "Chloe", "Jonas", "Mia", "Pedro", "Yuki"]
PLACES = ["the nearest charging station", "a quiet cafe", "the airport", "the city hospital", "a pharmacy",
          "the train station", "a parking garage", "the office", "home"]
SONGS = ["jazz", "the morning news", "classical piano", "my driving playlist", "a podcast about history",
         "rock from the eighties", "the weather report"]
TEMPS = ["19", "20", "21", "22", "23", "24"]
TIMES = ["7:15", "8:40", "12:05", "14:30", "17:50", "21:10"]
DISTANCES = ["3.2", "7.5", "12", "18.4", "26", "41"]
LEVELS = ["12", "23", "35", "48", "64", "81"]
TOPICS = ["staying focused on long drives", "packing for a weekend trip", "saving fuel in city traffic",
          "keeping children busy in the car", "driving safely in the rain", "planning a road trip",
          "choosing a good audiobook", "taking breaks on a long journey"]
FUNCTIONS = [("reverse a string", "reverse_string"), ("sum a list of numbers", "total"),
             ("count the vowels in a word", "count_vowels"), ("check if a number is even", "is_even"),
             ("find the largest item in a list", "largest"), ("convert Celsius to Fahrenheit", "to_fahrenheit"),
             ("join words with commas", "join_words"), ("return the square of a number", "square")]
FACTS = [("The Rhine Falls", "Switzerland", "23 meters", "150 meters", "1.2 million"),
         ("Lake Bled", "Slovenia", "30 meters", "2.1 kilometers", "700,000"),
         ("The Eden Project", "England", "50 meters", "100 meters", "1 million"),
         ("The Atomium", "Belgium", "102 meters", "18 meters", "600,000"),
         ("Kinderdijk", "the Netherlands", "19 windmills", "3 kilometers", "400,000")]


@dataclass(frozen=True)
class CalibrationPrompt:
    id: str
    task: str
    content: str  # one user turn
    record: dict[str, str] = field(default_factory=dict)  # values a correct answer must contain
    instructions: str = ""  # the prompt's instruction sentence (an answer must not echo it)


def _pick(values: list, n: int, stride: int):
    return values[(n * stride) % len(values)]


def _voice(n: int) -> CalibrationPrompt:
    kind = n % 4
    if kind == 0:
        place, city = _pick(PLACES, n, 1), _pick(CITIES, n, 3)
        text = f"Navigate to {place} in {city}, avoiding tolls."
    elif kind == 1:
        text = f"Set the temperature to {_pick(TEMPS, n, 1)} degrees and turn on the seat heating."
    elif kind == 2:
        text = f"Play {_pick(SONGS, n, 1)} and lower the volume a little."
    else:
        text = f"Call {_pick(NAMES, n, 1)} and tell them I arrive at {_pick(TIMES, n, 5)}."
    instructions = "Confirm the command in one short sentence."
    return CalibrationPrompt(f"voice-{n:03d}", "voice-command", f"{text} {instructions}", {}, instructions)


def _record(n: int) -> dict[str, str]:
    return {"destination": f"{_pick(STREETS, n, 1)}, {_pick(CITIES, n, 3)}", "arrival": _pick(TIMES, n, 5),
            "distance_km": _pick(DISTANCES, n, 2), "battery_percent": _pick(LEVELS, n, 7)}


def _templated(n: int) -> CalibrationPrompt:
    record = _record(n)
    instructions = ["Write one sentence for the driver with all the values.",
                    "Tell the driver the trip details in one friendly sentence.",
                    "Summarize this route for the driver in one sentence, keeping every number."][n % 3]
    body = "; ".join(f"{k}: {v}" for k, v in record.items())
    return CalibrationPrompt(f"templated-{n:03d}", "templated", f"Route record: {body}. {instructions}",
                             record, instructions)


def _json(n: int) -> CalibrationPrompt:
    kind = n % 3
    if kind == 0:
        command = f"navigate to {_pick(STREETS, n, 1)} in {_pick(CITIES, n, 3)}"
        keys = '{"intent": "navigate", "street": ..., "city": ...}'
        record = {"street": _pick(STREETS, n, 1), "city": _pick(CITIES, n, 3)}
    elif kind == 1:
        command = f"set the cabin to {_pick(TEMPS, n, 1)} degrees"
        keys = '{"intent": "climate", "temperature": ...}'
        record = {"temperature": _pick(TEMPS, n, 1)}
    else:
        command = f"call {_pick(NAMES, n, 1)}"
        keys = '{"intent": "call", "contact": ...}'
        record = {"contact": _pick(NAMES, n, 1)}
    instructions = f"Answer only with JSON of the form {keys}."
    return CalibrationPrompt(f"json-{n:03d}", "json", f"Voice command: \"{command}\". {instructions}",
                             record, instructions)


def _grounded(n: int) -> CalibrationPrompt:
    name, country, height, width, visitors = _pick(FACTS, n, 1)
    season = ["spring", "summer", "autumn", "winter"][(n // 20) % 4]
    passage = (f"{name} is in {country}. It is {height} high and {width} wide, and about {visitors} "
               f"people visit it every year, most of them in {season}.")
    kind = (n // 5) % 4
    question = ["How high is it?", "Where is it?", "How many people visit it each year?",
                "Summarize the passage in one sentence."][kind]
    record = [{"height": height}, {"country": country}, {"visitors": visitors}, {}][kind]
    return CalibrationPrompt(f"grounded-{n:03d}", "grounded", f"{passage}\n\nQuestion: {question}", record, question)


def _dialogue(n: int) -> CalibrationPrompt:
    count = ["two", "three", "four"][(n // 4) % 3]
    text = [f"Give me {count} tips for {_pick(TOPICS, n, 1)}.", f"What should I know about {_pick(TOPICS, n, 3)}?",
            f"My friend {_pick(NAMES, n, 1)} is tired after driving {_pick(DISTANCES, n, 1)} km. What can they do?",
            f"Tell me {count} short facts about {_pick(CITIES, n, 5)}."][n % 4]
    return CalibrationPrompt(f"dialogue-{n:03d}", "dialogue", text)


def _code(n: int) -> CalibrationPrompt:
    what, name = _pick(FUNCTIONS, n, 1)
    language = ["Python", "JavaScript"][(n // 8) % 2]
    instructions = ["Reply with the code only.", "Add one short comment.", "Keep it under five lines."][(n // 16) % 3]
    return CalibrationPrompt(f"code-{n:03d}", "code", f"Write a {language} function named {name} to {what}. "
                             f"{instructions}", {"name": name}, instructions)


BUILDERS = {"voice-command": _voice, "templated": _templated, "json": _json, "grounded": _grounded,
            "dialogue": _dialogue, "code": _code}


def builtin_prompts(per_task: int = PER_TASK) -> list[CalibrationPrompt]:
    """Up to ``per_task`` prompts of every task, interleaved (task order repeats), ids stable;
    a combination that repeats an earlier prompt's text is left out."""
    prompts, seen = [], set()
    for prompt in (BUILDERS[task](n) for n in range(per_task) for task in TASKS):
        if prompt.content not in seen:
            seen.add(prompt.content)
            prompts.append(prompt)
    return prompts


def load_prompts(path: str | Path) -> list[CalibrationPrompt]:
    """A JSONL file of ``{"id", "task", "content"[, "record", "instructions"]}`` lines."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"prompt file {path} does not exist")
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            data: dict[str, Any] = json.loads(line)
            prompt = CalibrationPrompt(**data)
        except (json.JSONDecodeError, TypeError) as err:
            raise InputError(f"{path}:{number} is not a prompt line like "
                             '{"id": "p1", "task": "templated", "content": "..."} '
                             f"({err})") from None
        if prompt.task not in TASKS:
            raise InputError(f"{path}:{number}: task {prompt.task!r} is not one of {', '.join(TASKS)}")
        prompts.append(prompt)
    if not prompts:
        raise InputError(f"prompt file {path} holds no prompts")
    return prompts


def prompts_sha256(prompts: list[CalibrationPrompt]) -> str:
    return hashlib.sha256(json.dumps([asdict(p) for p in prompts], sort_keys=True).encode()).hexdigest()
