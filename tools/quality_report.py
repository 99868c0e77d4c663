"""Quality of SmolLM2 bundles against the fp32 (dequantized) model, teacher-forced.

Exports (or, with --reuse, reuses) four bundles of the packaged SmolLM2-135M Q4_1 GGUF:

- ``fp32``: the GGUF dequantized (``--quant fp32``), the reference;
- ``int4-rtn`` and ``int4-gptq``: the dequantized model written as a float HF checkpoint
  (through transformers' GGUF loader) and quantized again by export, GPTQ calibrated on
  ``calibration_text()``;
- ``demo``: the default export (Q4_1 blocks carried over exactly, with the 12-layer SLM).

Each bundle's LLM runs over the same tokens of ``evaluation_text()`` in non-overlapping
windows (see edgeroute.runtime.evaluate), the int4 ones with int8 activations (the runtime's
default) and fp32 activations; the table gives top-1 agreement with fp32, perplexity,
next-token accuracy against the text and the sizes. Needs the export extra
(torch, transformers) for the exports and the float checkpoint.

    python tools/quality_report.py                         # -> bench-results/quality.json
    python tools/quality_report.py --reuse --tokens 4096 --json out.json
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from edgeroute.bundle import Bundle
from edgeroute.export import ExportOptions, export_bundle
from edgeroute.export.checkpoints import dequantized_gguf_checkpoint
from edgeroute.export.sources import packaged_gguf
from edgeroute.runtime.evaluate import DEFAULT_WINDOW, evaluate_bundle, tokenize_text
from edgeroute.texts import evaluation_text

QUANTS = ("int4-rtn", "int4-gptq")


def plans(args: argparse.Namespace) -> list[tuple[str, Path, ExportOptions | None]]:
    """(name, bundle path, export options); options None for the fp32 source of the others."""
    root = args.dir
    common = dict(parity_tokens=0, force=True, block_size=args.block_size, head=args.head)
    float_dir = root / "smollm2-fp32-hf"
    return [
        ("fp32", root / "fp32", ExportOptions(quant="fp32", slm=None, out=root / "fp32", **common)),
        *((quant, root / quant, ExportOptions(llm=str(float_dir), slm=None, quant=quant, out=root / quant,
                                               calibration_tokens=args.calibration_tokens, **common))
          for quant in QUANTS),
        ("demo", args.demo, ExportOptions(out=args.demo, parity_tokens=0, force=True)),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("bundles/quality"),
                        help="where the fp32, int4-rtn and int4-gptq bundles (and the float checkpoint) go")
    parser.add_argument("--demo", type=Path, default=Path("bundles/smollm2-demo"), help="the demo bundle")
    parser.add_argument("--reuse", action="store_true", help="reuse bundles that already exist instead of exporting")
    parser.add_argument("--tokens", type=int, default=2048, help="evaluation predictions per bundle")
    parser.add_argument("--window", type=int, default=DEFAULT_WINDOW, help="tokens per teacher-forced window")
    parser.add_argument("--calibration-tokens", type=int, default=ExportOptions.calibration_tokens,
                        help="GPTQ calibration tokens")
    parser.add_argument("--activations", nargs="+", choices=("int8", "fp32"), default=["int8", "fp32"],
                        help="activation precisions of the int4 kernels to evaluate the int4 bundles with")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--head", default="int8")
    parser.add_argument("--json", type=Path, default=Path("bench-results/quality.json"), help="where to write the figures")
    args = parser.parse_args(argv)
    console = Console()
    if not console.is_terminal:
        console.width = 160  # rich's default of 80 columns would cut the table

    export_seconds: dict[str, float | None] = {}
    float_written = False
    for name, path, options in plans(args):
        if args.reuse and (path / "manifest.json").is_file():
            export_seconds[name] = None
            console.print(f"reusing {path}")
            continue
        start = time.perf_counter()
        if name in QUANTS and not (float_written or (args.reuse and (args.dir / "smollm2-fp32-hf" / "config.json").is_file())):
            console.print("writing the dequantized model as a float HF checkpoint")
            float_written = True
            dequantized_gguf_checkpoint(packaged_gguf(), args.dir / "smollm2-fp32-hf")
            gc.collect()
        console.print(f"exporting {name} -> {path}")
        export_bundle(options)
        export_seconds[name] = time.perf_counter() - start

    bundles = {name: Bundle.open(path) for name, path, _ in plans(args)}
    ids = tokenize_text(bundles["fp32"], evaluation_text(), args.tokens + 1)
    runs = [(name, activations) for name in bundles
            for activations in (["int8"] if name == "fp32" else args.activations)]  # fp32: no int4 kernels
    results = {}
    for name, activations in runs:
        start = time.perf_counter()
        console.print(f"evaluating {name} ({activations} activations) over {args.tokens} tokens")
        try:
            forced = evaluate_bundle(bundles[name], ids, window=args.window, activations=activations)
        except Exception as err:  # a reused bundle from an older graph layout, typically
            hint = " (it was reused: run without --reuse to export it again)" if export_seconds[name] is None else ""
            raise SystemExit(f"{bundles[name].path} could not be evaluated: {type(err).__name__}: {err}{hint}") from err
        results[name, activations] = (forced, time.perf_counter() - start)
        gc.collect()

    reference = results["fp32", "int8"][0]
    fp32_llm = bundles["fp32"].total_bytes("llm/")
    rows = []
    for (name, activations), (forced, seconds) in results.items():
        bundle = bundles[name]
        quant = bundle.llm.quantization
        rows.append({
            "name": name, "path": str(bundle.path), "quant": quant["method"],
            "carried_over": quant.get("carried_over", False), "formats": quant.get("formats", {}),
            "activations": "fp32" if name == "fp32" else activations,
            "llm_bytes": bundle.total_bytes("llm/"), "total_bytes": bundle.total_bytes(),
            "llm_fraction_of_fp32": bundle.total_bytes("llm/") / fp32_llm,
            "agreement_vs_fp32": forced.agreement(reference), "perplexity": forced.perplexity,
            "next_token_accuracy": forced.accuracy, "export_seconds": export_seconds[name],
            "eval_seconds": seconds,
        })

    table = Table(title=f"SmolLM2-135M quality: {args.tokens} evaluation tokens, window {args.window}, "
                        "agreement = teacher-forced top-1 agreement with fp32")
    columns = ("bundle", "layer weights", "activations", "llm MB", "vs fp32", "agreement", "perplexity", "accuracy",
               "export s")
    for column in columns:
        table.add_column(column, justify="left" if column in columns[:3] else "right", no_wrap=True)
    for row in rows:
        layer_formats = {k: v for k, v in row["formats"].items() if not k.startswith(("embedding", "lm_head"))}
        weights = max(layer_formats, key=layer_formats.get) + (", carried over" if row["carried_over"] else "")
        table.add_row(row["name"], weights, row["activations"], f"{row['llm_bytes'] / 1e6:.1f}",
                      f"{row['llm_fraction_of_fp32']:.1%}", f"{row['agreement_vs_fp32']:.4f}", f"{row['perplexity']:.3f}",
                      f"{row['next_token_accuracy']:.4f}",
                      "reused" if row["export_seconds"] is None else f"{row['export_seconds']:.1f}")
    console.print(table)

    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "model": "SmolLM2-135M-Instruct Q4_1 (packaged GGUF)", "tokens": args.tokens, "window": args.window,
        "evaluation_text": "edgeroute.texts.evaluation_text()", "calibration_tokens": args.calibration_tokens,
        "block_size": args.block_size, "head": args.head,
        "bundles": rows,
    }, indent=2))
    console.print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
