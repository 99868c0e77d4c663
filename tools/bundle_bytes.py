"""What a bundle costs against its GGUF source: size on disk, resident memory once loaded,
and the weight bytes one decode step reads, next to llama.cpp's for the same file.

What a decode step reads, per backend: ``edgeroute.measure.step_bytes``.

    python tools/bundle_bytes.py bundles/qwen-pair --gguf llm=qwen2.5-coder-1.5b --gguf slm=qwen2.5-coder-0.5b
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import tempfile
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import onnx
from rich.console import Console
from rich.table import Table

from edgeroute.measure.step_bytes import gguf_step_bytes, native_step_bytes, ort_step_graphs, save_optimized

MB = 1e6


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def bundle_figures(bundle: Path, role: str) -> dict:
    from edgeroute.bundle import Bundle
    from edgeroute.runtime.backends.onnxruntime import OrtModel, choose_flavour

    b = Bundle.open(bundle, verify=False)
    step_bytes, ops = 0, Counter()
    for g in ort_step_graphs(b.models[role], choose_flavour(b.models[role])):
        with tempfile.TemporaryDirectory() as tmp:
            model, data = save_optimized(b.file(g.file), Path(tmp))
            step_bytes += data.stat().st_size
            ops += Counter(n.op_type for n in onnx.load(str(model), load_external_data=False).graph.node)
    gc.collect()
    before = resident_bytes()
    model = OrtModel(b, role)
    loaded = resident_bytes() - before
    del model
    return {"disk_bytes": b.total_bytes(f"{role}/"), "resident_bytes": loaded, "step_bytes": step_bytes,
            "native_step_bytes": native_step_bytes(b.models[role]),
            "matmul_ops": {k: v for k, v in ops.items() if "MatMul" in k or k == "Gemm"}}


def gguf_figures(spec: str) -> dict:
    from edgeroute.export.sources import resolve_source

    path = resolve_source(spec)
    return {"path": str(path), "disk_bytes": path.stat().st_size, "step_bytes": gguf_step_bytes(path)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--gguf", action="append", default=[], help="ROLE=SOURCE (a .gguf path or a named source)")
    parser.add_argument("--json", type=Path, default=Path("bench-results/bundle-bytes.json"))
    args = parser.parse_args(argv)
    sources = dict(item.split("=", 1) for item in args.gguf)
    manifest = json.loads((args.bundle / "manifest.json").read_text())
    results = {}
    for role in manifest["models"]:
        # a fresh process per model: memory freed by the previous one would hide the next one's
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            results[role] = {"bundle": pool.submit(bundle_figures, args.bundle, role).result()}
        if role in sources:
            results[role]["gguf"] = gguf_figures(sources[role])

    table = Table(title=f"{args.bundle}: bundle vs GGUF (MB)")
    for column in ("model", "bundle disk", "GGUF disk", "ratio", "ORT resident after load", "ORT bytes / decode step",
                   "native / step", "llama.cpp / step", "ORT ratio", "native ratio"):
        table.add_column(column)

    def ratio(a: int | None, b: int | None) -> str:
        return f"{a / b:.2f}x" if a and b else "-"

    for role, r in results.items():
        b, g = r["bundle"], r.get("gguf") or {}
        native = b["native_step_bytes"]
        table.add_row(role, f"{b['disk_bytes'] / MB:,.0f}", f"{g['disk_bytes'] / MB:,.0f}" if g else "-",
                      ratio(b["disk_bytes"], g.get("disk_bytes")), f"{b['resident_bytes'] / MB:,.0f}",
                      f"{b['step_bytes'] / MB:,.0f}", f"{native / MB:,.0f}" if native else "-",
                      f"{g['step_bytes'] / MB:,.0f}" if g else "-", ratio(b["step_bytes"], g.get("step_bytes")),
                      ratio(native, g.get("step_bytes")))
    Console().print(table)
    for role, r in results.items():
        Console().print(f"{role}: matmul kernels after ORT optimization: {r['bundle']['matmul_ops']}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
