"""A calibrated bundle's defaults: the decoding options ``edgeroute calibrate`` chose.

- ``--mode auto`` takes the mode and light path calibrated for the task profile (the fastest
  configuration that met the quality budget on held-out prompts), with exactly the options it
  ran with there (the defaults below apply to explicit modes).
- ``route`` without an explicit router takes the bundle's router for its light path and
  route check (a trained graph or a baseline; ``router_key``) and its fitted threshold.
- ``speculate`` without an explicit ``draft_confidence`` takes the fitted one, and where the
  SLM drafts (``slm``, ``ngram+slm``), with its draft lengths left at their defaults, the
  fitted ones (``draft_tokens``, ``max_draft_tokens``); the prompt lookup alone keeps the
  runtime's lengths (the lookup's tree fit replays those).
- ``speculate --light ngram`` (``slm``) with no tree shape set (``draft_branches`` 1,
  ``draft_tree_nodes`` None) takes the fitted lookup (SLM) trees
  (``calibration.decoding["lookup_tree"]`` / ``["slm_tree"]``), and ``auto`` a task profile's
  shape on the same condition; ``ngram+slm`` keeps linear drafts (no fit replays its mix).
- a skip mode whose skip options are all left at their defaults takes the calibrated ones,
  where calibration found a skip setting that paid (``calibration.decoding["skip"]``).
An explicit option always wins; an uncalibrated bundle keeps the uncalibrated defaults.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from edgeroute.bundle import Calibration, RouterCalibration
from edgeroute.errors import InputError
from edgeroute.runtime.decoding import DecodeOptions
from edgeroute.runtime.policies import Router
from edgeroute.skip_options import SkipOptions

# characters whose token a JSON answer cannot get wrong and still parse
FORMAT_CHARACTERS = frozenset('{}[]":,')
AUTO_KEYS = ("mode", "light", "route_check", "draft_tokens", "max_draft_tokens", "draft_confidence", "lookup_min_match",
             "lookup_tokens", "protect_format")
# skip options a calibrated profile or ``decoding["skip"]`` may set (flat SkipOptions fields)
SKIP_KEYS = ("granularity", "scorer", "importance_threshold", "max_free_layers", "skip_ratio")
DEFAULT_DRAFT_LENGTHS = (DecodeOptions.draft_tokens, DecodeOptions.max_draft_tokens)
# a profile's draft tree shape (speculate/ngram+tree): taken where the caller set none
TREE_KEYS = ("draft_branches", "draft_tree_nodes")
UNSET_TREE = (DecodeOptions.draft_branches, DecodeOptions.draft_tree_nodes)
TREE_DECODING = {"ngram": "lookup_tree", "slm": "slm_tree"}  # a light path's fitted tree shape in decoding


def auto_options(options: DecodeOptions, calibration: Calibration | None) -> DecodeOptions:
    if calibration is None:
        raise InputError("mode auto needs a calibrated bundle, and this one is uncalibrated: run "
                         "`edgeroute calibrate BUNDLE`, or choose a mode (full, route, speculate, ...)")
    task = options.task or "default"
    chosen = calibration.profiles.get(task)
    if chosen is None:
        raise InputError(f"the bundle was not calibrated for task {task!r}; calibrated: "
                         f"{', '.join(sorted(calibration.profiles))}")
    keys = (*AUTO_KEYS, *SKIP_KEYS, *(TREE_KEYS if _tree_unset(options) else ()))
    return options.updated(**{k: chosen[k] for k in keys if k in chosen})


def _tree_unset(options: DecodeOptions) -> bool:
    return (options.draft_branches, options.draft_tree_nodes) == UNSET_TREE


def calibrated_options(options: DecodeOptions, calibration: Calibration | None,
                       load_router: Callable[[RouterCalibration], Router]) -> DecodeOptions:
    """``options`` with mode auto resolved and the calibrated router filled in where unset. A
    task profile is the configuration its runtime runs measured, so the bundle-wide fitted
    draft and skip settings apply to explicit modes only (a profile that ran speculate/slm with
    the runtime's draft defaults keeps them)."""
    fitted = calibration.decoding if calibration is not None else {}
    if options.mode == "auto":
        options, fitted = auto_options(options, calibration), {}
    if options.draft_confidence is None and "draft_confidence" in fitted:
        options = dataclasses.replace(options, draft_confidence=fitted["draft_confidence"])
    # the fitted lengths are the SLM's (its drafts replayed): the prompt lookup alone keeps the defaults
    if ("max_draft_tokens" in fitted and "slm" in (options.light or "")
            and (options.draft_tokens, options.max_draft_tokens) == DEFAULT_DRAFT_LENGTHS):
        options = dataclasses.replace(options, draft_tokens=fitted["draft_tokens"],
                                      max_draft_tokens=fitted["max_draft_tokens"])
    tree = fitted.get(TREE_DECODING.get(options.light or "", ""))
    if tree is not None and options.mode == "speculate" and _tree_unset(options):
        options = dataclasses.replace(options, **{k: tree[k] for k in TREE_KEYS})
    skip = fitted.get("skip")
    if skip is not None and options.skips and options.skip == SkipOptions():
        options = options.updated(**{k: skip[k] for k in SKIP_KEYS if k in skip})
    entry = _router_entry(options, calibration)
    if entry is None or options.router not in (None, entry.router):
        return options
    threshold = entry.threshold if options.route_threshold is None else options.route_threshold
    router = load_router(entry) if entry.router == "trained" else entry.router
    return dataclasses.replace(options, router=router, route_threshold=threshold)


def calibrated_route(options: DecodeOptions, calibration: Calibration | None) -> bool:
    """Whether a route mode's quality was measured: it routes with the router the calibration fitted
    for its light path, at the fitted threshold (the ones ``calibrated_options`` fills in where
    unset). Verified routing at threshold 0 keeps no difference: exact speculation, lossless."""
    if options.route_check == "verified" and options.route_threshold == 0:
        return True
    entry = _router_entry(options, calibration)
    return (entry is not None and options.router in (None, entry.router)
            and options.route_threshold in (None, entry.threshold))


def _router_entry(options: DecodeOptions, calibration: Calibration | None) -> RouterCalibration | None:
    """The calibration's router for the options' light path and route check, if it fitted one."""
    return calibration.routers.get(router_key(options.light, options.route_check)) if calibration is not None else None


def router_key(light: str, route_check: str = "ahead") -> str:
    """A calibration's routers by light path, ``slm:verified`` for verified routing's."""
    return light if route_check == "ahead" else f"{light}:{route_check}"


def format_token_ids(vocabulary: dict[str, int]) -> frozenset[int]:
    """Ids of tokens that carry JSON structure (a bracket, quote, colon or comma)."""
    return frozenset(i for token, i in vocabulary.items() if FORMAT_CHARACTERS & set(token))
