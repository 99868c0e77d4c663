"""When the SLM should stop drafting: ``draft_confidence`` fitted on labels and measured costs.

A drafted token costs an SLM step and a row of the LLM's verification pass; it saves an LLM
step only if it and every draft token before it are accepted. Greedy speculation over the
labelled answers can be replayed exactly from the teacher-forced labels: at each point the
SLM drafts from the LLM's own prefix, and a draft is accepted up to its first token that
differs from the LLM's. (After a wrong token the SLM would draft from its own guess; those
tokens are rejected whatever they are, and their confidence is taken from the labelled
position, an approximation of what the SLM would then be sure of.)

For each candidate confidence the replay gives the decode time of every answer under the
cost model ``draft * slm_step + llm_pass(1 + draft)``, with the costs measured on this
machine and this bundle; the fit picks the confidence with the highest tokens per second
on the calibration split and reports the replayed speed-up on the validation split.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np

from edgeroute.runtime.engine import Engine

CANDIDATES = (0.0, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
MEASURED_CONTEXT = 96  # tokens before the timed steps (a short prompt and answer)


@dataclass(frozen=True)
class DraftCosts:
    """Seconds on this machine: an SLM draft step, and an LLM pass over 1 + k tokens as
    ``llm_pass + k * llm_row``."""

    slm_step: float
    llm_pass: float
    llm_row: float

    def pass_seconds(self, drafted: int) -> float:
        return self.llm_pass + drafted * self.llm_row


def _median_seconds(call, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def measure_costs(engine: Engine, repeats: int = 9, extra_rows: int = 4) -> DraftCosts:
    """Time an SLM step and LLM passes of 1 and 1 + ``extra_rows`` tokens after a prefix."""
    prefix = (engine.encode("The driver asked for the route to the station and the assistant answered ") * 8)
    prefix = prefix[:MEASURED_CONTEXT]
    llm, slm = engine.llm, engine.slm

    def timed_pass(model, tokens: int) -> float:
        cache = model.new_cache()
        model.forward(cache, prefix)

        def one() -> None:
            cache.truncate(len(prefix))
            model.forward(cache, prefix[:tokens], tail=tokens)

        one()  # warm-up (first call of this shape)
        return _median_seconds(one, repeats)

    one_row = timed_pass(llm, 1)
    rows = timed_pass(llm, 1 + extra_rows)
    return DraftCosts(slm_step=timed_pass(slm, 1), llm_pass=one_row, llm_row=max(rows - one_row, 0.0) / extra_rows)


def replay(agree: np.ndarray, confidence: np.ndarray, answers: np.ndarray, threshold: float, draft_tokens: int,
           costs: DraftCosts) -> tuple[float, int]:
    """(seconds, tokens) of greedy speculation over the labelled answers: ``agree[i]`` the SLM's
    token equals the LLM's at position i, ``confidence[i]`` the SLM's probability of its token,
    ``answers`` the index where each answer starts (in order), drafts of at most ``draft_tokens``."""
    seconds, ends = 0.0, [*answers[1:], len(agree)]
    for start, end in zip(answers, ends, strict=True):
        position = start
        while position < end:
            drafted = 0
            while drafted < draft_tokens and position + drafted < end - 1 and \
                    confidence[position + drafted] >= threshold:
                drafted += 1
            accepted = 0
            while accepted < drafted and agree[position + accepted]:
                accepted += 1
            seconds += drafted * costs.slm_step + costs.pass_seconds(drafted)
            position += accepted + 1  # the accepted drafts and the LLM's own token
    return seconds, len(agree)


@dataclass
class DraftFit:
    draft_confidence: float
    costs: DraftCosts
    curve: dict[str, dict[str, float]]  # candidate -> replayed tok/s on calibration / validation
    speedup_vs_no_stop: float  # replayed on the validation split

    def to_dict(self) -> dict:
        return {**asdict(self), "costs": asdict(self.costs)}


def fit_draft_confidence(agree: np.ndarray, confidence: np.ndarray, answer_ids: np.ndarray, splits: np.ndarray,
                         costs: DraftCosts, draft_tokens: int) -> DraftFit:
    """Pick the candidate confidence with the most replayed tokens per second on the
    calibration split; ``answer_ids`` numbers each position's answer (contiguous runs)."""
    def rate(split: str, threshold: float) -> float:
        mask = splits == split
        starts = np.flatnonzero(np.diff(answer_ids[mask], prepend=-1) != 0)
        seconds, tokens = replay(agree[mask], confidence[mask], starts, threshold, draft_tokens, costs)
        return tokens / seconds if seconds else 0.0

    curve = {f"{c:.1f}": {"calibration": rate("calibration", c), "validation": rate("validation", c)}
             for c in CANDIDATES}
    best = max(CANDIDATES, key=lambda c: curve[f"{c:.1f}"]["calibration"])
    speedup = curve[f"{best:.1f}"]["validation"] / max(curve["0.0"]["validation"], 1e-12)
    return DraftFit(best, costs, curve, speedup)
