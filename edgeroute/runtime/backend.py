"""The seam between the decode loop and an inference backend.

``decoding.py`` and the drafters need only what :class:`ModelBackend` declares: forward T
tokens over a sequence's cache with a per-layer plan, caches that can be created,
truncated (rejected drafts) and copied (shared prompt prefixes), and the LM head.
:class:`edgeroute.runtime.backends.onnxruntime.OrtModel` implements it on ONNX Runtime with the bundle's
attention flavours (portable standard ops, or the ort flavour's in-place
GroupQueryAttention), :class:`edgeroute.runtime.backends.native.NativeModel` on edgeroute's own CPU
kernels over the bundle's GGUF blocks (``open_model`` chooses); ``onnxruntime-cuda`` is
OrtModel on ONNX Runtime's GPU providers; :class:`edgeroute.runtime.backends.tensorrt.TrtModel` runs the
engines of ``edgeroute build-engines`` with a KV cache on the GPU behind the same
:class:`Cache` methods (not yet verified on hardware: docs/guide/gpu.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
import onnxruntime as ort

from edgeroute.arch import ArchConfig
from edgeroute.bundle import Bundle, ModelEntry
from edgeroute.errors import InputError, NativeBackendUnavailable
from edgeroute.kv_formats import GRAPH_KV_DTYPES, KV_DTYPE_CHOICES, auto_kv_dtype, check_kv_dtype
from edgeroute.runtime.layers import LayerPlan, no_graphs
from edgeroute.runtime.vocab import HeadVocabulary

if TYPE_CHECKING:
    from edgeroute.runtime.options import EngineOptions


@runtime_checkable
class Cache(Protocol):
    """One sequence's KV cache: fixed capacity, allocated once."""

    length: int  # positions held (the next token's position)
    capacity: int

    def truncate(self, length: int) -> None:
        """Forget positions >= length."""

    def reset(self) -> None:
        """Forget everything (a new conversation)."""

    def copy_from(self, other: Cache, length: int | None = None) -> None:
        """Take over the first ``length`` positions of a cache of the same model and layout."""

    def clone(self) -> Cache:
        """An independent copy."""


@runtime_checkable
class ModelBackend(Protocol):
    """What the decode loop needs from a model (LLM or SLM)."""

    arch: ArchConfig
    capacity: int  # the default cache capacity (the bundle's context length)
    flavour: str  # what runs the layers: portable | ort (ONNX Runtime graphs) | native | tensorrt
    head_vocab: HeadVocabulary | None  # a reduced-vocabulary head's token ids (None: the whole vocabulary)
    pass_rows: int | None  # tokens one pass over the weights serves (None: not known for this backend)
    tree_forwards: bool  # runs forward_tree / keep_path (native); False: drafts are verified as linear chains
    kernels: str | None  # the native library's kernel set ("avx2", "dotprod", ...); None: another backend

    @property
    def num_layers(self) -> int: ...

    def new_cache(self, capacity: int | None = None) -> Cache:
        """A fresh, empty cache in this backend's layout."""

    def forward(self, cache: Cache, ids: Sequence[int] | np.ndarray, plan: Sequence[bool] | LayerPlan | None = None,
                all_logits: bool = False, tail: int | None = None) -> np.ndarray:
        """Run new tokens over the cache (prefill, decode step, catch-up, verification) through
        the layers the plan allows, filling skipped layers' K/V; return logits (see
        ``OrtModel.forward``)."""

    def hidden_states(self, cache: Cache, ids: Sequence[int] | np.ndarray,
                      plan: Sequence[bool] | LayerPlan | None = None) -> np.ndarray:
        """``forward`` without the LM head: the last layer's hidden states [T, d]."""

    def forward_tree(self, cache: Cache, ids: Sequence[int] | np.ndarray,
                     parents: Sequence[int] | np.ndarray) -> np.ndarray:
        """New tokens forming a tree (``parents[i]``: an earlier token, or -1 for the cache's last)
        in one pass: each token's logits [T, vocab] are its root-to-token path's. Where
        ``tree_forwards`` only (others raise InputError)."""

    def keep_path(self, cache: Cache, path: Sequence[int] | np.ndarray) -> None:
        """After ``forward_tree``: keep the tree's tokens ``path`` (root first) as if run linearly."""

    def embed(self, ids: np.ndarray) -> np.ndarray:
        """Token ids [T] -> hidden states [T, d]."""

    def head(self, hidden: np.ndarray) -> np.ndarray:
        """Hidden states [T, d] -> logits [T, vocab]."""

    def close(self) -> None:
        """Free the model's memory now (ONNX Runtime sessions, the library's handle, device
        memory); it runs nothing after (an InputError), and closing again does nothing."""


