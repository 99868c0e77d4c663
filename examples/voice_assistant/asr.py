"""Speech recognition behind a small interface: a recognizer yields, per utterance, timed
partial transcripts (the whole message so far, each time) and then a final one.

- :class:`ScriptedRecognizer`: timed partial transcripts from a script (what the tests and the
  benchmark use: ``timed_partials`` spreads a command's words at a speaking rate, 150 words a
  minute by default, and a script may revise earlier words as a real ASR does).
- :class:`PocketsphinxRecognizer`: the ``pocketsphinx`` package (PyPI; it ships a US English
  model) on 16-bit mono PCM: WAV files, or any async source of audio chunks (a microphone).
"""

from __future__ import annotations

import asyncio
import time
import wave
from abc import ABC, abstractmethod
from collections.abc import AsyncIterable, AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

WORDS_PER_MINUTE = 150


class AudioInputError(ValueError):
    """A WAV the recognizer cannot hear (missing, not a WAV, not 16-bit mono PCM), or no
    pocketsphinx to hear it with: said before any audio is read."""


@dataclass(frozen=True)
class Partial:
    """One transcript of the utterance in progress: the whole message so far. The last of an
    utterance is ``final``; it carries ``speech_end``, the ``time.perf_counter()`` at which the
    speech ended (the ASR's own time is ``at - speech_end``)."""

    text: str
    final: bool = False
    at: float = 0.0  # time.perf_counter() when the recognizer delivered it
    speech_end: float | None = None
    utterance: int = 0


class Recognizer(ABC):
    """Utterances as partial transcripts: ``events()`` yields each utterance's partials and then
    its final transcript, utterance after utterance."""

    @abstractmethod
    def events(self) -> AsyncIterator[Partial]:
        ...


@dataclass
class Utterance:
    """A scripted utterance: ``partials`` as (seconds from its start, transcript so far), the
    speech ending at ``end`` and the final transcript delivered ``asr_delay`` later; ``pause``:
    seconds between the previous utterance's final transcript and this one's start (a driver
    who cuts in while the answer is spoken)."""

    final: str
    partials: list[tuple[float, str]]
    end: float
    asr_delay: float = 0.0
    pause: float = 0.0


def timed_partials(text: str, wpm: float = WORDS_PER_MINUTE, revisions: Sequence[tuple[int, str]] = (),
                   asr_delay: float = 0.0, pause: float = 0.0) -> Utterance:
    """``text`` spoken at ``wpm`` words a minute: a partial after each word but the last; the
    final transcript carries the last word, ``asr_delay`` seconds after the speech ended. With
    an ``asr_delay`` (an endpointer that waits for silence before it calls the utterance
    over) the whole text comes first as a partial, when the last word was heard, as streaming
    ASRs do. ``revisions``: (after word n, what the ASR heard so far instead), e.g. (2, "call
    and a") before "call Anna"; each replaces the partial after that word, as an ASR's early
    guesses do."""
    words = text.split()
    per_word = 60.0 / wpm
    wrong = dict(revisions)
    heard = range(1, len(words) + (1 if asr_delay > 0 else 0))
    partials = [(per_word * n, wrong.get(n, " ".join(words[:n]))) for n in heard]
    return Utterance(text, partials, per_word * len(words), asr_delay, pause)


class ScriptedRecognizer(Recognizer):
    """Plays scripted utterances on the event loop's clock. ``speed``: 1.0 real time, 0.5 twice
    as fast, 0 no waiting at all (every partial at once)."""

    def __init__(self, utterances: Sequence[Utterance | str], speed: float = 1.0, wpm: float = WORDS_PER_MINUTE) -> None:
        self.utterances = [u if isinstance(u, Utterance) else timed_partials(u, wpm) for u in utterances]
        self.speed = speed

    async def _until(self, moment: float) -> None:
        delay = moment - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)

    async def events(self) -> AsyncIterator[Partial]:
        for number, utterance in enumerate(self.utterances):
            if utterance.pause and self.speed:
                await asyncio.sleep(utterance.pause * self.speed)
            start = time.perf_counter()
            for offset, text in utterance.partials:
                await self._until(start + offset * self.speed)
                yield Partial(text, at=time.perf_counter(), utterance=number)
            speech_end = start + utterance.end * self.speed
            await self._until(speech_end + utterance.asr_delay * self.speed)
            yield Partial(utterance.final, final=True, at=time.perf_counter(),
                          speech_end=min(speech_end, time.perf_counter()), utterance=number)


