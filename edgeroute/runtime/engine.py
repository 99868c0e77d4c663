"""The embeddable API: load a bundle once, then generate, stream or chat.

>>> engine = Engine("bundles/smollm2-demo")
>>> engine.generate([{"role": "user", "content": "Hi!"}], max_new_tokens=32).text
>>> chat = engine.chat(mode="speculate")          # keeps its KV caches across turns
>>> for piece in chat.stream("Navigate to 12 Baker Street"): print(piece, end="")
>>> chat.generate("And then home?")                # a follow-up user turn: prefills only its own tokens
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from edgeroute.bundle import Bundle, RouterCalibration
from edgeroute.chat_format import format_messages
from edgeroute.errors import InputError
from edgeroute.runtime.calibrated import calibrated_options, format_token_ids
from edgeroute.runtime.constraints import Constraint, GrammarCompiler
from edgeroute.runtime.decoding import DecodeOptions, Decoder, GenerationStats, SequenceState, TokenTrace
from edgeroute.runtime.model import OrtModel
from edgeroute.runtime.routers import TrainedRouter

Messages = Sequence[dict[str, str]]


@dataclass
class Generation:
    text: str
    tokens: list[int]
    stats: GenerationStats = field(default_factory=GenerationStats)
    trace: list[TokenTrace] = field(default_factory=list)
    # length | eos | stop | cancelled | incomplete (a response_format's structure is unfinished:
    # the text is not valid output)
    finish_reason: str = "length"


class Engine:
    """A loaded bundle: tokenizer and ONNX Runtime sessions, shared by every session."""

    def __init__(self, bundle: str | Path | Bundle, providers: Sequence[str] | None = None, verify: bool = True,
                 options: DecodeOptions | None = None, activations: str = "int8", attention: str = "auto") -> None:
        """``activations``: "int8" (fast int4 kernels that quantize activations, like
        llama.cpp) or "fp32" (slower, but a multi-token verification pass then rounds like a
        one-token step, so speculation reproduces full decoding except at near-ties).
        ``attention``: the attention graphs' flavour, "portable", "ort" or "auto" (ort on
        the CPU provider when the bundle has it, see ``OrtModel``)."""
        self.bundle = bundle if isinstance(bundle, Bundle) else Bundle.open(bundle, verify=verify)
        self.tokenizer = Tokenizer.from_file(str(self.bundle.file(self.bundle.tokenizer["file"])))
        self.providers, self.activations, self.attention = providers, activations, attention
        self.llm = OrtModel(self.bundle, "llm", providers, activations, attention)
        self._slm: OrtModel | None = None
        self._slm_lock = threading.Lock()
        self.eos_ids = set(self.bundle.tokenizer.get("eos_token_ids") or [])
        self.options = options or DecodeOptions()
        self._routers: dict[str, TrainedRouter] = {}
        self._format_tokens: frozenset[int] | None = None
        self.grammars = GrammarCompiler(self.bundle.file(self.bundle.tokenizer["file"]), self.llm.arch.vocab_size,
                                        self.bundle.tokenizer.get("eos_token_ids") or [])

    # -- calibrated defaults --------------------------------------------------------------------

    def _trained_router(self, entry: RouterCalibration) -> TrainedRouter:
        if entry.file not in self._routers:
            self._routers[entry.file] = TrainedRouter(str(self.bundle.file(entry.file)), entry.features)
        return self._routers[entry.file]

    def resolve(self, options: DecodeOptions) -> DecodeOptions:
        """The options a generation runs with: mode auto and unset router choices taken from
        the bundle's calibration, format-critical tokens listed when the profile protects them."""
        options = calibrated_options(options, self.bundle.calibration, self._trained_router)
        if options.protect_format and not options.protected_tokens:
            if self._format_tokens is None:
                self._format_tokens = format_token_ids(self.tokenizer.get_vocab())
            options = dataclasses.replace(options, protected_tokens=self._format_tokens)
        return options

    @property
    def slm(self) -> OrtModel | None:
        """The SLM's sessions, loaded on first use (a bundle without one returns None)."""
        if self.bundle.slm is None:
            return None
        with self._slm_lock:
            if self._slm is None:
                self._slm = OrtModel(self.bundle, "slm", self.providers, self.activations, self.attention)
        return self._slm

    # -- text <-> tokens ------------------------------------------------------------------------

    @property
    def chat_format(self) -> dict[str, str]:
        chat_format = self.bundle.tokenizer.get("chat_format")
        if not chat_format:
            raise InputError("this bundle's model has no usable chat template: pass a plain prompt string")
        return chat_format

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, prompt: str | Messages) -> list[int]:
        text = prompt if isinstance(prompt, str) else format_messages(self.chat_format, list(prompt))
        if isinstance(prompt, str) and not prompt.strip():
            raise InputError("the prompt is empty")
        if not isinstance(prompt, str) and not any(m.get("content", "").strip() for m in prompt):
            raise InputError("the messages are empty")
        ids = self.encode(text)
        bos = self.bundle.tokenizer.get("bos_token_id")
        if self.bundle.tokenizer.get("add_bos_token") and bos is not None and ids[:1] != [bos]:
            ids = [bos, *ids]
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    # -- sessions -------------------------------------------------------------------------------

    def session(self, **options: Any) -> Session:
        """An independent sequence (its own KV caches) on this engine's shared sessions; a
        string prompt is plain text (a continuation)."""
        return Session(self, self.resolve(self.options.updated(**options)))

    def chat(self, **options: Any) -> Session:
        """Like ``session``, but a string prompt is a user turn in the chat template."""
        return Session(self, self.resolve(self.options.updated(**options)), chat=True)

    def generate(self, prompt: str | Messages, **options: Any) -> Generation:
        """One-shot generation in a fresh session; options override the engine's defaults."""
        return self.session(**options).generate(prompt)

    def stream(self, prompt: str | Messages, **options: Any) -> Iterator[str]:
        return self.session(**options).stream(prompt)