def close_cache(cache: Cache) -> None:
    """Free a cache's memory now where it lies outside Python's heap: a libedgeroute session
    (native), device buffers (TensorRT). An ONNX Runtime cache (numpy arrays) goes with its
    last reference."""
    close = getattr(cache, "close", None)
    if close is not None:
        close()


BACKENDS = ("auto", "onnxruntime", "onnxruntime-cuda", "native", "tensorrt")
GRAPH_BACKENDS = ("onnxruntime", "onnxruntime-cuda", "tensorrt")  # what runs a bundle's ONNX graphs
GPU_PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider")  # the order onnxruntime-cuda tries them


def cuda_providers(available: Sequence[str] | None = None) -> list[str]:
    """ONNX Runtime's providers for ``backend='onnxruntime-cuda'``: TensorRT's where installed,
    CUDA's, then the CPU for what they do not take; refused where this ONNX Runtime has no CUDA."""
    available = list(ort.get_available_providers() if available is None else available)
    if "CUDAExecutionProvider" not in available:
        raise InputError(f"backend='onnxruntime-cuda' needs onnxruntime-gpu and an NVIDIA GPU; this ONNX Runtime has "
                         f"{', '.join(available)}: use backend='onnxruntime' (CPU) or install onnxruntime-gpu")
    return [p for p in GPU_PROVIDERS if p in available] + ["CPUExecutionProvider"]


def providers_beyond_the_cpu(providers: Sequence[Any] | None) -> list[str]:
    """The providers of ``providers`` (names, or [name, options]) other than the CPU's that this
    ONNX Runtime has. A device profile names its GPU's (Jetson: TensorRT, CUDA); where this ONNX
    Runtime lacks them, it would run the graphs on its CPU provider, which the native kernels beat,
    so ``auto`` takes those (docs/guide/devices.md)."""
    available = set(ort.get_available_providers())
    names = (provider if isinstance(provider, str) else provider[0] for provider in providers or ())
    return [name for name in names if name != "CPUExecutionProvider" and name in available]


def native_blocker(entry: ModelEntry, options: EngineOptions) -> str | None:
    """Why the native backend cannot take this model with these settings (None: it can)."""
    if entry.native is None:
        if not entry.target.carries_over:
            return (f"the {entry.role} model has no native weights: the bundle was exported for --target "
                    f"{entry.target.name}, which re-blocks the source's weights")
        return f"the {entry.role} model has no native weights (export writes them for GGUF sources)"
    if entry.target.graphs and (others := providers_beyond_the_cpu(options.providers)):
        return f"providers {others} run the graphs through ONNX Runtime"
    if options.attention != "auto":
        return f"attention={options.attention!r} chooses ONNX Runtime graphs"
    if options.activations != "int8":
        return (f"the native kernels quantize activations to int8 (activations={options.activations!r} is "
                "ONNX Runtime's)")
    return None


def resolve_kv_dtype(kv_dtype: str, backend: str, entry: ModelEntry, kernels: str = "auto") -> str:
    """The cache element type ``kv_dtype`` means for ``entry``'s model on ``backend`` ("native",
    "onnxruntime" or "tensorrt") with the native ``kernels`` set: for "auto", what ``kv_formats``
    picks; on ONNX Runtime the bundle's target's first cache where it has no graphs for that one;
    on TensorRT the cache of the graphs ``build-engines`` builds (the target's first)."""
    if check_kv_dtype(kv_dtype, KV_DTYPE_CHOICES) != "auto":
        return kv_dtype
    if backend == "tensorrt":
        return entry.target.kv_dtypes[0]
    if backend == "native":
        from edgeroute.runtime.backends.native import native_kernels

        return auto_kv_dtype(backend, native_kernels(kernels), entry.arch.head_dim)
    cache = auto_kv_dtype(backend, None, entry.arch.head_dim)
    return cache if cache in entry.target.kv_dtypes else entry.target.kv_dtypes[0]


