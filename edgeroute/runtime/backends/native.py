"""The native CPU backend: a bundle's GGUF blocks run by libedgeroute, edgeroute's C library.

A decode step on a CPU is bound by the bytes it reads. ONNX Runtime's int4 kernel reads its
own repacked format (fp32 block scales, an fp32 offset table), 1.4x the GGUF's bytes on the
Qwen2.5-Coder 1.5B; :class:`NativeModel` has the library read the blocks of the bundle's native
weight file (``models.<role>.native``, a GGUF file written by export for GGUF sources) as they
are stored. It implements :class:`edgeroute.runtime.backend.ModelBackend` like
:class:`OrtModel`; its caches (:class:`NativeCache`) are the library's sessions.

This module is a thin binding over the library's public header (``libedgeroute/include/
edgeroute.h``): the handles are opaque, the ABI version and the enum values are read from the
header itself, and the params structs carry their size, which the library checks. One forward
is one call into C (the per-layer steps are used only where a plan is decided from the hidden
state as it goes, or where calibration reruns layers).

The library is built with the package (``pip install .`` / the wheel: ``setup.py`` runs
``libedgeroute/build.py``) and carries every kernel set of its architecture, chosen at load
by the CPU's features: nothing is compiled at run time. ``EDGEROUTE_NATIVE_LIB`` names another
build. Every row of a pass is computed alike whatever the pass's length, so a speculative
verification pass reproduces one-token steps bit for bit.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import re
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from importlib import resources
from pathlib import Path

import numpy as np

from edgeroute.bundle import Bundle
from edgeroute.cpu import thread_count
from edgeroute.errors import BundleError, InputError, NativeBackendUnavailable
from edgeroute.files import atomic_path, cache_dir
from edgeroute.kv_formats import check_int8_head_dim, check_kv_dtype
from edgeroute.runtime.evaluate import tokenize_text
from edgeroute.runtime.layers import DROP, RUN, SKIP, SKIP_MLP, LayerPlan, LayerwiseModel, plan_action
from edgeroute.runtime.memory import PREFILL_CHUNK
from edgeroute.texts import calibration_text

LIBRARY_NAME = "libedgeroute.so"
# "x86" / "arm": the best x86 / Arm set this CPU runs (refused where that is the generic one)
KERNELS = ("auto", "x86", "arm", "generic", "avx2", "avx512-vnni", "neon", "dotprod", "i8mm")
FAMILIES = {"x86": ("avx2", "avx512-vnni"), "arm": ("neon", "dotprod", "i8mm")}
FAMILY_NEEDS = {"x86": "an x86-64 CPU with AVX2, FMA and F16C", "arm": "an aarch64 CPU (NEON)"}
BLOCK_FORMATS = ("Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K")  # er_block_format: ER_<name>
KV_FORMAT_NAMES = {"float32": "ER_KV_F32", "float16": "ER_KV_F16", "int8": "ER_KV_INT8"}
ACTION_NAMES = {RUN: "ER_LAYER_RUN", SKIP_MLP: "ER_LAYER_SKIP_MLP", SKIP: "ER_LAYER_SKIP", DROP: "ER_LAYER_DROP"}
TIMING_KINDS = {RUN: "layer", SKIP_MLP: "attn", SKIP: "kv", DROP: "kv"}
KEY_SCALE_TOKENS = 256  # of the calibration text, for an int8 cache's key channel scales


def native_header() -> Path:
    """The public header: inside the installed package (``edgeroute/native/include``) or the
    checkout's ``libedgeroute/include``."""
    packaged = resources.files("edgeroute") / "native" / "include" / "edgeroute.h"
    if packaged.is_file():
        return Path(str(packaged))
    return Path(__file__).resolve().parents[3] / "libedgeroute" / "include" / "edgeroute.h"


@functools.cache
def header_constants() -> dict[str, int]:
    """ER_ABI_VERSION and every ``ER_NAME = value`` enum constant of the headers."""
    header = native_header()  # and the kernels' header beside it (block formats, kernels alone)
    text = header.read_text() + header.with_name("edgeroute_kernels.h").read_text()
    constants = {name: int(value) for name, value in re.findall(r"\b(ER_[A-Z0-9_]+) = (-?\d+)", text)}
    constants["ER_ABI_VERSION"] = int(re.search(r"#define ER_ABI_VERSION (\d+)", text).group(1))
    return constants


# -- the params structs: sized and checked by the library (struct_size) ---------------------------

class _ModelParams(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32), ("kernels", ctypes.c_int32), ("threads", ctypes.c_int32),
                ("max_pass", ctypes.c_int32), ("verify", ctypes.c_int32)]


class _ModelInfo(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32),
                *((name, ctypes.c_int32) for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "ffn",
                                                       "vocab", "context_length", "kernels", "threads",
                                                       "pass_rows", "verified"))]


