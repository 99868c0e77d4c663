"""A reduced-vocabulary LM head for the SLM: the N most useful token ids plus one "rest" row.

The 0.5B SLM's head is 136M of its 494M parameters, read on every drafted token. A draft
only pays when the LLM accepts it, and the LLM mostly writes common tokens, so the SLM's head
keeps the ids that the calibration text uses most, every special token and every token of the
chat template. One extra last row stands for all the other tokens: its logit is
``log(n_rest) + h . mean(rest rows)``, Jensen's lower bound of their log-sum-exp, so when it
wins the SLM expects a token it cannot name and the drafter stops (see
``edgeroute.runtime.vocab``).
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter

import numpy as np

from edgeroute.errors import EdgerouteError
from edgeroute.export.quantize import rtn_quantize
from edgeroute.export.tensors import BlockQuantWeight, FloatWeight, Linear

CHUNK_ROWS = 16384  # rows dequantized at once while averaging the rest rows (bounded memory)


def required_ids(tokenizer_json: str, template_text: str, eos_ids: list[int], bos_id: int | None) -> set[int]:
    """Ids the head must always cover: special (added) tokens, eos / bos, the chat template's."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(tokenizer_json)
    ids = {int(t["id"]) for t in json.loads(tokenizer_json).get("added_tokens", [])}
    ids.update(eos_ids)
    if bos_id is not None:
        ids.add(bos_id)
    ids.update(tokenizer.encode(template_text, add_special_tokens=False).ids)
    return ids


def select_vocabulary(tokenizer_json: str, size: int, calibration_text: str, required: set[int],
                      vocab_size: int) -> np.ndarray:
    """The sorted ids of the head: ``required`` plus the most frequent ids of the calibration
    text (ties broken by the lower id, so the choice is deterministic) up to ``size``."""
    from tokenizers import Tokenizer

    if not len(required) <= size < vocab_size:
        raise EdgerouteError(f"--slm-vocab {size} must be at least {len(required)} (the special and chat-template "
                             f"tokens) and below the vocabulary of {vocab_size}: choose a size in between")
    counts = Counter(Tokenizer.from_str(tokenizer_json).encode(calibration_text, add_special_tokens=False).ids)
    chosen = set(required)
    for token, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(chosen) >= size:
            break
        if token < vocab_size:
            chosen.add(token)
    for token in range(vocab_size):  # a short calibration text: fill up with the lowest other ids
        if len(chosen) >= size:
            break
        chosen.add(token)
    return np.array(sorted(chosen), np.int64)


def _rest_mean(weight: BlockQuantWeight | FloatWeight, rest: np.ndarray) -> np.ndarray:
    total = np.zeros(weight.shape[1], np.float64)
    for begin in range(0, len(rest), CHUNK_ROWS):
        total += weight.take_rows(rest[begin:begin + CHUNK_ROWS]).dequantize().sum(0, dtype=np.float64)
    return (total / len(rest)).astype(np.float32)


def reduced_head(lm_head: Linear, ids: np.ndarray) -> Linear:
    """The head's rows ``ids`` (exactly as stored) followed by the rest row (the mean of the
    other rows, quantized like the head, with ``log(n_rest)`` in its bias)."""
    weight = lm_head.weight
    rest = np.setdiff1d(np.arange(weight.shape[0]), ids)
    mean = _rest_mean(weight, rest)[None, :]  # in the stored input order, like the rows themselves
    kept = weight.take_rows(ids)
    if isinstance(kept, FloatWeight):
        reduced: BlockQuantWeight | FloatWeight = FloatWeight(np.concatenate([kept.w, mean]), kept.storage)
    else:
        row = rtn_quantize(mean, kept.bits, kept.block)
        offset = None if kept.offset is None else np.concatenate([kept.offset, np.zeros_like(row.scale)])
        reduced = BlockQuantWeight(np.concatenate([kept.q, row.q]), np.concatenate([kept.scale, row.scale]),
                                   kept.bits, kept.block, offset, kept.origin)
    bias = np.zeros(len(ids) + 1, np.float32)
    if lm_head.bias is not None:
        bias[:-1] = lm_head.bias[ids]
        bias[-1] = lm_head.bias[rest].mean()
    bias[-1] += np.log(len(rest))
    return dataclasses.replace(lm_head, weight=reduced, bias=bias)
