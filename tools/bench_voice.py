"""Voice latency: from the end of a spoken car command to the first audio sample of the answer,
with listen-ahead on and off, per decoding mode; and the tool calls' correctness.

Each command (tools/voice_commands.json: at least 30, with the calls they should make) is
"spoken" by a scripted recognizer: a partial transcript after each word at ``--wpm`` words a
minute (150: a driver's pace; some commands' early partials are wrong, as an ASR's guesses
are), then the final transcript ``--asr-delay`` seconds after the speech ends. With 0 (the
default) the last word comes only with the final transcript, so listen-ahead has it to
compute after the speech; with an endpointer's delay (``--asr-delay 0.3``: an ASR that waits
for 300 ms of silence) the whole text comes as a partial when the last word is heard, and
that delay counts in ``asr``. It is answered by the example app
(examples/voice_assistant) in a fresh chat from the engine's shared system prompt, or, with
``--conversation K``, in chats of K commands said one after another (``--shuffle SEED``: in a
seeded random order), each answered before the next and judged on its own: listen-ahead
prefills the partials while the words are spoken (in real time); with it off the partials are
ignored (and not waited for). The answer is streamed sentence by sentence to espeak-ng (``--tts
espeak``, the default where it is installed: the first audio sample is the first PCM byte it
writes) or to no speaker (``--tts none``: the first clause's completion counts as the first
sample).

Per sample, seconds from the end of speech (TurnRecord.breakdown): asr, first_token (final
transcript -> first token: a listen in flight, the prefill, the first pick; ``prefill`` is the
runtime's part), tools (first token -> calls decoded and run), first_clause (-> the first
speakable chunk of the answer: after tool results, their prefill and the decode of the
clause), audio (-> its first sample), total. With ``--acknowledge`` the app says what it is
doing as soon as the call's name is decoded ("Navigating"), and the template confirmation says
the rest ("to the airport."): ``total`` is then the acknowledgement's first sample, and
``answer_total`` (end of speech to the confirmation's first sample) is what ``total`` is
without it. Tool calls are judged by
tools/benchlib/voice.py's ``check_calls`` (right tool; right arguments, normalised; a command that
expects no call: the words said are words a speaker can say, not a call written as text, and say
what its ``assert`` asks: that the car cannot, or a fact). The first
generation's ``tool_choice`` is ``required`` by default: the demo's and the pair's models do
not write a call on their own (``--tool-choice auto`` shows it), so the three commands that
expect words cannot be right then, unless ``--words-tool`` offers the app's words tool beside the
car's (``car.WORDS_TOOL``: its ``text`` is the answer in words). ``--status-tool`` offers the
car's reading tool too (``car.STATUS_TOOL``: the time, the fuel, the route, ...); a command whose
right answer it changes says so in ``"with_status"`` (the ``expect`` and ``assert`` then;
tools/voice_status_*.json are written for it). ``--ground-arguments`` holds the car's calls to
what the driver said (the app's ``ground_arguments``): the calls judged are those the car ran,
with the arguments it ran them with; a call not run for an argument the driver did not say is
kept in the sample (``unsaid_calls``) and counted apart, and the answer judged is what the car
said instead ("Sorry, I did not catch the destination.").

Conversations (``--conversation K``): the chat keeps the earlier exchanges that called the car
(the app's ``history_seconds`` None: each command comes right after the last answer; those
answered in words only too with ``--keep-words``); ``--forget`` answers each from the system
prompt alone (0: commands minutes apart). A command with ``"before"``
(tools/voice_followups_*.json) follows up on them: they are said first in its chat, not judged.
``done`` (end of speech to the end of the turn: every generation decoded) is summarized too.

Threads: ``--threads``, else $EDGEROUTE_THREADS, else the device profile's (``--profile``),
else every core. Writes voice.json (machine, commit, command, settings, every sample), voice.md
(the tables) and voice.png under ``--out``.

    python -m tools.bench_voice --bundle bundles/qwen-pair                      # all commands, full,speculate(,auto)
    python -m tools.bench_voice --bundle bundles/smollm2-demo --commands 3      # a check that it runs
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from examples.voice_assistant import (
    CAR_TOOLS,
    EspeakSpeaker,
    NullSpeaker,
    ScriptedRecognizer,
    Utterance,
    VoiceAssistant,
    timed_partials,
)
from examples.voice_assistant.car import STATUS_TOOL_NAME, WORDS_TOOL_NAME
from examples.voice_assistant.speech import espeak_available
from tools.benchlib.voice import check_calls, percentiles, unasked_actions, word_assertions

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = Path(__file__).with_name("voice_commands.json")
COMPONENTS = ("asr", "first_token", "prefill", "tools", "first_clause", "audio", "total")
SUMMARIZED = (*COMPONENTS, "answer_total", "speech_to_token", "done")
LISTEN = {"off": "listen-off", "on": "listen-on", "answer": "answer-ahead"}  # --listen values: the rows' names


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {"cpu_count": os.cpu_count(), "machine": platform.machine(), "platform": platform.platform(),
                            "python": platform.python_version(), "load_average": os.getloadavg()}
    with contextlib.suppress(OSError):
        info["cpu"] = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                            if line.startswith("model name")), None)
    try:
        info["espeak_ng"] = subprocess.run(["espeak-ng", "--version"], capture_output=True, text=True).stdout.strip()
    except OSError:
        info["espeak_ng"] = None
    return info


def commit() -> dict[str, Any]:
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True).stdout.strip()

    return {"commit": git("rev-parse", "HEAD") or None, "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def load_commands(path: Path, count: int | None) -> list[dict[str, Any]]:
    commands = json.loads(path.read_text())["commands"]
    return commands[:count] if count else commands


def available_modes(engine, wanted: list[str]) -> tuple[list[str], list[str]]:
    """The modes that run on this bundle, and notes on those left out."""
    notes = []
    modes = []
    for mode in wanted:
        if mode == "auto" and engine.bundle.calibration is None:
            notes.append("auto left out: the bundle is not calibrated (edgeroute calibrate)")
            continue
        modes.append(mode)
    return modes, notes


async def one_chat(engine, commands: list[dict[str, Any]], mode: str, listen: str, args: argparse.Namespace,
                   speaker_factory) -> list[dict[str, Any]]:
    """``commands`` said one after another in one chat, each answered (spoken, its calls run)
    before the next is said; each judged on its own."""
    assistant = VoiceAssistant(engine, speaker_factory(), tools=None if args.no_tools else CAR_TOOLS,
                               listen_ahead=listen != "off", answer_ahead=listen == "answer",
                               max_new_tokens=args.max_new_tokens, tool_choice=args.tool_choice, confirm=args.confirm,
                               acknowledge=args.acknowledge, words_tool=args.words_tool, words_bias=args.words_bias,
                               status_tool=args.status_tool, ground_arguments=args.ground_arguments,
                               history_seconds=0.0 if args.forget else None, keep_words=args.keep_words,
                               mode=mode, share_prefix=True,
                               **({} if mode == "auto" else {"light": args.light}))
    samples = []
    for turn, command in enumerate(commands, 1):
        before = []  # what the command follows up on: said first, not judged
        for text in command.get("before", []):
            [earlier] = await assistant.run(ScriptedRecognizer([Utterance(text, [], 0.0)], speed=args.speed))
            before.append({"command": text, "tool_calls": earlier.tool_calls, "answer": earlier.answer})
        utterance = timed_partials(command["text"], args.wpm, [tuple(r) for r in command.get("revisions", [])],
                                   asr_delay=args.asr_delay)
        if listen == "off":  # nothing happens while the words are spoken: not waited for (the ASR's delay still is)
            utterance = Utterance(utterance.final, [], 0.0, utterance.asr_delay)
        [record] = await assistant.run(ScriptedRecognizer([utterance], speed=args.speed))
        right = expectation(command, args.status_tool)
        check = check_calls(right["expect"], record.tool_calls, assistant.tools or CAR_TOOLS, answer=record.answer,
                            prompt=assistant.system, says=word_assertions(right.get("assert")))
        resolved = assistant.chat.options  # what auto chose
        samples.append({
            "command": command["text"], "mode": mode, "listen_ahead": listen, "turn": turn, "before": before,
            "wants": "call" if right["expect"] else "words",
            "ran": f"{resolved.mode}" + (f"+{resolved.light}" if resolved.mode not in ("full", "slm") else ""),
            "seconds": record.breakdown(), "listened": record.listened, "listen_tokens": record.listen_tokens,
            "listen_seconds": record.listen_seconds, "listen_wait": record.listen_wait,
            "answered_ahead": record.answered_ahead, "ahead_kept": record.ahead_kept,
            "prompt_tokens": record.prompt_tokens, "tokens": record.tokens, "finish_reason": record.finish_reason,
            "tool_calls": record.tool_calls, "answer": record.answer, "acknowledgement": record.acknowledgement,
            "unsaid_calls": record.unsaid_calls,
            "unasked": unasked_actions(right["expect"], record.tool_calls, (WORDS_TOOL_NAME, STATUS_TOOL_NAME)),
            "check": {"right_tool": check.right_tool, "right_arguments": check.right_arguments,
                      "reason": check.reason}})
    return samples


def expectation(command: dict[str, Any], status_tool: bool) -> dict[str, Any]:
    """What is right for ``command`` (``expect``, ``assert``): its ``with_status`` ones where the
    car's reading tool is offered and it has them."""
    return command["with_status"] if status_tool and "with_status" in command else command