def backend_for(entry: ModelEntry, options: EngineOptions) -> tuple[str, str | None]:
    """Which backend ``open_model`` runs the model on, "native", "onnxruntime" or "tensorrt"
    (only when named: its engines are built per GPU), without loading it; and why ``auto`` did
    not take the native backend (None where it did, or where a backend was named). ``auto``
    takes the native backend where the model has native weights, the settings are its own
    (attention auto, int8 activations, no provider beyond the CPU's that this ONNX Runtime has:
    :func:`providers_beyond_the_cpu`) and the library's best kernels here are not the
    generic ones: an x86 set (AVX2, AVX-512 VNNI) or an Arm set (NEON, dotprod, i8mm, held to
    the generic kernels under qemu in the C tests); the generic kernels only when named.
    Otherwise ONNX Runtime."""
    from edgeroute.runtime.backends.native import native_kernels

    backend = options.backend
    if backend not in BACKENDS:
        raise InputError(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")
    if backend in GRAPH_BACKENDS and not entry.target.graphs:
        raise no_graphs(entry, backend)
    if backend in ("onnxruntime", "onnxruntime-cuda"):
        return "onnxruntime", None
    if backend == "tensorrt":
        return "tensorrt", None
    why_not = native_blocker(entry, options)
    if why_not is None:
        try:
            kernels = native_kernels(options.kernels)  # loads the library: whether the backend runs here at all
        except NativeBackendUnavailable as err:
            why_not = str(err)
        else:
            if backend == "auto" and kernels == "generic" and options.kernels == "auto":
                why_not = ("this CPU runs the generic native kernels, not measured against ONNX Runtime here: "
                           "backend='native' opts in")
    if why_not is None:
        return "native", None
    if backend == "native":
        raise NativeBackendUnavailable(f"backend='native' cannot run here: {why_not}")
    if not entry.target.graphs:  # nothing to fall back on
        raise NativeBackendUnavailable(f"the native backend cannot run here ({why_not}), and the bundle was exported "
                                       f"with --target {entry.target.name}: no ONNX graphs for ONNX Runtime; export "
                                       "again without --target (both, the default)")
    return "onnxruntime", why_not


def open_tensorrt(bundle: Bundle, role: str, options: EngineOptions, kv_dtype: str) -> ModelBackend:
    """The model on its TensorRT engines; settings of the other backends are refused, naming them
    (ONNX Runtime's providers, which device profiles set, do not apply and are left alone)."""
    from edgeroute.runtime.backends.tensorrt import TrtModel

    others = {"attention": None if options.attention == "auto" else options.attention,
              "activations": None if options.activations == "int8" else options.activations,
              "kernels": None if options.kernels == "auto" else options.kernels}
    if given := [f"{name}={value!r}" for name, value in others.items() if value]:
        raise InputError(f"backend='tensorrt' runs the engines as built: {', '.join(given)} belong to ONNX Runtime or "
                         "the native backend")
    return TrtModel(bundle, role, options.engine_cache, kv_dtype)


def open_model(bundle: Bundle, role: str, options: EngineOptions,
               exact_steps: bool | None = None) -> tuple[ModelBackend, str | None]:
    """The model of ``role`` on the backend :func:`backend_for` picks, and why ``auto`` did
    not take the native backend (None where it did, or where a backend was named).
    ``exact_steps``: None takes ``options.exact_steps`` (the engine asks it for the LLM only)."""
    from edgeroute.runtime.backends.native import NativeModel
    from edgeroute.runtime.backends.onnxruntime import OrtModel

    check_kv_dtype(options.kv_dtype, KV_DTYPE_CHOICES)  # a wrong name fails before anything is chosen or loaded
    if role not in bundle.models:
        raise InputError(f"bundle {bundle.path} has no {role!r} model (it has: {', '.join(bundle.models)})")
    if options.backend in GRAPH_BACKENDS and not bundle.target.graphs:  # before what the backend needs installed
        raise no_graphs(bundle.models[role], options.backend)
    if options.backend == "onnxruntime-cuda" and not options.providers:
        options = dataclasses.replace(options, providers=tuple(cuda_providers()))
    chosen, why_not = backend_for(bundle.models[role], options)
    cache = resolve_kv_dtype(options.kv_dtype, chosen, bundle.models[role], options.kernels)
    if chosen == "tensorrt":
        return open_tensorrt(bundle, role, options, cache), None
    if chosen == "native":
        return NativeModel(bundle, role, threads=options.model_threads(), kv_dtype=cache, kernels=options.kernels,
                           verify=bundle.verify), None
    if cache not in GRAPH_KV_DTYPES:  # why_not is None where a graph backend was named: say that, not "None"
        reason = why_not or f"backend={options.backend!r} was asked for"
        raise InputError(f"kv_dtype={cache!r}: that KV cache runs on the native backend only, which does not "
                         f"take the {role} model here ({reason}): use backend='auto' or 'native' on a model with "
                         "native weights, or kv_dtype='float16'")
    steps = options.exact_steps if exact_steps is None else exact_steps
    return OrtModel(bundle, role, options.providers, options.activations, options.attention, exact_steps=steps,
                    kv_dtype=cache, threads=options.model_threads()), why_not
