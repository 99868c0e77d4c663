"""CUDA check (issue 43, item 5): the TensorRT backend's CUDA side on a real GPU, without TensorRT.

    tools/device/cuda_check.sh LOGDIR                 # the shell wrapper: nvidia-smi, a 5-minute limit, a log
    python tools/device/cuda_check.py LOGDIR [--bundle BUNDLE] [--tokens 64] [--host-memory]

Needs an NVIDIA GPU, CUDA 12 and cuda-python's runtime bindings (``from cuda.bindings import
runtime``; ``pip install 'cuda-python>=12.8,<13'``); not TensorRT, not onnxruntime-gpu. The
backend (``TrtModel``) runs with its real ``CudaDevice`` (cudaMalloc'd buffers, host<->device
and device-to-device copies, one stream per model) and ``DeviceKVCache`` on device memory, while
each "engine" is its graph on ONNX Runtime CPU: the stand-ins of the CPU tests
(edgeroute/runtime/backends/tensorrt_standins.py), whose I/O goes through the same CUDA runtime
and stream. The arithmetic is ONNX Runtime's either way, so everything must match the
onnxruntime backend EXACTLY (the CPU tests' bound); a difference is the device memory, the copies
or the backend's addressing on a real GPU. Checks, each printed as it ends, then a table, all in
LOGDIR/cuda_check.json:

1. ``device``: the GPU, the CUDA runtime and driver versions, free memory;
2. ``bundle``: the demo bundle in the tensorrt target (``export --target tensorrt --quant
   int4-rtn --no-slm`` into LOGDIR, seconds; reused when there) or ``--bundle``;
3. ``logits``: N teacher-forced tokens (several prefill passes), three decode steps, a truncation
   and a 3-token verification pass, under full and a plan that skips layers (kv engines) and MLPs
   (attn engines): every logit identical to OrtModel's (fp16 KV cache);
4. ``kv_cache``: a prefilled cache's rows on the device, its clone, a prefix copy into a smaller
   cache (other pitch) and a truncation: rows identical, and each continues with the logits of
   the original pass;
5. ``greedy``: ``full`` for N greedy tokens through ``Engine(backend="tensorrt")``, identical to
   ``Engine(backend="onnxruntime")``;
6. ``memory``: every cudaMalloc freed (counted), and cudaMemGetInfo back to where it started
   (within 4 MiB: the driver's granularity; the streams' own memory).

Exit status: 0 every check held, 1 one did not, 2 nothing ran (no cuda-python runtime bindings,
or no GPU). ``--host-memory`` runs it all on HostCudaRuntime (host memory for device memory), as
tests/test_cuda_check.py does: everything but the real CUDA calls.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]  # gpu_check beside it; this checkout's edgeroute before an installed one
from gpu_check import CHAT, TEXT, _export, _step  # noqa: E402  (the GPU check's steps and texts)

TOKENS = 64
# the stand-in engines' prefill limit: N teacher-forced tokens run in several passes. ONNX Runtime
# CPU's results depend on a pass's shape (a 40-token prompt in passes of 32 and 8 is not
# bit-identical to one pass of 40), so the reference (OrtModel) runs the same passes
PREFILL_TOKENS = 32
LEAK_SLACK = 4 << 20  # bytes cudaMemGetInfo may differ by after everything is freed
NO_BINDINGS = ("cuda_check needs cuda-python's CUDA runtime bindings (`from cuda.bindings import runtime` failed: "
               "{error}): pip install 'cuda-python>=12.8,<13' on a machine with an NVIDIA GPU and CUDA 12 "
               "(or pass --host-memory for a run on host memory that checks everything but CUDA)")


class CountingRuntime:
    """A CUDA runtime (cuda.bindings.runtime or HostCudaRuntime) whose cudaMalloc/cudaFree are
    counted: the addresses still allocated are ``live``."""

    def __init__(self, cudart: Any) -> None:
        self._cudart, self.live, self.allocations = cudart, {}, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cudart, name)

    def cudaMalloc(self, nbytes):
        result = self._cudart.cudaMalloc(nbytes)
        if result[0] == self._cudart.cudaError_t.cudaSuccess:
            self.live[int(result[1])] = nbytes
            self.allocations += 1
        return result

    def cudaFree(self, address):
        result = self._cudart.cudaFree(address)
        if result[0] == self._cudart.cudaError_t.cudaSuccess:
            self.live.pop(int(address), None)
        return result


def load_cudart() -> Any:
    """cuda-python's runtime bindings; ImportError (or OSError) where they are not installed."""
    from cuda.bindings import runtime

    return runtime


