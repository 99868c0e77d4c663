"""GPU paths: onnxruntime-gpu (CUDA, TensorRT providers), TensorRT's own ONNX parser and engines, and
the TensorRT backend (backend="tensorrt").

They need an NVIDIA GPU and the `gpu` extra; elsewhere (CI has no GPU) they skip with the
reason. Run them on a GPU machine with `pytest -m gpu`."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from edgeroute.runtime import Bundle, OrtModel
from tests.conftest import export_tiny, relative_error

pytestmark = pytest.mark.gpu
PROMPT = [1, 504, 3458, 282, 4649, 314, 253, 17]


def _require_provider(name: str) -> None:
    if name not in ort.get_available_providers():
        pytest.skip(f"{name} is not available: needs an NVIDIA GPU and onnxruntime-gpu (pip install '.[gpu]')")


@pytest.fixture(scope="module")
def tiny_int4_bundle(tiny_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu") / "llama-int4"
    export_tiny(tiny_models["llama"][0], out, quant="int4-rtn")
    return out


@pytest.mark.parametrize("variant", [("portable", "float32"), ("ort", "float32"), ("portable", "float16")],
                         ids=["portable", "ort", "portable-kv16"])
@pytest.mark.parametrize("provider", ["CUDAExecutionProvider", "TensorrtExecutionProvider"])
@pytest.mark.parametrize("bundle_kind", ["fp32", "int4"])
def test_gpu_provider_matches_the_cpu(provider, bundle_kind, variant, request):
    """The GPU runs the portable graphs (auto picks them off the CPU provider) and agrees with
    the CPU in each flavour; with an fp16 KV cache, with the CPU's fp16 cache."""
    _require_provider(provider)  # before the fixtures: no exports where the test cannot run
    path = request.getfixturevalue("tiny_bundles")["llama"] if bundle_kind == "fp32" \
        else request.getfixturevalue("tiny_int4_bundle")
    bundle = Bundle.open(path)
    cpu_flavour, kv_dtype = variant
    cpu = OrtModel(bundle, attention=cpu_flavour, kv_dtype=kv_dtype)
    gpu = OrtModel(bundle, providers=[provider, "CPUExecutionProvider"], kv_dtype=kv_dtype)
    assert gpu.flavour == "portable" and gpu.new_cache().dtype == kv_dtype
    want = cpu.forward(cpu.new_cache(), PROMPT, all_logits=True)
    got = gpu.forward(gpu.new_cache(), PROMPT, all_logits=True)
    assert relative_error(got, want) <= (1e-3 if bundle_kind == "fp32" else 3e-2)
    assert np.array_equal(got.argmax(-1), want.argmax(-1))


def test_tensorrt_parses_every_graph_of_a_tensorrt_target_bundle(tiny_models, tmp_path_factory):
    """The default target's graphs hold what TensorRT rejects (`inspect --tensorrt` lists it);
    the tensorrt target's must all parse."""
    trt = pytest.importorskip("tensorrt", reason="TensorRT is not installed (pip install '.[gpu]' on a GPU machine)")
    try:
        builder = trt.Builder(trt.Logger(trt.Logger.WARNING))
    except Exception as err:  # no CUDA device: TensorRT cannot create a builder
        pytest.skip(f"TensorRT has no usable GPU here: {err}")
    out = tmp_path_factory.mktemp("gpu-parse") / "llama"
    export_tiny(tiny_models["llama"][0], out, quant="int4-rtn", target="tensorrt")
    bundle = Bundle.open(out)
    portable = list(bundle.llm.graphs.values())
    assert len(portable) == 4 * bundle.llm.num_layers + 2  # per layer: layer, attn (fp16 cache), mlp, kv
    for graph in portable:
        network = builder.create_network(0)
        parser = trt.OnnxParser(network, builder.logger)
        ok = parser.parse_from_file(str(bundle.file(graph.file)))
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        assert ok, f"{graph.file}: {errors}"


def test_build_engines_builds_a_tensorrt_target_bundle_then_reuses_the_cache(tiny_models, tmp_path_factory):
    """Not yet run on hardware (docs/guide/gpu.md)."""
    pytest.importorskip("tensorrt", reason="TensorRT is not installed (pip install '.[gpu]' on a GPU machine)")
    from edgeroute.runtime.backends.tensorrt_engines import gpu_identity
    from edgeroute.runtime.profiles import load_profile
    from edgeroute.tensorrt.engines import build_engines

    try:
        gpu_identity()
    except Exception as err:
        pytest.skip(f"no NVIDIA GPU here: {err}")
    root = tmp_path_factory.mktemp("gpu-engines")
    export_tiny(tiny_models["llama"][0], root / "trt", quant="int4-rtn", target="tensorrt")
    bundle = Bundle.open(root / "trt")
    first = build_engines(bundle, load_profile("cuda"), root / "cache")
    assert not first.reused and len(first.built) == 2 + 4 * bundle.llm.num_layers
    again = build_engines(bundle, load_profile("cuda"), root / "cache")
    assert again.reused and again.cache == first.cache


