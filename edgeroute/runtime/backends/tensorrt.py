"""The TensorRT backend: the engines of ``edgeroute build-engines`` run by edgeroute itself.

:class:`TrtModel` implements :class:`edgeroute.runtime.backend.ModelBackend` like
:class:`edgeroute.runtime.backends.onnxruntime.OrtModel`, over the same graphs of a bundle of the tensorrt
target, each built into an engine (``edgeroute/tensorrt/engines.py``): a pass runs ``embed``,
then per layer ``layer_i`` (attention + MLP), ``attn_i`` (an MLP skip) or ``kv_i`` (a skipped
layer's K/V, CALM-style), then ``head``. The ``mlp_i`` engines are not needed (as on ONNX
Runtime, they serve tests only); ``attn_i`` and ``kv_i`` are loaded on the first pass that skips.

Everything between the engines stays on the GPU: the hidden states ping-pong between two device
buffers, and each sequence's KV cache (:class:`DeviceKVCache`) is preallocated at full capacity
per layer, positions-first like the portable cache, so a layer's past is the first rows of its
region, bound as ``past_key``/``past_value`` without a copy, and the graphs' ``key``/``value``
outputs (the new rows) are written at the cache's length. The host sends the token ids, the
RoPE rows and the attention bias (once per pass, once per layer only where layers dropped
positions), and reads the hidden states of the pass (a callable plan reads them per layer) and
the logits. A call over up to ``decode_tokens`` tokens runs in the engines' decode profile, a
longer one in the prefill profile; a pass holds at most ``prefill_tokens`` (``chunk_tokens``).

CUDA memory and streams come from cuda-python's runtime bindings (``cuda.bindings.runtime``),
not PyCUDA, CuPy or torch: they are NVIDIA's prebuilt binding of the CUDA runtime API, the API
TensorRT itself runs on (its stream is what ``execute_async_v3`` takes, and the runtime's
primary context is TensorRT's, so nothing creates or pushes a context), with nothing to compile
at install and a few MB to install (torch is barred from the device, CuPy ships its own kernels).

Not yet verified on hardware (docs/guide/gpu.md): written against TensorRT 10's Python API and
cuda-python's runtime bindings as documented; what a CPU can test (every mode on stand-ins for
TensorRT and CUDA that run each engine's graph on ONNX Runtime, tensorrt_standins.py) is in
tests/test_tensorrt_backend.py, and tools/device/cuda_check.py runs the CUDA side (this module's
device memory, copies and caches) on a GPU with the same stand-in engines, without TensorRT.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgeroute.bundle import Bundle, GraphEntry
from edgeroute.errors import EdgerouteError, InputError
from edgeroute.rope import rope_tables
from edgeroute.runtime.attention import CacheBook, PortableAttention
from edgeroute.runtime.backends.tensorrt_engines import (
    PROFILES,
    EngineCache,
    build_command,
    choose_profile,
    engine_graphs,
    find_engines,
    gpu_identity,
)
from edgeroute.runtime.layers import RUN, SKIP, SKIP_MLP, LayerPlan, LayerwiseModel, plan_action
from edgeroute.runtime.vocab import HeadVocabulary

# TensorRT asks for 256-byte aligned scratch memory (set_device_memory); I/O addresses are kept
# to the same rule: every buffer is a cudaMalloc (aligned more), each layer's cache region starts
# on it, and the new K/V rows are written in place only where a row is a multiple of it
ALIGNMENT = 256
GPU_EXTRA = ("pip install 'edgeroute[gpu]' on a machine with an NVIDIA GPU and CUDA 12 (on a Jetson: its JetPack's "
             "TensorRT, and pip install 'cuda-python>=12.8,<13')")


def gpu_modules() -> tuple[Any, Any]:
    """TensorRT's module and cuda-python's runtime bindings, or an InputError naming what to install."""
    missing, found = [], []
    for name, load in (("tensorrt", _import_tensorrt), ("cuda-python", _import_cudart)):
        try:
            found.append(load())
        except (ImportError, OSError) as err:  # OSError: a package whose native libraries do not load
            missing.append(f"{name} ({err})")
    if missing:
        raise InputError(f"backend='tensorrt' needs TensorRT's and cuda-python's Python packages, and cannot import "
                         f"{'; '.join(missing)}: {GPU_EXTRA}")
    return found[0], found[1]


def _import_tensorrt() -> Any:
    import tensorrt

    return tensorrt


def _import_cudart() -> Any:
    from cuda.bindings import runtime

    return runtime


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


class CudaDevice:
    """The CUDA runtime calls the backend makes, all on one stream of the current device,
    every result checked. Host arrays are pageable: CUDA copies them to the device before an
    upload returns, and a download returns once the data is on the host (then the stream is
    synchronized too), so no host buffer outlives its call."""

    def __init__(self, cudart: Any) -> None:
        self.cudart = cudart
        error, count = cudart.cudaGetDeviceCount()
        if error != cudart.cudaError_t.cudaSuccess or not count:
            raise InputError(f"backend='tensorrt' needs an NVIDIA GPU: CUDA finds none here ({self._describe(error)}): "
                             "use backend='onnxruntime' or 'native' on this machine")
        self.stream = self._check("cudaStreamCreate", cudart.cudaStreamCreate())
        self.stream_handle = int(self.stream)  # what TensorRT's calls take

    def _describe(self, error: Any) -> str:
        name = self.cudart.cudaGetErrorName(error)[1]
        text = self.cudart.cudaGetErrorString(error)[1]
        return f"{name.decode() if isinstance(name, bytes) else name}: {text.decode() if isinstance(text, bytes) else text}"

    def _check(self, call: str, result: tuple[Any, ...]) -> Any:
        if result[0] != self.cudart.cudaError_t.cudaSuccess:
            raise EdgerouteError(f"CUDA {call} failed: {self._describe(result[0])}")
        return result[1] if len(result) > 1 else None

    def alloc(self, nbytes: int) -> int:
        return int(self._check("cudaMalloc", self.cudart.cudaMalloc(max(nbytes, 1))))

    def free(self, address: int) -> None:
        self._check("cudaFree", self.cudart.cudaFree(address))

    def upload(self, address: int, array: np.ndarray) -> None:
        array = np.ascontiguousarray(array)
        self._check("cudaMemcpyAsync", self.cudart.cudaMemcpyAsync(
            address, array.ctypes.data, array.nbytes, self.cudart.cudaMemcpyKind.cudaMemcpyHostToDevice, self.stream))

    def download(self, address: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        out = np.empty(shape, dtype)
        self._check("cudaMemcpyAsync", self.cudart.cudaMemcpyAsync(
            out.ctypes.data, address, out.nbytes, self.cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost, self.stream))
        self.synchronize()
        return out

    def copy(self, destination: int, source: int, nbytes: int) -> None:
        self._check("cudaMemcpyAsync", self.cudart.cudaMemcpyAsync(
            destination, source, nbytes, self.cudart.cudaMemcpyKind.cudaMemcpyDeviceToDevice, self.stream))

    def copy_rows(self, destination: int, destination_pitch: int, source: int, source_pitch: int, width: int,
                  rows: int) -> None:
        """``rows`` rows of ``width`` bytes, each ``*_pitch`` bytes after the last (one call for every layer)."""
        self._check("cudaMemcpy2DAsync", self.cudart.cudaMemcpy2DAsync(
            destination, destination_pitch, source, source_pitch, width, rows,
            self.cudart.cudaMemcpyKind.cudaMemcpyDeviceToDevice, self.stream))

    def synchronize(self) -> None:
        self._check("cudaStreamSynchronize", self.cudart.cudaStreamSynchronize(self.stream))


class DeviceBuffer:
    """``nbytes`` of device memory, freed with the object (after the stream's pending work)."""

    def __init__(self, device: CudaDevice, nbytes: int) -> None:
        self.nbytes = nbytes
        self.address = device.alloc(nbytes)
        self._finalizer = weakref.finalize(self, _release, device, self.address)
        # not at exit: CUDA may be unloading by then, and the process's memory goes with it
        self._finalizer.atexit = False

    @property
    def freed(self) -> bool:
        return not self._finalizer.alive

    def free(self) -> None:
        """Frees the memory now (once; otherwise with the object)."""
        self._finalizer()


def _release(device: CudaDevice, address: int) -> None:
    device.synchronize()  # an engine or a copy may still use it
    device.free(address)


class DeviceKVCache(CacheBook):
    """One sequence's keys and values on the GPU, ``capacity`` positions per layer allocated at
    once (cudaMalloc commits them: a cache that does not fit fails at the start, not mid-way).
    Each layer's region holds rows [kv_heads, head_dim] by position, so positions [0, n) of a
    layer are one contiguous [n, kv, hd] tensor at :meth:`address`; truncating is setting the
    length, copies between caches are device-to-device."""

    def __init__(self, device: CudaDevice, layers: int, capacity: int, kv_heads: int, head_dim: int,
                 dtype: str = "float16") -> None:
        self.device, self.capacity, self.length, self.dropped = device, capacity, 0, None
        self.shape, self.dtype = (layers, kv_heads, head_dim), dtype
        self.row_bytes = kv_heads * head_dim * np.dtype(dtype).itemsize
        self.layer_bytes = _aligned(capacity * self.row_bytes)
        self.keys = DeviceBuffer(device, layers * self.layer_bytes)
        self.values = DeviceBuffer(device, layers * self.layer_bytes)

    @property
    def layers(self) -> int:
        return self.shape[0]

    def address(self, buffer: DeviceBuffer, layer: int, position: int) -> int:
        """Where ``layer``'s row of ``position`` lies in ``buffer`` (keys or values)."""
        return buffer.address + layer * self.layer_bytes + position * self.row_bytes

    def _layout(self) -> tuple[Any, ...]:
        return type(self), self.shape, self.dtype

    def _copy_rows(self, other: DeviceKVCache, length: int) -> None:
        if self.keys.freed or other.keys.freed:
            raise InputError("cannot copy to or from a closed cache (its engine closed): its device memory is freed")
        if length:
            for mine, theirs in ((self.keys, other.keys), (self.values, other.values)):
                self.device.copy_rows(mine.address, self.layer_bytes, theirs.address, other.layer_bytes,
                                      length * self.row_bytes, self.layers)

    def close(self) -> None:
        """Frees the keys and values on the device now (its engine closing); nothing runs on it after."""
        self.keys.free()
        self.values.free()

    def clone(self) -> DeviceKVCache:
        """An independent cache of the same capacity holding the same positions."""
        copy = DeviceKVCache(self.device, self.layers, self.capacity, *self.shape[1:], dtype=self.dtype)
        copy.copy_from(self)
        return copy


def tensor_shape(spec: dict[str, Any], dims: dict[str, int]) -> tuple[int, ...]:
    """A graph input's shape in the manifest ([\"tokens\", \"total\"], ...) for this call's dims."""
    return tuple(dim if isinstance(dim, int) else dims[dim] for dim in spec["shape"])


def check_engine_io(graph: GraphEntry, found: dict[str, tuple[str, bool]], kv_dtype: str) -> None:
    """An engine's I/O (name -> (numpy dtype, is input)) must be its graph's, with the K/V
    tensors in the cache's type; an engine built from another graph is an error naming both."""
    want = {**{s["name"]: (s["dtype"], True) for s in graph.inputs}, **{s["name"]: (s["dtype"], False) for s in graph.outputs}}
    kv = {name: dtype for name, (dtype, _) in want.items() if name in ("past_key", "past_value", "key", "value")}
    if found != want or any(dtype != kv_dtype for dtype in kv.values()):
        raise EdgerouteError(f"the engine of {graph.name} does not take the graph's I/O (engine: {found}; graph: "
                             f"{want}; K/V must be {kv_dtype}): rebuild the engines")


@dataclass
class _Engine:
    graph: GraphEntry
    engine: Any  # tensorrt.ICudaEngine
    contexts: list[Any]  # one tensorrt.IExecutionContext per optimisation profile, in PROFILES order


class TrtModel(LayerwiseModel):
    """A model on its TensorRT engines; implements :class:`edgeroute.runtime.backend.ModelBackend`."""

    flavour = "tensorrt"

    def __init__(self, bundle: Bundle, role: str = "llm", engine_cache: str | Path | None = None,
                 kv_dtype: str = "float16") -> None:
        if role not in bundle.models:
            raise InputError(f"bundle {bundle.path} has no {role!r} model (it has: {', '.join(bundle.models)})")
        required = engine_graphs(bundle, role, ("embed", "layer", "head"))  # refuses another target's bundle first
        self.variant = bundle.target.attention_variants[0]  # (portable, float16): the graphs build-engines built
        self.kv_dtype = self.variant[1]
        if kv_dtype != self.kv_dtype:
            raise InputError(f"backend='tensorrt' keeps the {self.kv_dtype} KV cache its engines take, not {kv_dtype}: "
                             "use kv_dtype='auto'")
        trt, cudart = gpu_modules()
        self.device = CudaDevice(cudart)
        self._trt, self._bundle, self.role = trt, bundle, role
        self._cache_root = Path(engine_cache) if engine_cache is not None else None
        self._cache: EngineCache = find_engines(bundle, role, gpu_identity(), trt.__version__,
                                                [f"{role}/{g.name}" for g in required], self._cache_root)
        self.limits = self._cache.key.limits
        self.entry = bundle.models[role]
        self.arch = self.entry.arch
        self.capacity = self.limits.context
        self.chunk_tokens = self.limits.prefill_tokens
        self.head_vocab = HeadVocabulary.load(bundle, role)
        self._lock = threading.Lock()  # one pass at a time: the contexts share the scratch memory and buffers
        self._runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self._scratch: DeviceBuffer | None = None
        self._contexts: list[Any] = []
        layers = range(self.arch.num_layers)
        self._embed = self._load("embed", verified=True)
        self._head = self._load("head", verified=True)
        self._layers = [self._load("layer", i, verified=True) for i in layers]
        self._skips: dict[str, list[_Engine | None]] = {kind: [None] * self.arch.num_layers for kind in ("attn", "kv")}
        self._closed = False
        self._buffers()

    def close(self) -> None:
        """Frees the model's device memory now (otherwise when it is collected): the execution
        contexts, then the engines, then the scratch and pass buffers, once the stream's work is
        done. Caches made by :meth:`new_cache` are their owners' to close. The model runs nothing
        after: a pass is an InputError saying so. Closing again does nothing."""
        with self._lock:  # after the pass in flight
            if self._closed:
                return
            self._closed = True
            self.device.synchronize()
            engines = [self._embed, self._head, *self._layers, *(e for kind in self._skips.values() for e in kind if e)]
            for engine in engines:  # contexts before their engines: TensorRT's order of destruction
                engine.contexts.clear()
            self._contexts.clear()
            del engines
            self._embed = self._head = None
            self._layers = []
            self._skips = {kind: [None] * self.arch.num_layers for kind in self._skips}
            buffers = [self._ids, *self._hidden, *self._rope, self._bias, self._logits, *(self._staged or []),
                       self._scratch]
            for buffer in buffers:
                if buffer is not None:
                    buffer.free()
            self._runtime = None

    def _check_open(self) -> None:
        """A closed model is refused before any device call (passes check it under ``_lock``)."""
        if self._closed:
            raise InputError(f"the {self.role} model was closed (its engine closed): its engines and device memory are "
                             "freed; open the bundle again")

    # -- engines --------------------------------------------------------------------------------

    def _load(self, kind: str, layer: int | None = None, verified: bool = False) -> _Engine:
        """A graph's engine with a context per optimisation profile (``verified``: its file's
        sha256 was checked with the cache entry)."""
        graph = self.entry.graph(kind, layer, *self.variant) if kind in ("layer", "attn") else self.entry.graph(kind, layer)
        name = f"{self.role}/{graph.name}"
        if not verified and not self._cache.valid([name]):
            raise InputError(f"skipping needs the {kind} engines of the {self.role} model, and {name} is not built in "
                             f"{self._cache.directory} (or was damaged): build it with "
                             f"`{build_command(self._bundle, self.role, self._cache_root)}`")
        trt = self._trt
        engine = self._runtime.deserialize_cuda_engine(self._cache.engine_path(name).read_bytes())
        if engine is None:
            raise EdgerouteError(f"TensorRT could not load {self._cache.engine_path(name)} (its log above says why)")
        found = {}
        for i in range(engine.num_io_tensors):
            tensor = engine.get_tensor_name(i)
            found[tensor] = (np.dtype(trt.nptype(engine.get_tensor_dtype(tensor))).name,
                             engine.get_tensor_mode(tensor) == trt.TensorIOMode.INPUT)
        check_engine_io(graph, found, self.kv_dtype)
        if engine.num_optimization_profiles != len(PROFILES):
            raise EdgerouteError(f"{name} has {engine.num_optimization_profiles} optimisation profiles, not "
                                 f"{len(PROFILES)} ({', '.join(PROFILES)}): rebuild the engines")
        self._grow_scratch(max(engine.get_device_memory_size_for_profile_v2(i) for i in range(len(PROFILES))))
        contexts = []
        for index in range(len(PROFILES)):
            context = engine.create_execution_context(trt.ExecutionContextAllocationStrategy.USER_MANAGED)
            if context is None:
                raise EdgerouteError(f"TensorRT could not create a context for {name} (its log above says why)")
            context.set_device_memory(self._scratch.address, self._scratch.nbytes)
            if not context.set_optimization_profile_async(index, self.device.stream_handle):
                raise EdgerouteError(f"TensorRT could not select the {PROFILES[index]} profile of {name}")
            contexts.append(context)
        self._contexts += contexts
        return _Engine(graph, engine, contexts)

    def _grow_scratch(self, size: int) -> None:
        """One scratch buffer for every context (they run one at a time), grown to ``size``."""
        if self._scratch is None or size > self._scratch.nbytes:
            self.device.synchronize()
            self._scratch = DeviceBuffer(self.device, _aligned(size))
            for context in self._contexts:
                context.set_device_memory(self._scratch.address, self._scratch.nbytes)

    def _skip_engine(self, kind: str, layer: int) -> _Engine:
        engines = self._skips[kind]
        if engines[layer] is None:
            engines[layer] = self._load(kind, layer)
        return engines[layer]

    def _execute(self, kind: str, engine: _Engine, dims: dict[str, int], addresses: dict[str, int]) -> None:
        """Enqueue one engine call over ``dims`` (tokens, past, total) in the profile they need."""
        context = engine.contexts[choose_profile(dims["tokens"], self.limits)]
        for spec in engine.graph.inputs:
            if not context.set_input_shape(spec["name"], tensor_shape(spec, dims)):
                raise EdgerouteError(f"TensorRT refused {spec['name']} {tensor_shape(spec, dims)} for "
                                     f"{engine.graph.name} (the engines take up to {self.limits.context} positions)")
        for name, address in addresses.items():
            context.set_tensor_address(name, address)

        def run() -> None:
            if not context.execute_async_v3(self.device.stream_handle):
                raise EdgerouteError(f"TensorRT could not run {engine.graph.name} (its log above says why)")
            if self.timings is not None:
                self.device.synchronize()  # the timing hook measures the engine, not its enqueueing
        self._timed(kind, run)

    # -- buffers and caches ---------------------------------------------------------------------

    def _buffers(self) -> None:
        """The pass's device buffers, sized for a prefill chunk."""
        t, d, arch = self.chunk_tokens, self.arch.hidden_size, self.arch
        self._ids = DeviceBuffer(self.device, t * 8)
        self._hidden = [DeviceBuffer(self.device, t * d * 4) for _ in range(2)]
        self._rope = [DeviceBuffer(self.device, t * arch.head_dim * 4) for _ in range(2)]
        self._bias = DeviceBuffer(self.device, t * self.capacity * 4)
        self.vocab = int(self._head.graph.outputs[0]["shape"][-1])
        self._logits = DeviceBuffer(self.device, t * self.vocab * 4)
        self.row_bytes = arch.num_kv_heads * arch.head_dim * np.dtype(self.kv_dtype).itemsize
        # rows of a multiple of ALIGNMENT are written in place; others land here and are copied
        self._staged = None if self.row_bytes % ALIGNMENT == 0 else \
            [DeviceBuffer(self.device, t * self.row_bytes) for _ in range(2)]
        self.cos, self.sin = rope_tables(self.capacity, arch.head_dim, arch.rope_theta, arch.rope_scaling)
        self._attention = PortableAttention(self.capacity)  # the bias, as the portable graphs take it

    def new_cache(self, capacity: int | None = None) -> DeviceKVCache:
        self._check_open()
        capacity = capacity or self.capacity
        if capacity > self.capacity:
            raise InputError(f"a cache of {capacity} positions exceeds the {self.capacity} the TensorRT engines were "
                             f"built for: use context_length <= {self.capacity}, or rebuild them with a device profile "
                             f"of a longer memory.default_context: `{build_command(self._bundle, self.role, self._cache_root)}`")
        return DeviceKVCache(self.device, self.num_layers, capacity, self.arch.num_kv_heads, self.arch.head_dim,
                             self.kv_dtype)

    def _check_cache(self, cache: DeviceKVCache) -> None:
        if not isinstance(cache, DeviceKVCache) or cache.device is not self.device:
            raise InputError("this cache is not one of this TensorRT model's (new_cache() makes one)")
        if cache.keys.freed:
            raise InputError("this cache was closed (its engine closed): its device memory is freed")

    def _new_rows(self, cache: DeviceKVCache, layer: int, start: int) -> dict[str, int]:
        """Where an engine writes its new K/V rows: in the cache at ``start``, or staged."""
        if self._staged is None:
            return {"key": cache.address(cache.keys, layer, start), "value": cache.address(cache.values, layer, start)}
        return {"key": self._staged[0].address, "value": self._staged[1].address}

    def _settle_rows(self, cache: DeviceKVCache, layer: int, start: int, t: int) -> None:
        if self._staged is not None:
            for buffer, staged in zip((cache.keys, cache.values), self._staged, strict=True):
                self.device.copy(cache.address(buffer, layer, start), staged.address, t * self.row_bytes)

    # -- graph calls ----------------------------------------------------------------------------

    def _run_embed(self, ids: np.ndarray) -> None:
        """ids [t] -> the first hidden buffer."""
        self.device.upload(self._ids.address, np.asarray(ids, np.int64))
        self._execute("embed", self._embed, {"tokens": len(ids)},
                      {"input_ids": self._ids.address, "hidden": self._hidden[0].address})

    def embed(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, np.int64).reshape(-1)
        with self._lock:
            self._check_open()
            parts = []
            for offset in range(0, len(ids), self.chunk_tokens):
                chunk = ids[offset:offset + self.chunk_tokens]
                self._run_embed(chunk)
                parts.append(self.device.download(self._hidden[0].address, (len(chunk), self.arch.hidden_size),
                                                  "float32"))
            return np.concatenate(parts)

    def head(self, hidden: np.ndarray) -> np.ndarray:
        with self._lock:
            self._check_open()
            parts = []
            for offset in range(0, len(hidden), self.chunk_tokens):
                rows = np.asarray(hidden[offset:offset + self.chunk_tokens], np.float32)
                self.device.upload(self._hidden[0].address, rows)
                self._execute("head", self._head, {"tokens": len(rows)},
                              {"hidden": self._hidden[0].address, "logits": self._logits.address})
                parts.append(self.device.download(self._logits.address, (len(rows), self.vocab), "float32"))
            return np.concatenate(parts) if len(parts) > 1 else parts[0]

    def _bias_for(self, cache: DeviceKVCache, layer: int, dims: dict[str, int], plain: bool) -> bool:
        """Send ``layer``'s attention bias unless the bias of a layer without drops is there
        (``plain``); whether it is there now."""
        dropped = cache.dropped_before(layer, dims["past"])
        if dropped is None and plain:
            return True
        self.device.upload(self._bias.address, self._attention.bias(cache, layer, dims["past"], dims["tokens"]))
        return dropped is None

    def _attend(self, kind: str, engine: _Engine, cache: DeviceKVCache, layer: int, dims: dict[str, int], source: int,
                target: int) -> None:
        """A layer (or its attention sub-layer): hidden ``source`` -> ``target``, new rows into the cache."""
        past = {"past_key": cache.address(cache.keys, layer, 0), "past_value": cache.address(cache.values, layer, 0)}
        self._execute(kind, engine, dims, {"hidden": source, "cos": self._rope[0].address, "sin": self._rope[1].address,
                                           "attn_bias": self._bias.address, **past, "hidden_out": target,
                                           **self._new_rows(cache, layer, dims["past"])})
        self._settle_rows(cache, layer, dims["past"], dims["tokens"])

    def _fill(self, cache: DeviceKVCache, layer: int, dims: dict[str, int], source: int) -> None:
        """A skipped layer's K/V from the current hidden states (the kv engine)."""
        self._execute("kv", self._skip_engine("kv", layer), dims,
                      {"hidden": source, "cos": self._rope[0].address, "sin": self._rope[1].address,
                       **self._new_rows(cache, layer, dims["past"])})
        self._settle_rows(cache, layer, dims["past"], dims["tokens"])

    def _pass(self, cache: DeviceKVCache, ids: np.ndarray, plan: Sequence[bool] | LayerPlan | None) -> np.ndarray:
        """One pass of at most ``chunk_tokens`` tokens through the layers; the last hidden states."""
        self._check_cache(cache)
        start, t = cache.length, ids.shape[0]
        dims = {"tokens": t, "past": start, "total": start + t}
        d = self.arch.hidden_size
        with self._lock:
            self._check_open()
            self._run_embed(ids)
            self.device.upload(self._rope[0].address, self.cos[start:start + t])
            self.device.upload(self._rope[1].address, self.sin[start:start + t])
            hidden, spare = self._hidden
            plain = False
            for layer in range(self.num_layers):
                now = self.device.download(hidden.address, (t, d), "float32") if callable(plan) else None
                action = plan_action(plan, layer, now)
                if action in (RUN, SKIP_MLP):
                    plain = self._bias_for(cache, layer, dims, plain)
                    engine = self._layers[layer] if action == RUN else self._skip_engine("attn", layer)
                    self._attend("layer" if action == RUN else "attn", engine, cache, layer, dims, hidden.address,
                                 spare.address)
                    hidden, spare = spare, hidden
                elif action == SKIP:
                    self._fill(cache, layer, dims, hidden.address)
                else:  # DROP
                    cache.drop(layer, start, t)
            out = self.device.download(hidden.address, (t, d), "float32")
        cache.length = start + t
        return out
