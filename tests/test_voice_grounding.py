"""The voice app's check of a call's arguments against what the driver said
(examples/voice_assistant/grounding.py), and the app running only what rests on it."""

from __future__ import annotations

import asyncio

import pytest

from examples.voice_assistant import CAR_TOOLS, NullSpeaker, VoiceAssistant
from examples.voice_assistant.car import TOOLS_BY_NAME, confirmation
from examples.voice_assistant.grounding import ground, is_said, says_a_number


def parameters(name: str) -> dict:
    return TOOLS_BY_NAME[name]["function"]["parameters"]


@pytest.mark.parametrize(("heard", "name", "arguments", "kept", "left_out", "unsaid"), [
    # the pair's own made-up arguments (the voice records): left out when optional, the call unrun when required
    ("remind me to call the dentist", "set_reminder", {"text": "call the dentist", "time": "10:00"},
     {"text": "call the dentist"}, ["time"], None),
    ("turn the temperature down to 18", "set_temperature", {"temperature_c": 18, "zone": "driver"},
     {"temperature_c": 18}, ["zone"], None),
    ("roll down the windows", "navigate", {"destination": "home"}, None, [], "destination"),
    ("turn on the seat heating", "set_temperature", {"temperature_c": 20, "zone": "driver"}, None, [], "temperature_c"),
    ("tell me a joke", "call", {"contact": "John Doe"}, None, [], "contact"),
    # what was said stays, in digits or words, a plural or a synonym
    ("remind me at 9:15 to call the bank", "set_reminder", {"text": "call the bank", "time": "09:15"},
     {"text": "call the bank", "time": "09:15"}, [], None),
    ("remind me at noon to eat lunch", "set_reminder", {"text": "eat lunch", "time": "12:00"},
     {"text": "eat lunch", "time": "12:00"}, [], None),
    ("make it one degree warmer", "set_temperature", {"temperature_c": 22}, {"temperature_c": 22}, [], None),
    ("make it 20 degrees in the back", "set_temperature", {"temperature_c": 20, "zone": "rear"},
     {"temperature_c": 20, "zone": "rear"}, [], None),
    ("set all zones to 20 degrees", "set_temperature", {"temperature_c": 20, "zone": "all"},
     {"temperature_c": 20, "zone": "all"}, [], None),
    ("play some relaxing music", "play_media", {"query": "relaxing music"}, {"query": "relaxing music"}, [], None),
    ("take me to 221B Baker Street", "navigate", {"destination": "221b Baker St"}, {"destination": "221b Baker St"}, [],
     None),
    ("call Anna call her again", "call", {"contact": "Anna"}, {"contact": "Anna"}, [], None),
])
def test_an_argument_is_run_only_as_far_as_the_driver_said_it(heard, name, arguments, kept, left_out, unsaid):
    held = ground(parameters(name), arguments, heard)
    assert (held.unsaid, held.left_out) == (unsaid, left_out)
    if unsaid is None:
        assert held.arguments == kept


def test_what_counts_as_said():
    assert says_a_number("at 6 pm") and says_a_number("half past six") and says_a_number("twenty one degrees")
    assert not says_a_number("turn up the heat") and not says_a_number("someone")  # "one" is a word, not a part
    zone = parameters("set_temperature")["properties"]["zone"]
    assert is_said(zone, "passenger", "the passenger side") and not is_said(zone, "driver", "the passenger side")
    assert not is_said({"type": "string"}, "mom", "phone my mother")  # words, not meaning: a paraphrase is not said
    assert not is_said({"type": "string"}, "to the home", "roll down the windows")  # "the" shows nothing
    assert is_said({"type": "string"}, "Jazz FMs", "play the radio station Jazz FM")


def test_a_call_not_run_for_an_argument_not_said_is_answered_by_the_car_asking_for_it():
    result = {"ok": False, "unsaid": "temperature_c", "error": "the driver did not say the temperature_c"}
    assert confirmation("set_temperature", {"temperature_c": 20}, result) == "Sorry, I did not catch the temperature."
    assert confirmation("navigate", {"destination": "home"}, {**result, "unsaid": "destination"}) == \
        "Sorry, I did not catch the destination."
    # after the acknowledgement was said ("Navigating"), the apology breaks off the sentence begun
    assert confirmation("navigate", {"destination": "home"}, {**result, "unsaid": "destination"},
                        acknowledged=True) == "... sorry, I did not catch the destination."
    assert confirmation("call", {"contact": "x"}, {"ok": False, "error": "busy"}, acknowledged=True) == \
        "... sorry, I could not do that."
    assert confirmation("car_status", {"item": "time"}, {"ok": False, "error": "no clock"}, acknowledged=True) == \
        "Sorry, I could not do that."  # after "Let me see."


