"""Teacher-forced quality figures of a bundle's model: top-1 agreement and perplexity.

Device-side (numpy, onnxruntime, tokenizers: no torch). A text is run in non-overlapping
windows of ``window`` tokens, each on a fresh KV cache, so the first prediction of every
window sees a single token of context and later ones up to ``window``; that makes the
perplexity a little higher than a sliding-window figure, identically for every bundle
compared on the same ids and window. Only two numbers per position are kept (the argmax and
the log-probability of the true next token), never the [T, vocab] logits of the whole text.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from edgeroute.bundle import Bundle
from edgeroute.runtime.backends.onnxruntime import OrtModel

DEFAULT_WINDOW = 512


@dataclass(frozen=True)
class TeacherForced:
    """Per position i in 0..n-2 of the ids: what the model predicts for token i+1."""

    top1: np.ndarray  # [n-1] int64: argmax of the logits at position i
    logprob_next: np.ndarray  # [n-1] float64: log p(ids[i+1] | the window's tokens up to i)
    targets: np.ndarray  # [n-1] int64: ids[1:]

    def __len__(self) -> int:
        return len(self.top1)

    @property
    def perplexity(self) -> float:
        return float(np.exp(-self.logprob_next.mean()))

    @property
    def accuracy(self) -> float:
        """Top-1 next-token accuracy against the text itself."""
        return float((self.top1 == self.targets).mean())

    def prefix(self, n: int) -> TeacherForced:
        """The first ``n`` positions. Equal to a run over ``ids[:n + 1]`` when the window
        divides ``n`` (the windows then fall on the same tokens)."""
        if not 0 < n <= len(self):
            raise ValueError(f"a prefix of {n} positions out of {len(self)}")
        return TeacherForced(self.top1[:n], self.logprob_next[:n], self.targets[:n])

    def agreement(self, other: TeacherForced) -> float:
        """Fraction of positions where both models predict the same next token."""
        if not np.array_equal(self.targets, other.targets):
            raise ValueError("agreement compares two runs over the same ids")
        return float((self.top1 == other.top1).mean())


def _log_softmax_at(logits: np.ndarray, index: np.ndarray) -> np.ndarray:
    """log_softmax(logits)[row, index[row]] for each row, in float64 where it matters."""
    peak = logits.max(-1, keepdims=True)
    log_norm = np.log(np.exp(logits - peak).sum(-1, dtype=np.float64)) + peak[:, 0]
    return logits[np.arange(len(index)), index].astype(np.float64) - log_norm


def teacher_forced(model: OrtModel, ids: np.ndarray, window: int = DEFAULT_WINDOW) -> TeacherForced:
    """Run ``ids`` through the model in non-overlapping windows (fresh cache for each) and keep,
    for every position but the last, the top-1 prediction and the log-probability of the
    true next token. The last position of a window predicts the next window's first token."""
    ids = np.asarray(ids, np.int64).reshape(-1)
    if len(ids) < 2:
        raise ValueError(f"teacher forcing needs at least 2 tokens (got {len(ids)})")
    window = min(window, model.capacity)
    top1 = np.empty(len(ids) - 1, np.int64)
    logprob = np.empty(len(ids) - 1, np.float64)
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start:min(start + window, len(ids) - 1)]  # positions whose next token exists
        logits = model.forward(model.new_cache(len(chunk)), chunk, all_logits=True)
        if model.head_vocab is not None:
            logits = model.head_vocab.expand(logits)
        positions = slice(start, start + len(chunk))
        top1[positions] = logits.argmax(-1)
        logprob[positions] = _log_softmax_at(logits, ids[start + 1:start + 1 + len(chunk)])
    return TeacherForced(top1, logprob, ids[1:].copy())


def tokenize_text(tokenizer: Tokenizer | Bundle | str | Path, text: str, limit: int | None = None) -> np.ndarray:
    """Token ids of plain text (no special tokens, no BOS: as export's parity check does),
    cut to ``limit``. ``tokenizer`` is a tokenizers.Tokenizer, a bundle (or its directory), or
    a tokenizer.json path."""
    if not isinstance(tokenizer, Tokenizer):
        if isinstance(tokenizer, (str, Path)) and Path(tokenizer).is_dir():
            tokenizer = Bundle.open(tokenizer, verify=False)
        if isinstance(tokenizer, Bundle):
            tokenizer = tokenizer.file(tokenizer.tokenizer["file"])
        tokenizer = Tokenizer.from_file(str(tokenizer))
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    if limit is not None and len(ids) < limit:
        raise ValueError(f"the text has only {len(ids)} tokens, {limit} were asked for")
    return np.asarray(ids[:limit], np.int64)


def evaluate_bundle(bundle: Bundle | str | Path, ids: np.ndarray, role: str = "llm", window: int = DEFAULT_WINDOW,
                    activations: str = "int8") -> TeacherForced:
    """Load one model of a bundle and run it teacher-forced over ``ids``. ``activations``
    is the precision of the int4 kernels' activations (see OrtModel): the runtime's
    default int8, or fp32."""
    bundle = bundle if isinstance(bundle, Bundle) else Bundle.open(bundle)
    return teacher_forced(OrtModel(bundle, role, activations=activations), ids, window)
