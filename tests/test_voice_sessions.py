"""A voice session and another app's session on one model (the native backend) at the same time,
from two threads: each gives exactly the tokens it gives alone. The voice side is the example
app's asyncio loop (listen-ahead on timed partials, tool calls, the answers streamed to a speaker); the other
app chats on the same engine (speculating with the SLM, and with a JSON schema).

Threads: libedgeroute runs one model's forwards one at a time (the model's lock; they share its
working memory) and each forward on the model's OpenMP threads, so two sessions share the
threads the device profile grants rather than doubling them; the SLM is a model of its own,
whose forwards may run beside the LLM's."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from examples.voice_assistant import CAR_TOOLS, NullSpeaker, ScriptedRecognizer, VoiceAssistant, timed_partials

VOICE_SYSTEM = "You are the voice assistant of a car. Answer in one short sentence."
COMMANDS = [timed_partials("Navigate to the airport.", revisions=[(3, "Navigate to there")]),
            timed_partials("Call Anna Schmidt.")]
OTHER_SYSTEM = "You summarize messages for the driver in a few words."
MESSAGES = ["Anna: running late, see you at eight at the station.", "Garage: your car is ready for pick-up tomorrow.",
            "Mum: don't forget the milk!"]
INTENT = {"type": "json_schema", "json_schema": {"schema": {
    "type": "object", "required": ["sender", "urgent"], "additionalProperties": False,
    "properties": {"sender": {"type": "string", "maxLength": 20}, "urgent": {"type": "boolean"}}}}}


@pytest.fixture(scope="module")
def engine(smollm2_bundles):
    from edgeroute.errors import NativeBackendUnavailable
    from edgeroute.runtime import Engine

    try:
        return Engine(smollm2_bundles["int4"][0], backend="native", verify=False)
    except NativeBackendUnavailable as err:
        pytest.skip(str(err))


def voice(engine, mode: str) -> list:
    """The voice app's turns (tool calls, their results, the spoken answers), each answered to its end
    before the next is spoken: their tokens, calls and words, and the chat's history."""
    assistant = VoiceAssistant(engine, NullSpeaker(), system=VOICE_SYSTEM, tools=CAR_TOOLS, tool_choice="required",
                               max_new_tokens=64, mode=mode, light="slm")
    records = [r for command in COMMANDS for r in asyncio.run(assistant.run(ScriptedRecognizer([command], speed=0.1)))]
    assert all(r.listened and r.tool_calls for r in records)
    return [(r.tokens, r.tool_calls, r.answer) for r in records] + [assistant.chat.messages]


def other_app(engine) -> list[list[int]]:
    chat = engine.chat(system=OTHER_SYSTEM, mode="speculate", light="slm", max_new_tokens=12)
    tokens = [chat.generate(message).tokens for message in MESSAGES]
    tokens.append(engine.session(max_new_tokens=24).generate(MESSAGES[0], response_format=INTENT).tokens)
    return tokens


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["full", "speculate"])
def test_a_voice_session_and_another_apps_session_side_by_side_give_their_serial_tokens(engine, mode):
    alone = {"voice": voice(engine, mode), "other": other_app(engine)}
    start = threading.Barrier(2)
    results: dict[str, list] = {}
    spans: dict[str, tuple[float, float]] = {}
    errors: list[BaseException] = []

    def worker(name: str, work) -> None:
        try:
            start.wait()
            began = time.perf_counter()
            results[name] = [work() for _ in range(2)]  # twice: the two overlap whatever their lengths
            spans[name] = (began, time.perf_counter())
        except BaseException as err:  # noqa: BLE001 - reported by the main thread
            errors.append(err)

    threads = [threading.Thread(target=worker, args=("voice", lambda: voice(engine, mode))),
               threading.Thread(target=worker, args=("other", lambda: other_app(engine)))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert not errors, errors
    assert spans["voice"][0] < spans["other"][1] and spans["other"][0] < spans["voice"][1]  # they ran at once
    assert results["voice"] == [alone["voice"]] * 2
    assert results["other"] == [alone["other"]] * 2
    # one model, one set of threads: the sessions share the LLM's (and the SLM's) threads
    assert engine.llm.threads == engine.settings.model_threads()