# -- in the app ------------------------------------------------------------------------------------

SYSTEM = "You are the voice assistant of a car. Answer in one short sentence."
NAVIGATE = {"type": "function", "function": {"name": "navigate"}}
TOOLS = [t for t in CAR_TOOLS if t["function"]["name"] in ("navigate", "set_temperature")]


@pytest.fixture(scope="module")
def engine(tiny_models, tmp_path_factory):
    from edgeroute.runtime import Engine
    from tests.conftest import export_tiny

    src = tiny_models["llama"][0]
    out = tmp_path_factory.mktemp("voice-grounding") / "llama"
    export_tiny(src, out, context_length=512)
    return Engine(out)


@pytest.mark.parametrize("grounded", [False, True])
def test_a_call_whose_destination_was_not_said_is_not_run_and_the_car_says_so(engine, grounded):
    speaker = NullSpeaker()
    assistant = VoiceAssistant(engine, speaker, system=SYSTEM, tools=TOOLS, tool_choice=NAVIGATE, confirm="template",
                               max_new_tokens=40, ground_arguments=grounded, share_prefix=False)
    # the random model's destination is words of its own: none of them said in "Roll down the windows."
    [record] = asyncio.run(assistant.converse("Roll down the windows.", speed=0))
    [decoded] = assistant.chat.messages[2]["tool_calls"]
    destination = decoded["function"]["arguments"]
    if not grounded:
        assert [c["name"] for c in record.tool_calls] == ["navigate"] and assistant.car.destination is not None
        return
    assert not record.tool_calls and assistant.car.destination is None and not assistant.car.log
    assert [c["name"] for c in record.unsaid_calls] == ["navigate"] and destination
    assert record.answer == "Sorry, I did not catch the destination."
    assert [chunk for chunk, _ in speaker.said] == [record.answer]
    assert assistant.chat.messages[-1] == {"role": "assistant", "content": record.answer}
    tool_result = assistant.chat.messages[-2]
    assert tool_result["role"] == "tool" and '"unsaid": "destination"' in tool_result["content"]


def test_the_car_runs_a_call_with_the_arguments_said_and_the_confirmation_says_what_ran(engine):
    from types import SimpleNamespace

    from examples.voice_assistant.assistant import TurnRecord

    assistant = VoiceAssistant(engine, NullSpeaker(), system=SYSTEM, tools=CAR_TOOLS[-1:], max_new_tokens=1,
                               ground_arguments=True, share_prefix=False)
    assistant.chat.generate("Remind me to call the dentist.")  # what the driver said, in the chat
    record = TurnRecord("Remind me to call the dentist.", 1, 0.0, 0.0)
    call = SimpleNamespace(id="call_0", name="set_reminder", arguments={"text": "call the dentist", "time": "10:00"})
    arguments, result = assistant._run(call, record)
    assert arguments == {"text": "call the dentist"} and result == {"ok": True, "reminder": "call the dentist",
                                                                     "time": None}
    assert record.tool_calls == [{"id": "call_0", "name": "set_reminder", "arguments": arguments}]
    assert assistant.car.reminders == [{"text": "call the dentist", "time": None}]
    assert confirmation(call.name, arguments, result) == "Setting a reminder to call the dentist."


def test_an_acknowledged_call_that_is_not_run_is_apologized_for_as_the_sentence_goes_on(engine):
    speaker = NullSpeaker()
    assistant = VoiceAssistant(engine, speaker, system=SYSTEM, tools=TOOLS, tool_choice=NAVIGATE, confirm="template",
                               acknowledge=True, max_new_tokens=40, ground_arguments=True, share_prefix=False)
    [record] = asyncio.run(assistant.converse("Roll down the windows.", speed=0))
    assert record.unsaid_calls and not record.tool_calls and record.acknowledgement == "Navigating"
    said = "".join(chunk for chunk, _ in speaker.said)
    assert said == "Navigating ... sorry, I did not catch the destination."
    assert assistant.chat.messages[-1] == {"role": "assistant", "content": said}
