"""llama.cpp (llama-cpp-python) as a benchmark peer: greedy tokens with per-token timing."""

from __future__ import annotations

import time
from pathlib import Path

from edgeroute.llamacpp import NotTheSource, Unavailable, open_llama, source_gguf

__all__ = ["checked_gguf", "greedy_tokens", "open_llama"]


def checked_gguf(bundle: str | Path, role: str = "llm", given: str | Path | None = None) -> Path:
    """The GGUF llama.cpp runs as the peer of ``bundle``'s ``role`` model: the source export
    recorded, or ``given`` once it is checked to be that source (sha256). Anything else stops
    the tool with the reason: it never times another model than the bundle's."""
    try:
        return source_gguf(bundle, role, given)
    except (NotTheSource, Unavailable) as err:
        raise SystemExit(f"refusing to time llama.cpp: {err}") from None


def greedy_tokens(llm, ids: list[int], eos_ids: set[int], budget: int, grammar=None) -> tuple[list[int], list[float]]:
    """llama.cpp's greedy answer to ``ids`` after a fresh prefill (no prompt-prefix reuse
    between prompts, as edgeroute does), and the wall time before each token: the first is the
    prefill's. Stops at an end-of-sequence token or after ``budget`` tokens."""
    last = time.perf_counter()
    llm.reset()
    tokens: list[int] = []
    seconds: list[float] = []
    generator = llm.generate(list(ids), temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True,
                             grammar=grammar)
    try:
        for token in generator:
            now = time.perf_counter()
            seconds.append(now - last)
            last = now
            tokens.append(int(token))
            if token in eos_ids or len(tokens) >= budget:
                break
    finally:
        generator.close()
    return tokens, seconds