@pytest.mark.parametrize("provider", ["CUDAExecutionProvider", "TensorrtExecutionProvider"])
def test_gpu_provider_runs_the_tensorrt_target_like_the_cpu(provider, tiny_models, tmp_path_factory):
    """The tensorrt target's fp16 graphs on a GPU provider against the same graphs on the CPU."""
    _require_provider(provider)
    out = tmp_path_factory.mktemp("gpu-trt-target") / "llama"
    export_tiny(tiny_models["llama"][0], out, quant="int4-rtn", target="tensorrt")
    bundle = Bundle.open(out)
    cpu = OrtModel(bundle, kv_dtype="float16")
    gpu = OrtModel(bundle, providers=[provider, "CPUExecutionProvider"], kv_dtype="float16")
    want = cpu.forward(cpu.new_cache(), PROMPT, all_logits=True)
    got = gpu.forward(gpu.new_cache(), PROMPT, all_logits=True)
    assert relative_error(got, want) <= 1e-2


def _require_tensorrt_backend() -> None:
    """Skips (with the reason) where backend='tensorrt' cannot run: no TensorRT, cuda-python or GPU."""
    pytest.importorskip("tensorrt", reason="TensorRT is not installed (pip install '.[gpu]' on a GPU machine)")
    pytest.importorskip("cuda.bindings.runtime", reason="cuda-python is not installed (pip install '.[gpu]')")
    from edgeroute.runtime.backends.tensorrt_engines import gpu_identity

    try:
        gpu_identity()
    except Exception as err:
        pytest.skip(f"no NVIDIA GPU here: {err}")


def test_tensorrt_backend_runs_the_tensorrt_target_like_the_cpu(tiny_models, tmp_path_factory):
    """TrtModel's logits (every engine kind: a plan skipping a layer and an MLP) against ONNX
    Runtime CPU on the same graphs. Not yet run on hardware (docs/guide/gpu.md)."""
    _require_tensorrt_backend()
    from edgeroute.runtime.backends.tensorrt import TrtModel
    from edgeroute.runtime.layers import RUN, SKIP, SKIP_MLP
    from edgeroute.runtime.profiles import load_profile
    from edgeroute.tensorrt.engines import build_engines

    root = tmp_path_factory.mktemp("gpu-trt-backend")
    export_tiny(tiny_models["llama"][0], root / "llama", quant="int4-rtn", target="tensorrt")
    bundle = Bundle.open(root / "llama")
    build_engines(bundle, load_profile("cuda"), root / "engines")
    cpu = OrtModel(bundle, kv_dtype="float16")
    gpu = TrtModel(bundle, "llm", root / "engines")

    def plan(layer, hidden):
        return (RUN, SKIP_MLP, SKIP)[layer % 3]
    for each in (None, plan):
        cpu_cache, gpu_cache = cpu.new_cache(), gpu.new_cache()
        want = cpu.forward(cpu_cache, PROMPT, plan=each, all_logits=True)
        assert relative_error(gpu.forward(gpu_cache, PROMPT, plan=each, all_logits=True), want) <= 1e-2
        assert relative_error(gpu.forward(gpu_cache, [17], plan=each), cpu.forward(cpu_cache, [17], plan=each)) <= 1e-2


@pytest.mark.slow
def test_tensorrt_backend_greedy_full_gives_the_cpus_64_tokens_on_the_demo(tmp_path_factory):
    """`edgeroute run --backend tensorrt` on the demo model exported for the tensorrt target:
    64 greedy tokens of `full`, the same as ONNX Runtime CPU's on the same graphs (fp16 both).
    Not yet run on hardware (docs/guide/gpu.md)."""
    _require_tensorrt_backend()
    from edgeroute.export import ExportOptions, export_bundle
    from edgeroute.runtime import Engine
    from edgeroute.runtime.profiles import load_profile
    from edgeroute.tensorrt.engines import build_engines

    root = tmp_path_factory.mktemp("gpu-trt-demo")
    export_bundle(ExportOptions(out=root / "smollm2", target="tensorrt", quant="int4-rtn", slm=None, parity_tokens=0))
    bundle = Bundle.open(root / "smollm2")
    build_engines(bundle, load_profile("cuda"), root / "engines", kinds=("embed", "layer", "head"))
    turn = [{"role": "user", "content": "Write a long story about a lighthouse keeper and a storm."}]
    want = Engine(bundle, backend="onnxruntime", kv_dtype="float16", slm=False).generate(
        turn, mode="full", max_new_tokens=64).tokens
    got = Engine(bundle, backend="tensorrt", engine_cache=str(root / "engines"), slm=False).generate(
        turn, mode="full", max_new_tokens=64).tokens
    assert len(want) == 64, "the CPU's answer ended early: the check would cover fewer tokens"
    assert got == want