def conversations(commands: list[dict[str, Any]], size: int, shuffle: int | None) -> list[list[dict[str, Any]]]:
    """The commands cut into chats of ``size`` (the last may be shorter), after a shuffle seeded
    with ``shuffle`` (None: in the file's order)."""
    if shuffle is not None:
        commands = list(commands)
        random.Random(shuffle).shuffle(commands)
    return [commands[i:i + size] for i in range(0, len(commands), size)]


def summarize(samples: list[dict[str, Any]], modes: list[str], listens: list[str]) -> dict[str, Any]:
    rows = {}
    for mode in modes:
        for listen in listens:
            runs = [s for s in samples if s["mode"] == mode and s["listen_ahead"] == listen]
            if not runs:
                continue
            row = {"n": len(runs), "ran": sorted({r["ran"] for r in runs})}
            for component in SUMMARIZED:
                row[component] = percentiles([r["seconds"][component] for r in runs])
            row["right_tool"] = sum(r["check"]["right_tool"] for r in runs)
            row["right_calls"] = sum(r["check"]["right_tool"] and r["check"]["right_arguments"] for r in runs)
            row["unasked_actions"] = sum(bool(r["unasked"]) for r in runs)
            row["unsaid_calls"] = sum(bool(r["unsaid_calls"]) for r in runs)
            # a command answered in words has no call to wait for: its latency is the words' own
            row["by_wants"] = {wants: {"n": len(part), **{c: percentiles([r["seconds"][c] for r in part])
                                                         for c in ("total", "answer_total", "done")}}
                               for wants in ("call", "words") if (part := [r for r in runs if r["wants"] == wants])}
            if any(r["turn"] > 1 for r in runs):  # a conversation: the first turns, then those after earlier ones
                row["by_turn"] = {part: {"n": len(turns), "right_tool": sum(r["check"]["right_tool"] for r in turns),
                                         "right_calls": sum(r["check"]["right_tool"] and r["check"]["right_arguments"]
                                                            for r in turns)}
                                  for part, turns in (("first", [r for r in runs if r["turn"] == 1]),
                                                      ("later", [r for r in runs if r["turn"] > 1]))}
            if listen == "answer":
                row["ahead_kept"] = sum(r["ahead_kept"] for r in runs)
            rows[f"{mode} {LISTEN[listen]}"] = row
    exact = {}
    for mode in modes:  # listening and answering ahead are lossless: the same tokens as the cold prefill
        off = {s["command"]: s["tokens"] for s in samples if s["mode"] == mode and s["listen_ahead"] == "off"}
        for listen in listens:
            ahead = {s["command"]: s["tokens"] for s in samples if s["mode"] == mode and s["listen_ahead"] == listen}
            both = set(ahead) & set(off) if listen != "off" else set()
            if both:
                exact[f"{mode} {LISTEN[listen]}"] = {"same": sum(ahead[c] == off[c] for c in both), "of": len(both)}
    return {"rows": rows, "listen_ahead_same_tokens": exact}


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def markdown(result: dict[str, Any]) -> str:
    summary = result["summary"]
    acknowledged = result["settings"].get("acknowledge", False)
    backend = result["backend"] + (f" ({result['kernels']} kernels)" if result["kernels"] else "")
    lines = [f"Voice latency, {result['bundle']}, {result['settings']['commands']} commands, backend "
             f"{backend}, {result['threads']} threads, TTS {result['tts']}, tools "
             + (f"tool_choice {result['settings']['tool_choice']}"
                + (" + words tool" if result["settings"].get("words_tool") else "")
                + (" + status tool" if result["settings"].get("status_tool") else "")
                + (", arguments held to what was said" if result["settings"].get("ground_arguments") else "")
                + (f" (bias {result['settings']['words_bias']:g})" if result["settings"].get("words_bias") else "")
                + f", confirm {result['settings']['confirm']}"
                + (", acknowledge" if acknowledged else "") if result["settings"]["tools"] else "off")
             + f", {result['created']}",
             f"(`{result['command']}`; commit {(result['commit']['commit'] or '?')[:10]}"
             f"{' dirty' if result['commit']['dirty'] else ''}; {result['machine'].get('cpu')})", "",
             "End of speech to the first audio sample, ms (p50 / p95)"
             + (" (the acknowledgement's; `to confirmation`: the confirmation's first sample)" if acknowledged else "")
             + ", and the parts of the answer's:", "",
             "| configuration | runs as | n | total | " + ("to confirmation | " if acknowledged else "")
             + "asr | first token | (prefill) | tools | first clause | audio | right tool | right calls |",
             "|---|---|---|---|" + ("---|" if acknowledged else "") + "---|---|---|---|---|---|---|---|"]
    shown = ("total", *(("answer_total",) if acknowledged else ()), *COMPONENTS[:-1])
    for name, row in summary["rows"].items():
        cells = [f"{ms(row[c]['p50'])} / {ms(row[c]['p95'])}" for c in shown]
        lines.append(f"| {name} | {', '.join(row['ran'])} | {row['n']} | {' | '.join(cells)} | "
                     f"{row['right_tool']}/{row['n']} | {row['right_calls']}/{row['n']} |")
    lines += ["", "Answers equal to the cold prefill's (tokens): " + ", ".join(
        f"{name} {v['same']}/{v['of']}" for name, v in summary["listen_ahead_same_tokens"].items())]
    by_wants = [f"{name}: " + ", ".join(f"{wants} {ms(part['total']['p50'])} / {ms(part['total']['p95'])} ms (n={part['n']})"
                                        for wants, part in row["by_wants"].items())
                for name, row in summary["rows"].items() if len(row["by_wants"]) > 1]
    if by_wants:
        lines.append("End of speech to the first audio sample by what the command wants, p50 / p95: "
                     + "; ".join(by_wants))
    unasked = [f"{name} {row['unasked_actions']}/{row['n']}" for name, row in summary["rows"].items()]
    if unasked and result["settings"]["tools"]:
        lines.append("Answers in which the car did what no one asked (a car function beyond the expected calls; "
                     "reading and words left out): " + ", ".join(unasked))
    unsaid = [f"{name} {row['unsaid_calls']}/{row['n']}" for name, row in summary["rows"].items()
              if row["unsaid_calls"]]
    if unsaid:
        lines.append("Answers with a call not run for an argument the driver did not say (the car said it did not "
                     "catch it): " + ", ".join(unsaid))
    turns = [f"{name}: first turns {row['by_turn']['first']['right_calls']}/{row['by_turn']['first']['n']}, later "
             f"turns {row['by_turn']['later']['right_calls']}/{row['by_turn']['later']['n']}"
             for name, row in summary["rows"].items() if "by_turn" in row]
    if turns:
        lines.append(f"Right calls in chats of {result['settings']['conversation']} commands: " + "; ".join(turns))
    kept = [f"{name} {row['ahead_kept']}/{row['n']}" for name, row in summary["rows"].items() if "ahead_kept" in row]
    if kept:
        lines.append("Answers begun on the last partial and kept at the final transcript: " + ", ".join(kept))
    for part, what in (("speech_to_token", "End of speech"), ("first_token", "Final transcript")):
        cuts = []
        for name, row in summary["rows"].items():
            mode, _, listen = name.partition(" ")
            off = summary["rows"].get(f"{mode} {LISTEN['off']}")
            if listen != LISTEN["off"] and off and row[part]["p50"] and off[part]["p50"]:
                cuts.append(f"{name} {ms(off[part]['p50'])} / {ms(row[part]['p50'])} ms = "
                            f"{off[part]['p50'] / row[part]['p50']:.1f}x")
        if cuts:
            lines.append(f"{what} to the first token, listen-off against (p50): " + ", ".join(cuts))
    if result["settings"]["tools"] and result["settings"]["tool_choice"] == "required" \
            and not result["settings"].get("words_tool"):
        wordy = sum(not expectation(c, result["settings"].get("status_tool", False))["expect"]
                    for c in load_commands(Path(result["settings"]["commands_file"]), None)[:result["settings"]["commands"]])
        if wordy:
            lines.append(f"tool_choice required: the {wordy} command(s) that expect no call cannot be right")
    wrong = [s for s in result["samples"] if not (s["check"]["right_tool"] and s["check"]["right_arguments"])]
    if wrong:
        lines += ["", "Wrong tool calls:", ""]
        lines += [f"- {s['mode']} {LISTEN[s['listen_ahead']]}: {s['command']!r}"
                  + (f" (chat {s['chat']}, turn {s['turn']})" if s["turn"] > 1 else "") + f": {s['check']['reason']}"
                  for s in wrong]
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> Path | None:
    from edgeroute.errors import EdgerouteError
    from edgeroute.plots import pyplot

    try:
        plt = pyplot()
    except EdgerouteError:
        return None
    rows = result["summary"]["rows"]
    names = list(rows)
    parts = ["asr", "first_token", "tools", "first_clause", "audio"]
    fig, (stack, cdf) = plt.subplots(1, 2, figsize=(12, 4.5))
    bottom = [0.0] * len(names)
    for part in parts:
        values = [(rows[n][part]["p50"] or 0.0) * 1000 for n in names]
        stack.barh(names, values, left=bottom, label=part.replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    stack.set_xlabel("ms from the end of speech (medians of each part)")
    stack.legend(fontsize=8)
    stack.invert_yaxis()
    for name in names:
        totals = sorted(s["seconds"]["total"] * 1000 for s in result["samples"]
                        if f"{s['mode']} {LISTEN[s['listen_ahead']]}" == name and s["seconds"]["total"] is not None)
        if totals:
            cdf.step(totals, [(i + 1) / len(totals) for i in range(len(totals))], where="post", label=name)
    cdf.axvline(400, color="grey", linestyle=":", linewidth=1)
    cdf.set_xlabel("end of speech to the first audio sample, ms")
    cdf.set_ylabel("share of commands")
    cdf.legend(fontsize=8)
    fig.suptitle(f"{Path(result['bundle']).name}: {result['threads']} threads, TTS {result['tts']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle", type=Path, default=ROOT / "bundles" / "smollm2-demo")
    parser.add_argument("--commands-file", type=Path, default=COMMANDS)
    parser.add_argument("--commands", type=int, default=None, help="the first N commands (default: all)")
    parser.add_argument("--modes", default="full,speculate,auto", help="decoding modes; auto where the bundle is calibrated")
    parser.add_argument("--light", default=None, help="speculate's light path (default: slm where the bundle has one)")
    parser.add_argument("--listen", default="off,on",
                        help="listen-ahead settings to run, comma-separated: off, on (prefill the partials), answer "
                             "(answer each partial, held back until the final transcript confirms it)")
    parser.add_argument("--profile", default=None, help="device profile (its threads; e.g. jetson-orin-nano-8gb)")
    parser.add_argument("--threads", type=int, default=None, help="threads (default: $EDGEROUTE_THREADS, the profile's)")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--kernels", default="auto",
                        help="the native kernels (auto: the best this CPU runs; generic: the same sums on every CPU)")
    parser.add_argument("--wpm", type=float, default=150, help="speaking rate, words a minute")
    parser.add_argument("--speed", type=float, default=1.0, help="scripted speech: 1 real time (listen-ahead on)")
    parser.add_argument("--asr-delay", type=float, default=0.0,
                        help="seconds from the end of speech to the final transcript (an endpointer's silence)")
    parser.add_argument("--tts", choices=["auto", "espeak", "none"], default="auto")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--tool-choice", default="required", choices=["auto", "required"],
                        help="the first generation's tool_choice: required (every command calls a tool; the commands "
                             "that expect words cannot be right) or auto (whether the model calls on its own)")
    parser.add_argument("--words-tool", action="store_true",
                        help="offer the app's words tool beside the car's (calling it answers in words): under "
                             "required, the commands that expect words can be right")
    parser.add_argument("--words-bias", type=float, default=0.0,
                        help="with --words-tool: added to the logit of the words tool's first token where the model "
                             "picks a tool (logit_bias)")
    parser.add_argument("--status-tool", action="store_true",
                        help="offer the car's reading tool beside its others (the app's status_tool): the time, the "
                             "fuel, the route, ... (a command's \"with_status\" says what is right then)")
    parser.add_argument("--ground-arguments", action="store_true",
                        help="hold each car call's arguments to what the driver said (the app's ground_arguments): "
                             "an optional one not said is left out, a call missing a required one is not run")
    parser.add_argument("--confirm", choices=["model", "template"], default="model",
                        help="after a tool ran: the model's words are spoken, or the car's own confirmation at once")
    parser.add_argument("--acknowledge", action="store_true",
                        help="say what the car is doing as soon as a call's name is decoded (the app's acknowledge)")
    parser.add_argument("--no-tools", action="store_true", help="chat without the car's tools (latency of words alone)")
    parser.add_argument("--conversation", type=int, default=1, metavar="K",
                        help="say the commands in chats of K, one after another, each answered before the next (the "
                             "chat keeps the earlier exchanges; each is judged on its own); 1: each in a fresh chat")
    parser.add_argument("--forget", action="store_true",
                        help="each command from the system prompt alone, as a driver's commands minutes apart are "
                             "(history_seconds 0); without it every command goes on with the chat (None)")
    parser.add_argument("--keep-words", action="store_true",
                        help="keep the exchanges answered in words only in the chat (the app's keep_words; by default "
                             "they leave it before the next command)")
    parser.add_argument("--shuffle", type=int, default=None, metavar="SEED",
                        help="the commands in a random order seeded with SEED (default: the file's order)")
    parser.add_argument("--warmup", type=int, default=1, help="commands run first per mode and not counted")
    parser.add_argument("--out", type=Path, default=ROOT / "bench-results" / "voice")
    parser.add_argument("--json", type=Path, default=None,
                        help="also write the result (voice.json) to this file (tools/records.py's {out})")
    args = parser.parse_args(argv)
    if args.conversation < 1:
        parser.error(f"--conversation: a chat holds at least one command (got {args.conversation})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        os.environ["EDGEROUTE_THREADS"] = str(args.threads)
    from edgeroute.runtime import Engine

    # what the options and the commands file say wrong, before the model loads
    listens = [v.strip() for v in args.listen.split(",") if v.strip()]
    if not listens or set(listens) - set(LISTEN):
        raise SystemExit(f"--listen: comma-separated {', '.join(LISTEN)} (got {args.listen!r})")
    commands = load_commands(args.commands_file, args.commands)
    if args.conversation > 1 and any(c.get("before") for c in commands):
        raise SystemExit(f"--conversation: {args.commands_file} holds follow-ups (\"before\"), each said in a chat "
                         "of its own after what it follows")
    engine = Engine(args.bundle, profile=args.profile, task="voice-command", backend=args.backend, kernels=args.kernels,
                    verify=False)
    args.light = args.light or ("slm" if engine.use_slm else "ngram")
    modes, notes = available_modes(engine, [m.strip() for m in args.modes.split(",") if m.strip()])
    tts = "espeak-ng" if args.tts == "espeak" or (args.tts == "auto" and espeak_available()) else "none"
    if tts == "espeak-ng":
        def speaker_factory():
            return EspeakSpeaker(realtime=False)
    else:
        def speaker_factory():
            return NullSpeaker()
        notes.append("no TTS: the first clause's completion counts as the first audio sample")
    threads = getattr(engine.llm, "threads", None) or engine.settings.model_threads()
    samples: list[dict[str, Any]] = []
    started = time.perf_counter()
    chats = conversations(commands, args.conversation, args.shuffle)
    for mode in modes:
        for command in commands[:args.warmup]:  # warm the caches, the grammars and the prefix of this mode's path
            asyncio.run(one_chat(engine, [command], mode, "off", args, speaker_factory))
        if not args.no_tools:
            VoiceAssistant(engine, NullSpeaker(), tool_choice=args.tool_choice, words_tool=args.words_tool,
                           status_tool=args.status_tool, mode=mode).warm_up()
        number = 0
        for chat_number, chat in enumerate(chats, 1):
            for listen in listens:  # interleaved: a busy moment of the machine hits both settings alike
                for sample in asyncio.run(one_chat(engine, chat, mode, listen, args, speaker_factory)):
                    sample["chat"] = chat_number
                    samples.append(sample)
                    total = sample["seconds"]["total"]
                    where = f"{number + sample['turn']}/{len(commands)}" + (
                        f" chat {chat_number} turn {sample['turn']}" if args.conversation > 1 else "")
                    print(f"[{mode} {LISTEN[listen]} {where}] {sample['command']!r}: "
                          f"{ms(total)} ms to audio, first token {ms(sample['seconds']['first_token'])} ms, "
                          f"{'ok' if sample['check']['right_tool'] and sample['check']['right_arguments'] else 'WRONG'} "
                          f"{[c['name'] for c in sample['tool_calls']]}", flush=True)
            number += len(chat)
    result = {"bundle": str(args.bundle), "backend": engine.llm.flavour, "kernels": engine.llm.kernels,
              "threads": threads, "profile": args.profile,
              "tts": tts, "created": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "command": " ".join(shlex.quote(a) for a in [sys.executable, "-m", "tools.bench_voice", *(argv or sys.argv[1:])]),
              "commit": commit(), "machine": machine_info(), "notes": notes,
              "settings": {"commands": len(commands), "modes": modes, "light": args.light, "listen": args.listen,
                           "commands_file": str(args.commands_file), "tools": not args.no_tools,
                           "tool_choice": args.tool_choice, "words_tool": args.words_tool,
                           "words_bias": args.words_bias, "status_tool": args.status_tool, "confirm": args.confirm,
                           "ground_arguments": args.ground_arguments,
                           "acknowledge": args.acknowledge,
                           "wpm": args.wpm, "speed": args.speed, "asr_delay": args.asr_delay,
                           "max_new_tokens": args.max_new_tokens, "warmup": args.warmup,
                           "conversation": args.conversation, "shuffle": args.shuffle, "forget": args.forget,
                           "keep_words": args.keep_words},
              "wall_seconds": time.perf_counter() - started, "samples": samples}
    result["summary"] = summarize(samples, modes, listens)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "voice.json").write_text(json.dumps(result, indent=1))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    table = markdown(result)
    (args.out / "voice.md").write_text(table)
    png = plot(result, args.out / "voice.png")
    print(table)
    for note in notes:
        print(f"note: {note}")
    print(f"wrote {args.out / 'voice.json'}, {args.out / 'voice.md'}{f', {png}' if png else ''} "
          f"in {result['wall_seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
