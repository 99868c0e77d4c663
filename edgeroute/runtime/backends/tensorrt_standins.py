"""Stand-ins that run the TensorRT backend (:class:`~edgeroute.runtime.backends.tensorrt.TrtModel`)
without TensorRT, and, for CPU-only runs, without CUDA.

- :class:`StandinTensorRT`: the part of TensorRT 10's Python API the backend uses. Each "engine"
  is its graph on ONNX Runtime CPU (OrtModel's session options), its I/O taken from the graph and
  its input shapes checked against the optimisation profile the call runs in. It reads its inputs
  and writes its outputs through the CUDA runtime it is given (``cudaMemcpyAsync`` on the stream
  the backend passes to ``execute_async_v3``, then synchronized), so the same stand-in runs on
  host memory (:class:`HostCudaRuntime`, tests/test_tensorrt_backend.py) and on a GPU's memory
  with cuda-python's ``cuda.bindings.runtime`` (tools/device/cuda_check.py).
- :class:`HostCudaRuntime`: ``cuda.bindings.runtime``'s calls the backend makes, over host memory.
- :func:`build_standin_engines`: what ``build-engines`` would leave in a cache, each "engine" naming
  its graph, under the key the stand-ins report (:data:`STANDIN_GPU`, :data:`STANDIN_VERSION`).

The same graphs do the arithmetic as on ONNX Runtime, so on these stand-ins every decoding mode
must give OrtModel's logits and tokens exactly: any difference is the backend's addressing,
caching or scheduling (or, on a GPU, its device memory and copies).
"""

from __future__ import annotations

import ctypes
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from edgeroute.bundle import Bundle
from edgeroute.runtime.backends.tensorrt_engines import (
    PROFILES,
    CacheKey,
    EngineCache,
    EngineLimits,
    bundle_hash,
    dimension_ranges,
    engine_graphs,
)

STANDIN_GPU = "Fake GPU (sm_00)"  # what gpu_identity() is replaced with where the stand-ins run
STANDIN_VERSION = "10.99.0-fake"
ENGINE_KINDS = ("embed", "layer", "attn", "mlp", "kv", "head")

OK = "cudaSuccess"