class _SessionParams(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32), ("capacity", ctypes.c_int32), ("kv_format", ctypes.c_int32)]


class _ForwardParams(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32), ("plan", ctypes.c_void_p), ("plan_layers", ctypes.c_int32),
                ("logits_rows", ctypes.c_int32), ("logits", ctypes.c_void_p), ("hidden", ctypes.c_void_p),
                ("layer_seconds", ctypes.c_void_p)]


def _sized(struct: type[ctypes.Structure], **fields) -> ctypes.Structure:
    return struct(struct_size=ctypes.sizeof(struct), **fields)


# -- the library ------------------------------------------------------------------------------------

def library_path() -> Path:
    """``EDGEROUTE_NATIVE_LIB``, else the library built into the package."""
    named = os.environ.get("EDGEROUTE_NATIVE_LIB")
    return Path(named) if named else Path(__file__).resolve().parents[2] / LIBRARY_NAME


_library: ctypes.CDLL | NativeBackendUnavailable | None = None
_library_lock = threading.Lock()


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    expected = header_constants()["ER_ABI_VERSION"]
    lib.er_abi_version.restype = ctypes.c_int
    if lib.er_abi_version() != expected:
        raise NativeBackendUnavailable(f"{library_path()} is libedgeroute ABI {lib.er_abi_version()}, this edgeroute "
                                       f"drives ABI {expected}: reinstall edgeroute (or unset EDGEROUTE_NATIVE_LIB)")
    p, i32, size, status = ctypes.c_void_p, ctypes.c_int32, ctypes.c_size_t, ctypes.c_int
    signatures = {
        "er_last_error": ([], ctypes.c_char_p), "er_kernels_name": ([ctypes.c_int], ctypes.c_char_p),
        "er_kernels_supported": ([ctypes.c_int], ctypes.c_int), "er_kernels_best": ([], ctypes.c_int),
        "er_kv_row_bytes": ([ctypes.c_int, ctypes.c_int], size),
        "er_model_open": ([ctypes.c_char_p, ctypes.POINTER(_ModelParams), ctypes.POINTER(p)], status),
        "er_model_free": ([p], None), "er_model_get_info": ([p, ctypes.POINTER(_ModelInfo)], status),
        "er_model_set_key_scales": ([p, p, size], status),
        "er_session_create": ([p, ctypes.POINTER(_SessionParams), ctypes.POINTER(p)], status),
        "er_session_free": ([p], None), "er_session_length": ([p], i32), "er_session_capacity": ([p], i32),
        "er_session_truncate": ([p, i32], status), "er_session_copy": ([p, p, i32], status),
        "er_session_kv": ([p, ctypes.POINTER(p), ctypes.POINTER(p), ctypes.POINTER(size)], status),
        "er_session_dropped": ([p], ctypes.POINTER(ctypes.c_uint8)),
        "er_session_forward": ([p, p, i32, ctypes.POINTER(_ForwardParams)], status),
        "er_session_forward_tree": ([p, p, p, i32, ctypes.POINTER(_ForwardParams)], status),
        "er_session_keep_path": ([p, p, i32], status),
        "er_model_embed": ([p, p, i32, p], status), "er_model_head": ([p, p, i32, p], status),
        "er_head_rows_open": ([p, p, i32, ctypes.POINTER(p)], status),
        "er_head_rows_logits": ([p, p, i32, p], status), "er_head_rows_free": ([p], None),
        "er_session_run_layers": ([p, p, i32, i32, i32, i32, p, p], status),
        "er_session_advance": ([p, i32], status),
        "er_matmul": ([ctypes.c_int, ctypes.c_int, p, size, i32, i32, p, i32, p, i32], status),
        "er_dequantize_rows": ([ctypes.c_int, p, size, i32, i32, p, i32, p], status),
        "er_attention": ([ctypes.c_int, ctypes.c_int, i32, i32, i32, i32, p, p, p, p, i32, i32, p, i32], status),
        "er_data_digest": ([p, size, i32], ctypes.c_uint64),
    }
    for name, (args, result) in signatures.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = args, result
    return lib


def native_library(kernels: str = "auto") -> ctypes.CDLL:
    """The library, loaded once per process, after checking that it runs ``kernels`` here
    ("auto": the best set this CPU runs; "x86" / "arm": the best x86 / Arm set; "generic",
    "avx2", "avx512-vnni", "neon", "dotprod", "i8mm": that set, e.g. to compare or to test what
    another CPU runs). Raises
    NativeBackendUnavailable with the reason (kept: later calls raise it again at no cost)."""
    global _library
    kernel_id(kernels)  # a wrong name is the caller's error, not the library's
    with _library_lock:
        if _library is None:
            path = library_path()
            try:
                _library = _bind(ctypes.CDLL(str(path)))
            except OSError as err:
                _library = NativeBackendUnavailable(f"libedgeroute does not load from {path} ({err}): reinstall "
                                                    "edgeroute, or name a build with EDGEROUTE_NATIVE_LIB")
            except NativeBackendUnavailable as err:
                _library = err
    if isinstance(_library, NativeBackendUnavailable):
        raise _library
    _resolve(_library, kernels)
    return _library


