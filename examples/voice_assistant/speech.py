"""Spoken output: streamed text pieces cut into sentences (the first clause early), each
synthesized as soon as it is complete while the rest of the answer is still being decoded.

- :class:`SentenceSplitter`: pieces in, chunks out; the chunks concatenate to exactly the text
  that went in (so what was spoken is always the start of the answer: ``Session.barge_in``).
- :class:`StringArgument`: a tool call's JSON as it is decoded in, one string argument's
  characters out (the words tool's ``text`` is spoken while the call is still being written).
- :class:`Speaker`: ``speak(chunk, on_audio)`` synthesizes and plays a chunk, calling
  ``on_audio(t)`` with the ``time.perf_counter()`` of its first audio sample; cancellable.
- :class:`EspeakSpeaker`: ``espeak-ng --stdout`` (Debian/Ubuntu: ``apt-get install espeak-ng``),
  its audio kept (``save`` writes a WAV) and optionally played in real time.
- :class:`NullSpeaker`: no audio; records when the first sample would come and what was said.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import struct
import time
import wave
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path

TERMINATORS = ".!?"
CLAUSE_MARKS = ",;:"
# a period after these is not a sentence's end ("Dr. Smith", "221B Baker St. in London")
ABBREVIATIONS = {"dr", "mr", "mrs", "ms", "st", "jr", "sr", "prof", "no", "vs", "etc", "e.g", "i.e", "approx", "ave"}


class SentenceSplitter:
    """Cut streamed text into speakable chunks: a sentence ends at . ! ? (or a line break)
    followed by white space, not after a known abbreviation or inside a number ("3.5");
    ``clause_chars``: a chunk also ends at , ; : followed by white space once it holds that
    many characters, so the first audio does not wait for a long sentence's end (None: never);
    ``max_chars``: text without any such mark is cut at the last white space once it is that
    long (None: never). ``push`` returns the chunks completed by a piece, ``flush`` the rest at the end. The
    white space after a chunk's end begins the next chunk: the chunks concatenate to the input."""

    def __init__(self, clause_chars: int | None = 24, max_chars: int | None = 160) -> None:
        self.clause_chars, self.max_chars = clause_chars, max_chars
        self.buffer = ""

    def _cut(self) -> int | None:
        """The end of the first complete chunk in the buffer, or None."""
        text = self.buffer
        for i in range(len(text) - 1):
            char, following = text[i], text[i + 1]
            if char == "\n" and text[:i].strip():
                return i + 1
            if not following.isspace():
                continue
            if char in TERMINATORS:
                if char == "." and self._abbreviation(text[:i]):
                    continue
                return i + 1
            if char in CLAUSE_MARKS and self.clause_chars is not None and len(text[:i + 1].strip()) >= self.clause_chars:
                return i + 1
        if self.max_chars is not None and len(text) > self.max_chars:
            space = max((i for i, c in enumerate(text[:self.max_chars + 1]) if c.isspace() and text[:i].strip()), default=None)
            if space is not None:
                return space
        return None

    @staticmethod
    def _abbreviation(before: str) -> bool:
        word = re.split(r"\s", before)[-1].lower()
        return word in ABBREVIATIONS or (len(word) == 1 and word.isalpha())  # an initial: "J. Smith"

    def push(self, piece: str) -> list[str]:
        self.buffer += piece
        chunks = []
        while (end := self._cut()) is not None:
            chunks.append(self.buffer[:end])
            self.buffer = self.buffer[end:]
        return chunks

    def flush(self) -> list[str]:
        rest, self.buffer = self.buffer, ""
        return [rest] if rest else []


def speakable(chunk: str) -> bool:
    return any(c.isalnum() for c in chunk)


# one JSON escape; a high surrogate takes the low one after it (one character between them)
ESCAPE = re.compile(r'\\(?:["\\/bfnrt]|u[dD][89abAB][0-9a-fA-F]{2}\\u[0-9a-fA-F]{4}|u[0-9a-fA-F]{4})')
HIGH_SURROGATE = re.compile(r'\\u[dD][89abAB][0-9a-fA-F]{2}')
ESCAPE_START = re.compile(r'(?:\\(?:u[0-9a-fA-F]{0,3})?)?')  # the start of a \uXXXX escape, or nothing yet
SURROGATES = re.compile("[\ud800-\udfff]")  # half a pair: no character, nothing to say


class StringArgument:
    """The characters of the string argument ``key`` of a tool call, from the call's JSON text as
    it is decoded: ``push(text)`` returns the characters that piece completed (escapes decoded;
    one cut in two waits for its end), nothing before the key's value opens or after it closes.
    The runtime's grammar makes the JSON well-formed; the first ``"key":`` in it is taken."""

    def __init__(self, key: str) -> None:
        self._opening = re.compile(rf'"{re.escape(key)}"\s*:\s*"')
        self._before = ""  # the call's text until the value opens
        self._pending = ""  # the value's text not yet given out: an escape cut short
        self.opened = self.closed = False

    def push(self, text: str) -> str:
        if self.closed:
            return ""
        if not self.opened:
            self._before += text
            if (start := self._opening.search(self._before)) is None:
                return ""
            self.opened, text = True, self._before[start.end():]
        value, at, out = self._pending + text, 0, []
        while at < len(value):
            char = value[at]
            if char == '"':
                self.closed = True
                break
            if char != "\\":
                out.append(char)
                at += 1
                continue
            escape = ESCAPE.match(value, at)
            # a high surrogate waits for the escape after it (its pair) only while one may still come
            if escape is None or (escape.end() - at == 6 and HIGH_SURROGATE.match(value, at)
                                  and ESCAPE_START.fullmatch(value, at + 6)):
                break  # cut short: the rest of it comes with the next piece
            out.append(SURROGATES.sub("", json.loads(f'"{escape.group()}"')))
            at = escape.end()
        self._pending = "" if self.closed else value[at:]
        return "".join(out)