class HostCudaRuntime:
    """cuda.bindings.runtime's calls the backend (and tools/device/cuda_check.py) makes, over host memory."""

    cudaError_t = SimpleNamespace(cudaSuccess=OK)
    cudaMemcpyKind = SimpleNamespace(cudaMemcpyHostToDevice=1, cudaMemcpyDeviceToHost=2, cudaMemcpyDeviceToDevice=3)
    total_bytes = 1 << 34  # what cudaMemGetInfo reports as the "device's" memory

    def __init__(self, devices: int = 1) -> None:
        self.devices, self.buffers = devices, {}

    def cudaGetDeviceCount(self):
        return (OK, self.devices) if self.devices else ("cudaErrorNoDevice", 0)

    def cudaGetErrorName(self, error):
        return OK, error.encode()

    def cudaGetErrorString(self, error):
        return OK, b"no CUDA-capable device is detected"

    def cudaGetDeviceProperties(self, device):
        return OK, SimpleNamespace(name=b"host memory (HostCudaRuntime stand-in)", major=0, minor=0,
                                   totalGlobalMem=self.total_bytes)

    def cudaRuntimeGetVersion(self):
        return OK, 0

    def cudaDriverGetVersion(self):
        return OK, 0

    def cudaMemGetInfo(self):
        used = sum(len(buffer) for buffer in self.buffers.values())
        return OK, self.total_bytes - used, self.total_bytes

    def cudaStreamCreate(self):
        return OK, 7

    def cudaStreamSynchronize(self, stream):
        return (OK,)

    def cudaMalloc(self, nbytes):  # aligned as cudaMalloc's are (256 bytes and more)
        buffer = (ctypes.c_char * (nbytes + 256))()
        address = -(-ctypes.addressof(buffer) // 256) * 256
        self.buffers[address] = buffer
        return OK, address

    def cudaFree(self, address):
        del self.buffers[address]
        return (OK,)

    def cudaMemcpyAsync(self, destination, source, nbytes, kind, stream):
        ctypes.memmove(destination, source, nbytes)
        return (OK,)

    def cudaMemcpy2DAsync(self, destination, destination_pitch, source, source_pitch, width, rows, kind, stream):
        if width > min(destination_pitch, source_pitch):
            raise ValueError(f"cudaMemcpy2DAsync: width {width} exceeds a pitch ({destination_pitch}, {source_pitch})")
        for row in range(rows):
            ctypes.memmove(destination + row * destination_pitch, source + row * source_pitch, width)
        return (OK,)


def host_view(address: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """The host memory at ``address`` as an array (a view; HostCudaRuntime's "device" memory)."""
    count = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return np.frombuffer((ctypes.c_char * count).from_address(address), dtype).reshape(shape) if count else \
        np.zeros(shape, dtype)


class StreamCopies:
    """Copies between the host and the memory the backend's addresses point at, on a stream, through
    a CUDA runtime (cuda.bindings.runtime or HostCudaRuntime), each synchronized before it returns."""

    def __init__(self, cudart: Any) -> None:
        self.cudart = cudart

    def _check(self, call: str, result: tuple[Any, ...]) -> None:
        if result[0] != self.cudart.cudaError_t.cudaSuccess:
            raise RuntimeError(f"CUDA {call} failed in a stand-in engine: {result[0]}")

    def _stream(self, stream: int) -> Any:
        """The handle TensorRT is given (an int) as the bindings' own stream type, where they have one."""
        wrap = getattr(self.cudart, "cudaStream_t", None)
        try:
            return wrap(stream) if wrap is not None else stream
        except (TypeError, ValueError):  # bindings whose handle type takes no int: the calls take one too
            return stream

    def read(self, address: int, shape: tuple[int, ...], dtype: str, stream: int) -> np.ndarray:
        out = np.empty(shape, dtype)
        if out.nbytes:
            stream = self._stream(stream)
            kind = self.cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost
            self._check("cudaMemcpyAsync", self.cudart.cudaMemcpyAsync(out.ctypes.data, address, out.nbytes, kind, stream))
            self._check("cudaStreamSynchronize", self.cudart.cudaStreamSynchronize(stream))
        return out

    def write(self, address: int, array: np.ndarray, stream: int) -> None:
        array = np.ascontiguousarray(array)
        if array.nbytes:
            stream = self._stream(stream)
            kind = self.cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
            self._check("cudaMemcpyAsync", self.cudart.cudaMemcpyAsync(address, array.ctypes.data, array.nbytes, kind,
                                                                       stream))
            self._check("cudaStreamSynchronize", self.cudart.cudaStreamSynchronize(stream))


class StandinContext:
    """An execution context: the shapes and addresses set, run by its engine's ONNX Runtime session."""

    def __init__(self, engine: StandinEngine) -> None:
        self.engine, self.shapes, self.addresses, self.profile, self.memory = engine, {}, {}, None, None

    def set_optimization_profile_async(self, index, stream):
        self.profile = index
        return True

    def set_device_memory(self, address, size):
        self.memory = (address, size)

    def set_input_shape(self, name, shape):
        ranges = self.engine.ranges[PROFILES[self.profile]]
        spec = next(s for s in self.engine.graph.inputs if s["name"] == name)
        for dim, size in zip(spec["shape"], shape, strict=True):
            if isinstance(dim, str) and not ranges[dim][0] <= size <= ranges[dim][2]:
                return False  # outside this optimisation profile, as TensorRT refuses it
        self.shapes[name] = tuple(shape)
        return True

    def set_tensor_address(self, name, address):
        if address % 64:  # new K/V rows too: staged, or rows of a multiple of the alignment
            raise ValueError(f"{name} bound at a misaligned address ({address:#x})")
        self.addresses[name] = address

    def execute_async_v3(self, stream):
        engine = self.engine
        if self.memory is None or self.memory[1] < engine.scratch:
            raise ValueError(f"{engine.graph.name} runs without its scratch memory")
        copies = engine.copies
        feeds = {s["name"]: copies.read(self.addresses[s["name"]], self.shapes[s["name"]], s["dtype"], stream)
                 for s in engine.graph.inputs}
        outputs = engine.session.run([s["name"] for s in engine.graph.outputs], feeds)
        for spec, value in zip(engine.graph.outputs, outputs, strict=True):
            if value.dtype != np.dtype(spec["dtype"]):
                raise ValueError(f"{engine.graph.name} output {spec['name']} is {value.dtype}, not {spec['dtype']}")
            copies.write(self.addresses[spec["name"]], value, stream)
        engine.calls.append((engine.graph.name, PROFILES[self.profile], self.shapes[engine.graph.inputs[0]["name"]][0]))
        return True


class StandinEngine:
    """An "engine": its graph on ONNX Runtime (OrtModel's session options), its I/O from the graph."""

    scratch = 4096

    def __init__(self, spec: dict, bundle: Bundle, calls: list, copies: StreamCopies) -> None:
        import onnxruntime as ort

        from edgeroute.runtime.backends.onnxruntime import session_options

        self.graph = bundle.models[spec["role"]].graphs[spec["graph"]]
        self.ranges = spec["ranges"]
        self.session = ort.InferenceSession(str(bundle.file(self.graph.file)), session_options(),
                                            providers=["CPUExecutionProvider"])
        self.io = [(s["name"], s["dtype"], "input") for s in self.graph.inputs] + \
            [(s["name"], s["dtype"], "output") for s in self.graph.outputs]
        self.num_io_tensors, self.num_optimization_profiles, self.calls = len(self.io), len(PROFILES), calls
        self.copies = copies

    def get_tensor_name(self, index):
        return self.io[index][0]

    def get_tensor_dtype(self, name):
        return next(dtype for n, dtype, _ in self.io if n == name)

    def get_tensor_mode(self, name):
        return next(mode for n, _, mode in self.io if n == name)

    def get_device_memory_size_for_profile_v2(self, index):
        return self.scratch

    def create_execution_context(self, strategy):
        if strategy != "user managed":
            raise ValueError(f"the backend asked for a context with {strategy!r} memory, not user-managed")
        return StandinContext(self)


class StandinTensorRT:
    """The part of TensorRT 10's Python API the backend uses, each engine's graph on ONNX Runtime
    CPU, its I/O through ``cudart`` (HostCudaRuntime by default); ``calls`` records
    (graph, profile, tokens) per engine call."""

    __version__ = STANDIN_VERSION
    TensorIOMode = SimpleNamespace(INPUT="input", OUTPUT="output")
    ExecutionContextAllocationStrategy = SimpleNamespace(USER_MANAGED="user managed")

    def __init__(self, bundle: Bundle, cudart: Any = None) -> None:
        self.calls: list[tuple[str, str, int]] = []
        self.cudart = cudart if cudart is not None else HostCudaRuntime()
        calls, copies = self.calls, StreamCopies(self.cudart)

        class Logger:
            WARNING = 2

            def __init__(self, level):
                pass

        class Runtime:
            def __init__(self, logger):
                pass

            def deserialize_cuda_engine(self, data):
                return StandinEngine(json.loads(data), bundle, calls, copies)

        self.Logger, self.Runtime = Logger, Runtime

    @staticmethod
    def nptype(dtype):
        return np.dtype(dtype).type


def build_standin_engines(bundle: Bundle, root: Path, limits: EngineLimits, roles=("llm", "slm"),
                          kinds=ENGINE_KINDS, gpu: str = STANDIN_GPU) -> EngineCache:
    """What build-engines would leave in ``root``, each "engine" naming its graph (roles the bundle lacks skipped)."""
    cache = EngineCache(root, CacheKey(gpu, STANDIN_VERSION, bundle_hash(bundle), limits), bundle.path)
    for role in roles:
        if role not in bundle.models:
            continue
        names = []
        for graph in engine_graphs(bundle, role, kinds):
            names.append(f"{role}/{graph.name}")
            spec = {"role": role, "graph": graph.name, "ranges": dimension_ranges(limits)}
            cache.write_engine(names[-1], json.dumps(spec).encode())
        cache.commit(names)
    return cache
