"""Trained routers: a small ONNX graph per light path, written by ``edgeroute calibrate`` into
the bundle, that maps per-token features to the probability that the light token is not the
LLM's. Torch-free: the calibration trains with torch, the device runs the graph here.

The feature functions below are the contract between the two sides: calibration computes its
training inputs with the same functions the runtime calls on every routed token.
"""

from __future__ import annotations

import math

import numpy as np
import onnxruntime as ort

from edgeroute.runtime.drafters import Proposal
from edgeroute.runtime.model import session_options

TOP_K = 8
SLM_FEATURES = "slm-v1"  # SLM last hidden state, top-k log-probabilities, entropy, 1-top1, 1-margin
NGRAM_FEATURES = "ngram-v1"  # match length and count, index in the continuation, position in the answer


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

    def __call__(self, proposal: Proposal, i: int) -> float:
        if i >= len(proposal.tokens) or (self.features == SLM_FEATURES and proposal.hidden[i] is None):
            return 1.0
        return float(self.scores(proposal_features(self.features, proposal, i)[None])[0])