def _checked(cudart: Any, result: tuple[Any, ...], call: str) -> tuple[Any, ...]:
    if result[0] != cudart.cudaError_t.cudaSuccess:
        raise RuntimeError(f"CUDA {call} failed: {result[0]}")
    return result[1:]


def _text(value: Any) -> str:
    return value.decode(errors="replace").rstrip("\0") if isinstance(value, bytes) else str(value)


def free_bytes(cudart: Any) -> int:
    return int(_checked(cudart, cudart.cudaMemGetInfo(), "cudaMemGetInfo")[0])


@contextlib.contextmanager
def standins(bundle: Any, cudart: Any, root: Path, limits: Any) -> Iterator[Any]:
    """The TensorRT backend on ``cudart`` with the stand-in engines (built into ``root``) for TensorRT."""
    from edgeroute.runtime.backends import tensorrt as trt_backend
    from edgeroute.runtime.backends.tensorrt_standins import STANDIN_GPU, StandinTensorRT, build_standin_engines

    build_standin_engines(bundle, root, limits, roles=("llm",))
    standin = StandinTensorRT(bundle, cudart)
    saved = trt_backend.gpu_modules, trt_backend.gpu_identity
    trt_backend.gpu_modules, trt_backend.gpu_identity = (lambda: (standin, cudart)), (lambda: STANDIN_GPU)
    try:
        yield standin
    finally:
        trt_backend.gpu_modules, trt_backend.gpu_identity = saved


