"""Confidence bounds on task pass rates, exact (Clopper-Pearson) and paired against ``full``.

A lossy mode is compared with ``full`` on the same prompts. What must be bounded is the share
of prompts ``full`` gets right and the mode gets wrong (its *losses*): the one-sided upper
Clopper-Pearson bound on that share at the stated confidence is the most the mode can lose with
that confidence, and ``-loss_bound`` is a lower confidence bound on the paired difference
``pass(mode) - pass(full)`` (gains are ignored: conservative, never flattering). With no loss
seen on n prompts the bound is ``1 - (1 - confidence) ** (1 / n)``: at 95% it is 39% on 6
prompts and 4.9% on 60, which is why a bound needs dozens of held-out prompts per task.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


def _binomial_cdf(k: int, n: int, p: float) -> float:
    """P(X <= k) for X ~ Binomial(n, p), summed in log space (n up to tens of thousands)."""
    if p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 1.0 if k >= n else 0.0
    log_p, log_q = math.log(p), math.log1p(-p)
    terms = [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * log_p + (n - i) * log_q
             for i in range(k + 1)]
    peak = max(terms)
    return min(1.0, math.exp(peak) * sum(math.exp(t - peak) for t in terms))


def _solve(function, target: float) -> float:
    """p in [0, 1] with function(p) == target, for a function decreasing in p (bisection)."""
    low, high = 0.0, 1.0
    for _ in range(60):
        middle = (low + high) / 2
        if function(middle) > target:
            low = middle
        else:
            high = middle
    return (low + high) / 2


def _check(successes: int, n: int, confidence: float) -> None:
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be within 0..n (got {successes} of {n})")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be within (0, 1) (got {confidence})")


def upper_bound(successes: int, n: int, confidence: float = 0.95) -> float:
    """One-sided Clopper-Pearson upper bound: P(true rate <= bound) >= ``confidence``."""
    _check(successes, n, confidence)
    if n == 0 or successes == n:
        return 1.0
    return _solve(lambda p: _binomial_cdf(successes, n, p), 1.0 - confidence)


def lower_bound(successes: int, n: int, confidence: float = 0.95) -> float:
    """One-sided Clopper-Pearson lower bound: P(true rate >= bound) >= ``confidence``."""
    _check(successes, n, confidence)
    if n == 0 or successes == 0:
        return 0.0
    return 1.0 - upper_bound(n - successes, n, confidence)


def interval(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Two-sided Clopper-Pearson interval at ``confidence`` (each tail (1 - confidence) / 2)."""
    tail = 1.0 - (1.0 - confidence) / 2
    return lower_bound(successes, n, tail), upper_bound(successes, n, tail)


@dataclass(frozen=True)
class PairedComparison:
    """A mode's pass/fail against ``full``'s on the same prompts, both judged."""

    n: int  # prompts judged for both
    passed: int  # the mode passes
    full_passed: int
    lost: int  # full passes, the mode fails
    gained: int  # the mode passes, full fails
    confidence: float
    loss_bound: float  # upper bound on P(full passes and the mode fails)

    @property
    def difference_lower_bound(self) -> float:
        """Lower confidence bound on pass(mode) - pass(full)."""
        return -self.loss_bound

    def meets(self, tolerance: float) -> bool:
        """The mode may lose at most ``tolerance`` of the prompts, at the stated confidence."""
        return self.n > 0 and self.loss_bound <= tolerance

    def to_dict(self) -> dict:
        return asdict(self)


def compare_paired(mode: list[bool], full: list[bool], confidence: float = 0.95) -> PairedComparison:
    """Pass/fail lists over the same judged prompts, in the same order."""
    if len(mode) != len(full):
        raise ValueError(f"paired results need the same prompts ({len(mode)} vs {len(full)})")
    lost = sum(f and not m for m, f in zip(mode, full, strict=True))
    gained = sum(m and not f for m, f in zip(mode, full, strict=True))
    return PairedComparison(len(mode), sum(mode), sum(full), lost, gained, confidence,
                            upper_bound(lost, len(mode), confidence))
