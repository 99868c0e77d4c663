"""backend='onnxruntime-cuda': ONNX Runtime's GPU providers by name, refused clearly without them."""

from __future__ import annotations

import onnxruntime as ort
import pytest

from edgeroute.errors import InputError
from edgeroute.runtime import Engine
from edgeroute.runtime.backend import cuda_providers


def test_the_tensorrt_provider_comes_first_where_installed_then_cuda_then_the_cpu():
    everything = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    assert cuda_providers(everything[::-1]) == everything
    assert cuda_providers(everything[1:]) == everything[1:]


def test_without_cuda_the_backend_is_refused_naming_what_to_install():
    with pytest.raises(InputError, match="onnxruntime-gpu"):
        cuda_providers(["CPUExecutionProvider"])


@pytest.mark.skipif("CUDAExecutionProvider" in ort.get_available_providers(), reason="CUDA is available here")
def test_an_engine_on_onnxruntime_cuda_without_a_gpu_is_refused(tiny_bundles):
    with pytest.raises(InputError, match="backend='onnxruntime-cuda' needs onnxruntime-gpu"):
        Engine(tiny_bundles["llama"], backend="onnxruntime-cuda")