def teacher_ids(bundle: Any, tokens: int) -> np.ndarray:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(bundle.file(bundle.tokenizer["file"])))
    ids = tokenizer.encode(TEXT * (tokens // 4 + 1)).ids[:tokens]
    if len(ids) < tokens:
        raise ValueError(f"the teacher text has {len(ids)} tokens, not {tokens}")
    return np.asarray(ids, np.int64)


def _same(got: np.ndarray, want: np.ndarray) -> dict:
    rel = float(np.abs(got - want).max() / max(float(np.abs(want).max()), 1e-30)) if got.shape == want.shape else None
    return {"identical": got.shape == want.shape and bool(np.array_equal(got, want)), "max_rel": rel}


def _rows(model: Any, cache: Any, length: int) -> np.ndarray:
    """Every layer's keys and values of positions [0, length), read from the device."""
    shape = (length, *cache.shape[1:])
    return np.stack([model.device.download(cache.address(buffer, layer, 0), shape, cache.dtype)
                     for buffer in (cache.keys, cache.values) for layer in range(cache.layers)])


def run_checks(logdir: Path, cudart: Any, bundle_path: Path | None = None, tokens: int = TOKENS) -> dict:
    """Every check on ``cudart`` (the real runtime bindings, or HostCudaRuntime); the results."""
    from edgeroute.bundle import Bundle
    from edgeroute.runtime import Engine, OrtModel
    from edgeroute.runtime.backends.tensorrt import CudaDevice, TrtModel
    from edgeroute.runtime.backends.tensorrt_engines import EngineLimits
    from edgeroute.runtime.layers import RUN, SKIP_MLP

    started = time.perf_counter()
    logdir.mkdir(parents=True, exist_ok=True)
    counting = CountingRuntime(cudart)
    results: dict = {"memory_kind": "host (HostCudaRuntime stand-in)" if type(cudart).__name__ == "HostCudaRuntime"
                     else "device (cuda.bindings.runtime)", "tokens": tokens}
    state: dict = {"CudaDevice": CudaDevice(counting)}  # creates the primary context before the baseline
    state["free_at_start"] = free_bytes(cudart)
    state["lowest_free"] = state["free_at_start"]

    def sample() -> None:
        state["lowest_free"] = min(state["lowest_free"], free_bytes(cudart))

    @_step(results, "device")
    def _():
        props = _checked(cudart, cudart.cudaGetDeviceProperties(0), "cudaGetDeviceProperties")[0]
        runtime = _checked(cudart, cudart.cudaRuntimeGetVersion(), "cudaRuntimeGetVersion")[0]
        driver = _checked(cudart, cudart.cudaDriverGetVersion(), "cudaDriverGetVersion")[0]
        return {"name": _text(props.name), "compute_capability": f"{props.major}.{props.minor}",
                "total_mib": int(props.totalGlobalMem) >> 20, "free_mib": state["free_at_start"] >> 20,
                "cuda_runtime": int(runtime), "cuda_driver": int(driver)}

    @_step(results, "bundle")
    def _():
        path = bundle_path or logdir / "smollm2-tensorrt"
        if bundle_path is None:
            _export(path, "--target", "tensorrt", "--quant", "int4-rtn")
        bundle = Bundle.open(path)
        if bundle.target.name != "tensorrt":
            raise ValueError(f"{path} is a bundle of the {bundle.target.name} target: export it with --target tensorrt")
        context = min(int(bundle.generation["context_length"]), 512)
        state["bundle"], state["limits"] = bundle, EngineLimits(context, min(PREFILL_TOKENS, context), 16, 1 << 30)
        return {"path": str(path), "layers": bundle.llm.arch.num_layers, "context": context,
                "prefill_tokens": state["limits"].prefill_tokens, "decode_tokens": state["limits"].decode_tokens}

    if "bundle" not in state:  # nothing else can run
        results["seconds"] = round(time.perf_counter() - started, 1)
        return results
    bundle, engines = state["bundle"], logdir / "standin-engines"
    layers = bundle.llm.arch.num_layers
    skipping = [i == 0 or i % 3 != 1 for i in range(layers)]  # a kv engine on every third layer

    def mlp_skipping(layer: int, hidden: np.ndarray) -> str:  # decided per layer: the hidden states are read back
        return SKIP_MLP if layer % 4 == 2 else RUN  # (attn engines)

    with standins(bundle, counting, engines, state["limits"]) as standin:

        @_step(results, "logits")
        def _():
            ids = teacher_ids(bundle, tokens)
            model, reference = TrtModel(bundle, "llm", engines), OrtModel(bundle, kv_dtype="float16")
            reference.chunk_tokens = model.chunk_tokens  # the engines' passes (PREFILL_TOKENS)
            out = {}
            for name, plan in (("full", None), ("skip_layers", skipping), ("skip_mlps", mlp_skipping)):
                mine, theirs = model.new_cache(), reference.new_cache()
                checks = [_same(model.forward(mine, ids, plan=plan, all_logits=True),
                                reference.forward(theirs, ids, plan=plan, all_logits=True))]
                for token in ids[:3]:  # decode steps (the decode profile)
                    checks.append(_same(model.forward(mine, [int(token)], plan=plan),
                                        reference.forward(theirs, [int(token)], plan=plan)))
                mine.truncate(tokens + 1)
                theirs.truncate(tokens + 1)
                checks.append(_same(model.forward(mine, ids[3:6], plan=plan, tail=3),
                                    reference.forward(theirs, ids[3:6], plan=plan, tail=3)))
                rels = [c["max_rel"] for c in checks if c["max_rel"] is not None]
                out[name] = {"identical": all(c["identical"] for c in checks), "calls": len(checks),
                             "max_rel": max(rels) if rels else None}
                sample()
            passes = sorted({(profile, n) for graph, profile, n in standin.calls if graph == "embed"})
            kinds = sorted({graph.split("_")[0] for graph, _, _ in standin.calls})
            if not all(v["identical"] for v in out.values()):
                raise AssertionError(f"logits differ from ONNX Runtime's: {out}")
            return {**out, "passes": [f"{p}:{n}" for p, n in passes], "engines_run": kinds}

        @_step(results, "kv_cache")
        def _():
            ids = teacher_ids(bundle, tokens)
            model = TrtModel(bundle, "llm", engines)
            half = tokens // 2
            original = model.new_cache()
            want = model.forward(original, ids, all_logits=True)
            rows = _rows(model, original, tokens)
            clone = original.clone()
            prefix = model.new_cache(tokens + 8)  # another capacity: another pitch between layers
            prefix.copy_from(original, half)
            original.truncate(half)
            checks = {
                "clone_rows": bool(np.array_equal(_rows(model, clone, tokens), rows)) and clone.length == tokens,
                "prefix_copy_rows": bool(np.array_equal(_rows(model, prefix, half), rows[:, :half]))
                and prefix.length == half,
                "truncated_rows_kept": bool(np.array_equal(_rows(model, original, half), rows[:, :half])),
            }
            again = model.forward(original, ids[half:], all_logits=True)  # rewrites the truncated rows
            checks["truncate_then_forward_logits"] = bool(np.array_equal(again, want[half:]))
            checks["truncate_then_forward_rows"] = bool(np.array_equal(_rows(model, original, tokens), rows))
            checks["prefix_copy_continues"] = bool(np.array_equal(model.forward(prefix, ids[half:], all_logits=True),
                                                                  want[half:]))
            step = [int(ids[0])]
            checks["clone_continues"] = bool(np.array_equal(model.forward(clone, step), model.forward(original, step)))
            sample()
            if not all(checks.values()):
                raise AssertionError(f"a device cache did not round-trip: {checks}")
            return {**checks, "cache_mib": round(2 * original.layers * original.layer_bytes / 2**20, 2)}

        @_step(results, "greedy")
        def _():
            cpu = Engine(bundle, slm=False, backend="onnxruntime", kv_dtype="float16")
            cpu.llm.chunk_tokens = state["limits"].prefill_tokens  # the engines' passes (PREFILL_TOKENS)
            want = cpu.generate(CHAT, mode="full", max_new_tokens=tokens).tokens
            got = Engine(bundle, slm=False, backend="tensorrt", engine_cache=str(engines)).generate(
                CHAT, mode="full", max_new_tokens=tokens).tokens
            sample()
            same = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
            out = {"tokens": len(got), "identical": got == want, "first_difference": None if got == want else same}
            if got != want or len(got) < tokens:
                raise AssertionError(f"greedy tokens: {out} (want {tokens} identical)")
            return out

    @_step(results, "memory")
    def _():
        state.pop("CudaDevice")
        gc.collect()
        final = free_bytes(cudart)
        leaked = state["free_at_start"] - final
        out = {"allocations": counting.allocations, "still_allocated": len(counting.live),
               "still_allocated_bytes": sum(counting.live.values()),
               "peak_used_mib": round((state["free_at_start"] - state["lowest_free"]) / 2**20, 1),
               "free_at_start_mib": state["free_at_start"] >> 20, "free_at_end_mib": final >> 20,
               "not_returned_bytes": leaked}
        if counting.live or leaked > LEAK_SLACK or not counting.allocations:
            raise AssertionError(f"device memory not freed: {out}")
        return out

    results["seconds"] = round(time.perf_counter() - started, 1)
    results["within_5_minutes"] = results["seconds"] < 300
    return results


def report(results: dict, logdir: Path) -> int:
    """The table, the JSON; the exit status (0: every check held)."""
    (logdir / "cuda_check.json").write_text(json.dumps(results, indent=1, default=str))
    steps = {name: r for name, r in results.items() if isinstance(r, dict) and "ok" in r}
    print(f"\ncheck      held   seconds  ({results['memory_kind']})")
    for name, result in steps.items():
        summary = result.get("error") or ", ".join(
            f"{k}={('identical' if v['identical'] else 'DIFFERS') if isinstance(v, dict) else v}"
            for k, v in result.items() if k not in ("ok", "seconds", "trace") and (not isinstance(v, dict) or "identical" in v))
        print(f"{name:10} {'yes' if result['ok'] else 'NO':6} {result['seconds']:7}  {summary[:150]}")
    print(f"\ntotal {results['seconds']} s; all figures: {logdir / 'cuda_check.json'}")
    held = steps and all(r["ok"] for r in steps.values()) and len(steps) == 6 and results.get("within_5_minutes")
    return 0 if held else 1


def main(argv: list[str] | None = None, cudart: Any = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logdir", type=Path)
    parser.add_argument("--bundle", type=Path, help="a bundle of the tensorrt target (default: export the demo)")
    parser.add_argument("--tokens", type=int, default=TOKENS, help="teacher-forced and greedy tokens (default 64)")
    parser.add_argument("--host-memory", action="store_true",
                        help="host memory for device memory (HostCudaRuntime): everything but the CUDA calls")
    args = parser.parse_args(argv)
    if cudart is None:
        if args.host_memory:
            from edgeroute.runtime.backends.tensorrt_standins import HostCudaRuntime

            cudart = HostCudaRuntime()
        else:
            try:
                cudart = load_cudart()
            except (ImportError, OSError) as err:  # OSError: the package is there, CUDA's libraries do not load
                print(NO_BINDINGS.format(error=f"{type(err).__name__}: {err}"), file=sys.stderr)
                return 2
    from edgeroute.errors import EdgerouteError
    from edgeroute.runtime.backends.tensorrt import CudaDevice

    try:
        CudaDevice(cudart)  # no GPU (InputError), or CUDA does not start (a stream cannot be created)
    except EdgerouteError as err:
        print(f"cuda_check: {err}", file=sys.stderr)
        return 2
    results = run_checks(args.logdir, cudart, args.bundle, args.tokens)
    return report(results, args.logdir)


if __name__ == "__main__":
    sys.exit(main())