def kernel_id(kernels: str) -> int | None:
    """The er_kernels value ``kernels`` names (None: decided by the CPU)."""
    if kernels not in KERNELS:
        raise InputError(f"kernels {kernels!r} is not one of {', '.join(KERNELS)}")
    if kernels in ("auto", *FAMILIES):
        return None
    return header_constants()[f"ER_KERNELS_{kernels.replace('-', '_').upper()}"]


def _resolve(lib: ctypes.CDLL, kernels: str) -> int:
    chosen = kernel_id(kernels)
    if chosen is None:
        chosen = lib.er_kernels_best()
        if kernels in FAMILIES and lib.er_kernels_name(chosen).decode() not in FAMILIES[kernels]:
            raise NativeBackendUnavailable(f"the {kernels} kernels need {FAMILY_NEEDS[kernels]}: this CPU "
                                           f"runs the {lib.er_kernels_name(chosen).decode()} kernels")
    elif not lib.er_kernels_supported(chosen):
        raise NativeBackendUnavailable(f"the {kernels} kernels do not run on this CPU (it runs "
                                       f"{lib.er_kernels_name(lib.er_kernels_best()).decode()})")
    return chosen


def native_kernels(kernels: str = "auto") -> str:
    """Which kernels ``kernels`` runs here: "generic", "avx2", "avx512-vnni", "neon", "dotprod" or
    "i8mm"."""
    lib = native_library(kernels)
    return lib.er_kernels_name(_resolve(lib, kernels)).decode()


FILE_ERRORS = ("ER_ERR_IO", "ER_ERR_FORMAT", "ER_ERR_VERSION")  # the weight file's fault: a BundleError


def _check(lib: ctypes.CDLL, status: int, error: type[Exception] = InputError) -> None:
    """Raises ``error`` with the library's message where ``status`` is not ER_OK."""
    if status != 0:
        message = lib.er_last_error().decode(errors="replace")
        file_error = status in (header_constants()[name] for name in FILE_ERRORS)
        raise (BundleError if file_error and error is InputError else error)(message)


def _address(array: np.ndarray | None) -> int | None:
    return None if array is None else array.ctypes.data


# -- caches: the library's sessions -----------------------------------------------------------------

class NativeCache:
    """One sequence's KV cache: a libedgeroute session (implements ``backend.Cache``). ``keys`` /
    ``values`` view the session's memory as [layers, 1, kv_heads, capacity, row] of ``dtype``
    (an int8 row: head_dim codes, then head_dim / 32 float32 scales)."""

    heads_first = True

    def __init__(self, model: NativeModel, capacity: int) -> None:
        self.model, self.lib, self.capacity, self.dtype = model, model.lib, capacity, model.kv_dtype
        handle = ctypes.c_void_p()
        params = _sized(_SessionParams, capacity=capacity, kv_format=header_constants()[KV_FORMAT_NAMES[self.dtype]])
        with model._held() as model_handle:  # the model's close waits: the new session holds the model
            _check(self.lib, self.lib.er_session_create(model_handle, ctypes.byref(params), ctypes.byref(handle)),
                   NativeBackendUnavailable)
        self.handle = handle
        keys, values, each = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_size_t()
        _check(self.lib, self.lib.er_session_kv(handle, ctypes.byref(keys), ctypes.byref(values), ctypes.byref(each)))
        a = model.arch
        row = self.lib.er_kv_row_bytes(params.kv_format, a.head_dim) // np.dtype(self.dtype).itemsize
        shape = (a.num_layers, 1, a.num_kv_heads, capacity, row)
        self.keys, self.values = (np.ctypeslib.as_array(ctypes.cast(pointer, ctypes.POINTER(ctypes.c_uint8)),
                                                        (each.value,)).view(self.dtype).reshape(shape)
                                  for pointer in (keys, values))

    def __del__(self) -> None:
        self.close()

    def close(self) -> None:
        """Frees the session now (otherwise when the cache is collected)."""
        if getattr(self, "handle", None):
            self.keys = self.values = None
            self.lib.er_session_free(self.handle)
            self.handle = None

    @property
    def length(self) -> int:
        return self.lib.er_session_length(self.handle) if self.handle else 0  # a closed cache holds nothing

    def _require_open(self) -> None:
        if not self.handle:
            raise InputError("this cache was closed (cache.close(), or its engine closed): it holds nothing to run on")

    @property
    def dropped(self) -> np.ndarray | None:
        """[layers, capacity] bool: positions each layer dropped (a view), None while none was."""
        pointer = self.lib.er_session_dropped(self.handle)
        if not pointer:
            return None
        return np.ctypeslib.as_array(pointer, (self.model.num_layers, self.capacity)).view(bool)

    def truncate(self, length: int) -> None:
        """Forget positions >= length (rejected speculative tokens)."""
        self._require_open()
        _check(self.lib, self.lib.er_session_truncate(self.handle, length), ValueError)

    def reset(self) -> None:
        self.truncate(0)

    def copy_from(self, other: NativeCache, length: int | None = None) -> None:
        """Take over ``other``'s first ``length`` positions (all by default), e.g. a shared prompt prefix."""
        if not isinstance(other, NativeCache):
            raise ValueError("cannot copy between caches of different backends")
        self._require_open()
        other._require_open()
        _check(self.lib, self.lib.er_session_copy(self.handle, other.handle, -1 if length is None else length), ValueError)

    def clone(self) -> NativeCache:
        copy = NativeCache(self.model, self.capacity)
        copy.copy_from(self)
        return copy


