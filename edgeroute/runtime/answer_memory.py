"""Answers the engine wrote before, as more text for prompt lookup to draft from.

An in-car assistant answers the same kinds of requests over and over: "Navigating to ...",
```json {"intent": ...```, "Calling ... now." Prompt lookup drafts only what the prompt and the
conversation hold; an :class:`AnswerMemory` also lets it continue the sequence's suffix where an
earlier answer of the same task continued it (the idea of REST, He et al. 2023, and
SuffixDecoding, Oliaro et al. 2024, over the engine's own answers). Drafts are verified, so
``speculate`` stays exact: memory only changes how many tokens a pass accepts. Routing modes,
which accept lookup drafts without the LLM's check, never draft from it.

Each task (``DecodeOptions.task``) keeps its latest answers up to ``max_tokens`` tokens; the
oldest go first. A session without a task adds its answers under ``"default"`` and drafts from
every task's. ``save`` / ``load`` keep a memory across restarts (one ``.npz``, written
atomically); ``edgeroute calibrate`` ships one in the bundle with the LLM's answers to its
labelled prompts, which the engine loads (not learning: see ``Engine.answer_memory``).
"""

from __future__ import annotations

import io
import threading
import zipfile
from collections import deque
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from edgeroute.errors import InputError
from edgeroute.files import atomic_write

DEFAULT_TASK = "default"
SEPARATOR = -1  # between answers in a task's haystack: no token id equals it, so no match spans two answers


class AnswerMemory:
    """The latest answers per task. ``learning``: whether finished generations are added (a
    benchmark that must not draft a prompt's own earlier answer adds what it chooses instead)."""

    def __init__(self, max_tokens: int = 32768, learning: bool = True) -> None:
        if max_tokens < 1:
            raise InputError(f"an answer memory holds at least 1 token per task (got max_tokens={max_tokens})")
        self.max_tokens, self.learning = max_tokens, learning
        self._answers: dict[str, deque[np.ndarray]] = {}
        self._sizes: dict[str, int] = {}
        self._haystacks: dict[str | None, np.ndarray] = {}
        self._lock = threading.Lock()  # sessions on several threads share the engine's memory

    def remember(self, task: str | None, tokens: Sequence[int]) -> None:
        """Adds one answer (its tokens, the end-of-turn marker left out by the caller)."""
        answer = np.asarray(tokens, np.int64)[-self.max_tokens:]
        if answer.size < 2:  # nothing to continue from a single token
            return
        key = _key(task)
        with self._lock:
            answers = self._answers.setdefault(key, deque())
            answers.append(answer)
            self._sizes[key] = self._sizes.get(key, 0) + answer.size
            while self._sizes[key] > self.max_tokens:
                self._sizes[key] -= answers.popleft().size
            self._haystacks.pop(key, None)
            self._haystacks.pop(None, None)

    def haystack(self, task: str | None) -> np.ndarray:
        """The task's answers (``None``: every task's), oldest first, each followed by
        :data:`SEPARATOR`; empty without any."""
        key = None if task is None else _key(task)  # None: the cache entry of every task's answers
        with self._lock:
            if key not in self._haystacks:
                tasks = list(self._answers) if key is None else [key]
                parts = [np.append(answer, SEPARATOR) for name in tasks for answer in self._answers.get(name, ())]
                self._haystacks[key] = np.concatenate(parts) if parts else np.empty(0, np.int64)
            return self._haystacks[key]

    def answers(self, task: str | None = None) -> int:
        """How many answers the task holds (``None``: every task)."""
        with self._lock:
            if task is None:
                return sum(len(answers) for answers in self._answers.values())
            return len(self._answers.get(_key(task), ()))

    def largest_id(self) -> int:
        """The largest token id of any answer (-1 without any)."""
        with self._lock:
            return max((int(answer.max()) for answers in self._answers.values() for answer in answers), default=-1)

    def tasks(self) -> dict[str, int]:
        """Each task's number of answers."""
        with self._lock:
            return {task: len(answers) for task, answers in self._answers.items()}

    def clear(self) -> None:
        with self._lock:
            self._answers.clear()
            self._sizes.clear()
            self._haystacks.clear()

    def to_bytes(self) -> bytes:
        """Every task's answers as one ``.npz``."""
        with self._lock:
            arrays = {f"{task}/{i}": answer for task, answers in self._answers.items()
                      for i, answer in enumerate(answers)}
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        return buffer.getvalue()

    def save(self, path: str | Path) -> None:
        """Writes every task's answers to ``path`` (.npz), replacing it only once complete."""
        atomic_write(path, self.to_bytes())

    @classmethod
    def kept_in(cls, path: str | Path, seed: AnswerMemory | None = None) -> AnswerMemory:
        """A learning memory for an app to keep in ``path``: the answers there where the file
        exists, else ``seed``'s (a calibrated bundle's, say), else none."""
        path = Path(path)
        if path.exists():
            return cls.load(path)
        return cls.from_bytes(seed.to_bytes()) if seed is not None else cls()

    @classmethod
    def load(cls, path: str | Path, max_tokens: int = 32768, learning: bool = True) -> AnswerMemory:
        """A memory with the answers ``save`` wrote to ``path``; a damaged file is a clear error."""
        try:
            data = Path(path).read_bytes()
        except OSError as error:
            raise InputError(f"{path}: cannot read the answer memory ({error.strerror or error})") from error
        return cls.from_bytes(data, max_tokens, learning, str(path))

    @classmethod
    def from_bytes(cls, data: bytes, max_tokens: int = 32768, learning: bool = True,
                   name: str = "answer memory") -> AnswerMemory:
        """A memory with the answers ``to_bytes`` gave."""
        memory = cls(max_tokens, learning)
        try:
            with np.load(io.BytesIO(data), allow_pickle=False) as arrays:
                entries = sorted(((key.rpartition("/")[0], int(key.rpartition("/")[2]), arrays[key])
                                  for key in arrays.files), key=lambda entry: entry[:2])
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as error:
            # numpy's own words for a file of pickled objects suggest loading it unsafely: not said here
            raise InputError(f"{name}: not an answer memory that AnswerMemory.save wrote (not an .npz of token "
                             "id arrays)") from error
        for task, _, answer in entries:
            if answer.ndim != 1 or answer.dtype.kind not in "iu" or (answer.size and answer.min() < 0):
                raise InputError(f"{name}: task {task!r} holds an answer that is not a list of token ids")
            memory.remember(task, answer)
        return memory


def _key(task: str | None) -> str:
    """Where a task's answers are kept: a session without a task (or an empty name) adds under
    :data:`DEFAULT_TASK`."""
    return task or DEFAULT_TASK
