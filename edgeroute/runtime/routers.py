"""Trained routers: a small ONNX graph per light path, written by ``edgeroute calibrate`` into
the bundle, that maps per-token features to the probability that keeping the light token
changes the answer. Torch-free: the calibration trains with torch, the device runs the graph here.

Two kinds of decision read them:
- routing ahead (R2R): before the LLM runs, from the light path's own state (``slm-v1``,
  ``ngram-v1``); above the threshold the LLM writes the token;
- verified routing: after an LLM pass over the SLM's draft, at a draft token that differs from
  the LLM's choice, from both models' distributions there (``verify-v1``); at or below the
  threshold the SLM's token stays (a neutral difference), above it the LLM's replaces it.

The feature functions below are the contract between the two sides: calibration computes its
training inputs with the same functions the runtime calls on every routed token.
"""

from __future__ import annotations

import math

import numpy as np
import onnxruntime as ort

from edgeroute.runtime.backends.onnxruntime import session_options
from edgeroute.runtime.drafters import Proposal

TOP_K = 8
SLM_FEATURES = "slm-v1"  # SLM last hidden state, top-k log-probabilities, entropy, 1-top1, 1-margin
NGRAM_FEATURES = "ngram-v1"  # match length and count, index in the continuation, position in the answer
# both models' log-probabilities of the draft token and of the LLM's choice, the LLM's margin,
# entropy and the draft's rank under it, the SLM's entropy, the position in the answer
VERIFY_FEATURES = "verify-v1"
VERIFY_WIDTH = 9


def slm_features(hidden: np.ndarray, probabilities: np.ndarray) -> np.ndarray:
    """[hidden..., top-k log p (descending), normalised entropy, 1 - top1, 1 - margin]."""
    top = np.sort(np.partition(probabilities, -TOP_K)[-TOP_K:])[::-1]
    nz = probabilities[probabilities > 0]
    entropy = -(nz * np.log(nz)).sum() / math.log(probabilities.shape[0])
    stats = [*np.log(top + 1e-12), entropy, 1.0 - top[0], 1.0 - (top[0] - top[1])]
    return np.concatenate([np.asarray(hidden, np.float32).reshape(-1), np.asarray(stats, np.float32)])


def ngram_features(match_length: int, match_count: int, index: int, position: int) -> np.ndarray:
    return np.asarray([min(match_length, 16) / 8.0, math.log1p(match_count), float(index),
                       math.log1p(position), float(position < 2)], np.float32)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = np.asarray(logits, np.float64).reshape(-1)
    top = logits.max()
    return logits - top - math.log(np.exp(logits - top).sum())


def _normalised_entropy(log_p: np.ndarray) -> float:
    finite = np.isfinite(log_p)
    p = np.exp(log_p[finite])
    return float(-(p * log_p[finite]).sum() / math.log(max(int(finite.sum()), 2)))


def verify_features(llm_logits: np.ndarray, slm_probabilities: np.ndarray, token: int, position: int) -> np.ndarray:
    """At a draft ``token`` the LLM's (masked) ``llm_logits`` do not pick: [LLM log p(token),
    LLM log p(its choice), their gap, LLM normalised entropy, log(1 + the token's rank under the
    LLM), SLM log p(token), SLM log p(the LLM's choice), SLM normalised entropy, log(1 + position)]."""
    llm = _log_softmax(llm_logits)
    choice = int(np.argmax(llm))
    slm = np.log(np.asarray(slm_probabilities, np.float64).reshape(-1) + 1e-12)
    rank = int((llm > llm[token]).sum())
    floor = -30.0  # a token the grammar forbids has log p -inf: a finite stand-in keeps the graph's input finite
    return np.asarray([max(llm[token], floor), llm[choice], max(llm[token] - llm[choice], floor),
                       _normalised_entropy(llm), math.log1p(rank), slm[token], slm[choice],
                       _normalised_entropy(slm), math.log1p(position)], np.float32)


def llm_ratio_score(llm_logits: np.ndarray, token: int) -> float:
    """The uncalibrated verified router: 1 - p_LLM(token) / p_LLM(its choice). 0 when the LLM
    rates the draft token as highly as its own choice, 1 when it rules it out."""
    llm = _log_softmax(llm_logits)
    return float(1.0 - math.exp(min(llm[token] - llm.max(), 0.0)))


def proposal_features(features: str, proposal: Proposal, i: int) -> np.ndarray:
    if features == SLM_FEATURES:
        return slm_features(proposal.hidden[i], proposal.probabilities[i])
    if features == NGRAM_FEATURES:
        return ngram_features(proposal.match_length, proposal.match_count, i, proposal.answer_position + i)
    raise ValueError(f"feature set {features!r} is not one of {SLM_FEATURES}, {NGRAM_FEATURES}")


class TrainedRouter:
    """``router(proposal, i)`` -> P(light token differs from the LLM's), from a bundle's graph
    (input ``features`` [N, F] float32, output ``probability`` [N, 1])."""

    def __init__(self, path: str | bytes, features: str, providers: list | None = None) -> None:
        self.session = ort.InferenceSession(path, session_options(), providers=providers or ["CPUExecutionProvider"])
        self.features = features
        self.name = "trained"

    def scores(self, rows: np.ndarray) -> np.ndarray:
        return self.session.run(None, {"features": np.asarray(rows, np.float32)})[0][:, 0]

    def difference(self, llm_logits: np.ndarray, slm_probabilities: np.ndarray, token: int, position: int) -> float:
        """A verified router's score of a draft token the LLM does not pick."""
        return float(self.scores(verify_features(llm_logits, slm_probabilities, token, position)[None])[0])

    def __call__(self, proposal: Proposal, i: int) -> float:
        if i >= len(proposal.tokens) or (self.features == SLM_FEATURES and proposal.hidden[i] is None):
            return 1.0
        return float(self.scores(proposal_features(self.features, proposal, i)[None])[0])
