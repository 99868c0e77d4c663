"""The example voice assistant (examples/voice_assistant) and its benchmark's scorer: sentence
splitting, the car's tools, the scripted recognizer's timing, the asyncio loop with
listen-ahead (the answer of a cold prefill, exactly) and barge-in (history as if the answer
ended where it was cut), espeak-ng and pocketsphinx where installed."""

from __future__ import annotations

import asyncio
import copy
import json
import re
import shutil
import time

import pytest

from examples.voice_assistant import (
    CAR_TOOLS,
    CarState,
    NullSpeaker,
    ScriptedRecognizer,
    SentenceSplitter,
    Utterance,
    VoiceAssistant,
    timed_partials,
)
from examples.voice_assistant.assistant import SYSTEM as CAR_SYSTEM
from examples.voice_assistant.car import (
    STATUS_ITEMS,
    STATUS_TOOL,
    STATUS_TOOL_NAME,
    WORDS_TOOL,
    WORDS_TOOL_INSTRUCTION,
    WORDS_TOOL_NAME,
    confirmation,
    reading,
)
from examples.voice_assistant.speech import EspeakSpeaker, StringArgument, speakable
from tools.bench_voice import COMMANDS as COMMANDS_FILE
from tools.bench_voice import expectation
from tools.benchlib.voice import check_calls, normalise, percentiles, unasked_actions, word_assertions

SYSTEM = "You are the voice assistant of a car. Answer in one short sentence."
needs_espeak = pytest.mark.skipif(shutil.which("espeak-ng") is None,
                                  reason="espeak-ng is not installed (apt-get install espeak-ng)")


# -- sentence splitting -----------------------------------------------------------------------

def split(text: str, step: int, **options) -> list[str]:
    splitter, chunks = SentenceSplitter(**options), []
    for i in range(0, len(text), step):
        chunks += splitter.push(text[i:i + step])
    return chunks + splitter.flush()


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_sentences_are_cut_at_their_ends_whatever_the_pieces_and_concatenate_to_the_text(step):
    text = "Navigating to 221B Baker St. in London. It is 3.5 km away! Shall I call Dr. Miller? Okay"
    chunks = split(text, step, clause_chars=None)
    assert chunks == ["Navigating to 221B Baker St. in London.", " It is 3.5 km away!", " Shall I call Dr. Miller?",
                      " Okay"]
    assert "".join(chunks) == text


def test_a_long_first_clause_is_spoken_at_its_comma_and_text_without_marks_at_a_space():
    text = "The route to the airport is clear, it takes twelve minutes. Enjoy."
    assert split(text, 3) == ["The route to the airport is clear,", " it takes twelve minutes.", " Enjoy."]
    assert split("Yes, sure. Done.", 3) == ["Yes, sure.", " Done."]  # a short clause waits for its sentence
    words = "one two three four five six seven eight nine ten"
    chunks = split(words, 4, max_chars=20)
    assert "".join(chunks) == words and all(len(c) <= 21 for c in chunks) and len(chunks) > 2
    assert split("Line one\nLine two", 2) == ["Line one\n", "Line two"]
    assert split("", 1) == [] and split("   ", 1) == ["   "]


# -- the car's tools ----------------------------------------------------------------------------

def test_the_tools_are_openai_functions_with_json_schemas_and_the_car_executes_them():
    names = [t["function"]["name"] for t in CAR_TOOLS]
    assert names == ["navigate", "set_temperature", "call", "play_media", "set_reminder"]
    assert all(t["type"] == "function" and t["function"]["parameters"]["type"] == "object" for t in CAR_TOOLS)
    car = CarState()
    assert car.dispatch("navigate", {"destination": "the airport"})["ok"] and car.destination == "the airport"
    assert car.dispatch("set_temperature", {"temperature_c": 19, "zone": "passenger"})["ok"]
    assert car.temperature_c == {"driver": 21.0, "passenger": 19.0, "rear": 21.0}
    car.dispatch("set_temperature", {"temperature_c": 23.5})  # zone all by default
    assert set(car.temperature_c.values()) == {23.5}
    car.dispatch("call", {"contact": "Anna"})
    car.dispatch("play_media", {"query": "jazz"})
    car.dispatch("set_reminder", {"text": "buy milk", "time": "18:00"})
    assert (car.calling, car.playing, car.reminders) == ("Anna", "jazz", [{"text": "buy milk", "time": "18:00"}])
    assert [name for name, _, _ in car.log] == ["navigate", "set_temperature", "set_temperature", "call", "play_media",
                                                "set_reminder"]


def test_the_car_reads_out_what_it_knows_from_its_own_state_and_clock():
    from datetime import datetime

    car = CarState(clock=lambda: datetime(2026, 12, 6, 16, 36))
    said = {item: confirmation(STATUS_TOOL_NAME, {"item": item}, car.dispatch(STATUS_TOOL_NAME, {"item": item}))
            for item in STATUS_ITEMS}
    assert said == {"time": "It is 16:36.", "date": "Today is Sunday, 6 December 2026.",
                    "fuel": "The tank is 62 percent full.", "range": "About 410 kilometers of range are left.",
                    "cabin_temperature": "The cabin is set to 21 degrees.", "outside_temperature": "It is 8 degrees outside.",
                    "route": "No route is set.", "playing": "Nothing is playing."}
    eta = car.dispatch("navigate", {"destination": "the airport"})["eta_minutes"]
    car.dispatch("set_temperature", {"temperature_c": 19, "zone": "passenger"})
    car.dispatch("play_media", {"query": "jazz"})
    read = {item: reading(car.dispatch(STATUS_TOOL_NAME, {"item": item})) for item in ("route", "cabin_temperature",
                                                                                        "playing")}
    assert read == {"route": f"We are going to the airport, arriving at 16:{36 + eta}.",
                    "cabin_temperature": "The driver side is set to 21 degrees, the passenger side is set to 19 degrees, "
                                         "the rear is set to 21 degrees.",
                    "playing": "Playing jazz."}
    # a reading is its own sentence, after "Let me see." or not
    assert confirmation(STATUS_TOOL_NAME, {"item": "fuel"}, car.dispatch(STATUS_TOOL_NAME, {"item": "fuel"}),
                        acknowledged=True) == "The tank is 62 percent full."
    assert STATUS_TOOL["function"]["parameters"]["properties"]["item"]["enum"] == STATUS_ITEMS


@pytest.mark.parametrize(("name", "arguments", "error"), [
    ("open_sunroof", {}, "no tool named"),
    ("car_status", {"item": "tire_pressure"}, "must be one of"),
    ("car_status", {}, "lacks 'item'"),
    ("navigate", {}, "lacks 'destination'"),
    ("navigate", {"destination": 7}, "must be a string"),
    ("set_temperature", {"temperature_c": 40}, "at most 30"),
    ("set_temperature", {"temperature_c": "warm"}, "must be a number"),
    ("set_temperature", {"temperature_c": 20, "zone": "roof"}, "must be one of"),
    ("set_reminder", {"text": "x", "time": "6pm"}, "must match"),
    ("call", {"contact": "Anna", "loud": True}, "unknown key 'loud'"),
])
def test_a_call_that_breaks_its_schema_changes_nothing_and_says_why(name, arguments, error):
    car = CarState()
    result = car.dispatch(name, arguments)
    assert not result["ok"] and error in result["error"]
    assert car.destination is None and car.temperature_c["driver"] == 21.0 and not car.reminders


# -- the scripted recognizer ----------------------------------------------------------------------

def test_timed_partials_speak_at_150_words_a_minute_with_the_asrs_revisions():
    utterance = timed_partials("call Anna Schmidt now", revisions=[(2, "call and a")])
    assert utterance.partials == [(0.4, "call"), (0.8, "call and a"), (pytest.approx(1.2), "call Anna Schmidt")]
    assert utterance.end == pytest.approx(1.6) and utterance.final == "call Anna Schmidt now"
    endpointed = timed_partials("call Anna now", asr_delay=0.3)  # the ASR waits for silence: the whole text first
    assert endpointed.partials[-1] == (pytest.approx(1.2), "call Anna now") and endpointed.end == pytest.approx(1.2)

    async def hear():
        return [event async for event in ScriptedRecognizer([utterance, "play jazz"], speed=0.05).events()]

    events = asyncio.run(hear())
    assert [(e.text, e.final, e.utterance) for e in events] == [
        ("call", False, 0), ("call and a", False, 0), ("call Anna Schmidt", False, 0), ("call Anna Schmidt now", True, 0),
        ("play", False, 1), ("play jazz", True, 1)]
    final = events[3]
    assert final.speech_end <= final.at and final.at - events[0].at == pytest.approx(1.2 * 0.05, abs=0.05)


