"""GPU check (issue 30): TensorRT engines, edgeroute's TensorRT backend and ONNX Runtime's GPU
providers against ONNX Runtime CPU.

    tools/device/gpu_check.sh LOGDIR        # the shell wrapper: nvidia-smi, a time limit, a log

Each step logs what it measured or why it could not run, and the others go on; the table is
printed and everything is written to LOGDIR/gpu_check.json:

1. the demo bundle in both targets (default: exact carry-over; tensorrt: re-blocked with RTN,
   which exports in seconds where GPTQ takes minutes), exported unless LOGDIR already holds them;
2. ``build-engines`` for the tensorrt bundle (embed, layer, head: what ``full`` runs): build time,
   peak host memory per parameter, then a second call that must reuse the cache;
3. logits over 64 teacher-forced tokens on each GPU provider (CUDA; TensorRT where installed) vs
   ONNX Runtime CPU on the same graphs: max relative error (the fp16 tensorrt target: <= 1e-2,
   the fp32 default target: <= 1e-3);
4. 64 greedy tokens of ``full`` on each GPU provider vs the CPU: identical in full;
5. decode tok/s per mode (full, speculate and route with the n-gram light path) per provider;
6. the same three for ``backend="tensorrt"`` (the engines of step 2, run by edgeroute's own
   backend) on the tensorrt bundle: logits vs the CPU (<= 1e-2), 64 greedy tokens identical in
   ``full``, tok/s per mode.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

GPU_PROVIDERS = ("CUDAExecutionProvider", "TensorrtExecutionProvider")
TOKENS = 64
MODES = ("full", "speculate", "route")
TEXT = "Give me three tips for staying awake on a long drive."  # teacher-forced, repeated to 64 tokens
# a chat turn that answers at length: the greedy check needs 64 tokens before the end of turn
CHAT = [{"role": "user", "content": "Write a long story about a lighthouse keeper and a storm."}]


def _step(results: dict, name: str):
    def wrap(fn):
        start = time.perf_counter()
        try:
            results[name] = {"ok": True, **fn()}
        except Exception as err:  # a step that cannot run here says why; the others go on
            results[name] = {"ok": False, "error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()}
        results[name]["seconds"] = round(time.perf_counter() - start, 1)
        print(f"[{name}] {json.dumps({k: v for k, v in results[name].items() if k != 'trace'})[:600]}", flush=True)
        return fn
    return wrap


def _gpu(providers: list[str]) -> list[str]:
    if not providers:
        raise RuntimeError("no GPU provider in this ONNX Runtime: install onnxruntime-gpu on a machine with a GPU")
    return providers


def _teacher_ids(bundle) -> np.ndarray:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(bundle.file(bundle.tokenizer["file"])))
    return np.asarray(tokenizer.encode(TEXT * 8).ids[:TOKENS], np.int64)


def _logits_against(got: np.ndarray, want: np.ndarray, limit: float) -> dict:
    rel = float(np.abs(got - want).max() / np.abs(want).max())
    return {"max_rel": rel, "within": rel <= limit, "limit": limit,
            "top1_same": float((got.argmax(-1) == want.argmax(-1)).mean())}


def _tokens_against(got: list[int], want: list[int]) -> dict:
    same = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
    return {"tokens": len(got), "identical": got == want and len(got) >= TOKENS,
            "first_difference": None if got == want else same}


def _export(out: Path, *args: str) -> None:
    if not (out / "manifest.json").is_file():
        subprocess.run([sys.executable, "-m", "edgeroute.cli", "export", "--no-slm", "--out", str(out), "--force",
                        "--parity-tokens", "256", *args], check=True)


def main(logdir: Path) -> int:
    import onnxruntime as ort

    from edgeroute.bundle import Bundle
    from edgeroute.runtime import Engine, OrtModel
    from edgeroute.runtime.backends.tensorrt import TrtModel
    from edgeroute.runtime.profiles import load_profile
    from edgeroute.tensorrt.engines import build_engines

    logdir.mkdir(parents=True, exist_ok=True)
    bundles = {"default": logdir / "smollm2-default", "tensorrt": logdir / "smollm2-tensorrt"}
    engines = logdir / "engines"
    providers = [p for p in GPU_PROVIDERS if p in ort.get_available_providers()]
    results: dict = {"available_providers": ort.get_available_providers()}

    @_step(results, "export")
    def _():
        _export(bundles["default"])
        _export(bundles["tensorrt"], "--target", "tensorrt", "--quant", "int4-rtn")
        return {name: str(path) for name, path in bundles.items()}

    @_step(results, "build_engines")
    def _():
        bundle = Bundle.open(bundles["tensorrt"])
        first = build_engines(bundle, load_profile("cuda"), engines, kinds=("embed", "layer", "head"))
        again = build_engines(bundle, load_profile("cuda"), engines, kinds=("embed", "layer", "head"))
        assert again.reused, "the second build did not reuse the cache"
        return {"gpu": first.key.gpu, "tensorrt": first.key.tensorrt, "engines": len(first.built),
                "build_seconds": round(first.seconds, 1), "peak_host_mib": first.peak_host_bytes >> 20,
                "bytes_per_parameter": round(first.peak_per_parameter, 2), "reused_seconds": round(again.seconds, 2)}

    for name, path in bundles.items():
        kv = "float16" if name == "tensorrt" else "float32"
        limit = 1e-2 if name == "tensorrt" else 1e-3

        @_step(results, f"logits_{name}")
        def _(path=path, kv=kv, limit=limit):
            gpu_providers = _gpu(providers)
            bundle = Bundle.open(path)
            ids = _teacher_ids(bundle)
            cpu = OrtModel(bundle, kv_dtype=kv)
            want = cpu.forward(cpu.new_cache(), ids, all_logits=True)
            out = {}
            for provider in gpu_providers:
                gpu = OrtModel(bundle, providers=[provider, "CPUExecutionProvider"], kv_dtype=kv)
                out[provider] = _logits_against(gpu.forward(gpu.new_cache(), ids, all_logits=True), want, limit)
            return out

        @_step(results, f"greedy_{name}")
        def _(path=path, kv=kv):
            gpu_providers = _gpu(providers)
            cpu = Engine(path, slm=False, backend="onnxruntime", kv_dtype=kv)
            want = cpu.generate(CHAT, mode="full", max_new_tokens=TOKENS).tokens
            out = {}
            for provider in gpu_providers:
                gpu = Engine(path, slm=False, providers=[provider, "CPUExecutionProvider"], kv_dtype=kv)
                out[provider] = _tokens_against(gpu.generate(CHAT, mode="full", max_new_tokens=TOKENS).tokens, want)
            return out

        @_step(results, f"speed_{name}")
        def _(path=path, kv=kv):
            out = {}
            for provider in ["CPUExecutionProvider", *providers]:
                engine = Engine(path, slm=False, providers=[provider] if provider == "CPUExecutionProvider"
                                else [provider, "CPUExecutionProvider"], kv_dtype=kv,
                                backend="onnxruntime")
                engine.generate(CHAT, mode="full", max_new_tokens=8)  # warm-up (TensorRT EP builds here)
                out[provider] = {mode: round(engine.generate(CHAT, mode=mode, max_new_tokens=TOKENS)
                                             .stats.decode_tokens_per_second, 1) for mode in MODES}
            return out

    @_step(results, "logits_tensorrt_backend")
    def _():
        bundle = Bundle.open(bundles["tensorrt"])
        ids = _teacher_ids(bundle)
        cpu = OrtModel(bundle, kv_dtype="float16")
        want = cpu.forward(cpu.new_cache(), ids, all_logits=True)
        gpu = TrtModel(bundle, "llm", engines)
        return _logits_against(gpu.forward(gpu.new_cache(), ids, all_logits=True), want, 1e-2)

    @_step(results, "greedy_tensorrt_backend")
    def _():
        want = Engine(bundles["tensorrt"], slm=False, backend="onnxruntime", kv_dtype="float16").generate(
            CHAT, mode="full", max_new_tokens=TOKENS).tokens
        got = Engine(bundles["tensorrt"], slm=False, backend="tensorrt", engine_cache=str(engines)).generate(
            CHAT, mode="full", max_new_tokens=TOKENS).tokens
        return _tokens_against(got, want)

    @_step(results, "speed_tensorrt_backend")
    def _():
        engine = Engine(bundles["tensorrt"], slm=False, backend="tensorrt", engine_cache=str(engines))
        engine.generate(CHAT, mode="full", max_new_tokens=8)  # warm-up
        return {mode: round(engine.generate(CHAT, mode=mode, max_new_tokens=TOKENS).stats.decode_tokens_per_second, 1)
                for mode in MODES}

    (logdir / "gpu_check.json").write_text(json.dumps(results, indent=1))
    print("\nstep                     ok     seconds")
    for name, result in results.items():
        if isinstance(result, dict) and "ok" in result:
            print(f"{name:24} {str(result['ok']):6} {result['seconds']:7}")
    print(f"\nall figures: {logdir / 'gpu_check.json'}")
    return 0 if all(r.get("ok") for r in results.values() if isinstance(r, dict) and "ok" in r) else 1


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: gpu_check.py LOGDIR")
    sys.exit(main(Path(sys.argv[1])))
