"""``edgeroute build-engines``: TensorRT engines from a tensorrt-target bundle, cached.

One engine per graph the runtime runs (embed, layer/attn/mlp/kv per layer, head), each with two
optimisation profiles: **prefill** (up to a prefill chunk of tokens over an empty to full cache)
and **decode** (one token, or a verification pass of a draft, over any past). Their ranges come
from the device profile: its context (``memory.default_context``, at most the bundle's) and its
``engines`` limits (``prefill_tokens``, ``decode_tokens``); the graphs have no batch axis, so
the batch limit is 1 (a sequence per call, as on every backend).

Engines are cached under ``CACHE/<key>/`` where the key hashes the GPU (name and compute
capability), the TensorRT version, the bundle (the sha256 of every file its manifest lists) and
the build settings; an entry whose recorded key, or any engine file's sha256, does not match is
stale and rebuilt, never loaded. One entry holds the engines of both models (``--role llm`` and
``--role slm`` add to it) and of every kind built so far; a build makes only the missing ones.
TensorRT's timing cache (``CACHE/timing-<gpu>-<trt>.cache``) is shared by every build on that
GPU and version, so a rebuild skips the kernel timing it did. The TensorRT backend
(``edgeroute.runtime.backends.tensorrt``) finds its engines with
:func:`edgeroute.runtime.backends.tensorrt_engines.find_engines`, beside it on the device side.

This module imports TensorRT only to build (:func:`build_engines`); the shape logic and the cache
keys are plain Python, tested without a GPU. Not yet verified on hardware (docs/guide/gpu.md).
"""

from __future__ import annotations

import resource
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from edgeroute.arch import ArchConfig
from edgeroute.bundle import Bundle, GraphEntry
from edgeroute.errors import EdgerouteError

if TYPE_CHECKING:
    from edgeroute.runtime.profiles import Profile

from edgeroute.runtime.backends.tensorrt_engines import (
    GRAPH_KINDS,
    CacheKey,
    EngineCache,
    EngineLimits,
    bundle_hash,
    default_cache_root,
    dimension_ranges,
    engine_graphs,
    engine_limits,
    gpu_identity,
    input_shapes,
)


def parameter_count(arch: ArchConfig) -> int:
    """Weights of the model (projections, MLP, embedding, an untied head)."""
    d, hd = arch.hidden_size, arch.head_dim
    attention = d * hd * (2 * arch.num_heads + 2 * arch.num_kv_heads)
    mlp = 3 * d * arch.intermediate_size
    embedding = arch.vocab_size * d
    return arch.num_layers * (attention + mlp) + embedding * (1 if arch.tie_word_embeddings else 2)


def peak_host_bytes() -> int:
    """The process's peak resident memory so far (Linux: ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _tensorrt():
    try:
        import tensorrt
    except ImportError as err:
        raise EdgerouteError(f"TensorRT's Python package is not installed ({err}): install the one of your JetPack "
                             "or CUDA (pip install tensorrt on x86 with CUDA 12), then run build-engines again") from None
    return tensorrt


@dataclass
class BuildReport:
    cache: Path
    key: CacheKey
    built: list[str]
    reused: bool
    removed_stale: int
    seconds: float
    peak_host_bytes: int
    parameters: int

    @property
    def peak_per_parameter(self) -> float:
        return self.peak_host_bytes / self.parameters


Progress = Callable[[str, int, int], None]


def _build_one(trt, builder, logger, path: Path, graph: GraphEntry, limits: EngineLimits, timing_cache) -> bytes:
    """Parse one graph and build its engine with both optimisation profiles."""
    # strongly typed: the graph's own types decide (fp16 activations, int4 weight-only DQ, the
    # fp32 norms and residual): no precision flags to second-guess them
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise EdgerouteError(f"TensorRT cannot parse {graph.file}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, limits.workspace_bytes)
    config.set_timing_cache(timing_cache, ignore_mismatch=False)
    for ranges in dimension_ranges(limits).values():
        profile = builder.create_optimization_profile()
        for name, (low, opt, high) in input_shapes(graph, ranges).items():
            profile.set_shape(name, low, opt, high)
        config.add_optimization_profile(profile)
    engine = builder.build_serialized_network(network, config)
    if engine is None:
        raise EdgerouteError(f"TensorRT could not build an engine for {graph.file} (its log above says why)")
    return bytes(engine)


def build_engines(bundle: Bundle, profile: Profile, cache_root: Path | None = None, role: str = "llm",
                  progress: Progress | None = None, kinds: tuple[str, ...] = GRAPH_KINDS) -> BuildReport:
    """Build (or reuse) the engines of ``role``'s model for this GPU, TensorRT and bundle."""
    start = time.perf_counter()
    progress = progress or (lambda task, done, total: None)
    graphs = engine_graphs(bundle, role, kinds)  # refuses a bundle of another target before anything else
    limits = engine_limits(bundle, profile)
    trt = _tensorrt()
    key = CacheKey(gpu_identity(), trt.__version__, bundle_hash(bundle), limits)
    cache = EngineCache(cache_root or default_cache_root(bundle), key, bundle.path)
    names = [f"{role}/{g.name}" for g in graphs]
    stale = cache.stale_entries()
    for entry in stale:
        shutil.rmtree(entry, ignore_errors=True)
    todo = [(name, graph) for name, graph in zip(names, graphs, strict=True) if not cache.valid([name])]
    if not todo:
        return BuildReport(cache.directory, key, [], True, len(stale), time.perf_counter() - start, peak_host_bytes(),
                           parameter_count(bundle.models[role].arch))
    if not cache.recorded():
        shutil.rmtree(cache.directory, ignore_errors=True)  # an interrupted first build: nothing in it is trusted
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    timing_config = builder.create_builder_config()
    timing_data = cache.timing_cache.read_bytes() if cache.timing_cache.is_file() else b""
    timing_cache = timing_config.create_timing_cache(timing_data)
    for done, (name, graph) in enumerate(todo, 1):
        cache.write_engine(name, _build_one(trt, builder, logger, bundle.file(graph.file), graph, limits, timing_cache))
        progress(f"{role}: engines", done, len(todo))
    cache.root.mkdir(parents=True, exist_ok=True)
    cache.timing_cache.write_bytes(bytes(timing_cache.serialize()))
    built = [name for name, _ in todo]
    cache.commit(built)
    return BuildReport(cache.directory, key, built, False, len(stale), time.perf_counter() - start, peak_host_bytes(),
                       parameter_count(bundle.models[role].arch))