# -- the model --------------------------------------------------------------------------------------

class NativeHeadRows:
    """A copy of some rows of a model's head: ``logits(hidden)`` gives the columns of the tokens
    ``ids`` (in their order) of what the model's ``head`` would, reading only those rows'
    weights. A drafter that proposes common tokens and those of its sequence reads a fraction of
    a large vocabulary's head per drafted token (:class:`~edgeroute.runtime.drafters.DraftVocabulary`).
    The rows keep the library's model alive until closed (or collected)."""

    def __init__(self, model: NativeModel, ids: Sequence[int] | np.ndarray) -> None:
        self.ids = np.ascontiguousarray(np.asarray(ids, np.int64).reshape(-1))
        self.lib, self.hidden_size = model.lib, model.arch.hidden_size
        self.handle: ctypes.c_void_p | None = None
        if not 0 < self.ids.size <= model.arch.vocab_size or self.ids.min() < 0 or self.ids.max() >= model.arch.vocab_size:
            raise InputError(f"head rows: {self.ids.size} token ids, each in [0, {model.arch.vocab_size}), are needed")
        rows = self.ids.astype(np.int32)
        handle = ctypes.c_void_p()
        with model._held() as model_handle:
            _check(self.lib, self.lib.er_head_rows_open(model_handle, _address(rows), rows.size, ctypes.byref(handle)))
        self.handle = handle

    def __len__(self) -> int:
        return int(self.ids.size)

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """Hidden states [T, d] (before the final norm) -> logits [T, len(ids)]."""
        if not self.handle:
            raise InputError("the head rows were closed")
        hidden = np.ascontiguousarray(hidden, np.float32).reshape(-1, self.hidden_size)
        logits = np.empty((hidden.shape[0], self.ids.size), np.float32)
        _check(self.lib, self.lib.er_head_rows_logits(self.handle, _address(hidden), hidden.shape[0], _address(logits)))
        return logits

    def close(self) -> None:
        if self.handle:
            self.lib.er_head_rows_free(self.handle)
            self.handle = None

    def __del__(self) -> None:
        self.close()


