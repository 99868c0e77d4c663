"""The embeddable API: load a bundle once, generate or stream text.

>>> engine = Engine("bundles/smollm2-demo")
>>> engine.generate("What is the capital of France?").text
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from edgeroute.bundle import Bundle
from edgeroute.chat_format import format_messages
from edgeroute.errors import InputError
from edgeroute.runtime.model import KVCache, OrtModel

Messages = Sequence[dict[str, str]]


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    time_to_first_token: float = 0.0
    decode_seconds: float = 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        steps = self.new_tokens - 1  # the first token comes from the prefill
        return steps / self.decode_seconds if steps > 0 and self.decode_seconds > 0 else 0.0


@dataclass
class Generation:
    text: str
    tokens: list[int]
    stats: GenerationStats = field(default_factory=GenerationStats)
    finish_reason: str = "length"  # length | eos


class Engine:
    def __init__(self, bundle: str | Path | Bundle, providers: Sequence[str] | None = None, verify: bool = True) -> None:
        self.bundle = bundle if isinstance(bundle, Bundle) else Bundle.open(bundle, verify=verify)
        self.tokenizer = Tokenizer.from_file(str(self.bundle.file(self.bundle.tokenizer["file"])))
        self.llm = OrtModel(self.bundle, "llm", providers)
        self.eos_ids = set(self.bundle.tokenizer.get("eos_token_ids") or [])

    # -- text <-> tokens ------------------------------------------------------------------------

    def encode_prompt(self, prompt: str | Messages) -> list[int]:
        if isinstance(prompt, str):
            text = prompt
        else:
            chat_format = self.bundle.tokenizer.get("chat_format")
            if not chat_format:
                raise InputError("this bundle's model has no usable chat template: pass a plain prompt string")
            text = format_messages(chat_format, list(prompt))
        if not text.strip():
            raise InputError("the prompt is empty")
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        bos = self.bundle.tokenizer.get("bos_token_id")
        if self.bundle.tokenizer.get("add_bos_token") and bos is not None and ids[:1] != [bos]:
            ids = [bos, *ids]
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    # -- generation -----------------------------------------------------------------------------

    def _check_length(self, prompt_ids: list[int], max_new_tokens: int, cache: KVCache) -> None:
        if max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be >= 1 (got {max_new_tokens})")
        if len(prompt_ids) >= cache.capacity:
            raise InputError(f"the prompt has {len(prompt_ids)} tokens; the bundle's context is {cache.capacity}: "
                             "shorten it or export with a larger --context-length")

    def stream_tokens(self, prompt: str | Messages, max_new_tokens: int | None = None,
                      stats: GenerationStats | None = None) -> Iterator[int]:
        """Greedy tokens of the LLM, one at a time (the `full` mode)."""
        stats = stats if stats is not None else GenerationStats()
        max_new_tokens = max_new_tokens or int(self.bundle.generation["max_new_tokens"])
        ids = self.encode_prompt(prompt)
        cache = self.llm.new_cache()
        self._check_length(ids, max_new_tokens, cache)
        budget = min(max_new_tokens, cache.capacity - len(ids))
        stats.prompt_tokens = len(ids)
        start = time.perf_counter()
        logits = self.llm.forward(cache, ids)
        for step in range(budget):
            token = int(np.argmax(logits))
            now = time.perf_counter()
            if step == 0:
                stats.time_to_first_token = now - start
                decode_start = now
            stats.new_tokens += 1
            stats.decode_seconds = now - decode_start
            yield token
            if token in self.eos_ids or step == budget - 1:
                return
            logits = self.llm.forward(cache, [token])

    def stream(self, prompt: str | Messages, max_new_tokens: int | None = None,
               stats: GenerationStats | None = None) -> Iterator[str]:
        """Text pieces as they are decoded (a voice app speaks while the model writes)."""
        tokens: list[int] = []
        emitted = ""
        for token in self.stream_tokens(prompt, max_new_tokens, stats):
            if token in self.eos_ids:
                break
            tokens.append(token)
            text = self.decode(tokens)
            if text.endswith("\ufffd"):
                continue  # a multi-byte character is still incomplete
            yield text[len(emitted):]
            emitted = text

    def generate(self, prompt: str | Messages, max_new_tokens: int | None = None) -> Generation:
        stats = GenerationStats()
        tokens = list(self.stream_tokens(prompt, max_new_tokens, stats))
        finish = "eos" if tokens and tokens[-1] in self.eos_ids else "length"
        text_tokens = tokens[:-1] if finish == "eos" else tokens
        return Generation(self.decode(text_tokens), tokens, stats, finish)
