"""The assistant's loop on asyncio: listen ahead while the driver speaks, answer the final
transcript with tools, speak the answer sentence by sentence while it is decoded, and stop
(keeping what was said) when the driver cuts in.

    engine = Engine("bundles/qwen-pair", task="voice-command")
    assistant = VoiceAssistant.demo(engine, EspeakSpeaker())   # the demo's measured settings
    records = asyncio.run(assistant.run(ScriptedRecognizer(["navigate to the airport"])))
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from examples.voice_assistant.asr import Partial, Recognizer, ScriptedRecognizer, Utterance
from examples.voice_assistant.car import (
    CAR_TOOLS,
    STATUS_TOOL,
    STATUS_TOOL_NAME,
    WORDS_TOOL,
    WORDS_TOOL_INSTRUCTION,
    WORDS_TOOL_NAME,
    CarState,
    acknowledgement,
    confirmation,
)
from examples.voice_assistant.grounding import ground
from examples.voice_assistant.speech import SentenceSplitter, Speaker, StringArgument, speakable

# a command this long after the last answer starts a fresh chat: a follow-up comes within seconds
# (shipping assistants keep listening for one about as long), and an unrelated command minutes
# later is answered better without the earlier exchanges (docs/guide/voice.md, conversations)
HISTORY_SECONDS = 8.0

# What the demo (``python -m examples.voice_assistant``) runs and the voice benchmarks measured
# (docs/guide/voice.md): every command calls a tool (neither the demo's nor the pair's model
# writes a call on its own), the words tool with its bias for commands no tool does, the car's
# own confirmation, calls held to what the driver said, speculation. VoiceAssistant's own
# defaults are the plainest assistant; VoiceAssistant.demo starts from these.
DEMO_SETTINGS: dict[str, Any] = {"tool_choice": "required", "words_tool": True, "words_bias": 4.0,
                                 "confirm": "template", "ground_arguments": True, "mode": "speculate"}

SYSTEM = ("You are the voice assistant of a car. When the driver asks for something a tool does, call the tool. "
          "After a tool ran, confirm what was done in one short sentence. Answer anything else in one or two short "
          "sentences. The answer is spoken: no lists, no markdown.")


def cache_system_prompt(engine, system: str, tools: list[dict[str, Any]] | None) -> int:
    """Compute the system prompt's K/V once for the engine (``Engine.share_prefix``): every chat
    opened with it starts from a copy. With tools, the prefix is the system message with the
    tools' block where the runtime's ``share_prefix`` takes them."""
    if tools and "tools" in inspect.signature(engine.share_prefix).parameters:
        return engine.share_prefix(system, tools=tools)
    return engine.share_prefix(system)


@dataclass
class TurnRecord:
    """One utterance answered: what happened and when (``time.perf_counter()`` seconds)."""

    final: str
    utterance: int
    speech_end: float
    final_at: float
    listened: int = 0  # partial transcripts prefilled ahead (listen-ahead)
    listen_tokens: int = 0  # tokens they computed
    listen_seconds: float = 0.0
    listen_wait: float = 0.0  # after the final transcript, waiting for a listen in flight
    answered_ahead: int = 0  # answers begun on partial transcripts (answer-ahead)
    ahead_kept: bool = False  # the final transcript was the last partial's: its answer was kept
    begin_at: float | None = None  # the first generation asked for (after the listen in flight)
    first_token_at: float | None = None  # the first generation's first token the model picked (a tool call's too)
    tools_done_at: float | None = None  # tool calls decoded and run
    acknowledged_at: float | None = None  # the first call's name decoded and its acknowledgement queued
    first_clause_at: float | None = None  # the first speakable chunk of the answer complete
    first_audio_at: float | None = None  # the first audio sample (the acknowledgement's, with one)
    answer_audio_at: float | None = None  # the first audio sample of the answer proper (not the acknowledgement)
    done_at: float | None = None
    prompt_tokens: int = 0  # the first generation's prompt tokens after what the chat held (listen-ahead's included)
    tokens: list[int] = field(default_factory=list)  # the first generation's tokens
    finish_reason: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # {"id", "name", "arguments"}: as run
    tool_results: list[dict[str, Any]] = field(default_factory=list)
    unsaid_calls: list[dict[str, Any]] = field(default_factory=list)  # calls not run: a required argument not said
    answer: str = ""  # the words of the answer (every generation's text)
    acknowledgement: str = ""  # said when the first call's name was decoded (``acknowledge``)
    spoken: str = ""  # of the interrupted generation's text, what was said (barge-in)
    barged_in: bool = False

    def breakdown(self) -> dict[str, float | None]:
        """Seconds from the end of the speech: ``asr`` (to the final transcript), ``first_token``
        (from it to the first token the model picks: a listen in flight, the prefill, the first
        pick; tokens a tool call's grammar forces take no step and do not count), ``tools``
        (from the first token to the calls decoded and run; 0 without), ``first_clause`` (to the
        first speakable chunk: the answer's prefill after tool results and its decode),
        ``audio`` (from that chunk to its first audio sample) and ``total`` (end of speech to
        the first audio sample: with ``acknowledge``, the acknowledgement's); ``answer_total``:
        end of speech to the first audio sample of the answer proper (the confirmation or the
        model's words; ``total`` without an acknowledgement); ``speech_to_token``: end of speech
        to the first token (``asr`` + ``first_token``); ``done``: end of speech to the end of the
        turn (every generation decoded, the answer said). ``prefill``: the part of ``first_token``
        after the generation was asked for (the listen in flight is the rest). An answer begun
        ahead on the last partial and kept counts its first token from the final transcript when
        it was picked before (nothing is released before the driver is known to have finished),
        and its ``prefill`` from when it began."""
        def span(a: float | None, b: float | None) -> float | None:
            return b - a if a is not None and b is not None else None

        after_token = self.tools_done_at if self.tools_done_at is not None else self.first_token_at
        return {"asr": span(self.speech_end, self.final_at), "first_token": span(self.final_at, self.first_token_at),
                "prefill": span(self.begin_at, self.first_token_at),
                "tools": span(self.first_token_at, self.tools_done_at) if self.tool_calls else 0.0,
                "first_clause": span(after_token, self.first_clause_at),
                "audio": span(self.first_clause_at, self.answer_audio_at),
                "total": span(self.speech_end, self.first_audio_at),
                "answer_total": span(self.speech_end, self.answer_audio_at),
                "speech_to_token": span(self.speech_end, self.first_token_at),
                "done": span(self.speech_end, self.done_at)}

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "breakdown": self.breakdown()}


NOTHING_HEARD = {"listened": 0, "tokens": 0, "seconds": 0.0, "answered": 0}  # an utterance's listening, before it


@dataclass(frozen=True)
class _CallNamed:
    """In a generation's pieces: the model chose to call ``name`` (acknowledged when said)."""

    name: str


@dataclass(frozen=True)
class _Words:
    """In a generation's pieces: words of the words tool's call (its ``text``), to be said;
    ``closes``: the text ended with them (its last chunk need not wait for the call's end)."""

    text: str
    closes: bool = False


@dataclass
class _Generation:
    """A generation decoding on a task of its own, its pieces queued for the turn that says
    them: any generation of a turn, or the first one begun ahead on a partial transcript, whose
    pieces wait, unspoken and its tool calls not run, until the final transcript says whether
    the driver said exactly that."""

    prompt: Any
    number: int  # its generation's number
    pieces: asyncio.Queue = field(default_factory=asyncio.Queue)  # text, _CallNamed and _Words, then None
    task: asyncio.Task | None = None
    begin_at: float | None = None
    first_token_at: float | None = None  # the first token the model picked (not one a grammar forced)


class _WordsReader:
    """On the decode's worker thread: while the words tool's call is decoded, its ``text`` as it
    is written, handed to ``say`` (so the words are spoken before the call is complete)."""

    def __init__(self, say) -> None:
        self.say, self.reader = say, None

    def named(self, name: str) -> None:
        self.reader = StringArgument("text") if name == WORDS_TOOL_NAME else None

    def token(self, trace) -> None:
        if self.reader is None or self.reader.closed or not trace.text:
            return
        text = self.reader.push(trace.text)
        if text or self.reader.closed:
            self.say(_Words(text, closes=self.reader.closed))


class VoiceAssistant:
    """A chat with the car's tools on an engine, driven by a recognizer, spoken by a speaker.

    ``listen_ahead``: partial transcripts are prefilled while the driver speaks
    (``Session.listen``; the latest partial wins when one arrives while another is being
    prefilled). ``answer_ahead`` (with ``listen_ahead``): each partial is answered instead, held
    back: when the final transcript is the last partial's text (an endpointer's delay after the
    last word), its answer is already under way and is released as it stands; otherwise it is
    cancelled and forgotten (``Session.barge_in(None)``: the message's K/V rows stay for the
    retry) and the final is answered. The output is the same either way; a wrong guess costs the
    cancel (one decode step), and a partial that is answered and superseded costs the decode it
    ran. ``keep_interrupted``: a barge-in keeps what was said of the answer (else the exchange
    is forgotten). ``tool_choice``: the first generation's (auto, required, none or a named
    tool); after one round of calls (``max_tool_rounds``) the model answers in words.
    ``words_tool``: offer :data:`car.WORDS_TOOL` beside ``tools`` (and end the system prompt
    with the line saying when to call it), so that under ``required`` a command no tool does is
    answered in words, not by the nearest tool: the call's ``text`` is spoken while it is
    decoded (no second generation); the call is never acknowledged or run on the car, and stays
    in the chat as the answer (a later round's tool results give it ``{"ok": true}``). A barge-in
    while its words are said forgets the exchange (words inside a call cannot be cut to what
    was said, as a text answer is). ``status_tool``: offer :data:`car.STATUS_TOOL` beside
    ``tools``: the car reads out what it knows (the time, the fuel, the route, ...), and with
    ``confirm="template"`` the value said is the car's (``car.reading``). ``words_bias``: added to
    the logit of the words tool's first token when the model picks a tool (``logit_bias``): a
    model that ranks a car function above words for a function the car lacks is moved off it.
    ``confirm``: "model", the model's words after the tool results are spoken; "template", the
    car's own confirmation (``car.confirmation``) is spoken as soon as the calls ran (the first
    audio does not wait for a second generation), and is the chat's answer to the results:
    written by a grammar that allows only that text (``tool_choice="none"`` with a
    ``response_format``), so no model step decodes it, and the chat holds what the car said, as
    a barge-in's cut does (one round of calls then; ``max_tool_rounds`` is the model's).
    ``ground_arguments``: hold each car call's arguments to what the driver said (the command
    and the driver's earlier ones in the chat; ``grounding.ground``): an optional argument not
    said is left out, and a call whose required argument was not said is not run (the car says
    it did not catch it; ``TurnRecord.unsaid_calls``); readings and words are not held.
    ``acknowledge``: as soon as the first call's name is decoded, before its arguments, say
    what the car is doing (``car.acknowledgement``: "Navigating"); the template
    confirmation then says the rest ("to the airport."). ``context_policy``: the chat's
    ("drop_oldest": a conversation that fills the context forgets its oldest exchanges; the
    system prompt stays). ``history_seconds``: a command first heard more than that long after
    the last answer ended starts the chat over (answered from the system prompt alone, as in a
    fresh chat); one within it, or one that cuts into the answer, goes on with the chat. None:
    the chat goes on always; 0: only a barge-in goes on. Kept history lets a follow-up ("call
    her again") be understood, and lets the pair copy its earlier answers into unrelated later
    ones (a decline into a command a tool does, a claim into one it cannot):
    docs/guide/voice.md, conversations. ``keep_words``: with tools, an exchange answered in
    words only (no car call) stays in the chat; by default it leaves it when the driver begins
    the next command (``Session.barge_in(None)``: as if it never happened), so its refusals and
    claims are not copied into later answers, while the car's exchanges stay for follow-ups.
    ``clause_chars``, ``max_chars``: how the answer is cut into chunks
    (:class:`SentenceSplitter`). ``decoding``: the chat's DecodeOptions fields (mode, light,
    ...)."""

    def __init__(self, engine, speaker: Speaker, *, system: str = SYSTEM, tools: list[dict[str, Any]] | None = CAR_TOOLS,
                 car: CarState | None = None, listen_ahead: bool = True, answer_ahead: bool = False,
                 keep_interrupted: bool = True,
                 tool_choice: Any = "auto", words_tool: bool = False, words_bias: float = 0.0, status_tool: bool = False,
                 max_tool_rounds: int = 1,
                 clause_chars: int | None = 24, max_chars: int | None = 160,
                 max_new_tokens: int = 64, share_prefix: bool = True, confirm: str = "model", acknowledge: bool = False,
                 context_policy: str = "drop_oldest", history_seconds: float | None = HISTORY_SECONDS,
                 keep_words: bool = False, ground_arguments: bool = False, **decoding: Any) -> None:
        if confirm not in ("model", "template"):
            raise ValueError(f"confirm must be model or template (got {confirm!r})")
        # the first generation's options beyond tool_choice (the one that picks a tool or words)
        self._picking: dict[str, Any] = {}
        if status_tool and tools:
            tools = [*tools, STATUS_TOOL]
        if words_tool and tools:
            tools, system = [*tools, WORDS_TOOL], f"{system} {WORDS_TOOL_INSTRUCTION}"
            if words_bias:
                self._picking["logit_bias"] = {engine.encode(WORDS_TOOL_NAME)[0]: words_bias}
        self.confirm, self.system, self.acknowledge = confirm, system, acknowledge and bool(tools)
        self.engine, self.speaker, self.car = engine, speaker, car if car is not None else CarState()
        self.tools, self.tool_choice, self.max_tool_rounds = tools, tool_choice, max_tool_rounds
        if history_seconds is not None and not history_seconds >= 0:
            raise ValueError(f"history_seconds must be None or a number of seconds >= 0 (got {history_seconds!r})")
        self.listen_ahead, self.keep_interrupted = listen_ahead, keep_interrupted
        self.history_seconds, self.keep_words, self.ground_arguments = history_seconds, keep_words, ground_arguments
        self.answer_ahead = listen_ahead and answer_ahead
        self.clause_chars, self.max_chars = clause_chars, max_chars  # the SentenceSplitter's
        if share_prefix:
            cache_system_prompt(engine, system, tools)
        extra = {"tools": tools} if tools else {}
        self.decoding = decoding  # the chat's DecodeOptions fields, for every chat it opens
        self.chat = engine.chat(system=system, context_policy=context_policy, max_new_tokens=max_new_tokens, **extra,
                                **decoding)
        self.records: list[TurnRecord] = []
        self._response: asyncio.Task | None = None
        self._listener: asyncio.Task | None = None
        self._pending: str | None = None
        self._ahead: _Generation | None = None
        self._heard = dict(NOTHING_HEARD)
        self._generation = 0  # numbers the generations; _spoken: each one's chunks said so far
        self._spoken: dict[int, list[str]] = {0: []}
        self._before: dict[int, Any] = {}  # chat.last before each generation (it began when that changed)
        self._worded: set[int] = set()  # the generations whose words came from the words tool's call

    @classmethod
    def demo(cls, engine, speaker: Speaker, **settings: Any) -> VoiceAssistant:
        """An assistant with :data:`DEMO_SETTINGS`, ``settings`` over them (any of ``__init__``'s);
        where it decodes with a light path and none is named, the bundle's SLM, else prompt lookup."""
        settings = {**DEMO_SETTINGS, **settings}
        light = settings.pop("light", None)
        if light is None and settings.get("mode") != "auto":  # auto: each task's own
            light = "slm" if engine.use_slm else "ngram"
        return cls(engine, speaker, **settings, **({} if light is None else {"light": light}))

    def _starts_over(self, heard_at: float) -> bool:
        """Whether a command first heard at ``heard_at`` starts the chat over (``history_seconds``)."""
        ended = self.records[-1].done_at if self.records else None
        return (self.history_seconds is not None and ended is not None and heard_at - ended > self.history_seconds
                and len(self.chat.messages) > 1)

    def _forgets_words(self) -> bool:
        """Whether the last exchange, answered in words only, leaves the chat (``keep_words``); one
        whose call was not run for an argument not said stays."""
        last = self.records[-1] if self.records else None
        return (bool(self.tools) and not self.keep_words and last is not None and not last.tool_calls
                and not last.unsaid_calls  # "which temperature?" waits for the driver's answer
                and not last.barged_in and last.done_at is not None and len(self.chat.messages) > 1
                and self.chat.messages[-1]["role"] == "assistant")

    def warm_up(self) -> None:
        """Before the driver speaks: compile the tool-call grammars this assistant uses (the
        first request of each takes hundreds of milliseconds) in a throwaway chat."""
        if not self.tools:
            return
        chat = self.engine.chat(system=self.system, tools=self.tools, **self.decoding)
        for choice in [self.tool_choice] + [c for c in ("auto", "none") if c != self.tool_choice]:
            chat.generate("hello", tool_choice=choice, max_new_tokens=1)
            chat.reset()

    # -- listening ahead ---------------------------------------------------------------------

    def _listen(self, text: str) -> None:
        self._pending = text
        if self._listener is None or self._listener.done():
            self._listener = asyncio.create_task(self._listen_loop())

    async def _listen_loop(self) -> None:
        while self._pending is not None:
            text, self._pending = self._pending, None
            if self.answer_ahead:
                if self._ahead is None or self._ahead.prompt != text:
                    await self._drop_answer_ahead()
                    self._ahead = self._begin(text, self._first_options())
                    self._heard["answered"] += 1
                continue
            start = time.perf_counter()
            computed = await asyncio.to_thread(self.chat.listen, text)
            self._heard["listened"] += 1
            self._heard["tokens"] += computed
            self._heard["seconds"] += time.perf_counter() - start

    def _first_options(self) -> dict[str, Any]:
        """The options of a turn's first generation (the one that picks a tool or words)."""
        return {"tool_choice": self.tool_choice, **self._picking} if self.tools else {}

    def _begin(self, prompt: Any, options: dict[str, Any]) -> _Generation:
        """Start a generation on the chat; its pieces come in ``pieces`` (``_pieces``)."""
        self._generation += 1
        generation = _Generation(prompt, self._generation, begin_at=time.perf_counter())
        self._before[generation.number], self._spoken[generation.number] = self.chat.last, []
        loop = asyncio.get_running_loop()

        def queue(item: Any) -> None:  # on the decode's worker thread
            # a call's words and names follow its content by a decode step at least: they queue after it
            loop.call_soon_threadsafe(generation.pieces.put_nowait, item)

        words = _WordsReader(queue)

        def on_token(trace) -> None:  # on the decode's worker thread
            if generation.first_token_at is None and trace.source != "grammar":
                generation.first_token_at = time.perf_counter()
            words.token(trace)

        def on_tool_name(name: str) -> None:  # on the decode's worker thread
            words.named(name)
            if self.acknowledge:
                queue(_CallNamed(name))

        async def decode() -> None:
            try:
                async for piece in self.chat.astream(prompt, on_token=on_token,
                                                     on_tool_name=on_tool_name if self.tools else None, **options):
                    generation.pieces.put_nowait(piece)
            finally:
                generation.pieces.put_nowait(None)

        generation.task = asyncio.create_task(decode())
        return generation

    async def _drop_answer_ahead(self) -> None:
        """Cancel the answer begun on a partial and forget its exchange (never spoken, no tool run)."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return
        ahead.task.cancel()
        # an answer that failed on a partial (a message too long, say) goes too: the final's says why
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await ahead.task
        began = self.chat.last is not self._before.get(ahead.number)
        if began and self.chat.messages and self.chat.messages[-1]["role"] == "assistant":
            self.chat.barge_in(None)

    async def _pieces(self, generation: _Generation):
        try:
            while (piece := await generation.pieces.get()) is not None:
                yield piece
            await generation.task  # its errors are the answer's
        finally:
            if not generation.task.done():  # the response was cancelled (a barge-in): so is its decode
                generation.task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await generation.task

    async def _stop_listening(self) -> None:
        self._pending = None
        if self._listener is not None:
            await self._listener
            self._listener = None

    # -- answering ---------------------------------------------------------------------------

    async def run(self, recognizer: Recognizer) -> list[TurnRecord]:
        """Answer every utterance the recognizer hears; returns their records (``self.records``
        keeps every run's)."""
        current, first = None, len(self.records)
        async for event in recognizer.events():
            if event.utterance != current:  # the driver speaks: a new utterance begins
                current = event.utterance
                await self._drop_answer_ahead()  # an utterance that never had its final
                if self._response is not None and not self._response.done():
                    await self.barge_in()  # cut in: it goes on from what was said
                elif self._starts_over(event.at):  # before anything is heard of it
                    self.chat.reset()
                elif self._forgets_words():
                    self.chat.barge_in(None)
                self._heard = dict(NOTHING_HEARD)
            if not event.final:
                if self.listen_ahead and event.text.strip():
                    self._listen(event.text)
                continue
            waiting = time.perf_counter()
            await self._stop_listening()
            if self._ahead is not None and self._ahead.prompt != event.text:
                await self._drop_answer_ahead()
            ahead, self._ahead = self._ahead, None
            if not event.text.strip():
                continue  # the recognizer heard nothing
            record = TurnRecord(event.text, event.utterance, event.speech_end if event.speech_end is not None else event.at,
                                event.at, listened=self._heard["listened"], listen_tokens=self._heard["tokens"],
                                listen_seconds=self._heard["seconds"], listen_wait=time.perf_counter() - waiting,
                                answered_ahead=self._heard["answered"], ahead_kept=ahead is not None)
            self.records.append(record)
            self._response = asyncio.create_task(self._respond(record, ahead))
        if self._response is not None:
            await self._response
        return self.records[first:]

    async def converse(self, *utterances: str | Utterance, speed: float = 1.0) -> list[TurnRecord]:
        """``run`` on scripted utterances (text spoken at 150 words a minute, or scripts)."""
        return await self.run(ScriptedRecognizer(list(utterances), speed=speed))

    async def _respond(self, record: TurnRecord, ahead: _Generation | None = None) -> None:
        queue: asyncio.Queue = asyncio.Queue()
        speaking = asyncio.create_task(self._speak(queue, record))
        try:
            prompt: Any = record.final
            round_, confirmed = 0, ""  # confirmed: what the car said of the calls it ran (confirm="template")
            while True:
                if round_ == 0:
                    options = self._first_options()
                elif confirmed:
                    # the chat's answer to the results is what the car said: written by a grammar that
                    # allows only that text, so no model step decodes it (the next turn's prefill computes it)
                    options = {"tool_choice": "none", "max_new_tokens": len(self.engine.encode(confirmed)) + 8,
                               "response_format": {"type": "regex", "regex": re.escape(confirmed)}}
                else:
                    options = {"tool_choice": "none" if round_ == self.max_tool_rounds else "auto"} if self.tools else {}
                generation = ahead if round_ == 0 and ahead is not None else self._begin(prompt, options)
                splitter = SentenceSplitter(self.clause_chars, self.max_chars)
                if confirmed:  # said now, as the generation that holds it: a barge-in keeps what was said of it
                    # an acknowledgement, queued when the call's name was decoded, is the start of the text
                    # and counts as said (it is, before any of the rest)
                    begun = f"{record.acknowledgement} " if record.acknowledgement else ""
                    self._spoken[generation.number] += [begun] if begun else []
                    self._queue(queue, generation.number, confirmed[len(begun):], record)
                said = ""  # the words tool's words
                if round_ == 0:
                    record.begin_at = generation.begin_at
                try:
                    async for piece in self._pieces(generation):
                        if isinstance(piece, _CallNamed):
                            self._acknowledge(queue, piece.name, record)
                            continue
                        if isinstance(piece, _Words):
                            said += piece.text
                            if piece.text:
                                self._worded.add(generation.number)
                            # the closing quote ends the last sentence: said now, not after the call's
                            # closing tokens and the end of the turn
                            chunks = splitter.push(piece.text) + (splitter.flush() if piece.closes else [])
                        else:
                            chunks = splitter.push(piece)
                        for chunk in [] if confirmed else chunks:
                            self._queue(queue, generation.number, chunk, record)
                finally:  # a barge-in's record keeps it too
                    if round_ == 0 and generation.first_token_at is not None:
                        # one begun ahead on a partial is released at the final transcript, not before
                        record.first_token_at = max(generation.first_token_at, record.final_at)
                decoded = self.chat.last
                calls = list(getattr(decoded, "tool_calls", None) or [])
                # what the words calls hold beyond what was read while they were decoded (a tail held back)
                words = "".join(call.arguments.get("text", "") for call in calls if call.name == WORDS_TOOL_NAME)
                tail = words[len(said):] if words.startswith(said) else ""
                said += tail
                for chunk in [] if confirmed else splitter.push(tail) + splitter.flush():
                    self._queue(queue, generation.number, chunk, record)
                if tail:
                    self._worded.add(generation.number)
                if round_ == 0:
                    record.tokens, record.finish_reason = list(decoded.tokens), decoded.finish_reason
                    record.prompt_tokens = decoded.stats.prompt_tokens
                record.answer += decoded.text + said
                car_calls = [call for call in calls if call.name != WORDS_TOOL_NAME]
                if confirmed or not car_calls or round_ == self.max_tool_rounds:
                    break
                results, ran = [], []  # ran: (name, arguments, result) of this round's car calls, run or not
                for call in calls:
                    if call.name == WORDS_TOOL_NAME:  # said already
                        result: dict[str, Any] = {"ok": True}
                    else:
                        arguments, result = self._run(call, record)
                        ran.append((call.name, arguments, result))
                    results.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})
                record.tools_done_at = time.perf_counter()
                if self.confirm == "template":
                    confirmed = " ".join(confirmation(name, arguments, result, acknowledged=i == 0 and
                                                      bool(record.acknowledgement))
                                         for i, (name, arguments, result) in enumerate(ran))
                    if record.acknowledgement:
                        confirmed = f"{record.acknowledgement} {confirmed}"
                prompt, round_ = results, round_ + 1
            queue.put_nowait(None)
            await speaking
            record.done_at = time.perf_counter()
        finally:
            if not speaking.done():
                speaking.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await speaking

    def _run(self, call, record: TurnRecord) -> tuple[dict[str, Any], dict[str, Any]]:
        """Run one car call on the car (its arguments held to what was said, ``ground_arguments``)
        and record it: the arguments it ran with, and the result that goes back to the model."""
        entry = {"id": call.id, "name": call.name, "arguments": call.arguments}
        tool = next((t for t in self.tools or [] if t["function"]["name"] == call.name), None)
        if self.ground_arguments and tool is not None and call.name != STATUS_TOOL_NAME \
                and isinstance(call.arguments, dict):
            heard = " ".join(m["content"] for m in self.chat.messages
                             if m["role"] == "user" and isinstance(m.get("content"), str))
            held = ground(tool["function"]["parameters"], call.arguments, heard)
            if held.unsaid is not None:
                record.unsaid_calls.append(entry)
                return call.arguments, {"ok": False, "unsaid": held.unsaid,
                                        "error": f"the driver did not say the {held.unsaid}"}
            entry["arguments"] = held.arguments
        result = self.car.dispatch(call.name, entry["arguments"])
        record.tool_calls.append(entry)
        record.tool_results.append(result)
        return entry["arguments"], result

    def _queue(self, queue: asyncio.Queue, number: int, chunk: str, record: TurnRecord) -> None:
        if record.first_clause_at is None and speakable(chunk):
            record.first_clause_at = time.perf_counter()
        queue.put_nowait((number, chunk, False))

    def _acknowledge(self, queue: asyncio.Queue, name: str, record: TurnRecord) -> None:
        """Say what the first call of the turn does, once (generation 0: words of no generation)."""
        if record.acknowledgement or record.tool_calls or name == WORDS_TOOL_NAME:
            return
        record.acknowledgement, record.acknowledged_at = acknowledgement(name), time.perf_counter()
        queue.put_nowait((0, record.acknowledgement + " ", True))

    async def _speak(self, queue: asyncio.Queue, record: TurnRecord) -> None:
        while (item := await queue.get()) is not None:
            number, chunk, acknowledging = item

            def first_audio(t: float, answer: bool = not acknowledging) -> None:
                if record.first_audio_at is None:
                    record.first_audio_at = t
                if answer and record.answer_audio_at is None:
                    record.answer_audio_at = t

            await self.speaker.speak(chunk, first_audio)
            self._spoken[number].append(chunk)

    async def barge_in(self) -> None:
        """The driver cut in: stop decoding and speaking, and keep what was said of the answer
        (``keep_interrupted``) or forget the exchange (``Session.barge_in``)."""
        task, self._response = self._response, None
        if task is None:
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        record = self.records[-1]
        record.barged_in = True
        number = self._generation
        spoken = "".join(self._spoken.get(number, []))
        record.spoken = spoken
        last = self.chat.last
        if last is None or not self.chat.messages or self.chat.messages[-1]["role"] != "assistant":
            return  # the answer never began: nothing of it is in the chat
        if last is self._before.get(number):
            # this generation never began (cut between a tool call and its answer): the chat ends
            # with the tool call, which ran; nothing to cut
            return
        self.chat.barge_in(spoken if self.keep_interrupted and number not in self._worded else None)


def describe(record: TurnRecord) -> dict[str, Any]:
    """A record's figures in milliseconds, for printing."""
    return {k: None if v is None else round(v * 1000, 1) for k, v in record.breakdown().items()}


__all__ = ["HISTORY_SECONDS", "SYSTEM", "Partial", "TurnRecord", "VoiceAssistant", "cache_system_prompt", "describe"]