class Speaker(ABC):
    """Synthesizes and plays chunks of an answer, one at a time."""

    @abstractmethod
    async def speak(self, chunk: str, on_audio: Callable[[float], None] | None = None) -> None:
        """Say ``chunk``; ``on_audio(t)`` when its first audio sample exists (``t``:
        ``time.perf_counter()``). Returns when it was played; cancelling stops it."""


class NullSpeaker(Speaker):
    """No audio: the first sample "exists" ``synth_seconds`` after a chunk is given, playing
    takes ``seconds_per_char`` per character (0.06: about 150 words a minute). ``said`` lists
    (chunk, time of its first sample) in order."""

    def __init__(self, seconds_per_char: float = 0.0, synth_seconds: float = 0.0) -> None:
        self.seconds_per_char, self.synth_seconds = seconds_per_char, synth_seconds
        self.said: list[tuple[str, float]] = []

    async def speak(self, chunk: str, on_audio: Callable[[float], None] | None = None) -> None:
        if not speakable(chunk):
            return
        if self.synth_seconds:
            await asyncio.sleep(self.synth_seconds)
        now = time.perf_counter()
        self.said.append((chunk, now))
        if on_audio is not None:
            on_audio(now)
        if self.seconds_per_char:
            await asyncio.sleep(len(chunk.strip()) * self.seconds_per_char)


WAV_HEADER = 44  # espeak-ng --stdout: a canonical RIFF header, then 16-bit mono PCM


def espeak_available() -> str | None:
    return shutil.which("espeak-ng")


class EspeakSpeaker(Speaker):
    """espeak-ng, one process per chunk, its WAV read from stdout as it is written; the first
    audio sample is the first PCM byte after the header. ``realtime``: a chunk takes as long
    as its audio lasts (what a car's loudspeaker does), so a barge-in finds part of the answer
    unsaid; ``play``: a command that plays raw PCM from stdin (e.g. ``["aplay", "-q", "-f",
    "S16_LE", "-r", "22050", "-c", "1"]``). ``audio`` keeps every PCM byte synthesized."""

    def __init__(self, voice: str = "en-us", words_per_minute: int = 175, realtime: bool = True,
                 play: list[str] | None = None, binary: str | None = None) -> None:
        self.binary = binary or espeak_available()
        if self.binary is None:
            raise RuntimeError("espeak-ng is not installed (Debian/Ubuntu: apt-get install espeak-ng)")
        self.voice, self.words_per_minute, self.realtime, self.play = voice, words_per_minute, realtime, play
        self.sample_rate = 22050
        self.audio = bytearray()
        self.said: list[tuple[str, float]] = []
        self.synthesis_seconds: list[float] = []  # per chunk: given -> first audio sample

    async def synthesize(self, text: str, on_audio: Callable[[float], None] | None = None) -> bytes:
        """The PCM of ``text`` (16-bit mono at ``sample_rate``)."""
        process = await asyncio.create_subprocess_exec(
            self.binary, "--stdout", "-v", self.voice, "-s", str(self.words_per_minute),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
        started = time.perf_counter()
        data = bytearray()
        try:
            process.stdin.write(text.encode())
            await process.stdin.drain()
            process.stdin.close()
            first = None
            while block := await process.stdout.read(4096):
                data += block
                if first is None and len(data) > WAV_HEADER:
                    first = time.perf_counter()
                    self.synthesis_seconds.append(first - started)
                    if on_audio is not None:
                        on_audio(first)
            await process.wait()
        finally:
            if process.returncode is None:  # cancelled (a barge-in): the synthesis stops
                process.kill()
                await process.wait()
        if len(data) >= WAV_HEADER and data[:4] == b"RIFF":
            self.sample_rate = struct.unpack_from("<I", data, 24)[0]
        return bytes(data[WAV_HEADER:])

    async def speak(self, chunk: str, on_audio: Callable[[float], None] | None = None) -> None:
        if not speakable(chunk):
            return
        first: list[float] = []

        def heard(t: float) -> None:
            first.append(t)
            if on_audio is not None:
                on_audio(t)

        pcm = await self.synthesize(chunk.strip(), heard)
        self.audio += pcm
        self.said.append((chunk, first[0] if first else time.perf_counter()))
        if self.play:
            player = await asyncio.create_subprocess_exec(*self.play, stdin=asyncio.subprocess.PIPE)
            try:
                await player.communicate(pcm)
            finally:
                if player.returncode is None:
                    player.kill()
                    await player.wait()
        elif self.realtime and first:
            rest = first[0] + len(pcm) / (2 * self.sample_rate) - time.perf_counter()
            if rest > 0:
                await asyncio.sleep(rest)

    def save(self, path: str | Path) -> Path:
        """Everything said so far as a WAV file."""
        with wave.open(str(path), "wb") as wav:
            wav.setnchannels(1)
            wav.setsampwidth(2)
            wav.setframerate(self.sample_rate)
            wav.writeframes(bytes(self.audio))
        return Path(path)