@pytest.mark.parametrize("size", [1, 2, 3, 5, 1000])
def test_a_string_argument_is_read_as_the_call_is_written_whatever_the_pieces(size):
    text = 'Say "hi" \\ to caf\u00e9 \U0001f600\nnow'
    for ensure_ascii in (True, False):
        call = json.dumps({"name": "answer_in_words", "arguments": {"text": text}}, ensure_ascii=ensure_ascii) + "\n"
        reader = StringArgument("text")
        read = [reader.push(call[i:i + size]) for i in range(0, len(call), size)]
        assert "".join(read) == text and reader.closed
        assert size > 3 or sum(map(bool, read)) > 3  # given out as it came


def test_a_string_argument_gives_nothing_before_its_key_or_after_its_end():
    reader = StringArgument("text")
    assert reader.push('{"name": "x", "arguments": {"tex') == "" and not reader.opened
    assert reader.push('t": "ab') == "ab" and reader.push('c", "text": "no"}') == "c" and reader.closed
    assert reader.push("more") == ""


@pytest.mark.parametrize("pieces, said", [
    (['{"text": "a\\ud83d", "x": 1}'], ["a"]),  # a high surrogate the string ends after
    (['{"text": "a\\ud83d', ' later"}'], ["a", " later"]),  # what follows it is no escape: it holds nothing back
    (['{"text": "a\\ud83d', "\\", "u", "de", '00b"}'], ["a", "", "", "", "\U0001f600b"]),  # its pair, cut anywhere
    (['{"text": "\\ude00x\\ud83d\\u0041"}'], ["xA"]),  # a low one alone, a high one before a character
])
def test_half_a_surrogate_pair_is_not_said_and_holds_nothing_back(pieces, said):
    reader = StringArgument("text")
    assert [reader.push(piece) for piece in pieces] == said and reader.closed


# -- the benchmark's scorer ---------------------------------------------------------------------------

def test_values_are_compared_normalised():
    assert normalise("The Airport!") == "airport" and normalise(" to  Munich   central") == "munich central"
    assert normalise("21") == normalise(21) == normalise(21.0) == 21.0
    assert normalise("8:30") == "08:30" and normalise("6 pm") == "18:00" and normalise("3.5 km") == "3.5 km"


def test_the_scorer_takes_right_calls_in_any_form():
    want = [{"name": "set_temperature", "arguments": {"temperature_c": 21}}]
    for got in ([{"name": "set_temperature", "arguments": {"temperature_c": 21}}],
                [{"name": "set_temperature", "arguments": {"temperature_c": "21.0", "zone": "all"}}]):  # the default zone
        assert check_calls(want, got, CAR_TOOLS).ok
    assert check_calls([{"name": "navigate", "arguments": {"destination": ["airport", "munich airport"]}}],
                       [{"name": "navigate", "arguments": {"destination": "the Munich Airport"}}], CAR_TOOLS).ok
    assert check_calls([], [], CAR_TOOLS, answer="The capital of France is Paris.").ok
    two = [{"name": "call", "arguments": {"contact": "anna"}}, {"name": "navigate", "arguments": {"destination": "home"}}]
    assert check_calls(two, list(reversed(two)), CAR_TOOLS).ok


@pytest.mark.parametrize(("got", "right_tool", "reason"), [
    ([], False, "called nothing"),
    ([{"name": "call", "arguments": {"contact": "airport"}}], False, "want ['navigate']"),
    ([{"name": "navigate", "arguments": {"destination": "the station"}}], True, "destination='the station'"),
    ([{"name": "navigate", "arguments": {}}], True, "destination missing"),
    ([{"name": "navigate", "arguments": {"destination": "airport", "avoid": "tolls"}}], True, "unexpected avoid"),
    ([{"name": "navigate", "arguments": {"destination": "airport"}}] * 2, False, "want ['navigate']"),
])
def test_the_scorer_rejects_wrong_tools_and_wrong_arguments(got, right_tool, reason):
    check = check_calls([{"name": "navigate", "arguments": {"destination": "airport"}}], got, CAR_TOOLS)
    assert not check.ok and check.right_tool == right_tool and reason in check.reason


def test_the_scorer_rejects_a_wrong_number_and_an_optional_argument_not_asked_for():
    want = [{"name": "set_temperature", "arguments": {"temperature_c": 21}}]
    assert "temperature_c=22" in check_calls(want, [{"name": "set_temperature", "arguments": {"temperature_c": 22}}],
                                             CAR_TOOLS).reason
    wrong_zone = check_calls(want, [{"name": "set_temperature", "arguments": {"temperature_c": 21, "zone": "driver"}}],
                             CAR_TOOLS)
    assert not wrong_zone.ok and "unexpected zone='driver'" in wrong_zone.reason
    assert not check_calls([], [{"name": "call", "arguments": {"contact": "x"}}], CAR_TOOLS).right_tool
    reminder = [{"name": "set_reminder", "arguments": {"text": "buy milk", "time": "18:00"}}]
    assert not check_calls(reminder, [{"name": "set_reminder", "arguments": {"text": "buy milk", "time": "06:00"}}],
                           CAR_TOOLS).ok


# answers the pair gave to commands that want words (docs/records/voice-words.json): call-shaped
# text, the tool list or the system prompt said back, an unspeakable function name
NOT_WORDS = [
    '{{"name": "answer_in_words", "arguments": {"text": "The time is now 14:30."}}}',
    '<tools>\n{"type": "function", "function": {"name": "play_media", "description": "Play music, a radio station',
    '```json\n{\n  "name": "answer_in_words",\n  "arguments": {\n    "text": "Today is <current-day>"\n  }\n}\n```',
    '{{"name": "lock_doors", "arguments": null}}',
    'To determine how much fuel you have left, you can call the `get_fuel_level` function.',
    "no list, no markdown",
    '"text": "Hello there"',
    "- navigate\n- call\n* play music",
    "OK",
    "",
]


@pytest.mark.parametrize("answer", NOT_WORDS)
def test_the_scorer_takes_no_call_as_right_only_with_words_a_speaker_can_say(answer):
    check = check_calls([], [], CAR_TOOLS, answer=answer, prompt=CAR_SYSTEM)
    assert check.right_tool and not check.ok and check.reason


@pytest.mark.parametrize("answer", ["The capital of France is Paris.", "Why was the car sad? Because it had no gas.",
                                    "I'm sorry, I can't open the sunroof.", "¡Hola! ¿En qué puedo ayudarte?",
                                    "The moon is approximately 384,400 kilometers away from Earth."])
def test_the_scorer_takes_sentences_as_words(answer):
    assert check_calls([], [], CAR_TOOLS, answer=answer, prompt=CAR_SYSTEM).ok


@pytest.mark.parametrize(("answer", "declines"), [
    ("I'm sorry, I can't open the sunroof.", True), ("I can’t check the weather from here.", True),
    ("I don't have access to the time.", True), ("That is not possible in this car.", True),
    ("I am unable to lock the doors.", True), ("I do not know the speed limit here.", True),
    ("The sunroof is now open.", False), ("The windshield wipers have been turned on.", False),
    ("You have 10 liters of fuel left.", False), ("It is going to rain tomorrow.", False),
    ("The time is now 14:30.", False),
])
def test_a_command_the_car_cannot_do_is_right_only_when_the_words_say_so(answer, declines):
    assert check_calls([], [], CAR_TOOLS, answer=answer, says=word_assertions("declines")).ok == declines


def test_a_command_with_a_fact_is_right_only_when_the_words_hold_it():
    says = word_assertions([{"type": "icontains", "value": "paris"}])
    assert check_calls([], [], CAR_TOOLS, answer="The capital of France is Paris.", says=says).ok
    wrong = check_calls([], [], CAR_TOOLS, answer="The capital of France is Lyon.", says=says)
    assert wrong.right_tool and not wrong.ok and "icontains" in wrong.reason
    with pytest.raises(ValueError, match="declines"):
        word_assertions("refuses")


COMMAND_SETS = {"voice_commands": 30, "voice_commands_dev": 18, "voice_commands_unseen": 20, "voice_followups_dev": 6,
                "voice_followups_unseen": 6, "voice_status_dev": 16, "voice_status_unseen": 16,
                "voice_arguments_unseen": 20}
STATUS_TOOLS = [*CAR_TOOLS, STATUS_TOOL]
NAVIGATE_HOME = {"name": "navigate", "arguments": {"destination": "home"}}


