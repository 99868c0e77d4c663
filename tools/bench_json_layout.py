"""Does a JSON constraint keep the model's meaning? The built-in held-out json prompts (voice
command -> intent, judged on the intent's values), unconstrained and under ``json_object`` in
both layouts (``compact``: minified, forced; ``model``: the model's own whitespace and fence),
in ``full`` and the json profile's lossless and lossy modes.

    python -m tools.bench_json_layout --bundle bundles/qwen-pair --prompts 60 --json OUT.json

Writes the ``edgeroute eval`` report (every answer, verdict and figure) with the command line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from rich.console import Console

from edgeroute.calibration.checks import prompt_case
from edgeroute.calibration.prompts import held_out_prompts
from edgeroute.quality import RunConfig, evaluate, print_report
from edgeroute.runtime import Engine


def configs() -> list[RunConfig]:
    """full unconstrained (the reference), then full and speculate/slm (the json profile's
    calibrated choice on the pair) in each layout."""
    layouts = {layout: {"type": "json_object", "layout": layout} for layout in ("compact", "model")}
    return [RunConfig("full", {"mode": "full"}),
            *(RunConfig(f"{mode}+{layout}", {"mode": mode, "light": "slm", "response_format": spec})
              for layout, spec in layouts.items() for mode in ("full", "speculate"))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", required=True)
    parser.add_argument("--prompts", type=int, default=60, help="held-out json prompts")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--json", type=Path, help="write the report here")
    args = parser.parse_args(argv)
    engine = Engine(args.bundle, threads=args.threads)
    # without the json profile's own response_format: each configuration sets its own
    cases = [dataclasses.replace(prompt_case(p), response_format=None)
             for p in held_out_prompts(args.prompts, tasks=("json",))]
    report = evaluate(engine, cases, configs(), args.max_new_tokens, threads=args.threads)
    print_report(report, Console())
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"command": " ".join(["python -m tools.bench_json_layout", *sys.argv[1:]]),
                                         **report.to_dict()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
