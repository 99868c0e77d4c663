"""tools/device/cuda_check.py (issue 43, item 5) without a GPU: every check on the CPU stand-in
for the CUDA runtime (HostCudaRuntime, host memory for device memory) that the TensorRT backend's
tests use, so everything but the real CUDA calls runs here; and the refusals (no cuda-python
runtime bindings, no GPU: exit 2 with the reason)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from edgeroute.runtime.backends import tensorrt as trt_backend
from edgeroute.runtime.backends.tensorrt_standins import HostCudaRuntime
from tests.conftest import export_tiny

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "device" / "cuda_check.py"


@pytest.fixture(scope="module")
def cuda_check():
    spec = importlib.util.spec_from_file_location("cuda_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def trt_bundle_path(tiny_models, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cuda-check") / "llama"
    export_tiny(tiny_models["llama"][0], out, quant="int4-rtn", target="tensorrt")
    return out


def test_every_check_holds_on_the_host_stand_in_for_cuda(cuda_check, trt_bundle_path, tmp_path, capsys):
    saved = trt_backend.gpu_modules, trt_backend.gpu_identity
    cudart = HostCudaRuntime()
    # 40 tokens: passes of 32 (prefill) and 8 (decode: the engines take up to 16), then decode steps
    assert cuda_check.main([str(tmp_path), "--bundle", str(trt_bundle_path), "--tokens", "40"], cudart=cudart) == 0
    assert (trt_backend.gpu_modules, trt_backend.gpu_identity) == saved  # the stand-ins were uninstalled
    results = json.loads((tmp_path / "cuda_check.json").read_text())
    assert results["memory_kind"].startswith("host") and results["within_5_minutes"]
    for name in ("device", "bundle", "logits", "kv_cache", "greedy", "memory"):
        assert results[name]["ok"], (name, results[name])
    logits = results["logits"]
    assert all(logits[plan]["identical"] and logits[plan]["max_rel"] == 0.0 for plan in ("full", "skip_layers", "skip_mlps"))
    assert {"prefill:32", "decode:8", "decode:1", "decode:3"} <= set(logits["passes"])
    assert {"embed", "layer", "attn", "kv", "head"} == set(logits["engines_run"])
    assert results["greedy"] == {**results["greedy"], "tokens": 40, "identical": True}
    memory = results["memory"]
    assert memory["allocations"] > 0 and memory["still_allocated"] == 0 and memory["not_returned_bytes"] == 0
    assert memory["peak_used_mib"] > 0 and not cudart.buffers  # every stand-in "cudaMalloc" freed
    table = capsys.readouterr().out
    for name in ("logits", "kv_cache", "greedy", "memory"):
        assert f"\n{name:10} yes" in table


def test_memory_kept_alive_fails_the_memory_check(cuda_check, trt_bundle_path, tmp_path, monkeypatch):
    from edgeroute.runtime.backends.tensorrt import DeviceBuffer

    kept = []
    original = DeviceBuffer.__init__

    def keep(self, device, nbytes):  # a leak: the backend's buffers never released
        original(self, device, nbytes)
        kept.append(self)

    monkeypatch.setattr(DeviceBuffer, "__init__", keep)
    results = cuda_check.run_checks(tmp_path, HostCudaRuntime(), trt_bundle_path, tokens=8)
    assert results["logits"]["ok"] and not results["memory"]["ok"]
    assert "device memory not freed" in results["memory"]["error"]


def test_without_cuda_bindings_it_exits_2_saying_what_to_install(cuda_check, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "cuda", None)  # `from cuda.bindings import runtime` fails as where not installed
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    assert cuda_check.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "cuda_check needs cuda-python's CUDA runtime bindings" in err and "pip install 'cuda-python" in err
    assert not (tmp_path / "cuda_check.json").exists()


@pytest.mark.skipif(importlib.util.find_spec("cuda") is not None, reason="cuda-python is installed here")
def test_the_script_without_cuda_bindings_exits_2_with_the_message(tmp_path):
    result = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "log")], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2, result.stderr
    assert "from cuda.bindings import runtime` failed" in result.stderr


def test_without_a_gpu_it_exits_2_saying_so(cuda_check, tmp_path, capsys):
    assert cuda_check.main([str(tmp_path)], cudart=HostCudaRuntime(devices=0)) == 2
    assert "needs an NVIDIA GPU" in capsys.readouterr().err


def test_stand_in_engines_copy_on_the_bindings_stream_type():
    """cuda.bindings.runtime takes its own cudaStream_t; the stand-ins are given TensorRT's int handle."""
    import numpy as np

    from edgeroute.runtime.backends.tensorrt_standins import StreamCopies

    class Stream(int):
        pass

    class Bindings(HostCudaRuntime):
        cudaStream_t = Stream
        streams: list = []

        def cudaMemcpyAsync(self, destination, source, nbytes, kind, stream):
            self.streams.append(stream)
            return super().cudaMemcpyAsync(destination, source, nbytes, kind, stream)

    cudart = Bindings()
    address = cudart.cudaMalloc(64)[1]
    copies = StreamCopies(cudart)
    copies.write(address, np.arange(4, dtype=np.float32), 7)
    assert copies.read(address, (4,), "float32", 7).tolist() == [0, 1, 2, 3]
    assert cudart.streams == [7, 7] and all(type(s) is Stream for s in cudart.streams)