@pytest.mark.parametrize("name", COMMAND_SETS)
def test_each_command_set_has_distinct_commands_whose_expected_calls_fit_the_tools(name):
    commands = json.loads((COMMANDS_FILE.parent / f"{name}.json").read_text())["commands"]
    assert len(commands) >= COMMAND_SETS[name] and len({c["text"] for c in commands}) == len(commands)
    for command in commands:
        if "with_status" in command:  # what is right with the reading tool offered: an expectation of its own
            assert "expect" in command["with_status"] and set(command["with_status"]) <= {"expect", "assert"}
        for right, tools in ((command, CAR_TOOLS), (expectation(command, True), STATUS_TOOLS)):
            for call in right["expect"]:  # a call made exactly as expected passes the car's own schema check
                arguments = {k: v[0] if isinstance(v, list) else v for k, v in call["arguments"].items()}
                assert call["name"] in {t["function"]["name"] for t in tools}, command
                assert CarState().dispatch(call["name"], arguments)["ok"], command
                assert check_calls(right["expect"], [{"name": call["name"], "arguments": arguments}], tools).ok
        assert all(isinstance(text, str) and text.strip() for text in command.get("before", []))
        for after, _ in command.get("revisions", []):
            assert 0 < after < len(command["text"].split())
        assert not command.get("assert") or not command["expect"]  # what the words say: only where words are wanted
        word_assertions(command.get("assert"))
    assert percentiles([0.1, None, 0.3]) == {"p50": pytest.approx(0.2), "p95": pytest.approx(0.29)}


def test_the_held_out_commands_are_none_of_the_commands_the_choices_were_made_on():
    texts = {name: {c["text"].lower() for c in json.loads((COMMANDS_FILE.parent / f"{name}.json").read_text())["commands"]}
             for name in COMMAND_SETS}
    unseen = texts.pop("voice_commands_unseen") | texts.pop("voice_status_unseen") | texts.pop("voice_arguments_unseen")
    assert not unseen & set().union(*texts.values())
    assert not texts["voice_followups_unseen"] & texts["voice_followups_dev"]
    assert sum(not c["expect"] for c in json.loads((COMMANDS_FILE.parent / "voice_commands_unseen.json").read_text())
               ["commands"]) == 10  # half want words


# -- the loop on a model --------------------------------------------------------------------------

FINAL = "Navigate to 12 Baker Street in London, and avoid the motorway."


def test_listen_ahead_in_the_app_gives_the_cold_prefills_answer(tiny_engine):
    cold = tiny_engine.chat(system=SYSTEM, max_new_tokens=12).generate(FINAL)
    assistant = VoiceAssistant(tiny_engine, NullSpeaker(), system=SYSTEM, tools=None, max_new_tokens=12,
                               share_prefix=False)
    script = timed_partials(FINAL, revisions=[(3, "Navigate to 21"), (6, "Navigate to 12 Baker Street in Lund")])
    [record] = asyncio.run(assistant.run(ScriptedRecognizer([script], speed=0.1)))
    assert record.tokens == cold.tokens and record.answer == cold.text
    assert record.listened >= 3 and record.listen_tokens > 0
    assert record.prompt_tokens < cold.stats.prompt_tokens / 2  # only the words after what was prefilled
    parts = record.breakdown()
    assert parts["first_token"] >= 0 and parts["total"] is None or parts["total"] >= parts["first_token"]


@pytest.mark.parametrize("asr_delay", [0.2, 0.0])
def test_answering_ahead_gives_the_cold_answer_whether_the_last_partial_was_the_final_or_not(tiny_engine, asr_delay):
    cold_chat = tiny_engine.chat(system=SYSTEM, max_new_tokens=12)
    cold = cold_chat.generate(FINAL)
    assistant = VoiceAssistant(tiny_engine, NullSpeaker(), system=SYSTEM, tools=None, max_new_tokens=12,
                               share_prefix=False, answer_ahead=True)
    # with an endpointer's delay the whole text is the last partial: its answer is kept; without,
    # the final carries a word no partial had: every answer begun ahead is dropped
    script = timed_partials(FINAL, revisions=[(3, "Navigate to 21")], asr_delay=asr_delay)
    [record] = asyncio.run(assistant.run(ScriptedRecognizer([script], speed=0.1)))
    assert record.ahead_kept == (asr_delay > 0) and 1 <= record.answered_ahead <= len(script.partials)
    assert record.tokens == cold.tokens and record.answer == cold.text
    assert assistant.chat.messages == cold_chat.messages  # the dropped guesses left nothing behind
    assert record.breakdown()["first_token"] >= 0  # nothing is released before the final transcript


def test_the_answer_is_spoken_chunk_by_chunk_while_it_is_decoded(tiny_engine):
    speaker = NullSpeaker()
    assistant = VoiceAssistant(tiny_engine, speaker, system=SYSTEM, tools=None, max_new_tokens=40, share_prefix=False,
                               clause_chars=None, max_chars=24)
    [record] = asyncio.run(assistant.converse("Tell me about the route.", speed=0))
    chunks = split(record.answer, 1000, clause_chars=None, max_chars=24)  # the app's chunks are the splitter's
    assert len(speaker.said) > 1 and [c for c, _ in speaker.said] == [c for c in chunks if any(ch.isalnum() for ch in c)]
    assert [t for _, t in speaker.said] == sorted(t for _, t in speaker.said)
    assert record.first_audio_at is not None and record.first_clause_at <= record.first_audio_at <= record.done_at


@pytest.mark.parametrize("answer_ahead", [False, True])
def test_barge_in_while_speaking_keeps_what_was_said_and_the_chat_goes_on_as_one_that_ended_there(tiny_engine,
                                                                                                   answer_ahead):
    # the answer is spoken slowly (20 ms a character) in chunks of at most 16; the driver cuts in 0.5 s after
    # the first command's end (answering ahead: the first answer was begun on the last partial and kept)
    speaker = NullSpeaker(seconds_per_char=0.02)
    assistant = VoiceAssistant(tiny_engine, speaker, system=SYSTEM, tools=None, max_new_tokens=40, share_prefix=False,
                               clause_chars=None, max_chars=16, answer_ahead=answer_ahead)
    first, second = asyncio.run(assistant.run(ScriptedRecognizer(
        [timed_partials(FINAL, asr_delay=0.1), Utterance("No, to the station.", [(0.1, "No,")], 0.2, pause=0.5)],
        speed=1.0)))
    assert first.barged_in and not second.barged_in and first.ahead_kept == answer_ahead
    assert first.breakdown()["prefill"] > 0  # an answer cut short keeps its times
    full_answer = tiny_engine.chat(system=SYSTEM, max_new_tokens=40).generate(FINAL).text
    assert first.spoken and full_answer.startswith(first.spoken) and len(first.spoken) < len(full_answer)
    messages = assistant.chat.messages
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    assert messages[2]["content"] == first.spoken
    kept = len(tiny_engine.encode(first.spoken))
    reference = tiny_engine.chat(system=SYSTEM, max_new_tokens=40)
    assert reference.generate(FINAL, max_new_tokens=kept).text == first.spoken
    assert second.tokens == reference.generate("No, to the station.").tokens
    assert assistant.chat.messages == reference.messages


def test_a_barge_in_that_forgets_leaves_the_chat_as_if_the_exchange_never_happened(tiny_engine):
    assistant = VoiceAssistant(tiny_engine, NullSpeaker(seconds_per_char=0.05), system=SYSTEM, tools=None,
                               max_new_tokens=40, share_prefix=False, keep_interrupted=False)
    first, second = asyncio.run(assistant.run(ScriptedRecognizer(
        [FINAL, Utterance("Play some jazz.", [], 0.1, pause=0.2)], speed=1.0)))
    assert first.barged_in
    reference = tiny_engine.chat(system=SYSTEM, max_new_tokens=40)
    assert second.tokens == reference.generate("Play some jazz.").tokens
    assert assistant.chat.messages == reference.messages


@pytest.mark.parametrize("history_seconds", [0.0, 0.05])
def test_a_command_after_the_history_window_is_answered_as_in_a_fresh_chat(tiny_engine, history_seconds):
    assistant = VoiceAssistant(tiny_engine, NullSpeaker(), system=SYSTEM, tools=None, max_new_tokens=12,
                               share_prefix=False, history_seconds=history_seconds)
    first, second = asyncio.run(assistant.run(ScriptedRecognizer(
        [Utterance(FINAL, [], 0.1), Utterance("Play some jazz.", [(0.1, "Play")], 0.2, pause=0.2)], speed=1.0)))
    assert not first.barged_in and second.done_at - first.done_at > history_seconds
    fresh = tiny_engine.chat(system=SYSTEM, max_new_tokens=12)
    assert second.tokens == fresh.generate("Play some jazz.").tokens and assistant.chat.messages == fresh.messages


