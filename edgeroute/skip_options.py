"""The skip controller's settings, a plain dataclass with its own checks. Standard library only:
the bundle validates a calibrated skip setting with it, and the runtime's ``SkipController``
runs it (``edgeroute.runtime.policies``)."""

from __future__ import annotations

from dataclasses import dataclass

from edgeroute.errors import InputError

SKIP_SCORERS = ("update", "cosine", "random")  # importance scorers (runtime.policies.make_scorer)
GRANULARITIES = ("layer", "mlp")
# Without a calibrated setting a skip decision frees at most this many layers, not the seed's 8:
# on the pair's 1.5B, 8-layer runs changed 21-76% of the tokens (docs/measured/2026-12-01-skipping-pair.md);
# calibration observes longer runs itself (calibration.skipping.FREE_LAYERS) and keeps what it measured.
UNCALIBRATED_FREE_LAYERS = 2


@dataclass
class SkipOptions:
    importance_threshold: float = 0.6  # skip when the importance score is below this
    re_eval_interval: int = 2
    max_free_layers: int | None = None  # None: UNCALIBRATED_FREE_LAYERS, at most half the layers
    skip_ratio: float = 0.1  # cap on the skipped share of layer work per sequence
    protected_first: int = 2  # skipping the first layers is catastrophic (Mistral-7B ppl 9 -> 3200)
    protected_last: int = 2
    granularity: str = "layer"  # layer (K/V filled CALM-style) | mlp (attention always runs)
    kv_cache_reduction: bool = False  # skipped layers' cache entries masked instead of filled
    scorer: str = "update"  # one of SKIP_SCORERS

    def free_layers(self, num_layers: int) -> int:
        return self.max_free_layers or max(1, min(UNCALIBRATED_FREE_LAYERS, num_layers // 2))

    def validate(self, num_layers: int | None) -> None:
        """Value ranges always; the layer-count checks when ``num_layers`` is given (skip modes)."""
        for name in ("importance_threshold", "skip_ratio"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise InputError(f"{name} must be within [0, 1] (got {value})")
        layers = num_layers if num_layers is not None else 10**9
        if self.max_free_layers is not None and not 1 <= self.max_free_layers <= layers:
            raise InputError(f"max_free_layers must be between 1 and the model's {num_layers} layers "
                             f"(got {self.max_free_layers})")
        if self.re_eval_interval < 1:
            raise InputError(f"re_eval_interval must be >= 1 (got {self.re_eval_interval})")
        if self.protected_first < 0 or self.protected_last < 0 or self.protected_first + self.protected_last > layers:
            raise InputError("protected_first + protected_last must be between 0 and the number of layers")
        if self.granularity not in GRANULARITIES:
            raise InputError(f"granularity must be 'layer' or 'mlp' (got {self.granularity!r})")
        if self.scorer not in SKIP_SCORERS:
            raise InputError(f"importance scorer {self.scorer!r} is not one of: {', '.join(SKIP_SCORERS)}")
