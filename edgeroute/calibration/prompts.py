"""The built-in calibration prompts: task-tagged, written for calibration only (kept apart from
the benchmark workloads in tools/workloads/ and from the export's evaluation text).

Each task has a few templates and slot values; prompts are their deterministic combinations
(slot i of prompt n is ``values[(n * stride) % len(values)]``), so the set is data, stable
across runs, and large enough to label tens of thousands of positions. A user JSONL file adds
prompts of the same shape: ``{"id", "task", "content"[, "record"]}``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from edgeroute.errors import InputError
from edgeroute.files import read_user_text

TASKS = ("voice-command", "templated", "json", "grounded", "dialogue", "code")
PER_TASK = 40
ECHO_WORDS = 8  # this many consecutive words of the instructions (all, if fewer) in an answer is an echo
# the longest answer a right one needs where the calibration's answer length (40) cuts it: a
# function with a comment in a fence, a sentence with four values (seen cut on the pair at 40)
ANSWER_TOKENS = {"code": 96, "templated": 64}
HELD_OUT_PER_TASK = 60  # a bound on a pass rate needs dozens of prompts: 0 losses in 60 bound the loss at 4.9% (95%)


@dataclass(frozen=True)
class SlotValues:
    """The values a split's prompts are built from. The held-out split shares none with the
    calibration split (cities, names, numbers, functions, facts), so a held-out pass rate is not
    a memory of calibration answers."""

    cities: list[str]
    streets: list[str]
    names: list[str]
    places: list[tuple[str, str]]  # (as said, the word a confirmation must carry)
    media: list[tuple[str, str]]
    temperatures: list[str]
    times: list[str]
    distances: list[str]
    levels: list[str]
    topics: list[str]
    functions: list[tuple[str, str, list]]  # (what it does, name, [[args, expected], ...] unit tests)
    facts: list[tuple[str, str, str, str, str]]  # name, country, height, width, visitors a year


CALIBRATION_VALUES = SlotValues(
    cities=["Lyon", "Turin", "Porto", "Ghent", "Bergen", "Graz", "Malmo", "Bilbao", "Leeds", "Utrecht", "Krakow"],
    streets=["Oak Avenue", "Harbor Road", "Mill Lane", "Station Street", "King's Way", "Elm Court", "Bridge Row"],
    names=["Anna", "Marco", "Sofia", "Tom", "Lena", "Ravi", "Chloe", "Jonas", "Mia", "Pedro", "Yuki"],
    places=[("the nearest charging station", "charging station"), ("a quiet cafe", "cafe"), ("the airport", "airport"),
            ("the city hospital", "hospital"), ("a pharmacy", "pharmacy"), ("the train station", "train station"),
            ("a parking garage", "parking"), ("the office", "office"), ("home", "home")],
    media=[("jazz", "jazz"), ("the morning news", "news"), ("classical piano", "piano"),
           ("my driving playlist", "playlist"), ("a podcast about history", "podcast"),
           ("rock from the eighties", "rock"), ("the weather report", "weather")],
    temperatures=["19", "20", "21", "22", "23", "24"],
    times=["7:15", "8:40", "12:05", "14:30", "17:50", "21:10"],
    distances=["3.2", "7.5", "12", "18.4", "26", "41"],
    levels=["12", "23", "35", "48", "64", "81"],
    topics=["staying focused on long drives", "packing for a weekend trip", "saving fuel in city traffic",
            "keeping children busy in the car", "driving safely in the rain", "planning a road trip",
            "choosing a good audiobook", "taking breaks on a long journey"],
    functions=[("reverse a string", "reverse_string", [[["abc"], "cba"], [["road"], "daor"]]),
               ("sum a list of numbers", "total", [[[[1, 2, 3]], 6], [[[]], 0]]),
               ("count the vowels in a word", "count_vowels", [[["banana"], 3], [["sky"], 0]]),
               ("check if a number is even", "is_even", [[[4], True], [[7], False]]),
               ("find the largest item in a list", "largest", [[[[3, 9, 2]], 9], [[[-5, -2]], -2]]),
               ("convert Celsius to Fahrenheit", "to_fahrenheit", [[[100], 212], [[0], 32]]),
               ("join words with commas", "join_words", [[[["a", "b", "c"]], "a,b,c"]]),
               ("return the square of a number", "square", [[[3], 9], [[-4], 16]])],
    facts=[("The Rhine Falls", "Switzerland", "23 meters", "150 meters", "1.2 million"),
           ("Lake Bled", "Slovenia", "30 meters", "2.1 kilometers", "700,000"),
           ("The Eden Project", "England", "50 meters", "100 meters", "1 million"),
           ("The Atomium", "Belgium", "102 meters", "18 meters", "600,000"),
           ("Kinderdijk", "the Netherlands", "19 windmills", "3 kilometers", "400,000")])

HELD_OUT_VALUES = SlotValues(
    cities=["Nantes", "Verona", "Seville", "Aarhus", "Tampere", "Linz", "Uppsala", "Zaragoza", "York", "Leiden",
            "Gdansk", "Brno", "Cork"],
    streets=["Maple Drive", "Canal Street", "Church Lane", "Victoria Road", "Park Terrace", "Willow Walk",
             "Market Square", "Hill Crescent"],
    names=["Olga", "Hugo", "Nadia", "Felix", "Ines", "Omar", "Greta", "Luca", "Priya", "Sven", "Amara", "Theo"],
    places=[("the closest gas station", "gas station"), ("a car wash", "car wash"), ("the stadium", "stadium"),
            ("a bakery", "bakery"), ("the public library", "library"), ("the ferry terminal", "ferry"),
            ("a hotel", "hotel"), ("the museum", "museum"), ("the school", "school"), ("a supermarket", "supermarket")],
    media=[("blues", "blues"), ("the traffic update", "traffic"), ("opera", "opera"),
           ("my workout mix", "workout"), ("an audiobook about space", "audiobook"), ("country music", "country"),
           ("the football commentary", "football"), ("reggae", "reggae"), ("salsa", "salsa"),
           ("the cricket scores", "cricket"), ("folk songs", "folk"), ("hip hop", "hip hop")],
    temperatures=["14", "15", "16", "17", "25", "27", "28", "29"],
    times=["6:20", "9:55", "11:35", "13:45", "16:10", "18:25", "20:05"],
    distances=["4.6", "9.1", "15", "22.7", "33", "58", "64.5"],
    levels=["9", "17", "29", "52", "76", "93", "44"],
    topics=["driving at night", "staying calm in a traffic jam", "travelling with a dog", "driving in snow",
            "keeping the car clean", "eating well on a road trip", "driving in a foreign country",
            "listening to podcasts while driving", "preparing the car for winter"],
    functions=[("return the larger of two numbers", "larger", [[[3, 7], 7], [[-1, -5], -1]]),
               ("count the words in a sentence", "count_words", [[["one two three"], 3], [["go"], 1]]),
               ("check if a word is a palindrome", "is_palindrome", [[["level"], True], [["drive"], False]]),
               ("return the last character of a string", "last_char", [[["road"], "d"], [["x"], "x"]]),
               ("convert kilometers to miles", "km_to_miles", [[[10], 6.21371], [[0], 0]]),
               ("double every number in a list", "double_all", [[[[1, 2, 3]], [2, 4, 6]], [[[]], []]]),
               ("return the first two items of a list", "first_two", [[[[5, 6, 7]], [5, 6]]]),
               ("capitalize the first letter of a word", "capitalize_first", [[["road"], "Road"]]),
               ("compute the average of a list of numbers", "average", [[[[2, 4, 9]], 5], [[[5]], 5]]),
               ("check if a number is negative", "is_negative", [[[-3], True], [[4], False]]),
               ("repeat a word three times with no spaces", "repeat_three", [[["go"], "gogogo"]])],
    facts=[("The Cliffs of Moher", "Ireland", "214 meters", "14 kilometers", "1.5 million"),
           ("Lake Hallstatt", "Austria", "125 meters", "5.9 kilometers", "800,000"),
           ("The Giant's Causeway", "Northern Ireland", "13 meters", "800 meters", "900,000"),
           ("The Sagrada Familia", "Spain", "172 meters", "60 meters", "4.7 million"),
           ("Mont Saint-Michel", "France", "92 meters", "960 meters", "2.5 million")])

# a number as written in an answer: 21, 7:15, 3.2, 700,000 (never a piece of a longer one)
_NUMBER = r"(?<![\w.,:])\d+(?:[.,:]\d+)*"
_NUMBER_END = r"(?![\d]|[.,:]\d)"


def spoken_forms(value: str) -> list[str]:
    """The ways an answer may write a number it was given: itself, and for a time of day its
    zero-padded and 12-hour forms (13:45 as 01:45 is not one; as 1:45 it is, before "pm")."""
    forms = [re.escape(value)]
    time = re.fullmatch(r"(\d{1,2}):(\d{2})", value)
    if time:
        hour, minute = int(time[1]), time[2]
        if hour < 10:
            forms.append(f"0{hour}:{minute}")
        if hour > 12:
            forms.append(rf"{hour - 12}:{minute}(?=\s*(?i:p\.?\s?m\b))")
    return forms


def number_pattern(value: str) -> str:
    """A regex finding ``value`` as a whole number in an answer (21 in "21 degrees", not in 214),
    in any of its :func:`spoken_forms`."""
    return rf"(?<![\w.,:])(?:{'|'.join(spoken_forms(value))}){_NUMBER_END}"


def foreign_number_pattern(allowed: list[str]) -> str:
    """A regex finding any number in an answer that is not one of ``allowed`` (a confirmation that
    says 22 degrees when 21 was asked for, an invented arrival time)."""
    forms = {form for v in allowed for form in spoken_forms(v)}
    known = "|".join(sorted(forms, key=len, reverse=True))
    guard = rf"(?!(?:{known}){_NUMBER_END})" if known else ""
    return rf"(?<![\w.,:]){guard}\d+(?:[.,:]\d+)*"


def numbers_in(text: str) -> list[str]:
    return re.findall(_NUMBER, text)


def echo_pattern(instructions: str, window: int = ECHO_WORDS) -> str:
    """A case-insensitive regex finding ``window`` consecutive words of the instructions (all
    of them if fewer) in an answer: an answer that repeats the prompt's instructions."""
    said = re.findall(r"[A-Za-z0-9]+", instructions)
    size = min(window, len(said))
    runs = {r"\W+".join(re.escape(w) for w in said[i:i + size]) for i in range(len(said) - size + 1)}
    return "(?i)" + "|".join(rf"\b{run}\b" for run in sorted(runs))