def test_a_command_within_the_history_window_or_one_that_cuts_in_goes_on_with_the_chat(tiny_engine):
    for window, speaker, pause in ((60.0, NullSpeaker(), 0.2), (0.0, NullSpeaker(seconds_per_char=0.05), 0.2)):
        assistant = VoiceAssistant(tiny_engine, speaker, system=SYSTEM, tools=None, max_new_tokens=12,
                                   share_prefix=False, history_seconds=window)
        first, second = asyncio.run(assistant.run(ScriptedRecognizer(
            [Utterance(FINAL, [], 0.1), Utterance("Play some jazz.", [], 0.1, pause=pause)], speed=1.0)))
        assert first.barged_in == (window == 0.0)  # the slow speaker is still saying the first answer
        assert [m["role"] for m in assistant.chat.messages] == ["system", "user", "assistant", "user", "assistant"]
    for wrong in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="history_seconds"):
            VoiceAssistant(tiny_engine, NullSpeaker(), system=SYSTEM, tools=None, share_prefix=False,
                           history_seconds=wrong)


# -- tools in the loop -------------------------------------------------------------------------------

def short_strings(tool: dict) -> dict:
    """The tool with its strings at most 12 characters: a random model's calls end soon."""
    tool = copy.deepcopy(tool)
    for spec in tool["function"]["parameters"]["properties"].values():
        if spec["type"] == "string":
            spec["maxLength"] = 12
    return tool


TOOLS = [short_strings(CAR_TOOLS[0])]  # navigate: the tiny model's context holds its listing and a few turns


@pytest.fixture(scope="module")
def tool_engine(tiny_models, tmp_path_factory):
    """The tiny Llama with its one-layer SLM, exported with the model's whole 512 positions."""
    from edgeroute.runtime import Engine
    from tests.conftest import export_tiny

    src = tiny_models["llama"][0]
    out = tmp_path_factory.mktemp("voice-tools") / "llama"
    export_tiny(src, out, slm=str(src), slm_layers=1, context_length=512)
    return Engine(out)


def cold_turn(engine, text: str, **options):
    chat = engine.chat(system=SYSTEM, tools=TOOLS, max_new_tokens=40)
    return chat, chat.generate(text, **options)


def test_listen_ahead_with_tools_gives_the_cold_prefills_calls(tool_engine):
    prefix = tool_engine.share_prefix(SYSTEM, tools=TOOLS)
    assert prefix > tool_engine.share_prefix(SYSTEM) + 50  # the tools' listing is in the shared prefix
    _, cold = cold_turn(tool_engine, FINAL, tool_choice="required")
    assistant = VoiceAssistant(tool_engine, NullSpeaker(), system=SYSTEM, tools=TOOLS, tool_choice="required",
                               max_new_tokens=40)
    script = timed_partials(FINAL, revisions=[(3, "Navigate to 21")])
    [record] = asyncio.run(assistant.run(ScriptedRecognizer([script], speed=0.1)))
    assert record.tokens == cold.tokens and cold.tool_calls
    assert [(c["name"], c["arguments"]) for c in record.tool_calls] == [(c.name, c.arguments) for c in cold.tool_calls]
    # the shared system prompt and tools were copied, not recomputed: only the partials' words were
    assert record.listened >= 3 and record.listen_tokens < prefix / 2
    assert record.tool_results == [entry[2] for entry in assistant.car.log]
    roles = [m["role"] for m in assistant.chat.messages]
    assert roles == ["system", "user", "assistant", "tool", "assistant"] and assistant.chat.messages[2]["tool_calls"]
    parts = record.breakdown()
    assert parts["tools"] > 0 and record.first_token_at <= record.tools_done_at


def test_answering_ahead_runs_no_tool_before_the_final_transcript_and_makes_the_cold_calls(tool_engine):
    tool_engine.share_prefix(SYSTEM, tools=TOOLS)
    _, cold = cold_turn(tool_engine, FINAL, tool_choice="required")
    assistant = VoiceAssistant(tool_engine, NullSpeaker(), system=SYSTEM, tools=TOOLS, tool_choice="required",
                               max_new_tokens=40, answer_ahead=True)
    script = timed_partials(FINAL, revisions=[(3, "Navigate to 21")], asr_delay=0.2)
    [record] = asyncio.run(assistant.run(ScriptedRecognizer([script], speed=0.1)))
    assert record.ahead_kept and record.answered_ahead > 1 and record.tokens == cold.tokens
    assert [(c["name"], c["arguments"]) for c in record.tool_calls] == [(c.name, c.arguments) for c in cold.tool_calls]
    assert len(assistant.car.log) == len(cold.tool_calls)  # the calls of answers dropped on partials never ran
    roles = [m["role"] for m in assistant.chat.messages]
    assert roles == ["system", "user", "assistant", "tool", "assistant"] and assistant.chat.messages[1]["content"] == FINAL


def test_a_named_tool_runs_and_the_template_confirmation_is_spoken_at_once_and_is_the_chats_answer(tool_engine):
    speaker = NullSpeaker()
    assistant = VoiceAssistant(tool_engine, speaker, system=SYSTEM, tools=TOOLS, confirm="template", max_new_tokens=40,
                               tool_choice={"type": "function", "function": {"name": "navigate"}})
    assistant.warm_up()
    [record] = asyncio.run(assistant.converse("Take me to the airport.", speed=0))
    assert [c["name"] for c in record.tool_calls] == ["navigate"]
    destination = record.tool_calls[0]["arguments"]["destination"]
    assert assistant.car.destination == destination
    assert [chunk for chunk, _ in speaker.said] == [f"Navigating to {destination}."]
    assert record.first_clause_at <= record.first_audio_at and record.breakdown()["first_clause"] < 0.05
    # the chat holds what the car said, not words of the model's that no one heard; no model step wrote them
    assert assistant.chat.messages[-1] == {"role": "assistant", "content": f"Navigating to {destination}."}
    assert assistant.chat.last.stats.llm_calls == 0 and assistant.chat.last.stats.forced > 0
    assert record.answer == f"Navigating to {destination}."


def test_a_reading_of_the_car_is_said_from_the_cars_value_and_is_the_chats_answer(tool_engine):
    from datetime import datetime

    speaker, car = NullSpeaker(), CarState(clock=lambda: datetime(2026, 12, 6, 7, 5))
    assistant = VoiceAssistant(tool_engine, speaker, system=SYSTEM, tools=TOOLS, status_tool=True, car=car,
                               confirm="template", max_new_tokens=40,
                               tool_choice={"type": "function", "function": {"name": STATUS_TOOL_NAME}})
    assert assistant.tools == [*TOOLS, STATUS_TOOL]
    [record] = asyncio.run(assistant.converse("What time is it?", speed=0))
    [call], [result] = record.tool_calls, record.tool_results
    assert call["name"] == STATUS_TOOL_NAME and call["arguments"]["item"] in STATUS_ITEMS and result["ok"]
    said = reading(result)  # whatever the random model read, what is said is the car's value
    assert [chunk for chunk, _ in speaker.said] == [said] and record.answer == said
    assert assistant.chat.messages[-1] == {"role": "assistant", "content": said}
    assert reading(car.dispatch(STATUS_TOOL_NAME, {"item": "time"})) == "It is 07:05."


class HoldingSpeaker(NullSpeaker):
    """Says every chunk at once but the first that begins with ``hold``, which it never finishes."""

    def __init__(self, hold: str) -> None:
        super().__init__()
        self.hold = hold

    async def speak(self, chunk, on_audio=None) -> None:
        await super().speak(chunk, on_audio)
        if self.hold and chunk.startswith(self.hold):
            self.hold = ""
            await asyncio.Event().wait()


