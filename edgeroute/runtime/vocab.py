"""A model's reduced-vocabulary head, as the runtime sees it (``head_vocab`` in the manifest).

The head graph then returns ``[T, N + 1]`` logits: column j is token ``ids[j]``, the last
column the estimated log-mass of every token outside ``ids`` (see ``edgeroute.export.vocab``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from edgeroute.bundle import Bundle
from edgeroute.errors import BundleError

# DecodeOptions.draft_rows' default: the head rows of common ids a speculating native SLM drafts
# from, beside its sequence's (drafters.DraftVocabulary)
DRAFT_ROWS = 32768


@dataclass(frozen=True)
class HeadVocabulary:
    ids: np.ndarray  # int64 [N], sorted token ids of the head's columns
    vocab_size: int  # the tokenizer's full vocabulary

    @classmethod
    def load(cls, bundle: Bundle, role: str) -> HeadVocabulary | None:
        """The model's reduced head, or None when its head covers the whole vocabulary."""
        entry = bundle.manifest["models"][role].get("head_vocab")
        if entry is None:
            return None
        try:
            ids = np.asarray(json.loads(bundle.file(entry["file"]).read_text()), np.int64)
        except (OSError, ValueError, KeyError) as err:
            raise BundleError(f"the {role} model's head vocabulary cannot be read ({err}): export the bundle again") \
                from err
        if ids.ndim != 1 or len(ids) != entry["size"] or (ids.size and (ids.min() < 0 or ids.max() >= entry["vocab_size"])):
            raise BundleError(f"the {role} model's head vocabulary {entry['file']} does not match its manifest entry "
                              f"({len(ids)} ids, {entry['size']} expected): export the bundle again")
        return cls(ids, int(entry["vocab_size"]))

    def __len__(self) -> int:
        return len(self.ids)

    def rest_wins(self, logits: np.ndarray) -> np.ndarray | bool:
        """Per row: the rest column is the argmax (the model expects a token outside the head)."""
        return logits.argmax(-1) == len(self.ids)

    def expand(self, logits: np.ndarray) -> np.ndarray:
        """Full-vocabulary logits: the head's columns at their ids, -inf elsewhere (so no
        token outside the head is ever chosen); the rest column is dropped."""
        full = np.full((*logits.shape[:-1], self.vocab_size), -np.inf, np.float32)
        full[..., self.ids] = logits[..., :len(self.ids)]
        return full
