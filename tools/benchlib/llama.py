"""llama.cpp (llama-cpp-python) as a benchmark peer: greedy tokens with per-token timing."""

from __future__ import annotations

import time


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