def test_a_barge_in_while_the_template_confirmation_is_said_keeps_what_was_said_of_it(tool_engine):
    speaker = HoldingSpeaker("to ")  # the confirmation's rest, after the acknowledgement
    assistant = VoiceAssistant(tool_engine, speaker, system=SYSTEM, tools=TOOLS, confirm="template", acknowledge=True,
                               max_new_tokens=40, tool_choice={"type": "function", "function": {"name": "navigate"}})
    first, second = asyncio.run(assistant.run(ScriptedRecognizer(
        [FINAL, Utterance("No, to the station.", [(0.1, "No,")], 0.2, pause=0.5)], speed=1.0)))
    assert first.barged_in and first.spoken == "Navigating " and first.tool_calls
    roles = [m["role"] for m in assistant.chat.messages]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "user", "assistant", "tool", "assistant"]
    assert assistant.chat.messages[4] == {"role": "assistant", "content": "Navigating"}
    destination = second.tool_calls[0]["arguments"]["destination"]
    assert assistant.chat.messages[-1] == {"role": "assistant", "content": f"Navigating to {destination}."}



@pytest.mark.parametrize("answer_ahead", [False, True])
def test_an_acknowledgement_is_spoken_once_the_calls_name_is_decoded_and_the_confirmation_finishes_it(
        tool_engine, answer_ahead):
    _, cold = cold_turn(tool_engine, FINAL, tool_choice="required")
    speaker = NullSpeaker()
    assistant = VoiceAssistant(tool_engine, speaker, system=SYSTEM, tools=TOOLS, tool_choice="required",
                               confirm="template", acknowledge=True, max_new_tokens=40, answer_ahead=answer_ahead)
    assistant.warm_up()
    script = timed_partials(FINAL, revisions=[(3, "Navigate to 21")], asr_delay=0.2)
    [record] = asyncio.run(assistant.run(ScriptedRecognizer([script], speed=0.1)))
    assert record.tokens == cold.tokens and [c["name"] for c in record.tool_calls] == ["navigate"]
    destination = record.tool_calls[0]["arguments"]["destination"]
    # the acknowledgement before the call ran, its rest after: one sentence, said once
    assert [chunk for chunk, _ in speaker.said] == ["Navigating ", f"to {destination}."]
    assert assistant.chat.messages[-1]["content"] == f"Navigating to {destination}."  # what was said, as one answer
    assert record.acknowledgement == "Navigating" and len(assistant.car.log) == 1
    assert record.acknowledged_at < record.tools_done_at and record.first_audio_at < record.answer_audio_at
    if answer_ahead:  # released with the kept answer, not before the final transcript
        assert record.ahead_kept and record.acknowledged_at >= record.final_at
    parts = record.breakdown()
    assert parts["total"] < parts["answer_total"]


def test_an_answer_dropped_ahead_says_nothing_of_its_call(tool_engine):
    speaker = NullSpeaker()
    assistant = VoiceAssistant(tool_engine, speaker, system=SYSTEM, tools=TOOLS, tool_choice="required",
                               confirm="template", acknowledge=True, max_new_tokens=40, answer_ahead=True)
    # the final transcript is not the last partial's text: the answer begun on it is dropped
    script = timed_partials(FINAL, revisions=[(len(FINAL.split()), FINAL + " please")], asr_delay=0.2)
    [record] = asyncio.run(assistant.run(ScriptedRecognizer([script], speed=0.1)))
    assert not record.ahead_kept and len(assistant.car.log) == len(record.tool_calls) == 1
    assert [chunk for chunk, _ in speaker.said][0] == "Navigating " and len(speaker.said) == 2


WORDS = {"type": "function", "function": {"name": WORDS_TOOL_NAME}}


def closing(engine) -> dict[int, float]:
    """The quote token weighed up: the random model's words end (unweighed they run to any length)."""
    return {engine.encode('"')[0]: 4}


@pytest.mark.parametrize("answer_ahead", [False, True])
def test_the_words_tool_is_never_run_or_acknowledged_and_its_text_is_what_is_said(tool_engine, answer_ahead):
    speaker = NullSpeaker()
    assistant = VoiceAssistant(tool_engine, speaker, system=SYSTEM, tools=TOOLS, words_tool=True, tool_choice=WORDS,
                               confirm="template", acknowledge=True, max_new_tokens=40, answer_ahead=answer_ahead,
                               logit_bias=closing(tool_engine))
    assert assistant.tools == [*TOOLS, WORDS_TOOL] and assistant.system == f"{SYSTEM} {WORDS_TOOL_INSTRUCTION}"
    assistant.warm_up()
    script = timed_partials("Tell me a joke.", asr_delay=0.2)
    [record] = asyncio.run(assistant.run(ScriptedRecognizer([script], speed=0.1)))
    # the chat holds the words call as the answer, as a cold chat that called it holds it
    chat = tool_engine.chat(system=assistant.system, tools=[*TOOLS, WORDS_TOOL], max_new_tokens=40,
                            logit_bias=closing(tool_engine))
    [call] = chat.generate("Tell me a joke.", tool_choice=WORDS).tool_calls
    assert without_ids(assistant.chat.messages) == without_ids(chat.messages) and record.tokens == chat.last.tokens
    assert record.answer == call.arguments["text"] and not record.tool_calls and not assistant.car.log
    assert not record.acknowledgement and record.finish_reason == "tool_calls"
    assert "".join(chunk for chunk, _ in speaker.said) == (call.arguments["text"] if speakable(record.answer) else "")


@pytest.mark.parametrize("keep_words", [False, True])
def test_an_exchange_in_words_only_leaves_the_chat_before_the_next_command_unless_kept(tool_engine, keep_words):
    assistant = VoiceAssistant(tool_engine, NullSpeaker(), system=SYSTEM, tools=TOOLS, words_tool=True, tool_choice=WORDS,
                               max_new_tokens=40, keep_words=keep_words, logit_bias=closing(tool_engine))
    [first] = asyncio.run(assistant.converse("Tell me a joke.", speed=0))  # answered to its end
    [second] = asyncio.run(assistant.converse("And another one.", speed=0))
    assert not first.tool_calls and not first.barged_in
    fresh = tool_engine.chat(system=assistant.system, tools=[*TOOLS, WORDS_TOOL], max_new_tokens=40,
                             logit_bias=closing(tool_engine))
    if not keep_words:  # the second is answered as if the first had never been said
        fresh.generate("And another one.", tool_choice=WORDS)
        assert second.tokens == fresh.last.tokens
        assert without_ids(assistant.chat.messages) == without_ids(fresh.messages)
    else:
        assert [m["content"] for m in assistant.chat.messages if m["role"] == "user"] == ["Tell me a joke.",
                                                                                         "And another one."]


def test_an_exchange_that_called_the_car_stays_for_the_next_command(tool_engine):
    assistant = VoiceAssistant(tool_engine, NullSpeaker(), system=SYSTEM, tools=TOOLS,
                               tool_choice={"type": "function", "function": {"name": "navigate"}}, confirm="template",
                               max_new_tokens=40)
    [first] = asyncio.run(assistant.converse("Take me home.", speed=0))
    [second] = asyncio.run(assistant.converse("No, to the station.", speed=0))
    assert first.tool_calls and second.tool_calls and not first.barged_in
    assert [m["content"] for m in assistant.chat.messages if m["role"] == "user"] == ["Take me home.",
                                                                                     "No, to the station."]


def without_ids(messages: list[dict]) -> list[dict]:
    """The messages without their calls' ids (a session numbers its calls: answers dropped ahead count)."""
    messages = copy.deepcopy(messages)
    for message in messages:
        for call in message.get("tool_calls", []):
            call.pop("id")
    return messages


def quote_tokens(engine) -> dict[int, float]:
    """A logit bias that bans every token with a double quote but the quote alone: a string the
    model opens with it ends only where the random model ranks the quote first among its tokens."""
    return {i: -100 for i in range(engine.bundle.llm.arch.vocab_size)
            if '"' in (text := engine.decode([i])) and text.strip() != '"'}


def test_the_words_are_said_while_the_call_is_written(tool_engine):
    # the words' string can never close: the call is cut by max_new_tokens, unfinished, and its words were
    # said all the same, so they were read from the tokens as they came, not from the finished call
    speaker = NullSpeaker()
    assistant = VoiceAssistant(tool_engine, speaker, system=SYSTEM, tools=TOOLS, words_tool=True, tool_choice=WORDS,
                               max_new_tokens=40, listen_ahead=False, clause_chars=None, max_chars=8,
                               logit_bias=quote_tokens(tool_engine))
    [record] = asyncio.run(assistant.converse("Tell me a joke.", speed=0))
    assert record.finish_reason == "incomplete" and not assistant.chat.last.tool_calls
    assert len(record.answer) > 8 and assistant.engine.decode(record.tokens).endswith(record.answer)
    assert "".join(chunk for chunk, _ in speaker.said) == record.answer and speakable(record.answer)


