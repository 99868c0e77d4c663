"""The TensorRT backend (``backend="tensorrt"``, edgeroute/runtime/backends/tensorrt.py) without a GPU.

What a CPU can test: the refusals (no TensorRT or cuda-python, no GPU, a bundle of the default
target, engines missing or stale), the optimisation profile per call, the device cache's
bookkeeping, and the whole data flow of a pass, run against stand-ins for TensorRT and the CUDA
runtime (edgeroute/runtime/backends/tensorrt_standins.py: ``StandinTensorRT``, each "engine" its
graph on ONNX Runtime, checked against the optimisation profile it runs in, and
``HostCudaRuntime``, host memory for device memory; tools/device/cuda_check.py runs the same
stand-in engines on a GPU's memory). On those stand-ins every decoding mode must give OrtModel's
tokens exactly: the same graphs do the arithmetic, so any difference is the backend's
addressing, caching or scheduling. TensorRT itself on a GPU:
tests/test_gpu.py and tools/device/gpu_check.sh (not yet run on hardware)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest

from edgeroute.bundle import Bundle
from edgeroute.errors import InputError
from edgeroute.runtime import Engine, OrtModel
from edgeroute.runtime.backend import open_model
from edgeroute.runtime.backends import tensorrt as trt_backend
from edgeroute.runtime.backends.tensorrt import CudaDevice, DeviceKVCache, TrtModel, check_engine_io, tensor_shape
from edgeroute.runtime.backends.tensorrt_engines import (
    PROFILES,
    EngineCache,
    EngineLimits,
    choose_profile,
    engine_graphs,
    find_engines,
)
from edgeroute.runtime.backends.tensorrt_standins import (
    STANDIN_GPU,
    STANDIN_VERSION,
    HostCudaRuntime,
    StandinTensorRT,
    build_standin_engines,
    host_view,
)
from edgeroute.runtime.layers import DROP, RUN, SKIP, SKIP_MLP
from edgeroute.runtime.options import EngineOptions
from tests.conftest import export_tiny

GPU = STANDIN_GPU
VERSION = STANDIN_VERSION
LIMITS = EngineLimits(256, 64, 16, 1 << 30)  # passes of 64: a longer prompt runs in several
PROMPT = [1, 504, 3458, 282, 4649, 314, 253, 17]


@pytest.fixture(scope="module")
def trt_bundle(tiny_models, tmp_path_factory) -> Bundle:
    """A tiny tensorrt-target bundle with an SLM (its own first layer)."""
    src = tiny_models["llama"][0]
    out = tmp_path_factory.mktemp("trt-backend") / "llama"
    export_tiny(src, out, quant="int4-rtn", target="tensorrt", slm=str(src), slm_layers=1)
    return Bundle.open(out)


def build_fake_engines(bundle: Bundle, root: Path, limits: EngineLimits = LIMITS, **options) -> EngineCache:
    """What build-engines would leave in ``root`` (the stand-ins' engines, tensorrt_standins)."""
    return build_standin_engines(bundle, root, limits, **options)


@pytest.fixture
def fake_gpu(trt_bundle, tmp_path, monkeypatch):
    """The stand-ins installed, engines "built" into tmp_path/engines; the fake TensorRT (its calls)."""
    cudart = HostCudaRuntime()
    fake = StandinTensorRT(trt_bundle, cudart)
    monkeypatch.setattr(trt_backend, "gpu_modules", lambda: (fake, cudart))
    monkeypatch.setattr(trt_backend, "gpu_identity", lambda: GPU)
    build_fake_engines(trt_bundle, tmp_path / "engines")
    fake.root = tmp_path / "engines"
    return fake


# -- refusals ----------------------------------------------------------------------------------------

def test_without_tensorrt_or_cuda_python_the_backend_is_refused_naming_what_to_install(trt_bundle, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # `import tensorrt` fails as where it is not installed
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    with pytest.raises(InputError, match=r"pip install 'edgeroute\[gpu\]'") as err:
        Engine(trt_bundle, backend="tensorrt", slm=False)
    assert "tensorrt" in str(err.value) and "cuda-python" in str(err.value)


def test_a_bundle_of_the_default_target_is_refused_before_anything_is_imported(tiny_bundles, monkeypatch):
    monkeypatch.setattr(trt_backend, "gpu_modules", lambda: pytest.fail("imported TensorRT for a bundle it cannot run"))
    with pytest.raises(InputError, match="--target tensorrt"):
        open_model(Bundle.open(tiny_bundles["llama"]), "llm", EngineOptions(backend="tensorrt"))


@pytest.mark.parametrize(("setting", "named"), [({"attention": "ort"}, "attention='ort'"),
                                                ({"kernels": "avx2"}, "kernels='avx2'"),
                                                ({"activations": "fp32"}, "activations='fp32'"),
                                                ({"kv_dtype": "float32"}, "float16 KV cache")])
def test_settings_of_the_other_backends_are_refused_naming_them(trt_bundle, setting, named):
    with pytest.raises(InputError, match=named):
        open_model(trt_bundle, "llm", EngineOptions(backend="tensorrt", **setting))


def test_without_a_gpu_the_backend_is_refused_saying_so():
    with pytest.raises(InputError, match="needs an NVIDIA GPU.*cudaErrorNoDevice"):
        CudaDevice(HostCudaRuntime(devices=0))


def test_missing_engines_are_refused_naming_the_build_command(trt_bundle, tmp_path):
    graphs = ["llm/embed"]
    with pytest.raises(InputError, match=f"no TensorRT engines.*`edgeroute build-engines {trt_bundle.path} "
                                         "--profile DEVICE`"):
        find_engines(trt_bundle, "llm", GPU, VERSION, graphs)  # the default cache, beside the bundle: none
    with pytest.raises(InputError, match=f"--role slm --cache {tmp_path}`"):
        find_engines(trt_bundle, "slm", GPU, VERSION, ["slm/embed"], tmp_path)


def test_stale_engines_are_refused_saying_why_and_the_intact_ones_found(trt_bundle, tmp_path):
    llm = [f"llm/{g.name}" for g in engine_graphs(trt_bundle, "llm", ("embed", "layer", "head"))]
    cache = build_fake_engines(trt_bundle, tmp_path, roles=("llm",), kinds=("embed", "layer", "head"))
    found = find_engines(trt_bundle, "llm", GPU, VERSION, llm, tmp_path)
    assert found.directory == cache.directory and found.key.limits == LIMITS  # the limits come from the entry
    with pytest.raises(InputError, match="stale .built for GPU Fake GPU .sm_00., this is Orin"):
        find_engines(trt_bundle, "llm", "Orin (sm_87)", VERSION, llm, tmp_path)
    with pytest.raises(InputError, match="stale .built for TensorRT 10.99.0-fake, this is 10.3.0"):
        find_engines(trt_bundle, "llm", GPU, "10.3.0", llm, tmp_path)
    with pytest.raises(InputError, match=r"stale .2 engines not built, e.g. slm/embed.*--role slm"):
        find_engines(trt_bundle, "slm", GPU, VERSION, ["slm/embed", "slm/head"], tmp_path)
    reexported = Bundle(trt_bundle.path, {**trt_bundle.manifest, "files": {
        **trt_bundle.manifest["files"], "manifest-extra": {"sha256": "0" * 64, "bytes": 1}}})
    with pytest.raises(InputError, match="stale .built from another export of the bundle"):
        find_engines(reexported, "llm", GPU, VERSION, llm, tmp_path)
    cache.engine_path("llm/head").write_bytes(b"damaged")
    with pytest.raises(InputError, match="stale .an engine file was changed or damaged.*build-engines"):
        find_engines(trt_bundle, "llm", GPU, VERSION, llm, tmp_path)


def test_skipping_without_the_sub_layer_engines_is_refused_naming_the_build(trt_bundle, fake_gpu, tmp_path):
    root = tmp_path / "full-only"
    build_fake_engines(trt_bundle, root, roles=("llm",), kinds=("embed", "layer", "head"))
    model = TrtModel(trt_bundle, "llm", root)
    model.forward(model.new_cache(), PROMPT)  # full needs embed, layer, head only
    with pytest.raises(InputError, match=r"the kv engines.*llm/kv_000 is not built.*build-engines"):
        model.forward(model.new_cache(), PROMPT, plan=[False, True, True])


# -- profiles, shapes, engine I/O ------------------------------------------------------------------------

@pytest.mark.parametrize(("tokens", "profile"), [(1, "decode"), (16, "decode"), (17, "prefill"), (64, "prefill")])
def test_a_call_runs_in_decode_up_to_decode_tokens_and_in_prefill_beyond(tokens, profile):
    assert PROFILES[choose_profile(tokens, LIMITS)] == profile


@pytest.mark.parametrize("tokens", [0, 65])
def test_a_call_outside_the_prefill_limit_is_refused(tokens):
    with pytest.raises(InputError, match=r"outside what the engines take \(1..64"):
        choose_profile(tokens, LIMITS)


def test_input_shapes_follow_the_graphs_symbolic_dimensions(trt_bundle):
    layer = trt_bundle.llm.graphs["layer_000_kv16"]
    spec = {s["name"]: s for s in layer.inputs}
    dims = {"tokens": 3, "past": 10, "total": 13}
    arch = trt_bundle.llm.arch
    assert tensor_shape(spec["attn_bias"], dims) == (3, 13)
    assert tensor_shape(spec["past_key"], dims) == (10, arch.num_kv_heads, arch.head_dim)
    assert tensor_shape(spec["cos"], dims) == (3, 1, arch.head_dim)


def test_an_engine_whose_io_is_not_its_graphs_is_refused(trt_bundle):
    graph = trt_bundle.llm.graphs["kv_000"]
    io = {**{s["name"]: (s["dtype"], True) for s in graph.inputs}, **{s["name"]: (s["dtype"], False) for s in graph.outputs}}
    check_engine_io(graph, io, "float16")
    with pytest.raises(Exception, match="does not take the graph's I/O"):
        check_engine_io(graph, {**io, "key": ("float32", False)}, "float16")
    with pytest.raises(Exception, match="does not take the graph's I/O"):
        check_engine_io(graph, {k: v for k, v in io.items() if k != "sin"}, "float16")
    with pytest.raises(Exception, match="K/V must be float32"):
        check_engine_io(graph, io, "float32")


# -- the device cache's bookkeeping -------------------------------------------------------------------

def _cache(capacity: int, device: CudaDevice, layers: int = 2) -> DeviceKVCache:
    return DeviceKVCache(device, layers, capacity, 3, 8)


def _rows(cache: DeviceKVCache, layer: int, stop: int) -> np.ndarray:
    return host_view(cache.address(cache.keys, layer, 0), (stop, 3, 8), "float16").copy()


def test_device_caches_truncate_copy_and_clone_within_their_bounds():
    device = CudaDevice(HostCudaRuntime())
    source, target = _cache(32, device), _cache(16, device)
    for layer in range(2):  # rows as an engine would leave them
        host_view(source.address(source.keys, layer, 0), (32, 3, 8), "float16")[...] = layer + np.arange(32)[:, None, None]
    source.length = 20
    source.drop(1, 4, 2)
    with pytest.raises(ValueError, match="cannot copy 17 positions"):
        target.copy_from(source, 17)  # more than the target holds
    target.copy_from(source, 12)  # a prefix, between caches of different capacities (pitches)
    assert target.length == 12 and target.dropped[1, 4:6].all() and not target.dropped[0].any()
    for layer in range(2):
        assert np.array_equal(_rows(target, layer, 12), _rows(source, layer, 12))
    with pytest.raises(ValueError, match="cannot truncate a cache of 12 tokens to 13"):
        target.truncate(13)
    target.truncate(5)
    assert target.length == 5 and target.dropped[1, 4] and not target.dropped[1, 5]
    clone = source.clone()
    assert clone.capacity == 32 and clone.length == 20 and clone.keys.address != source.keys.address
    assert np.array_equal(_rows(clone, 1, 20), _rows(source, 1, 20))
    with pytest.raises(ValueError, match="different models"):
        target.copy_from(_cache(16, device, layers=3))
    clone.reset()
    assert clone.length == 0 and clone.dropped is None


# -- the backend on the stand-ins: every mode gives OrtModel's tokens -------------------------------------

def _plans(model):
    def callable_plan(layer, hidden):
        assert hidden.shape[1] == model.arch.hidden_size
        return (RUN, SKIP_MLP, SKIP)[layer % 3] if hidden.shape[0] > 1 else (SKIP_MLP, DROP, RUN)[layer % 3]
    return [None, [True, False, True], callable_plan]


@pytest.mark.parametrize("aligned_rows", [False, True], ids=["staged-rows", "rows-in-place"])
def test_forward_on_the_stand_ins_matches_onnx_runtime_exactly(trt_bundle, fake_gpu, monkeypatch, aligned_rows):
    if aligned_rows:  # the tiny model's 64-byte rows count as aligned: the engines write into the cache
        monkeypatch.setattr(trt_backend, "ALIGNMENT", 64)
    model = TrtModel(trt_bundle, "llm", fake_gpu.root)
    assert (model._staged is None) == aligned_rows
    ort_model = OrtModel(trt_bundle, kv_dtype="float16")
    prompt = (PROMPT * 13)[:100]  # two passes of at most 64 tokens
    for plan in _plans(model):
        mine, theirs = model.new_cache(), ort_model.new_cache()
        want = ort_model.forward(theirs, prompt, plan=plan, all_logits=True)
        assert np.array_equal(model.forward(mine, prompt, plan=plan, all_logits=True), want)
        for token in (17, 504, 282):  # decode steps, then a verification pass of 3
            assert np.array_equal(model.forward(mine, [token], plan=plan), ort_model.forward(theirs, [token], plan=plan))
        mine.truncate(101)
        theirs.truncate(101)
        assert np.array_equal(model.forward(mine, [5, 6, 7], plan=plan, tail=3),
                              ort_model.forward(theirs, [5, 6, 7], plan=plan, tail=3))
    passes = [(name, profile, tokens) for name, profile, tokens in fake_gpu.calls if name == "embed"]
    assert ("embed", "prefill", 64) in passes and ("embed", "prefill", 36) in passes
    assert ("embed", "decode", 1) in passes and ("embed", "decode", 3) in passes


def test_every_mode_on_the_stand_ins_gives_onnx_runtimes_tokens(trt_bundle, fake_gpu):
    trt_engine = Engine(trt_bundle, backend="tensorrt", engine_cache=str(fake_gpu.root))
    ort_engine = Engine(trt_bundle, backend="onnxruntime", kv_dtype="float16")
    assert trt_engine.llm.flavour == "tensorrt" and trt_engine.context_length == LIMITS.context
    turn = [{"role": "user", "content": "Give me three tips for staying awake on a long drive."}]
    skipping = dict(scorer="random", importance_threshold=0.6, skip_ratio=0.5, protected_first=1, protected_last=0,
                    max_free_layers=1, re_eval_interval=1, fallback=None)  # as tests/test_decoding.py skips
    for mode, extra in [("full", {}), ("slm", {}), ("route", {"router": "entropy", "route_threshold": 1.0}),
                        ("speculate", {"light": "ngram+slm"}), ("skip", skipping),
                        ("skip", {**skipping, "granularity": "mlp", "protected_first": 0}),
                        ("speculate+skip", {**skipping, "light": "ngram"}),
                        ("skip", {**skipping, "kv_cache_reduction": True, "protected_first": 0})]:
        want = ort_engine.generate(turn, mode=mode, max_new_tokens=24, **extra).tokens
        got = trt_engine.generate(turn, mode=mode, max_new_tokens=24, **extra).tokens
        assert got == want, mode
    ran = {name.split("_")[0] for name, _, _ in fake_gpu.calls}
    assert {"kv", "attn"} <= ran, f"no layer or MLP was skipped ({ran}): the skip modes proved nothing"


def test_an_engine_context_shorter_than_the_bundles_bounds_the_sessions(trt_bundle, fake_gpu, tmp_path):
    root = tmp_path / "short"
    build_fake_engines(trt_bundle, root, dataclasses.replace(LIMITS, context=128))
    engine = Engine(trt_bundle, backend="tensorrt", engine_cache=str(root), slm=False)
    assert engine.context_length == 128  # the engines' context, not the bundle's 256
    with pytest.raises(InputError, match="exceeds the 128 positions the tensorrt backend takes"):
        Engine(trt_bundle, backend="tensorrt", engine_cache=str(root), slm=False, context_length=200)
    with pytest.raises(InputError, match="exceeds the 128 the TensorRT engines were built for.*build-engines"):
        engine.llm.new_cache(200)


def test_edgeroute_run_takes_the_tensorrt_backend_and_its_engine_cache(trt_bundle, fake_gpu):
    from typer.testing import CliRunner

    from edgeroute.cli import app

    result = CliRunner().invoke(app, ["run", str(trt_bundle.path), "--backend", "tensorrt", "--engine-cache",
                                      str(fake_gpu.root), "--raw", "--prompt", "The capital of France is",
                                      "--max-new-tokens", "4", "--mode", "speculate", "--light", "ngram+slm"])
    assert result.exit_code == 0, result.output
    assert "tensorrt, float16 KV cache" in result.output
