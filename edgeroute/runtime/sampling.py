"""Token choice: greedy, or seeded temperature / top-p sampling (numpy only)."""

from __future__ import annotations

import numpy as np


def softmax(logits: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """float32 is plenty for routing signals and sampling, and half the cost per vocabulary."""
    z = logits.astype(np.float32) / np.float32(max(temperature, 1e-6))
    z -= z.max(axis=-1, keepdims=True)
    p = np.exp(z)
    return p / p.sum(axis=-1, keepdims=True)


def top1_probability(logits: np.ndarray) -> float:
    """max softmax(logits) without materializing the distribution: 1 / sum(exp(l - max))."""
    return float(1.0 / np.exp(logits - logits.max()).sum())


class Sampler:
    """Greedy when temperature == 0; otherwise nucleus sampling from a seeded generator, so a
    seed reproduces the same text. ``bias`` (token id -> number, OpenAI's logit_bias) is added
    to the logits of every choice and every verification, so speculation stays exactly the
    biased model's."""

    def __init__(self, temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                 bias: dict[int, float] | None = None) -> None:
        self.temperature, self.top_p = temperature, top_p
        self.rng = np.random.default_rng(seed)
        self._bias_ids = np.fromiter(bias or {}, np.int64)
        self._bias_values = np.fromiter((bias or {}).values(), np.float32)

    def biased(self, logits: np.ndarray) -> np.ndarray:
        """The logits with the bias added (themselves without one). Ids beyond ``logits`` (an SLM
        cut to a smaller vocabulary) are left out: the model cannot choose them anyway."""
        if not self._bias_ids.size:
            return logits
        inside = self._bias_ids < logits.shape[-1]
        out = logits.astype(np.float32, copy=True)
        out[self._bias_ids[inside]] += self._bias_values[inside]
        return out

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def probabilities(self, logits: np.ndarray) -> np.ndarray:
        p = softmax(logits, self.temperature)
        if self.top_p < 1.0:
            order = np.argsort(-p)
            keep = np.cumsum(p[order]) - p[order] < self.top_p
            filtered = np.zeros_like(p)
            filtered[order[keep]] = p[order[keep]]
            p = filtered / filtered.sum()
        return p

    def sample(self, logits: np.ndarray) -> int:
        logits = self.biased(logits)
        if self.greedy:
            return int(np.argmax(logits))
        return self.choose(self.probabilities(logits))

    def choose(self, p: np.ndarray) -> int:
        p = p.astype(np.float64)  # numpy checks the sum at float64 precision
        return int(self.rng.choice(p.shape[0], p=p / p.sum()))

    def verify_draft(self, logits: np.ndarray, draft: int) -> tuple[bool, int]:
        """Speculative-sampling check of one deterministic draft token against the target's
        logits: accept with probability p(draft), else sample from p with the draft removed.
        The result is distributed exactly as sampling from p (greedy: accept iff argmax)."""
        index, token = self.verify_candidates(logits, [draft])
        return index == 0, token

    def verify_candidates(self, logits: np.ndarray, candidates: list[int]) -> tuple[int | None, int]:
        """Multi-draft speculative sampling over deterministic candidates (a draft tree's
        children of one node, distinct tokens), in order: each is accepted with its probability
        under p with the candidates before it removed (renormalized); when all are rejected, the
        token is sampled from p without them. The token is distributed exactly as sampling from p
        (the recursive rejection of SpecInfer with point-mass drafts; greedy: the argmax). Returns
        the accepted candidate's index (None: none) and the token."""
        logits = self.biased(logits)
        if self.greedy:
            best = int(np.argmax(logits))
            return (candidates.index(best) if best in candidates else None), best
        p = self.probabilities(logits).astype(np.float64)
        for index, token in enumerate(candidates):
            if self.rng.random() * p.sum() < p[token]:
                return index, token
            p[token] = 0.0
        total = p.sum()
        return None, self.choose(p / total) if total > 0 else int(np.argmax(logits))