def test_a_barge_in_on_words_from_the_words_tool_forgets_the_exchange(tool_engine):
    speaker = NullSpeaker(seconds_per_char=0.02)
    assistant = VoiceAssistant(tool_engine, speaker, system=SYSTEM, tools=TOOLS, words_tool=True, tool_choice=WORDS,
                               max_new_tokens=40, listen_ahead=False, clause_chars=None, max_chars=12,
                               logit_bias=quote_tokens(tool_engine))
    assistant.warm_up()
    first, second = asyncio.run(assistant.run(ScriptedRecognizer(
        ["Tell me a joke.", Utterance("Play some jazz.", [], 0.1, pause=0.4)], speed=1.0)))
    assert first.barged_in and first.spoken and first.answer.startswith(first.spoken)
    reference = tool_engine.chat(system=assistant.system, tools=[*TOOLS, WORDS_TOOL], max_new_tokens=40,
                                 logit_bias=quote_tokens(tool_engine))
    assert second.tokens == reference.generate("Play some jazz.", tool_choice=WORDS).tokens
    assert assistant.chat.messages == reference.messages


class CallingChat:
    """A chat whose first answer is the given calls and whose next one is empty: what the app does
    with calls a model cannot be made to write (a words call beside a car call)."""

    def __init__(self, calls: list) -> None:
        self.answers, self.prompts, self.messages, self.last = [calls, []], [], [], None

    def astream(self, prompt, on_token=None, on_tool_name=None, **options):
        from edgeroute.runtime.engine import Generation

        self.prompts.append(prompt)
        self.last = Generation("", [], tool_calls=self.answers.pop(0), finish_reason="tool_calls")

        async def nothing():
            return
            yield

        return nothing()


def test_a_words_call_beside_a_car_call_is_said_and_both_get_a_result(tool_engine):
    from edgeroute.runtime.tools import ToolCall

    speaker = NullSpeaker()
    assistant = VoiceAssistant(tool_engine, speaker, system=SYSTEM, tools=TOOLS, words_tool=True, tool_choice="required",
                               confirm="template", listen_ahead=False)
    words = ToolCall("call_0", WORDS_TOOL_NAME, {"text": "On my way."})
    assistant.chat = chat = CallingChat([words, ToolCall("call_1", "navigate", {"destination": "airport"})])
    [record] = asyncio.run(assistant.converse("Take me to the airport and say so.", speed=0))
    assert [c["name"] for c in record.tool_calls] == ["navigate"] and len(assistant.car.log) == 1
    assert [json.loads(m["content"])["ok"] for m in chat.prompts[1]] == [True, True]  # a result for each call
    assert [m["tool_call_id"] for m in chat.prompts[1]] == ["call_0", "call_1"]
    assert "".join(chunk for chunk, _ in speaker.said) == "On my way.Navigating to airport."
    assert record.answer == "On my way."


class WordsWritingChat:
    """A chat that writes one words call in ``pieces`` of its JSON, then takes ``linger`` seconds
    over the call's closing tokens and the end of the turn (a model's last decode steps)."""

    def __init__(self, pieces: list[str], linger: float) -> None:
        self.pieces, self.linger, self.messages, self.last = pieces, linger, [], None
        self.ended_at: float | None = None

    def astream(self, prompt, on_token=None, on_tool_name=None, **options):
        from types import SimpleNamespace

        from edgeroute.runtime.engine import Generation
        from edgeroute.runtime.tools import ToolCall

        text = json.loads("".join(self.pieces))["arguments"]["text"]

        async def write():
            on_tool_name(WORDS_TOOL_NAME)
            for piece in self.pieces:
                on_token(SimpleNamespace(text=piece, source="model"))
                await asyncio.sleep(0)
            await asyncio.sleep(self.linger)
            self.last = Generation("", [], tool_calls=[ToolCall("call_0", WORDS_TOOL_NAME, {"text": text})],
                                   finish_reason="tool_calls")
            self.ended_at = time.perf_counter()
            return
            yield

        return write()


@pytest.mark.parametrize("text", ["It is sunny.", "It is sunny. Take a hat", "I cannot, sorry"])
def test_the_words_last_sentence_is_said_when_its_string_closes_not_when_the_call_ends(tool_engine, text):
    speaker = NullSpeaker()
    assistant = VoiceAssistant(tool_engine, speaker, system=SYSTEM, tools=TOOLS, words_tool=True, tool_choice=WORDS,
                               listen_ahead=False)
    pieces = ['{"name": "', WORDS_TOOL_NAME, '", "arguments": {"text": "', *re.split("(?= )", text), '"}}']
    assistant.chat = chat = WordsWritingChat(pieces, linger=0.5)
    [record] = asyncio.run(assistant.converse("What is the weather?", speed=0))
    assert "".join(chunk for chunk, _ in speaker.said) == record.answer == text
    # every chunk, the last one too, was said before the call's closing tokens were decoded
    assert all(at < chat.ended_at - 0.4 for _, at in speaker.said)


def test_a_words_bias_of_100_moves_every_command_to_the_words_tool_and_minus_100_off_it(tool_engine):
    words = VoiceAssistant(tool_engine, NullSpeaker(), system=SYSTEM, tools=TOOLS, words_tool=True, words_bias=100,
                           tool_choice="required", max_new_tokens=40, listen_ahead=False)
    [record] = asyncio.run(words.converse(FINAL, speed=0))
    # the bias stays on for the words: the random model writes the name's first token again and again
    written = tool_engine.decode(record.tokens)
    assert f'"name": "{WORDS_TOOL_NAME}"' in written and written.endswith(record.answer) and record.answer
    assert not record.tool_calls and not words.car.log
    tool = VoiceAssistant(tool_engine, NullSpeaker(), system=SYSTEM, tools=TOOLS, words_tool=True, words_bias=-100,
                          tool_choice="required", max_new_tokens=40, listen_ahead=False)
    [record] = asyncio.run(tool.converse("Tell me a joke.", speed=0))
    assert [c["name"] for c in record.tool_calls] == ["navigate"]


def test_barge_in_while_the_tool_result_is_spoken_keeps_the_chat_consistent(tool_engine):
    speaker = NullSpeaker(seconds_per_char=0.03)
    assistant = VoiceAssistant(tool_engine, speaker, system=SYSTEM, tools=TOOLS, tool_choice="required",
                               max_new_tokens=40, clause_chars=None, max_chars=12)
    first, second = asyncio.run(assistant.run(ScriptedRecognizer(
        [FINAL, Utterance("No, to the station.", [(0.1, "No,")], 0.2, pause=0.6)], speed=1.0)))
    assert first.barged_in and first.tool_calls and first.spoken
    reference, called = cold_turn(tool_engine, FINAL, tool_choice="required")
    results = [{"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)}
               for call, result in zip(called.tool_calls, first.tool_results, strict=True)]
    kept = len(tool_engine.encode(first.spoken))
    assert reference.generate(results, tool_choice="none", max_new_tokens=kept).text == first.spoken
    assert second.tokens == reference.generate("No, to the station.", tool_choice="required").tokens
    assert assistant.chat.messages[:7] == reference.messages[:7]


@pytest.mark.slow
def test_the_demo_model_navigates_through_the_app(smollm2_bundles):
    from edgeroute.runtime import Engine

    # the 135M model's calls hang on the last bits of its sums (on AVX2 its destination runs on until
    # max_new_tokens and no call is made): the generic kernels sum alike on every CPU CI may draw. Whether
    # its destination is right is the benchmarks' to judge (the words it writes differ by kernels too).
    # On their scalar sums every token is slow: full (speculate writes its tokens, tested on the tiny
    # models) and the car's own confirmation (the demo's), not a second generation.
    engine = Engine(smollm2_bundles["int4"][0], verify=False, backend="native", kernels="generic")
    speaker = NullSpeaker()
    assistant = VoiceAssistant(engine, speaker, tool_choice="required", mode="full", confirm="template")
    [record] = asyncio.run(assistant.converse("navigate to the airport", speed=0.2))
    assert record.listened and record.tool_calls[0]["name"] == "navigate"
    assert assistant.car.destination == record.tool_calls[0]["arguments"]["destination"]
    assert [m["role"] for m in assistant.chat.messages] == ["system", "user", "assistant", "tool", "assistant"]
    if record.answer.strip():
        assert speaker.said and record.first_audio_at is not None


# -- espeak-ng and pocketsphinx, where installed -------------------------------------------------------

@needs_espeak
def test_espeak_writes_audio_and_reports_its_first_sample(tmp_path):
    speaker = EspeakSpeaker(realtime=False)
    heard = []
    asyncio.run(speaker.speak("Navigating to the airport.", heard.append))
    assert len(heard) == 1 and len(speaker.audio) > speaker.sample_rate  # more than half a second of 16-bit audio
    assert speaker.synthesis_seconds[0] > 0
    asyncio.run(speaker.speak(" , ", heard.append))  # nothing to say: no process, no audio
    assert len(heard) == 1
    import wave

    with wave.open(str(speaker.save(tmp_path / "answer.wav"))) as wav:
        assert wav.getframerate() == speaker.sample_rate and wav.getnframes() == len(speaker.audio) // 2


@needs_espeak
def test_cancelling_espeak_stops_its_process():
    speaker = EspeakSpeaker(realtime=True)

    async def cut():
        task = asyncio.create_task(speaker.speak("This sentence is long enough to be cut off while it is played."))
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cut())
    assert len(speaker.said) == 1 and speaker.audio  # synthesized, then cut while it played