def _stop_prefix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of ``text`` that begins one of the stop strings."""
    return max((k for s in stops for k in range(len(s) - 1, 0, -1) if text.endswith(s[:k])), default=0)


class Session:
    """One conversation. Chat turns append to the cached sequence, so each new user turn
    prefills only its own tokens; ``reset()`` starts over. Thread-safe to cancel."""

    def __init__(self, engine: Engine, options: DecodeOptions, chat: bool = False) -> None:
        self.engine, self.options, self.chat = engine, options, chat
        options.validate(engine.llm.num_layers, engine.bundle.slm is not None)
        self.state = SequenceState(engine.llm)  # the SLM joins on the first call that needs it
        self.messages: list[dict[str, str]] = []
        self._cancel = threading.Event()
        self.last: Generation | None = None
        self._constraint: Constraint | None = None  # the running generation's response_format

    def reset(self) -> None:
        self.state.reset()
        self.messages = []

    def cancel(self) -> None:
        """Stop the running generation within one token (callable from any thread)."""
        self._cancel.set()

    def _turn_tokens(self, prompt: str | Messages) -> tuple[list[int], bool, list[dict[str, str]]]:
        """The tokens a turn appends, whether it first drops the previous answer's end-of-turn
        marker, and the messages it adds. Changes nothing: a rejected turn leaves no trace."""
        engine = self.engine
        if isinstance(prompt, str) and self.chat:
            prompt = [{"role": "user", "content": prompt}]
        if isinstance(prompt, str) and not self.messages and not self.state.tokens:
            return engine.encode_prompt(prompt), False, []
        if isinstance(prompt, str) and self.state.tokens and not self.messages:
            if not prompt.strip():
                raise InputError("the prompt is empty")
            return engine.encode(prompt), False, []  # plain-text continuation
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if not self.state.tokens:
            return engine.encode_prompt(messages), False, messages
        # a later chat turn: close the assistant's answer and append only the new messages
        if any(m["role"] != "user" for m in messages) or not all(m["content"].strip() for m in messages):
            raise InputError("a follow-up chat turn takes one non-empty user message")
        drop_eos = self.state.tokens[-1] in engine.eos_ids  # the template's text below closes the turn
        fmt = engine.chat_format
        return engine.encode(fmt["assistant_to_user"] + messages[0]["content"] + fmt["user_suffix"]), drop_eos, messages

    def generate_tokens(self, prompt: str | Messages, **overrides: Any) -> Iterator[TokenTrace]:
        options = self.engine.resolve(self.options.updated(**overrides)) if overrides else self.options
        options.validate(self.engine.llm.num_layers, self.engine.bundle.slm is not None)
        constraint = self.engine.grammars.compile(options.response_format)  # once per request
        new, drop_eos, messages = self._turn_tokens(prompt)
        room = self.state.capacity - len(self.state.tokens) + drop_eos - options.max_draft_tokens - 1
        if len(new) > room:
            raise InputError(f"the prompt needs {len(new)} tokens but only {max(room, 0)} fit in the bundle's "
                             f"context of {self.state.capacity}: shorten it, reset() the session, "
                             "or export with a larger --context-length")
        budget = min(options.max_new_tokens or int(self.engine.bundle.generation["max_new_tokens"]), room - len(new))
        if budget < 1:
            raise InputError("no room left in the context for new tokens: reset() the session")
        if drop_eos:
            self.state.tokens.pop()
            # an accepted draft may have put the marker's K/V in the cache: forget it with the token
            self.state.llm_cache.truncate(min(self.state.llm_cache.length, len(self.state.tokens)))
        self.messages.extend(messages)
        if (options.mode == "slm" or options.light == "slm") and self.state.slm_drafter is None:
            self.state.attach_slm(self.engine.slm)
        self._cancel.clear()
        decoder = Decoder(self.state, options, self._cancel, constraint)
        self._constraint = constraint
        self.last = Generation("", [], decoder.stats)
        yield from decoder.run(new, budget, self.engine.eos_ids)

    def stream(self, prompt: str | Messages, on_token: Callable[[TokenTrace], None] | None = None,
               **overrides: Any) -> Iterator[str]:
        """Text pieces as they are decoded (a voice app speaks while the model writes)."""
        options = self.options.updated(**overrides) if overrides else self.options
        engine, emitted, decoded, finish = self.engine, "", "", "length"
        generation = None
        for trace in self.generate_tokens(prompt, **overrides):
            generation = self.last
            generation.trace.append(trace)
            if trace.token in engine.eos_ids:
                generation.tokens.append(trace.token)
                if on_token is not None:  # the trace covers every generated token, the end marker too
                    on_token(trace)
                finish = "eos"
                break
            generation.tokens.append(trace.token)
            text = engine.decode(generation.tokens)
            trace.text, decoded = text[len(decoded):], text
            if on_token is not None:
                on_token(trace)
            stop_at = min((i for s in options.stop if (i := text.find(s)) >= 0), default=-1)
            if stop_at >= 0:
                text, finish = text[:stop_at], "stop"
            else:
                # hold back a tail that may be the start of a stop string, or a multi-byte
                # character that is still incomplete
                text = text[:len(text) - _stop_prefix(text, options.stop)]
                if text.endswith("\ufffd"):
                    continue
            if len(text) > len(emitted):
                yield text[len(emitted):]
                emitted = text
            if finish == "stop":
                break
        if generation is not None:
            if finish != "stop":  # the end: what was held back is final now
                text = engine.decode(generation.tokens)
                if len(text) > len(emitted):
                    yield text[len(emitted):]
                    emitted = text
            if self._cancel.is_set():
                finish = "cancelled"
            elif self._constraint is not None and not self._constraint.complete:
                finish = "incomplete"
            generation.text, generation.finish_reason = emitted, finish
            if self.messages:
                self.messages.append({"role": "assistant", "content": emitted})

    def generate(self, prompt: str | Messages, **overrides: Any) -> Generation:
        for _ in self.stream(prompt, **overrides):
            pass
        return self.last
