"""Router thresholds with a guarantee on held-out prompts.

The risk of a threshold t is, per prompt, the share of its answer positions where the light
token is kept (score <= t) although it differs from the LLM's: 1 - teacher-forced agreement
with ``full``; or, per answer (the SLM routers, whose labels say which differences are
divergent), 1 if any kept token changes the answer, so that the budget is a share of answers,
the unit the task checks judge. It only grows with t, and prompts (not positions, which depend
on each other within an answer) are the exchangeable units.

- Conformal risk control (Angelopoulos et al., 2022): the largest t with
  n/(n+1) * mean risk + 1/(n+1) <= alpha; then E[risk of a new prompt] <= alpha.
- Learn then Test (Angelopoulos et al., 2021): thresholds tested from the safest up (fixed
  sequence), each accepted while the empirical-Bernstein upper confidence bound of its risk
  at level delta (Maurer & Pontil, 2009) stays <= alpha; then P(risk > alpha) <= delta.
  Stricter (it needs a few hundred prompts for a budget of 95%).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from edgeroute.errors import EdgerouteError

BOUNDS = ("crc", "ltt")


class BudgetUnreachable(EdgerouteError):
    """No threshold meets the quality budget with the chosen bound."""


@dataclass(frozen=True)
class Choice:
    threshold: float
    method: str
    alpha: float
    delta: float | None
    bound: float  # the guaranteed risk (crc: in expectation; ltt: with probability 1 - delta)
    risk: float  # mean per-prompt risk on the calibration prompts
    llm_share: float  # on the calibration prompts
    prompts: int

    def to_dict(self) -> dict:
        return asdict(self)


def per_prompt_means(values: np.ndarray, prompt: np.ndarray) -> np.ndarray:
    """[thresholds, positions] -> [thresholds, prompts]: each prompt's mean over its positions."""
    prompts, index = np.unique(prompt, return_inverse=True)
    counts = np.bincount(index, minlength=len(prompts))
    return np.stack([np.bincount(index, weights=row, minlength=len(prompts)) for row in values]) / counts


def prompt_risks(scores: np.ndarray, differ: np.ndarray, forced: np.ndarray, prompt: np.ndarray,
                 thresholds: np.ndarray, per_answer: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """[thresholds, prompts] risks and [thresholds] LLM shares. ``forced``: positions where the
    LLM runs whatever the score (no light token, e.g. no n-gram match). ``per_answer``: a
    prompt's risk is 1 if any of its positions keeps a harmful token (an answer changed), else
    the share of its positions that do."""
    kept = (scores[None, :] <= thresholds[:, None]) & ~forced[None, :]
    harmful = per_prompt_means(kept & differ[None, :].astype(bool), prompt)
    return (harmful > 0).astype(float) if per_answer else harmful, 1.0 - kept.mean(axis=1)


def candidate_thresholds(scores: np.ndarray, steps: int = 200) -> np.ndarray:
    return np.unique(np.clip(np.concatenate([[0.0, 1.0], np.quantile(scores, np.linspace(0, 1, steps))]), 0, 1))


def choose_threshold(scores: np.ndarray, differ: np.ndarray, forced: np.ndarray, prompt: np.ndarray,
                     budget: float, method: str = "crc", delta: float = 0.1, per_answer: bool = False) -> Choice:
    """The most permissive threshold whose bound keeps agreement >= ``budget`` (``per_answer``:
    the share of answers without a harmful token kept); raises :class:`BudgetUnreachable`
    naming the best achievable figures otherwise."""
    thresholds = candidate_thresholds(scores)
    risks, shares = prompt_risks(scores, differ, forced, prompt, thresholds, per_answer)
    return bounded_choice(thresholds, risks, shares, budget, method, delta,
                          what="routing (answers without a divergent token kept)" if per_answer else "routing")


def bounded_choice(thresholds: np.ndarray, risks: np.ndarray, shares: np.ndarray, budget: float,
                   method: str = "crc", delta: float = 0.1, what: str = "routing",
                   share_name: str = "LLM share") -> Choice:
    """Of ascending ``thresholds`` (risk growing with them; ``risks`` [thresholds, prompts]),
    the most permissive whose bound keeps agreement >= ``budget``. ``shares``: the cost each
    leaves (LLM share for a router, layer work run for skipping), reported with the choice."""
    if method not in BOUNDS:
        raise ValueError(f"bound {method!r} is not one of {', '.join(BOUNDS)}")
    alpha = 1.0 - budget
    n = risks.shape[1]
    mean = risks.mean(axis=1)
    if method == "crc":
        bounds = (n * mean + 1.0) / (n + 1)
        ok = np.flatnonzero(bounds <= alpha)
        chosen = int(ok.max()) if ok.size else None
    else:  # fixed-sequence testing from the safest threshold up
        log_term = math.log(2 / delta)
        variance = risks.var(axis=1, ddof=1) if n > 1 else np.ones(len(thresholds))
        bounds = mean + np.sqrt(2 * variance * log_term / n) + 7 * log_term / (3 * max(n - 1, 1))
        failed = np.flatnonzero(bounds > alpha)
        stop = int(failed[0]) if failed.size else len(thresholds)
        chosen = stop - 1 if stop > 0 else None
    if chosen is None:
        best = int(np.argmin(bounds))
        raise BudgetUnreachable(
            f"{what}: a teacher-forced agreement of {budget:.1%} cannot be guaranteed with the {method} bound on "
            f"{n} calibration prompts: the best achievable is {1 - bounds[best]:.2%} (threshold "
            f"{thresholds[best]:.3f}, {share_name} {shares[best]:.0%}, measured agreement {1 - mean[best]:.2%}); "
            f"lower --budget, or add calibration prompts (--prompts FILE.jsonl)")
    return Choice(float(thresholds[chosen]), method, alpha, delta if method == "ltt" else None,
                  float(bounds[chosen]), float(mean[chosen]), float(shares[chosen]), n)


def tradeoff(scores: np.ndarray, differ: np.ndarray, forced: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """LLM share and teacher-forced agreement (positions pooled) over candidate thresholds."""
    thresholds = candidate_thresholds(scores, 400)
    kept = (scores[None, :] <= thresholds[:, None]) & ~forced[None, :]
    return 1.0 - kept.mean(axis=1), 1.0 - (kept & differ[None, :].astype(bool)).mean(axis=1)


def share_at_agreement(scores: np.ndarray, differ: np.ndarray, forced: np.ndarray, target: float) -> float:
    """Smallest LLM share (positions pooled) whose teacher-forced agreement reaches ``target``."""
    share, agreement = tradeoff(scores, differ, forced)
    ok = agreement >= target
    return float(share[ok].min()) if ok.any() else 1.0
