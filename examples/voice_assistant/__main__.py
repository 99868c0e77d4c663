"""Run the voice assistant on a bundle: spoken commands as text (timed partial transcripts at
a speaking rate) or WAV files (pocketsphinx), the answer spoken by espeak-ng into a WAV.

    python -m examples.voice_assistant --bundle bundles/smollm2-demo --say "navigate to the airport"
    python -m examples.voice_assistant --bundle bundles/qwen-pair --say "set the temperature to 21" \\
        --say "no, make it 19" --pause 1.0 --out answer.wav
    python -m examples.voice_assistant --bundle bundles/qwen-pair --wav command.wav   # pip install pocketsphinx
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from examples.voice_assistant.asr import AudioInputError, PocketsphinxRecognizer, ScriptedRecognizer, timed_partials
from examples.voice_assistant.assistant import DEMO_SETTINGS, HISTORY_SECONDS, VoiceAssistant, describe
from examples.voice_assistant.car import CAR_TOOLS
from examples.voice_assistant.speech import EspeakSpeaker, NullSpeaker, espeak_available


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m examples.voice_assistant", description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", default="bundles/smollm2-demo")
    parser.add_argument("--say", action="append", default=[], help="a spoken command as text (repeatable)")
    parser.add_argument("--wav", action="append", default=[], help="a 16-bit mono WAV of a command, heard by pocketsphinx")
    parser.add_argument("--wpm", type=float, default=150, help="speaking rate of --say, words a minute")
    parser.add_argument("--pause", type=float, default=None,
                        help="seconds between one --say's end and the next one's start (default: after the answer was "
                             "spoken; a short pause cuts into the answer: a barge-in)")
    parser.add_argument("--profile", default=None, help="device profile (as edgeroute run --profile DEVICE): its threads")
    parser.add_argument("--mode", default=DEMO_SETTINGS["mode"], help="decoding mode (full, speculate, auto, ...)")
    parser.add_argument("--light", default=None, help="light path of speculate (default: slm when the bundle has one)")
    parser.add_argument("--no-listen-ahead", action="store_true", help="do not prefill partial transcripts")
    parser.add_argument("--answer-ahead", action="store_true",
                        help="answer each partial transcript, held back until the final one confirms it")
    parser.add_argument("--no-tools", action="store_true", help="chat without the car's tools")
    parser.add_argument("--tool-choice", default=DEMO_SETTINGS["tool_choice"],
                        help="required (every command calls a tool: the demo's and the pair's models do not write a "
                             "call on their own), auto (for a model that does), none, or a tool's name")
    parser.add_argument("--words-tool", action=argparse.BooleanOptionalAction, default=DEMO_SETTINGS["words_tool"],
                        help="offer a tool that carries words beside the car's (car.WORDS_TOOL): under required, a "
                             "command no tool does is answered with the words the model writes into it instead of by "
                             "the nearest tool (docs/guide/voice.md: commands no tool does)")
    parser.add_argument("--status-tool", action=argparse.BooleanOptionalAction, default=False,
                        help="offer a tool that reads what the car knows (car.STATUS_TOOL: the time, the fuel, the "
                             "route, ...): the answer says the car's value, not one the model makes up")
    parser.add_argument("--ground-arguments", action=argparse.BooleanOptionalAction,
                        default=DEMO_SETTINGS["ground_arguments"],
                        help="hold each car call's arguments to what the driver said: an optional one not said is "
                             "left out (no made-up reminder time or zone), a call missing a required one is not run "
                             "and the car asks for it (docs/guide/voice.md: arguments the driver did not say)")
    parser.add_argument("--words-bias", type=float, default=DEMO_SETTINGS["words_bias"],
                        help="added to the words tool's first token's logit where the model picks a tool (chosen on "
                             "the pair's dev commands; 0: none)")
    parser.add_argument("--confirm", choices=["model", "template"], default=DEMO_SETTINGS["confirm"],
                        help="after a tool ran, speak the car's own confirmation at once (template: it is the chat's "
                             "answer) or the model's words, a second generation (model)")
    parser.add_argument("--acknowledge", action="store_true",
                        help="say what the car is doing as soon as a call's name is decoded (\"Navigating\")")
    parser.add_argument("--memory", type=Path, default=None,
                        help="keep the assistant's answers in this file (read if it exists, written at the end): "
                             "speculation drafts from what it said before (edgeroute.runtime.answer_memory)")
    parser.add_argument("--history-seconds", type=float, default=HISTORY_SECONDS,
                        help="a command this long after the last answer starts a fresh chat (one sooner, or one that "
                             "cuts in, goes on with it)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--tts", choices=["auto", "espeak", "none"], default="auto",
                        help="auto: espeak-ng where installed, else no audio (the time the first sample would come)")
    parser.add_argument("--out", type=Path, default=None, help="write the spoken answers to this WAV (espeak-ng)")
    parser.add_argument("--json", action="store_true", help="print each turn's record as JSON")
    args = parser.parse_args(argv)
    if not args.say and not args.wav:
        parser.error("give at least one --say TEXT or --wav FILE")
    if any(not text.split() for text in args.say):
        parser.error("--say takes the words of a command (got an empty one)")
    if not args.history_seconds >= 0:
        parser.error(f"--history-seconds takes seconds, 0 or more (got {args.history_seconds})")
    return args


def tool_choice(text: str):
    """auto, required, none, or a tool's name (a named choice)."""
    if text in ("auto", "required", "none"):
        return text
    return {"type": "function", "function": {"name": text}}