async def wav_chunks(path: str | Path, seconds: float = 0.1, realtime: bool = True) -> AsyncIterator[bytes]:
    """A WAV file's 16-bit mono PCM (:func:`check_wav` has checked it) in chunks of ``seconds``,
    paced as a microphone delivers them when ``realtime``."""
    with wave.open(str(path), "rb") as wav:
        frames = max(1, int(wav.getframerate() * seconds))
        start = time.perf_counter()
        sent = 0
        while chunk := wav.readframes(frames):
            if realtime:
                delay = start + sent / wav.getframerate() - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
            sent += len(chunk) // 2
            yield chunk


MODEL_RATE = 16000  # pocketsphinx's English model


def resample(pcm: bytes, rate: int, to: int = MODEL_RATE) -> bytes:
    """16-bit mono PCM at ``rate`` linearly resampled to ``to`` (espeak-ng writes 22,050 Hz)."""
    if rate == to or not pcm:
        return pcm
    samples = np.frombuffer(pcm, dtype="<i2").astype(np.float32)
    count = max(1, round(len(samples) * to / rate))
    positions = np.arange(count) * (rate / to)
    return np.interp(positions, np.arange(len(samples)), samples).round().astype("<i2").tobytes()


def check_wav(path: str | Path) -> int:
    """The sample rate of ``path`` if it is a 16-bit mono PCM WAV, else an AudioInputError saying why."""
    try:
        with wave.open(str(path), "rb") as wav:
            if wav.getsampwidth() != 2 or wav.getnchannels() != 1:
                raise AudioInputError(f"{path}: give 16-bit mono PCM (got {wav.getsampwidth() * 8}-bit, "
                                      f"{wav.getnchannels()} channels); e.g. sox IN.wav -b 16 -c 1 OUT.wav")
            return wav.getframerate()
    except OSError as err:
        raise AudioInputError(f"cannot read the WAV {path}: {err.strerror or err}") from None
    except (wave.Error, EOFError) as err:
        raise AudioInputError(f"{path} is not a PCM WAV file ({err or 'it ends early'})") from None


class PocketsphinxRecognizer(Recognizer):
    """pocketsphinx (``pip install pocketsphinx``) on 16-bit mono PCM sources, one utterance per
    source: WAV paths, or async iterables of PCM chunks (a microphone's stream, with
    ``sample_rate``). A partial is yielded whenever the hypothesis changes; the final one when
    the source ends. Meant for real microphones: on synthetic (espeak-ng) voices its English
    model hears poorly, which is why the tests and the benchmark script their transcripts."""

    def __init__(self, sources: Sequence[str | Path | AsyncIterable[bytes]], sample_rate: int = 16000,
                 realtime: bool = True, **decoder_options) -> None:
        try:
            import pocketsphinx
        except ImportError as err:
            raise AudioInputError("PocketsphinxRecognizer needs the pocketsphinx package: pip install pocketsphinx") \
                from err
        self._pocketsphinx = pocketsphinx
        self.sources, self.sample_rate, self.realtime = list(sources), sample_rate, realtime
        for source in self.sources:
            if isinstance(source, (str, Path)):
                check_wav(source)
        self.decoder_options = decoder_options
        self._decoders: dict[int, object] = {}

    def _decoder(self, rate: int):
        if rate not in self._decoders:
            self._decoders[rate] = self._pocketsphinx.Decoder(samprate=rate, loglevel="FATAL", **self.decoder_options)
        return self._decoders[rate]


    async def events(self) -> AsyncIterator[Partial]:
        for number, source in enumerate(self.sources):
            if isinstance(source, (str, Path)):
                rate, chunks = check_wav(source), wav_chunks(source, realtime=self.realtime)
            else:
                rate, chunks = self.sample_rate, source
            decoder = self._decoder(MODEL_RATE)
            decoder.start_utt()
            said = ""
            async for chunk in chunks:
                decoder.process_raw(resample(chunk, rate), False, False)
                hypothesis = decoder.hyp()
                text = hypothesis.hypstr if hypothesis is not None else ""
                if text and text != said:
                    said = text
                    yield Partial(text, at=time.perf_counter(), utterance=number)
            speech_end = time.perf_counter()
            decoder.end_utt()
            hypothesis = decoder.hyp()
            yield Partial(hypothesis.hypstr if hypothesis is not None else "", final=True, at=time.perf_counter(),
                          speech_end=speech_end, utterance=number)