@needs_espeak
def test_pocketsphinx_hears_a_wav_as_partials_and_a_final(tmp_path):
    pytest.importorskip("pocketsphinx", reason="pocketsphinx is not installed (pip install pocketsphinx)")
    import subprocess

    from examples.voice_assistant import PocketsphinxRecognizer

    wav = tmp_path / "command.wav"
    subprocess.run(["espeak-ng", "-w", str(wav), "navigate to the airport"], check=True)

    async def hear():
        return [event async for event in PocketsphinxRecognizer([wav], realtime=False).events()]

    events = asyncio.run(hear())
    # what it hears of a synthetic voice is poor (the reason the tests script transcripts); its shape is checked
    assert events[-1].final and all(not e.final for e in events[:-1]) and events[-1].speech_end <= events[-1].at


# -- the benchmark, end to end ------------------------------------------------------------------------

def test_the_benchmark_runs_end_to_end_and_writes_json_markdown_and_a_plot(tiny_slm_bundle, tmp_path):
    from tools.bench_voice import main

    # the tiny model's 256 positions do not hold the car's five tools: words only (tools: the next test)
    assert main(["--bundle", str(tiny_slm_bundle), "--commands", "2", "--modes", "full,speculate,auto", "--no-tools",
                 "--listen", "off,on,answer", "--asr-delay", "0.2", "--speed", "0.05", "--tts", "none",
                 "--max-new-tokens", "8", "--warmup", "0", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "voice.json").read_text())
    assert result["settings"]["modes"] == ["full", "speculate"]  # auto: the tiny bundle is not calibrated
    assert any("auto left out" in note for note in result["notes"])
    assert len(result["samples"]) == 2 * 2 * 3 and result["commit"]["commit"] and result["machine"]["cpu_count"]
    assert result["summary"]["listen_ahead_same_tokens"] == {
        f"{mode} {setting}": {"same": 2, "of": 2} for mode in ("full", "speculate")
        for setting in ("listen-on", "answer-ahead")}
    assert all(s["listened"] > 0 for s in result["samples"] if s["listen_ahead"] == "on")
    assert all(s["ahead_kept"] and s["answered_ahead"] > 0 for s in result["samples"] if s["listen_ahead"] == "answer")
    table = (tmp_path / "voice.md").read_text()
    assert "| full listen-on | full | 2 |" in table and "| speculate listen-off | speculate+slm | 2 |" in table
    assert "| full answer-ahead | full | 2 |" in table and "kept at the final transcript: full answer-ahead 2/2" in table
    assert (tmp_path / "voice.png").stat().st_size > 1000