@dataclass(frozen=True)
class CalibrationPrompt:
    id: str
    task: str
    content: str  # one user turn
    record: dict[str, str] = field(default_factory=dict)  # values a correct answer must contain
    instructions: str = ""  # the prompt's instruction sentence (an answer must not echo it)
    # the task check, in promptfoo's assertion vocabulary (edgeroute.quality.assertions); none: no
    # automatic check (open dialogue), so only lossless modes may be chosen for the prompt's task
    assertions: tuple[dict[str, Any], ...] = ()


def _pick(values: list, n: int, stride: int):
    return values[(n * stride) % len(values)]


def _slot_checks(content: str, required: list[str], instructions: str,
                 forbidden: str | None = None) -> tuple[dict[str, Any], ...]:
    """Every slot said back (numbers as whole numbers), no number the request did not hold, no
    echo of the instructions, and nothing ``forbidden`` matches (a regex: the opposite action)."""
    words = [v for v in required if not re.fullmatch(r"[\d.,:]+", v)]
    numbers = [v for v in required if re.fullmatch(r"[\d.,:]+", v)]
    checks: list[dict[str, Any]] = []
    if words:
        checks.append({"type": "icontains-all", "value": words})
    checks += [{"type": "regex", "value": number_pattern(v)} for v in numbers]
    checks.append({"type": "not-regex", "value": foreign_number_pattern(numbers_in(content))})
    if instructions:
        checks.append({"type": "not-regex", "value": echo_pattern(instructions)})
    if forbidden:
        checks.append({"type": "not-regex", "value": forbidden})
    return tuple(checks)


