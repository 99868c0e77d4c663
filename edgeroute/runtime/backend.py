"""The seam between the decode loop and an inference backend.

``decoding.py`` and the drafters need only what :class:`ModelBackend` declares: forward T
tokens over a sequence's cache with a per-layer plan, caches that can be created,
truncated (rejected drafts) and copied (shared prompt prefixes), and the LM head.
:class:`edgeroute.runtime.model.OrtModel` implements it on ONNX Runtime with the bundle's
attention flavours (portable standard ops, or the ort flavour's in-place
GroupQueryAttention); a TensorRT backend would implement it over engines built from the
portable graphs, with its own cache layout behind the same :class:`Cache` methods.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from edgeroute.arch import ArchConfig
from edgeroute.runtime.model import LayerPlan
from edgeroute.runtime.vocab import HeadVocabulary


@runtime_checkable
class Cache(Protocol):
    """One sequence's KV cache: fixed capacity, allocated once."""

    length: int  # positions held (the next token's position)
    capacity: int

    def truncate(self, length: int) -> None:
        """Forget positions >= length."""

    def reset(self) -> None:
        """Forget everything (a new conversation)."""

    def copy_from(self, other: Cache, length: int | None = None) -> None:
        """Take over the first ``length`` positions of a cache of the same model and layout."""

    def clone(self) -> Cache:
        """An independent copy."""


@runtime_checkable
class ModelBackend(Protocol):
    """What the decode loop needs from a model (LLM or SLM)."""

    arch: ArchConfig
    capacity: int  # the default cache capacity (the bundle's context length)
    flavour: str  # the attention graphs it runs: portable | ort
    head_vocab: HeadVocabulary | None  # a reduced-vocabulary head's token ids (None: the whole vocabulary)

    @property
    def num_layers(self) -> int: ...

    def new_cache(self, capacity: int | None = None) -> Cache:
        """A fresh, empty cache in this backend's layout."""

    def forward(self, cache: Cache, ids: Sequence[int] | np.ndarray, plan: Sequence[bool] | LayerPlan | None = None,
                all_logits: bool = False, tail: int | None = None) -> np.ndarray:
        """Run new tokens over the cache (prefill, decode step, catch-up, verification) through
        the layers the plan allows, filling skipped layers' K/V; return logits (see
        ``OrtModel.forward``)."""

    def hidden_states(self, cache: Cache, ids: Sequence[int] | np.ndarray,
                      plan: Sequence[bool] | LayerPlan | None = None) -> np.ndarray:
        """``forward`` without the LM head: the last layer's hidden states [T, d]."""

    def embed(self, ids: np.ndarray) -> np.ndarray:
        """Token ids [T] -> hidden states [T, d]."""

    def head(self, hidden: np.ndarray) -> np.ndarray:
        """Hidden states [T, d] -> logits [T, vocab]."""