class NativeModel(LayerwiseModel):
    """A bundle model on libedgeroute; implements :class:`ModelBackend`."""

    flavour = "native"
    head_vocab = None  # export writes native weights for full-vocabulary heads only
    exact_steps = True  # every row is computed alike whatever the pass's length: steps are always exact
    tree_forwards = True  # forward_tree / keep_path: several drafts verified in one pass

    def __init__(self, bundle: Bundle, role: str = "llm", threads: int | None = None,
                 kv_dtype: str = "float16", kernels: str = "auto", verify: bool | None = None) -> None:
        """``kv_dtype``: the cache's element type, "float16" (half the bytes that attention reads
        per position), "float32" or "int8" (codes per 32 values and their float32 scales: 0.28x;
        keys scaled per channel, ``key_scales``); the kernels compute in float32 either way
        (``kv_formats.AUTO_KV_DTYPES``: what ``kv_dtype="auto"`` picks per kernel set). ``kernels``:
        see :func:`native_library`. ``verify`` (None: the bundle's ``verify``, True unless it was
        opened with ``verify=False``): the library checks the weights against the digest export
        wrote into the file (damaged weights: BundleError); a file without one (exported before
        it) is run with a warning that its bytes were not checked."""
        if role not in bundle.models:
            raise InputError(f"bundle {bundle.path} has no {role!r} model (it has: {', '.join(bundle.models)})")
        entry = bundle.models[role]
        if entry.native is None:
            raise NativeBackendUnavailable(f"the {role} model of {bundle.path} has no native weights (export writes "
                                           "them for GGUF sources in the formats the kernels read)")
        if entry.native.container != "gguf":
            raise NativeBackendUnavailable(f"the {role} model's native weights in {bundle.path} predate the GGUF "
                                           "container libedgeroute reads: re-export the bundle")
        self.kv_dtype = check_kv_dtype(kv_dtype)
        if kv_dtype == "int8":
            check_int8_head_dim(entry.arch.head_dim, f"{role} model")
        self.lib = native_library(kernels)
        self.arch = entry.arch
        self.capacity = int(bundle.generation["context_length"])
        threads = thread_count(threads)
        verify = bundle.verify if verify is None else verify
        params = _sized(_ModelParams, kernels=_resolve(self.lib, kernels), threads=threads, max_pass=PREFILL_CHUNK,
                        verify=header_constants()["ER_VERIFY_DIGEST" if verify else "ER_VERIFY_NONE"])
        handle = ctypes.c_void_p()
        self.handle: ctypes.c_void_p | None = None  # until the library opened the weights (close() then has none)
        self._handle_lock = threading.Lock()  # close() waits for the calls that run on the handle (_held)
        path = bundle.file(entry.native.file)
        _check(self.lib, self.lib.er_model_open(str(path).encode(), ctypes.byref(params), ctypes.byref(handle)))
        self.handle = handle
        info = _sized(_ModelInfo)
        _check(self.lib, self.lib.er_model_get_info(handle, ctypes.byref(info)))
        a = self.arch
        if (info.layers, info.hidden, info.heads, info.kv_heads, info.head_dim, info.vocab, info.context_length) != (
                a.num_layers, a.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim, a.vocab_size, self.capacity):
            raise BundleError(f"{path} does not describe the manifest's {role} model: export the bundle again")
        self.verified = bool(info.verified)  # the weights matched their digest at open
        if verify and not self.verified:
            warnings.warn(f"{path} carries no digest of its weights (exported before edgeroute wrote one): they were "
                          "not checked when opened; export the bundle again to have them checked", stacklevel=2)
        self.kernels = self.lib.er_kernels_name(info.kernels).decode()
        self.threads = info.threads
        self.pass_rows = info.pass_rows
        self.key_scales: np.ndarray | None = None  # [layers, kv_heads, head_dim], int8 caches only
        if self.kv_dtype == "int8":
            self.key_scales = self._key_scales(bundle, role)
            _check(self.lib, self.lib.er_model_set_key_scales(handle, _address(self.key_scales), self.key_scales.size))

    def __del__(self) -> None:
        self.close()

    def close(self) -> None:
        """Drops the model's handle now (otherwise when the model is collected). The library's
        model is reference-counted: caches that live keep it and keep working (whole forwards,
        truncations, copies), and its memory goes with the last of them; the model makes no new
        cache once closed, and a pass layer by layer (skipping) is refused (its embedding and
        head are the model's). Any thread may close it while others run its caches or its
        embedding and head (it waits for those calls: :meth:`_held`); closing again does nothing."""
        lock = getattr(self, "_handle_lock", None)
        if lock is None:  # never opened
            return
        with lock:
            if self.handle:
                self.lib.er_model_free(self.handle)
                self.handle = None

    @contextmanager
    def _held(self) -> Iterator[ctypes.c_void_p]:
        """The model's handle for one call on it (a new session, the embedding, the head): close()
        does not free it meanwhile. A closed model is an InputError saying so."""
        with self._handle_lock:
            if not self.handle:
                raise InputError("the native model was closed: its caches still run whole forwards; new caches, the "
                                 "embedding and the head (a pass layer by layer, as skipping runs) need the model "
                                 "opened again")
            yield self.handle

    def _key_scales(self, bundle: Bundle, role: str) -> np.ndarray:
        """_key_channel_peaks, kept in the cache directory under what they depend on (the
        weights, the tokenizer, the kernels): measured on the first load only (Qwen2.5-Coder-1.5B
        ~1.5 s). A cache directory that cannot be written costs the pass at every load."""
        files = bundle.manifest["files"]
        identity = [files.get(name, {}).get("sha256") for name in (bundle.models[role].native.file,
                                                                   bundle.tokenizer["file"])]
        if None in identity:  # nothing to name the scales by: measured each time
            return self._key_channel_peaks(bundle)
        abi = header_constants()["ER_ABI_VERSION"]
        key = hashlib.sha256(json.dumps([*identity, self.kernels, abi, KEY_SCALE_TOKENS]).encode())
        path = cache_dir() / "key-scales" / f"{key.hexdigest()[:32]}.npy"
        a = self.arch
        try:
            kept = np.load(path)
            if kept.shape == (a.num_layers, a.num_kv_heads, a.head_dim) and kept.dtype == np.float32 \
                    and np.isfinite(kept).all() and (kept > 0).all():
                return kept
        except (OSError, ValueError):
            pass
        peaks = self._key_channel_peaks(bundle)
        try:
            with atomic_path(path) as staged, open(staged, "wb") as out:
                np.save(out, peaks)
        except OSError:
            pass
        return peaks

    def _key_channel_peaks(self, bundle: Bundle) -> np.ndarray:
        """Each key channel's largest magnitude over KEY_SCALE_TOKENS of a fixed text, the divisor
        an int8 cache stores the channel's keys by (the library's key_channel_scales says why),
        from the int8 rows of a pass without scales; a channel far quieter than its head's others
        keeps a floor of a tenth of their mean, so a key that is louder later does not take its
        block's whole range."""
        # a prefix of the text: its whole (~1 MB) took longer to tokenize than the pass to run
        ids = tokenize_text(bundle, calibration_text()[:KEY_SCALE_TOKENS * 16], KEY_SCALE_TOKENS)
        cache = self.new_cache(len(ids))
        self.hidden_states(cache, ids)
        hd = self.arch.head_dim
        rows = cache.keys[:, 0, :, :len(ids)]  # [layers, kv, positions, hd codes + hd / 32 float32 scales]
        codes = rows[..., :hd].astype(np.float32).reshape(*rows.shape[:-1], hd // 32, 32)
        block_scales = np.ascontiguousarray(rows[..., hd:]).view(np.float32)[..., None]
        peaks = np.abs(codes * block_scales).reshape(*rows.shape[:-1], hd).max(axis=2)  # [layers, kv, hd]
        cache.close()  # the scales may change only while no int8 session exists
        floor = 0.1 * peaks.mean(axis=-1, keepdims=True)
        return np.ascontiguousarray(np.maximum(peaks, np.maximum(floor, np.finfo(np.float32).tiny)), np.float32)

    # -- passes ---------------------------------------------------------------------------------

    def new_cache(self, capacity: int | None = None) -> NativeCache:
        capacity = capacity or self.capacity
        if capacity > self.capacity:
            raise InputError(f"a cache of {capacity} positions exceeds the bundle's context of {self.capacity}")
        if not self.handle:
            raise InputError("the native model was closed: its caches still run, new ones need the model opened again")
        return NativeCache(self, capacity)

    def _check_cache(self, cache: NativeCache) -> None:
        if not isinstance(cache, NativeCache) or cache.model is not self:
            raise InputError(f"the native backend runs on its own caches (heads-first {self.kv_dtype}): use "
                             "model.new_cache()")
        cache._require_open()

    def _ids(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        ids = np.asarray(ids).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.arch.vocab_size):
            raise InputError(f"token ids {ids.min()}..{ids.max()} are outside the vocabulary of {self.arch.vocab_size}")
        return np.ascontiguousarray(ids, np.int32)

    def _plan(self, plan: Sequence[bool] | None) -> np.ndarray | None:
        if plan is None:
            return None
        codes = header_constants()
        return np.array([codes[ACTION_NAMES[RUN if keep else SKIP]] for keep in plan], np.uint8)

    def _forward(self, cache: NativeCache, ids: Sequence[int] | np.ndarray, plan: Sequence[bool] | None,
                 logits_rows: int, hidden: bool) -> tuple[np.ndarray | None, np.ndarray | None]:
        """One call into the library: the tokens through the layers, logits of the last rows."""
        self._check_cache(cache)
        ids = self._ids(ids)
        self.check_room(cache, ids.shape[0])
        plan_codes = self._plan(plan)
        if plan_codes is not None and plan_codes.shape[0] != self.num_layers:
            raise InputError(f"a plan of {plan_codes.shape[0]} layers for a model of {self.num_layers}")
        logits = np.empty((logits_rows, self.arch.vocab_size), np.float32) if logits_rows else None
        states = np.empty((ids.shape[0], self.arch.hidden_size), np.float32) if hidden else None
        seconds = np.zeros(self.num_layers, np.float64) if self.timings is not None else None
        params = _sized(_ForwardParams, plan=_address(plan_codes), plan_layers=self.num_layers,
                        logits_rows=logits_rows, logits=_address(logits), hidden=_address(states),
                        layer_seconds=_address(seconds))
        call = functools.partial(self.lib.er_session_forward, cache.handle, _address(ids), ids.shape[0],
                                 ctypes.byref(params))
        if seconds is None:
            _check(self.lib, call())
        else:
            self._timed_forward(call, seconds, plan)
        return logits, states

    def _timed_forward(self, call, seconds: np.ndarray, plan: Sequence[bool] | None) -> None:
        """The trace's timings: each layer's, and the rest of the call as the LM head and embedding."""
        start = time.perf_counter()
        status = call()
        total = time.perf_counter() - start
        _check(self.lib, status)
        for layer, spent in enumerate(seconds):
            self.timings(TIMING_KINDS[RUN if plan is None or plan[layer] else SKIP], float(spent))
        self.timings("head", max(0.0, total - float(seconds.sum())))

    def forward(self, cache: NativeCache, ids: Sequence[int] | np.ndarray,
                plan: Sequence[bool] | LayerPlan | None = None, all_logits: bool = False,
                tail: int | None = None) -> np.ndarray:
        """See ``OrtModel.forward``; a plan that is not a callable runs as one call into the library."""
        if callable(plan):
            return super().forward(cache, ids, plan, all_logits, tail)
        t = len(ids)
        logits, _ = self._forward(cache, ids, plan, t if all_logits else min(tail or 1, t), False)
        return logits if all_logits or tail is not None else logits[0]

    def forward_tree(self, cache: NativeCache, ids: Sequence[int] | np.ndarray,
                     parents: Sequence[int] | np.ndarray) -> np.ndarray:
        """Runs new tokens that form a tree over the cache as one pass: ``parents[i]`` is token
        i's parent, an earlier token of the tree, or -1 for the cache's last token. Each token sees
        the cache and its own ancestors only, at the position of its depth, so its logits (the
        returned [T, vocab]) are those of its root-to-token path run alone, to float rounding.
        The cache holds the T tokens' rows until :meth:`keep_path` keeps one path of them."""
        self._check_cache(cache)
        ids = self._ids(ids)
        parents = np.asarray(parents).reshape(-1)
        if parents.shape != ids.shape or (parents.size and parents.dtype.kind not in "iu"):
            raise InputError(f"parents {parents.tolist()} for {ids.shape[0]} tokens: one integer per token, an earlier "
                             "token's index or -1 (the cache's last token)")
        self.check_room(cache, ids.shape[0])
        parents = np.ascontiguousarray(parents, np.int32)
        logits = np.empty((ids.shape[0], self.arch.vocab_size), np.float32)
        params = _sized(_ForwardParams, logits_rows=ids.shape[0], logits=_address(logits))
        _check(self.lib, self.lib.er_session_forward_tree(cache.handle, _address(ids), _address(parents), ids.shape[0],
                                                          ctypes.byref(params)))
        return logits

    def keep_path(self, cache: NativeCache, path: Sequence[int] | np.ndarray) -> None:
        """After :meth:`forward_tree` (nothing run on the cache since): keeps the tree's tokens
        ``path`` (their indices, root first, each the previous one's child; empty: none) and drops
        the rest, leaving the cache as if the path had been run linearly."""
        self._check_cache(cache)
        path = np.ascontiguousarray(np.asarray(path, np.int64).reshape(-1), np.int32)
        _check(self.lib, self.lib.er_session_keep_path(cache.handle, _address(path), path.shape[0]))

    def hidden_states(self, cache: NativeCache, ids: Sequence[int] | np.ndarray,
                      plan: Sequence[bool] | LayerPlan | None = None) -> np.ndarray:
        if callable(plan):
            return super().hidden_states(cache, ids, plan)
        return self._forward(cache, ids, plan, 0, True)[1]

    def embed(self, ids: np.ndarray) -> np.ndarray:
        ids = self._ids(ids)
        out = np.empty((ids.shape[0], self.arch.hidden_size), np.float32)
        with self._held() as handle:
            _check(self.lib, self._timed("embed", lambda: self.lib.er_model_embed(handle, _address(ids), ids.shape[0],
                                                                                  _address(out))))
        return out

    def head(self, hidden: np.ndarray) -> np.ndarray:
        hidden = np.ascontiguousarray(hidden, np.float32).reshape(-1, self.arch.hidden_size)
        logits = np.empty((hidden.shape[0], self.arch.vocab_size), np.float32)
        with self._held() as handle:
            _check(self.lib, self._timed("head", lambda: self.lib.er_model_head(handle, _address(hidden),
                                                                                hidden.shape[0], _address(logits))))
        return logits

    def head_rows(self, ids: Sequence[int] | np.ndarray) -> NativeHeadRows:
        """The head over the tokens ``ids`` only (see :class:`NativeHeadRows`)."""
        return NativeHeadRows(self, ids)

    def _run_layers(self, cache: NativeCache, hidden: np.ndarray, start: int, first: int, last: int,
                    actions: Sequence[str]) -> None:
        """Layers [first, last) over ``hidden`` [T, d] (contiguous float32, updated in place) at
        positions start.. of the cache, without moving its length."""
        codes = header_constants()
        plan = np.array([codes[ACTION_NAMES[action]] for action in actions], np.uint8)
        call = functools.partial(self.lib.er_session_run_layers, cache.handle, _address(hidden), hidden.shape[0], start,
                                 first, last, _address(plan), None)
        _check(self.lib, self._timed(TIMING_KINDS[actions[0]] if len(actions) == 1 else "layer", call))

    def _sub_layer(self, action: str, layer: int, hidden: np.ndarray, cache: NativeCache, start: int) -> np.ndarray:
        self._check_cache(cache)
        out = np.array(hidden, np.float32, order="C")  # a copy: the caller's array stays as it was
        self._run_layers(cache, out, start, layer, layer + 1, [action])
        return out

    def layer(self, layer: int, hidden: np.ndarray, cache: NativeCache, start: int) -> np.ndarray:
        """The whole decoder layer (attention + MLP) over positions start.."""
        return self._sub_layer(RUN, layer, hidden, cache, start)

    def attention(self, layer: int, hidden: np.ndarray, cache: NativeCache, start: int) -> np.ndarray:
        """The attention sub-layer alone (its residual included)."""
        return self._sub_layer(SKIP_MLP, layer, hidden, cache, start)

    def kv_fill(self, layer: int, hidden: np.ndarray, cache: NativeCache, start: int) -> None:
        """The layer's K/V rows of ``hidden`` written at positions start.. (a skipped layer)."""
        self._sub_layer(SKIP, layer, hidden, cache, start)

    def _pass(self, cache: NativeCache, ids: np.ndarray, plan: Sequence[bool] | LayerPlan | None) -> np.ndarray:
        """A pass whose plan decides per layer from the hidden state: one library call per layer."""
        self._check_cache(cache)
        start, t = cache.length, ids.shape[0]
        hidden = self.embed(ids)
        for layer in range(self.num_layers):
            action = plan_action(plan, layer, hidden)
            if callable(plan) and action != DROP:
                hidden = hidden.copy()  # the library writes in place; a plan may keep what it was shown
            self._run_layers(cache, hidden, start, layer, layer + 1, [action])
        _check(self.lib, self.lib.er_session_advance(cache.handle, t))
        return hidden


# -- the kernels on their own (tests, kernel benchmarks) ------------------------------------------

def _blocks(tensor_format: str, blocks: np.ndarray) -> tuple[int, np.ndarray]:
    if tensor_format not in BLOCK_FORMATS:
        raise InputError(f"format {tensor_format!r} is not one of {', '.join(BLOCK_FORMATS)}")
    return header_constants()[f"ER_{tensor_format}"], np.ascontiguousarray(blocks, np.uint8)


def native_matmul(tensor_format: str, blocks: np.ndarray, shape: tuple[int, int], x: np.ndarray,
                  threads: int | None = None, kernels: str = "auto") -> np.ndarray:
    """``x [M, cols] @ W.T`` for a matrix W of ``shape`` (rows, cols) stored as ggml ``blocks``
    (uint8, as in a GGUF file), through the layer's kernels: activations quantized to int8."""
    lib = native_library(kernels)
    fmt, blocks = _blocks(tensor_format, blocks)
    x = np.ascontiguousarray(x, np.float32).reshape(-1, shape[1])
    y = np.empty((x.shape[0], shape[0]), np.float32)
    _check(lib, lib.er_matmul(_resolve(lib, kernels), fmt, _address(blocks), blocks.nbytes, shape[0], shape[1],
                              _address(x), x.shape[0], _address(y), threads or os.cpu_count() or 1))
    return y


def native_dequantize(tensor_format: str, blocks: np.ndarray, shape: tuple[int, int], rows: np.ndarray,
                      kernels: str = "auto") -> np.ndarray:
    """Rows of a ggml block matrix as float32 (the embedding lookup's kernel)."""
    lib = native_library(kernels)
    fmt, blocks = _blocks(tensor_format, blocks)
    rows = np.ascontiguousarray(rows, np.int64).reshape(-1)
    out = np.empty((rows.shape[0], shape[1]), np.float32)
    _check(lib, lib.er_dequantize_rows(fmt, _address(blocks), blocks.nbytes, shape[0], shape[1], _address(rows),
                                       rows.shape[0], _address(out)))
    return out


def native_attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, start: int, kv_dtype: str = "float32",
                     masked: np.ndarray | None = None, threads: int | None = None,
                     kernels: str = "auto") -> np.ndarray:
    """Attention of ``q`` [M, heads, head_dim] (rotated) at positions ``start``.. over one layer's
    heads-first cache rows ``keys`` / ``values`` [kv_heads, capacity, row] in the native cache
    format of ``kv_dtype`` (positions up to ``start + M`` filled), causal; ``masked``
    [capacity] bool drops positions. Returns [M, heads, head_dim]."""
    lib = native_library(kernels)
    q = np.ascontiguousarray(q, np.float32)
    m, heads, head_dim = q.shape
    keys, values = (np.ascontiguousarray(a, check_kv_dtype(kv_dtype)) for a in (keys, values))
    kv_heads, capacity, row = keys.shape
    kv_format = header_constants()[KV_FORMAT_NAMES[kv_dtype]]
    if values.shape != keys.shape or row * keys.itemsize != lib.er_kv_row_bytes(kv_format, head_dim):
        raise InputError(f"keys {keys.shape} and values {values.shape} are not {kv_dtype} cache rows of head_dim {head_dim}")
    drops = None if masked is None else np.ascontiguousarray(masked, np.uint8)
    out = np.empty_like(q)
    _check(lib, lib.er_attention(_resolve(lib, kernels), kv_format, heads, kv_heads, head_dim, capacity, _address(q),
                                 _address(keys), _address(values), _address(drops), m, start, _address(out),
                                 threads or os.cpu_count() or 1))
    return out
