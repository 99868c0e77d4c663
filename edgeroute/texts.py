"""Offline texts, kept apart by purpose (no dataset hub is reachable on the device or in CI).

Both come from ``pydoc_data.topics`` (the Python documentation shipped with CPython): the
topics in sorted order alternate between *calibration* (even positions: GPTQ Hessians,
threshold fitting) and *evaluation* (odd positions: parity, agreement, perplexity), so the
figures we report are never measured on the text a stage was fitted to.
"""

from __future__ import annotations


def _topics(parity: int) -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k].strip() for i, k in enumerate(sorted(topics)) if i % 2 == parity)


def calibration_text() -> str:
    return _topics(0)


def evaluation_text() -> str:
    return _topics(1)