def main(argv: list[str] | None = None) -> int:
    """The app; a bad bundle, option or WAV is one line on stderr and exit status 2, as the CLI's."""
    from edgeroute.errors import EdgerouteError

    args = parse_args(argv)
    try:
        return run(args)
    except (EdgerouteError, AudioInputError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace) -> int:
    from edgeroute.runtime import AnswerMemory, Engine

    recognizer = PocketsphinxRecognizer(args.wav) if args.wav else None  # the WAVs checked before the bundle loads
    engine = Engine(args.bundle, profile=args.profile, task="voice-command")
    if args.memory is not None:  # a learning memory, from the file or else from the calibration's answers
        engine.answer_memory = AnswerMemory.kept_in(args.memory, engine.answer_memory)
    if args.tts == "espeak" or (args.tts == "auto" and espeak_available()):
        speaker = EspeakSpeaker(realtime=True)
    else:
        if args.tts == "auto":
            print("espeak-ng is not installed (apt-get install espeak-ng): no audio, times are of the text", file=sys.stderr)
        speaker = NullSpeaker(seconds_per_char=0.06)
    if recognizer is None:
        utterances = [timed_partials(text, args.wpm) for text in args.say]
        if args.pause is not None:
            for utterance in utterances[1:]:
                utterance.pause = args.pause
        recognizer = ScriptedRecognizer(utterances)
    assistant = VoiceAssistant.demo(engine, speaker, tools=None if args.no_tools else CAR_TOOLS,
                                    listen_ahead=not args.no_listen_ahead, answer_ahead=args.answer_ahead,
                                    max_new_tokens=args.max_new_tokens, tool_choice=tool_choice(args.tool_choice),
                                    words_tool=args.words_tool, words_bias=args.words_bias, status_tool=args.status_tool,
                                    ground_arguments=args.ground_arguments, confirm=args.confirm,
                                    acknowledge=args.acknowledge, history_seconds=args.history_seconds, mode=args.mode,
                                    light=args.light)
    assistant.warm_up()
    if args.pause is None and not args.wav:  # one utterance after the other, each answer spoken to its end
        records = []
        for utterance in recognizer.utterances:
            records += asyncio.run(assistant.run(ScriptedRecognizer([utterance])))
    else:
        records = asyncio.run(assistant.run(recognizer))
    print(f"{args.bundle}: backend {engine.llm.flavour}, mode {args.mode} ({assistant.decoding.get('light', 'per task')}), "
          f"listen-ahead {'off' if args.no_listen_ahead else 'answer' if args.answer_ahead else 'on'}")
    for record in records:
        print(f"\ndriver: {record.final}")
        if record.listened:
            print(f"  listened ahead: {record.listened} partials, {record.listen_tokens} tokens")
        if record.answered_ahead:
            print(f"  answered ahead: {record.answered_ahead} partials, the last one's answer "
                  f"{'kept' if record.ahead_kept else 'dropped (the final differed)'}")
        for call, result in zip(record.tool_calls, record.tool_results, strict=True):
            print(f"  tool: {call['name']}({json.dumps(call['arguments'])}) -> {json.dumps(result)}")
        said = record.spoken if record.barged_in else record.answer
        print(f"  assistant: {said.strip()}{'  [cut off by the driver]' if record.barged_in else ''}")
        print(f"  ms from the end of speech: {describe(record)}")
        if args.json:
            print(json.dumps(record.as_dict()))
    if args.memory is not None:
        engine.answer_memory.save(args.memory)
        print(f"\nanswer memory: {engine.answer_memory.answers()} answers in {args.memory}")
    car = assistant.car
    print(f"\ncar: destination {car.destination}, temperature {car.temperature_c}, calling {car.calling}, "
          f"playing {car.playing}, reminders {car.reminders}")
    if args.out is not None:
        if isinstance(speaker, EspeakSpeaker):
            args.out.parent.mkdir(parents=True, exist_ok=True)
            print(f"wrote {speaker.save(args.out)}")
        else:
            print("no audio to write: espeak-ng is not installed", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