def _voice(n: int, values: SlotValues) -> CalibrationPrompt:
    kind, opposite = n % 4, None
    if kind == 0:
        (place, key), city = _pick(values.places, n, 1), _pick(values.cities, n, 3)
        text, slots = f"Navigate to {place} in {city}, avoiding tolls.", [key, city, "toll"]
    elif kind == 1:
        degrees = _pick(values.temperatures, n // 4, 1)
        text, slots = f"Set the temperature to {degrees} degrees and turn on the seat heating.", [degrees, "seat heat"]
        opposite = r"(?i)\b(?:off|disabl\w*|deactivat\w*)\b"
    elif kind == 2:
        media, key = _pick(values.media, n // 4, 1)
        text, slots = f"Play {media} and lower the volume a little.", [key, "volume"]
        opposite = r"(?i)\b(?:rais\w*|increas\w*|louder|turn\w* up)\b"
    else:
        name, time = _pick(values.names, n, 1), _pick(values.times, n, 5)
        text, slots = f"Call {name} and tell them I arrive at {time}.", [name, time]
    instructions = "Confirm the command in one short sentence."
    content = f"{text} {instructions}"
    return CalibrationPrompt("", "voice-command", content, {}, instructions,
                             _slot_checks(content, slots, instructions, opposite))


def _record(n: int, values: SlotValues) -> dict[str, str]:
    return {"destination": f"{_pick(values.streets, n, 1)}, {_pick(values.cities, n, 3)}",
            "arrival": _pick(values.times, n, 5), "distance_km": _pick(values.distances, n, 2),
            "battery_percent": _pick(values.levels, n, 7)}


def _templated(n: int, values: SlotValues) -> CalibrationPrompt:
    record = _record(n, values)
    instructions = ["Write one sentence for the driver with all the values.",
                    "Tell the driver the trip details in one friendly sentence.",
                    "Summarize this route for the driver in one sentence, keeping every number."][n % 3]
    body = "; ".join(f"{k}: {v}" for k, v in record.items())
    content = f"Route record: {body}. {instructions}"
    street, city = record["destination"].split(", ")
    required = [street, city, record["arrival"], record["distance_km"], record["battery_percent"]]
    return CalibrationPrompt("", "templated", content, record, instructions,
                             _slot_checks(content, required, instructions))


def _json(n: int, values: SlotValues) -> CalibrationPrompt:
    kind = n % 3
    if kind == 0:
        street, city = _pick(values.streets, n, 1), _pick(values.cities, n, 3)
        command, keys = f"navigate to {street} in {city}", '{"intent": "navigate", "street": ..., "city": ...}'
        record = {"intent": "navigate", "street": street, "city": city}
    elif kind == 1:
        degrees = _pick(values.temperatures, n // 3, 1)
        command, keys = f"set the cabin to {degrees} degrees", '{"intent": "climate", "temperature": ...}'
        record = {"intent": "climate", "temperature": degrees}
    else:
        name = _pick(values.names, n // 3, 1)
        command, keys = f"call {name}", '{"intent": "call", "contact": ...}'
        record = {"intent": "call", "contact": name}
    instructions = f"Answer only with JSON of the form {keys}."
    # the values, not the layout: a number may come as 21 or "21", the JSON in a code fence or not
    properties = {k: {"enum": [v, int(v)]} if v.isdigit() else {"const": v} for k, v in record.items()}
    schema = {"type": "object", "required": sorted(record), "properties": properties, "additionalProperties": False}
    checks = ({"type": "json-schema", "value": schema}, {"type": "not-regex", "value": echo_pattern(instructions)})
    return CalibrationPrompt("", "json", f"Voice command: \"{command}\". {instructions}",
                             {k: v for k, v in record.items() if k != "intent"}, instructions, checks)


def _grounded(n: int, values: SlotValues) -> CalibrationPrompt:
    name, country, height, width, visitors = _pick(values.facts, n, 1)
    season = ["spring", "summer", "autumn", "winter"][(n // 20) % 4]
    passage = (f"{name} is in {country}. It is {height} high and {width} wide, and about {visitors} "
               f"people visit it every year, most of them in {season}.")
    kind = (n // 5) % 4
    question = ["How high is it?", "Where is it?", "How many people visit it each year?",
                "Summarize the passage in one sentence."][kind]
    record = [{"height": height}, {"country": country}, {"visitors": visitors}, {}][kind]
    content = f"{passage}\n\nQuestion: {question}"
    # the name's most telling word (a model may drop "The" or write a curly apostrophe)
    key = max(re.findall(r"[A-Za-z-]+", name.removeprefix("The ")), key=len)
    if kind == 3:  # a summary carries its key facts: what and where, and at least one of its figures
        checks = (*_slot_checks(content, [key, country.removeprefix("the ")], question),
                  {"type": "icontains-any", "value": [height.split()[0], width.split()[0], visitors.split()[0]]})
    elif kind == 1:  # where: this country, and no other of the set (Northern Ireland is not Ireland)
        others = [c for _, c, *_ in values.facts if c.lower() not in country.lower()]
        checks = (*_slot_checks(content, [country.removeprefix("the ")], question),
                  {"type": "not-icontains-any", "value": others})
    else:
        checks = _slot_checks(content, [next(iter(record.values())).split()[0]], question)
    return CalibrationPrompt("", "grounded", content, record, question, checks)


def _dialogue(n: int, values: SlotValues) -> CalibrationPrompt:
    count = ["two", "three", "four"][(n // 4) % 3]
    text = [f"Give me {count} tips for {_pick(values.topics, n, 1)}.",
            f"What should I know about {_pick(values.topics, n, 3)}?",
            f"My friend {_pick(values.names, n, 1)} is tired after driving {_pick(values.distances, n, 1)} km. "
            "What can they do?",
            f"Tell me {count} short facts about {_pick(values.cities, n, 5)}."][n % 4]
    return CalibrationPrompt("", "dialogue", text)


PYTHON_UNIT_TESTS = """ns = {}
exec(code_block(output, "python"), ns)
if not callable(ns.get(NAME)):
    return {"pass": False, "reason": f"the answer defines no function {NAME}"}
for args, want in CASES:
    got = ns[NAME](*args)
    close = isinstance(want, (int, float)) and not isinstance(want, bool) and isinstance(got, (int, float)) \\
        and abs(got - want) <= 1e-2 * max(1.0, abs(want))
    if not (close or got == want):
        return {"pass": False, "reason": f"{NAME}{tuple(args)} returned {got!r}, expected {want!r}"}
return True"""

JAVASCRIPT_UNIT_TESTS = r"""const source = codeBlock(output, "javascript").replace(/^\s*export\s+(default\s+)?/gm, "");
const module = {exports: {}};
const fn = new Function("module", "exports", "require", source + `
;return typeof ${NAME} === "function" ? ${NAME} : (module.exports.${NAME} || module.exports);`)(
  module, module.exports, require);
if (typeof fn !== "function") return {pass: false, reason: `the answer defines no function ${NAME}`};
for (const [args, want] of CASES) {
  const got = fn(...args);
  const close = typeof want === "number" && typeof got === "number"
    && Math.abs(got - want) <= 1e-2 * Math.max(1, Math.abs(want));
  if (!close && JSON.stringify(got) !== JSON.stringify(want)) {
    const call = `${NAME}(${JSON.stringify(args).slice(1, -1)})`;
    return {pass: false, reason: `${call} returned ${JSON.stringify(got)}, expected ${JSON.stringify(want)}`};
  }
}
return true;"""


def unit_test_check(language: str, name: str, cases: list) -> dict[str, Any]:
    """A ``python`` / ``javascript`` assertion that runs the answer's function (its first fenced
    block, or the whole answer) against ``cases`` ([[args, expected], ...]) in the sandbox."""
    if language == "Python":
        return {"type": "python", "value": f"import json\nNAME = {name!r}\nCASES = json.loads({json.dumps(cases)!r})\n"
                                           + PYTHON_UNIT_TESTS}
    prelude = f"const NAME = {json.dumps(name)};\nconst CASES = {json.dumps(cases)};\n"
    return {"type": "javascript", "value": prelude + JAVASCRIPT_UNIT_TESTS}


def _code(n: int, values: SlotValues) -> CalibrationPrompt:
    what, name, cases = values.functions[n % len(values.functions)]
    language = ["Python", "JavaScript"][(n // len(values.functions)) % 2]
    instructions = ["Reply with the code only.", "Add one short comment.",
                    "Keep it under five lines."][(n // (2 * len(values.functions))) % 3]
    checks = (unit_test_check(language, name, cases), {"type": "not-regex", "value": echo_pattern(instructions)})
    return CalibrationPrompt("", "code", f"Write a {language} function named {name} to {what}. {instructions}",
                             {"name": name}, instructions, checks)


BUILDERS = {"voice-command": _voice, "templated": _templated, "json": _json, "grounded": _grounded,
            "dialogue": _dialogue, "code": _code}
ID_PREFIX = {"voice-command": "voice", "templated": "templated", "json": "json", "grounded": "grounded",
             "dialogue": "dialogue", "code": "code"}


def _unique(task: str, values: SlotValues, count: int, prefix: str) -> list[CalibrationPrompt]:
    """The first ``count`` prompts of a task with texts of their own (a combination that repeats
    an earlier text is passed over), ids numbered by the combination."""
    prompts, seen = [], set()
    for n in range(50 * count):
        if len(prompts) == count:
            break
        prompt = BUILDERS[task](n, values)
        if prompt.content not in seen:
            seen.add(prompt.content)
            prompts.append(dataclasses.replace(prompt, id=f"{prefix}{ID_PREFIX[task]}-{n:03d}"))
    return prompts


def builtin_prompts(per_task: int = PER_TASK) -> list[CalibrationPrompt]:
    """Up to ``per_task`` calibration prompts of every task, interleaved (task order repeats), ids
    stable; a combination that repeats an earlier prompt's text is left out."""
    prompts, seen = [], set()
    for n in range(per_task):
        for task in TASKS:
            prompt = BUILDERS[task](n, CALIBRATION_VALUES)
            if prompt.content not in seen:
                seen.add(prompt.content)
                prompts.append(dataclasses.replace(prompt, id=f"{ID_PREFIX[task]}-{n:03d}"))
    return prompts


def held_out_prompts(per_task: int = HELD_OUT_PER_TASK, tasks: tuple[str, ...] = TASKS) -> list[CalibrationPrompt]:
    """``per_task`` held-out prompts of every task (ids ``heldout-...``), built from
    :data:`HELD_OUT_VALUES`: no slot value of theirs occurs in a calibration prompt. What runtime
    runs judge modes on; never labelled or trained on. Where a task has fewer distinct prompts
    than ``per_task``, it gives those it has, with a warning naming the task and the count."""
    prompts, short = [], []
    for task in tasks:
        found = _unique(task, HELD_OUT_VALUES, per_task, "heldout-")
        if len(found) < per_task:
            short.append(f"{task} {len(found)}")
        prompts += found
    if short:
        warnings.warn(f"the built-in held-out set has fewer distinct prompts than the {per_task} per task asked for "
                      f"({', '.join(short)}): those tasks are judged on the prompts there are", stacklevel=2)
    return prompts


def load_prompts(path: str | Path) -> list[CalibrationPrompt]:
    """A JSONL file of ``{"id", "task", "content"[, "record", "instructions"]}`` lines."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"prompt file {path} does not exist")
    prompts = []
    for number, line in enumerate(read_user_text(path, "prompt file").splitlines(), 1):
        if not line.strip():
            continue
        try:
            data: dict[str, Any] = json.loads(line)
            prompt = CalibrationPrompt(**data)
        except (json.JSONDecodeError, TypeError) as err:
            raise InputError(f"{path}:{number} is not a prompt line like "
                             '{"id": "p1", "task": "templated", "content": "..."} '
                             f"({err})") from None
        for key in ("id", "task", "content"):
            value = getattr(prompt, key)
            if not isinstance(value, str) or not value.strip():
                raise InputError(f"{path}:{number}: \"{key}\" must be a non-empty string (got {value!r})")
        if prompt.task not in TASKS:
            raise InputError(f"{path}:{number}: task {prompt.task!r} is not one of {', '.join(TASKS)}")
        prompts.append(prompt)
    if not prompts:
        raise InputError(f"prompt file {path} holds no prompts")
    return prompts


def prompts_sha256(prompts: list[CalibrationPrompt]) -> str:
    return hashlib.sha256(json.dumps([asdict(p) for p in prompts], sort_keys=True).encode()).hexdigest()
