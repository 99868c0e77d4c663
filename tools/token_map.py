"""One answer, token by layer: which path wrote each token, the router's score, and what each
LLM layer did in the token's pass (run, attention only, skipped, no LLM pass). The same view
`edgeroute calibrate` puts in its report, for any prompt and mode.

    python tools/token_map.py bundles/qwen-pair --mode route+skip --light slm \\
        --prompt "Summarize for the driver: ..." --out token-map.png
"""

from __future__ import annotations

import argparse
from pathlib import Path

from edgeroute.calibration.report import plot_generation
from edgeroute.runtime import Engine


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--mode", default="route+skip")
    parser.add_argument("--light", default="slm")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("bench-results/token-map.png"))
    args = parser.parse_args(argv)
    engine = Engine(args.bundle)
    generation = engine.generate([{"role": "user", "content": args.prompt}], max_new_tokens=args.max_new_tokens,
                                 mode=args.mode, light=args.light)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    plot_generation(engine, generation, f"{args.bundle.name}: {args.mode}, light path {args.light}", args.out)
    print(generation.text)
    print(generation.stats.summary(args.mode, engine.llm.num_layers))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