def test_the_benchmark_times_commands_that_want_words_apart_from_those_that_want_a_call(tiny_slm_bundle, tmp_path):
    from tools.bench_voice import main

    mixed = tmp_path / "mixed.json"
    mixed.write_text(json.dumps({"commands": [{"text": "Navigate home.", "expect": [NAVIGATE_HOME]},
                                              {"text": "Tell me a joke.", "expect": []},
                                              {"text": "Good morning.", "expect": []}]}))
    assert main(["--bundle", str(tiny_slm_bundle), "--commands-file", str(mixed), "--modes", "full", "--no-tools",
                 "--listen", "off", "--tts", "none", "--max-new-tokens", "4", "--warmup", "0",
                 "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "voice.json").read_text())
    assert [s["wants"] for s in result["samples"]] == ["call", "words", "words"]
    parts = result["summary"]["rows"]["full listen-off"]["by_wants"]
    assert (parts["call"]["n"], parts["words"]["n"]) == (1, 2)
    totals = sorted(s["seconds"]["total"] for s in result["samples"][1:])
    assert parts["words"]["total"]["p50"] == pytest.approx(sum(totals) / 2)
    assert "by what the command wants, p50 / p95: full listen-off: call" in (tmp_path / "voice.md").read_text()


def test_the_benchmark_says_commands_in_conversations_each_judged_after_the_earlier_ones(tiny_slm_bundle, tmp_path):
    from tools.bench_voice import conversations, main

    commands = [{"text": f"command {i}"} for i in range(7)]
    chats = conversations(commands, 3, shuffle=5)
    assert [len(c) for c in chats] == [3, 3, 1] and chats == conversations(commands, 3, shuffle=5)
    assert sorted(c["text"] for chat in chats for c in chat) == sorted(c["text"] for c in commands)
    assert [c for chat in chats for c in chat] != commands and conversations(commands, 3, None)[0] == commands[:3]
    assert main(["--bundle", str(tiny_slm_bundle), "--commands", "3", "--modes", "full", "--no-tools", "--listen", "off",
                 "--conversation", "2", "--tts", "none", "--max-new-tokens", "4", "--warmup", "0",
                 "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "voice.json").read_text())
    assert [(s["chat"], s["turn"]) for s in result["samples"]] == [(1, 1), (1, 2), (2, 1)]
    assert result["settings"]["conversation"] == 2
    row = result["summary"]["rows"]["full listen-off"]
    assert row["by_turn"]["first"]["n"] == 2 and row["by_turn"]["later"]["n"] == 1
    assert "Right calls in chats of 2 commands: full listen-off: first turns" in (tmp_path / "voice.md").read_text()
    with pytest.raises(SystemExit):
        main(["--bundle", str(tiny_slm_bundle), "--conversation", "0"])
    followups = tmp_path / "followups.json"
    followups.write_text(json.dumps({"commands": [{"before": ["Navigate home."], "text": "Make it quick.", "expect": []}]}))
    common = ["--bundle", str(tiny_slm_bundle), "--commands-file", str(followups), "--modes", "full", "--no-tools",
              "--listen", "off", "--tts", "none", "--max-new-tokens", "4", "--warmup", "0", "--out", str(tmp_path)]
    assert main(common) == 0
    [sample] = json.loads((tmp_path / "voice.json").read_text())["samples"]  # what it follows is said, not judged
    assert sample["command"] == "Make it quick." and [b["command"] for b in sample["before"]] == ["Navigate home."]
    with pytest.raises(SystemExit, match="follow-ups"):
        main([*common, "--conversation", "2"])
    with pytest.raises(SystemExit, match="follow-ups"):  # said before a model loads: no bundle needed
        main([*common, "--conversation", "2", "--bundle", str(tmp_path / "no-bundle")])


@pytest.mark.slow
def test_the_benchmark_judges_the_demo_models_tool_calls(smollm2_bundles, tmp_path):
    from tools.bench_voice import main

    # the generic kernels: the demo model's calls are the same on every CPU (see the test above)
    assert main(["--bundle", str(smollm2_bundles["int4"][0]), "--commands", "2", "--modes", "full", "--listen", "on",
                 "--tool-choice", "required", "--confirm", "template", "--speed", "0.2", "--tts", "none",
                 "--backend", "native", "--kernels", "generic", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "voice.json").read_text())
    assert result["kernels"] == "generic" and "(generic kernels)" in (tmp_path / "voice.md").read_text()
    samples = result["samples"]
    assert len(samples) == 2 and all(s["tool_calls"] and s["seconds"]["tools"] > 0 for s in samples)
    assert all(s["seconds"]["total"] is not None for s in samples)  # the car's confirmation was "spoken"
    for sample in samples:  # the verdicts are the scorer's on the calls recorded
        command = next(c for c in json.loads(COMMANDS_FILE.read_text())["commands"] if c["text"] == sample["command"])
        assert check_calls(command["expect"], sample["tool_calls"], CAR_TOOLS).ok == (
            sample["check"]["right_tool"] and sample["check"]["right_arguments"])


@pytest.mark.slow
def test_the_benchmark_judges_readings_by_what_is_right_with_the_status_tool(smollm2_bundles, tmp_path):
    from tools.bench_voice import main

    status_file = COMMANDS_FILE.with_name("voice_status_dev.json")
    assert main(["--bundle", str(smollm2_bundles["int4"][0]), "--commands-file", str(status_file), "--commands", "2",
                 "--modes", "full", "--listen", "off", "--tool-choice", "required", "--words-tool", "--status-tool",
                 "--confirm", "template", "--tts", "none", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "voice.json").read_text())
    assert result["settings"]["status_tool"] and "+ status tool" in (tmp_path / "voice.md").read_text()
    commands = {c["text"]: c for c in json.loads(status_file.read_text())["commands"]}
    for sample in result["samples"]:  # judged by the with_status expectations, not the declines
        right = expectation(commands[sample["command"]], True)
        assert right["expect"] and right["expect"][0]["name"] == STATUS_TOOL_NAME
        assert check_calls(right["expect"], sample["tool_calls"], STATUS_TOOLS, answer=sample["answer"]).ok == (
            sample["check"]["right_tool"] and sample["check"]["right_arguments"])
        assert sample["unasked"] == unasked_actions(right["expect"], sample["tool_calls"], (STATUS_TOOL_NAME,))


# -- the runtime under the app: listen-ahead and the SLM ---------------------------------------------

def count_slm_tokens(engine, monkeypatch) -> list[int]:
    """The tokens each SLM pass computes."""
    counts: list[int] = []
    original = engine.slm.hidden_states

    def hidden_states(cache, ids, *args, **kwargs):
        counts.append(len(ids))
        return original(cache, ids, *args, **kwargs)

    monkeypatch.setattr(engine.slm, "hidden_states", hidden_states)
    return counts


def test_listening_ahead_starts_the_slm_from_the_shared_system_prompt(tool_engine, monkeypatch):
    prefix = tool_engine.share_prefix(SYSTEM, tools=TOOLS)
    tool_engine.chat(system=SYSTEM, tools=TOOLS, mode="speculate", light="slm").generate("Hi.", max_new_tokens=2)
    counts = count_slm_tokens(tool_engine, monkeypatch)  # the SLM's copy of the prefix exists now
    chat = tool_engine.chat(system=SYSTEM, tools=TOOLS, mode="speculate", light="slm", max_new_tokens=40)
    chat.listen("Navigate to")
    assert counts and sum(counts) < prefix / 2  # the partial's words, not the system prompt again
    cold = tool_engine.chat(system=SYSTEM, tools=TOOLS, mode="speculate", light="slm", max_new_tokens=40)
    assert chat.generate(FINAL, tool_choice="required").tokens == cold.generate(FINAL, tool_choice="required").tokens


def test_a_full_chat_never_runs_the_slm_whatever_its_light_path(tool_engine, monkeypatch):
    counts = count_slm_tokens(tool_engine, monkeypatch)
    chat = tool_engine.chat(system=SYSTEM, mode="full", light="slm", max_new_tokens=4)
    chat.listen("Navigate to")
    chat.generate(FINAL)
    assert counts == [] and chat.state.slm_drafter is None
    chat.generate("And back?", mode="speculate")  # a call that drafts with it brings it in
    assert counts and chat.state.slm_drafter is not None


def test_the_apps_answer_memory_is_written_and_read_again_by_the_next_run(tiny_slm_bundle, tmp_path, capsys):
    from examples.voice_assistant.__main__ import main

    memory = tmp_path / "memory.npz"
    command = ["--bundle", str(tiny_slm_bundle), "--say", "navigate to the airport", "--no-tools", "--tts", "none",
               "--mode", "speculate", "--light", "ngram", "--max-new-tokens", "8", "--memory", str(memory)]
    assert main(command) == 0
    assert "answer memory: 1 answers" in capsys.readouterr().out
    assert main(command) == 0  # the second run starts from the first one's answer
    assert "answer memory: 2 answers" in capsys.readouterr().out


def test_the_app_says_what_is_wrong_with_a_bundle_a_wav_or_a_command_in_one_line(tmp_path, capsys):
    pytest.importorskip("pocketsphinx", reason="pocketsphinx is not installed (pip install pocketsphinx)")
    from examples.voice_assistant.__main__ import main

    (tmp_path / "text.wav").write_text("not audio")
    for argv, said in [(["--bundle", str(tmp_path / "none"), "--say", "hi"], "bundle"),
                       (["--wav", str(tmp_path / "missing.wav")], "cannot read the WAV"),
                       (["--wav", str(tmp_path / "text.wav")], "is not a PCM WAV file")]:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and said in err and "Traceback" not in err
    with pytest.raises(SystemExit):
        main(["--say", "  "])
    assert "--say takes the words of a command" in capsys.readouterr().err
    for seconds in ("-1", "nan"):
        with pytest.raises(SystemExit):
            main(["--say", "hi", "--history-seconds", seconds])
        assert "--history-seconds takes seconds, 0 or more" in capsys.readouterr().err


def test_a_command_is_judged_by_what_is_right_with_the_tools_offered():
    fuel = {"text": "how much fuel do I have left", "expect": [], "assert": "declines",
            "with_status": {"expect": [{"name": "car_status", "arguments": {"item": "fuel"}}]}}
    read = [{"name": "car_status", "arguments": {"item": "fuel"}}]
    made_up = "The tank is half full."
    without, offered = expectation(fuel, False), expectation(fuel, True)
    assert not check_calls(without["expect"], [], CAR_TOOLS, answer=made_up, says=word_assertions(without["assert"])).ok
    assert check_calls(without["expect"], [], CAR_TOOLS, answer="Sorry, I can't tell.",
                       says=word_assertions(without["assert"])).ok
    assert check_calls(offered["expect"], read, STATUS_TOOLS).ok
    assert not check_calls(offered["expect"], [], STATUS_TOOLS, answer=made_up).right_tool
    assert not check_calls(offered["expect"], [{"name": "car_status", "arguments": {"item": "range"}}], STATUS_TOOLS).ok
    assert expectation({"text": "call Anna", "expect": read}, True)["expect"] == read


def test_an_action_no_one_asked_for_is_counted_and_reading_or_words_are_not():
    harmless = (WORDS_TOOL_NAME, STATUS_TOOL_NAME)
    navigate = {"name": "navigate", "arguments": {"destination": "home"}}
    assert unasked_actions([], [navigate], harmless) == ["navigate"]
    assert unasked_actions([navigate], [navigate], harmless) == []
    assert unasked_actions([navigate], [navigate, navigate], harmless) == ["navigate"]
    assert unasked_actions([], [{"name": "car_status", "arguments": {"item": "time"}}], harmless) == []
    assert unasked_actions([{"name": "call", "arguments": {}}], [navigate], harmless) == ["navigate"]


def test_an_embedder_gets_the_demos_measured_settings_from_voice_assistant_demo_and_overrides_win(tool_engine):
    from examples.voice_assistant import DEMO_SETTINGS
    from examples.voice_assistant.__main__ import parse_args

    cli = vars(parse_args(["--say", "navigate home"]))
    assert {name: cli[name] for name in DEMO_SETTINGS} == DEMO_SETTINGS  # one owner: the demo's defaults are these
    assistant = VoiceAssistant.demo(tool_engine, NullSpeaker(), system=SYSTEM, tools=TOOLS, share_prefix=False)
    assert assistant.tool_choice == "required" and assistant.confirm == "template" and assistant.ground_arguments
    assert WORDS_TOOL in assistant.tools and assistant.decoding == {"mode": "speculate", "light": "slm"}
    plain = VoiceAssistant(tool_engine, NullSpeaker(), system=SYSTEM, tools=TOOLS, share_prefix=False)
    assert plain.tool_choice == "auto" and plain.confirm == "model" and WORDS_TOOL not in plain.tools
    chosen = VoiceAssistant.demo(tool_engine, NullSpeaker(), system=SYSTEM, tools=TOOLS, share_prefix=False,
                                 confirm="model", mode="full", light="ngram")
    assert chosen.confirm == "model" and chosen.decoding == {"mode": "full", "light": "ngram"} and chosen.ground_arguments


def test_the_demo_holds_calls_to_what_was_said_and_leaves_readings_off_unless_asked():
    from examples.voice_assistant.__main__ import parse_args

    default = parse_args(["--say", "navigate home"])
    assert default.ground_arguments and not default.status_tool and default.words_tool and default.words_bias == 4
    chosen = parse_args(["--say", "navigate home", "--no-ground-arguments", "--status-tool"])
    assert not chosen.ground_arguments and chosen.status_tool
