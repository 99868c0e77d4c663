"""The native CPU backend: a bundle's GGUF blocks run by edgeroute's own kernels.

A decode step on a CPU is bound by the bytes it reads. ONNX Runtime's int4 kernel reads its
own repacked format (fp32 block scales, an fp32 offset table), 1.4x the GGUF's bytes on the
Qwen2.5-Coder 1.5B; :class:`NativeModel` reads the blocks of the bundle's native weight file
(``models.<role>.native``, written by export for GGUF sources) as they are stored, with the
decoder layer in C (``runtime/native/edgeroute_native.c``: int8 activations, VNNI / AVX2 byte
dot products, OpenMP over output rows). It implements
:class:`edgeroute.runtime.backend.ModelBackend` like :class:`OrtModel`, on the heads-first
float32 :class:`KVCache`.

Every row of a pass is computed alike whatever the pass's length (activations are quantized
per row, dot products summed in one order), so a speculative verification pass reproduces
one-token steps bit for bit without ``exact_steps``' second row.

The library is compiled on first use with the machine's C compiler for its own CPU
(``-march=native``, ~1 s) into ``$EDGEROUTE_CACHE/native`` (default ``~/.cache/edgeroute``),
keyed by the source, compiler and instruction sets; ``EDGEROUTE_NATIVE_LIB`` names a prebuilt
one. On x86-64 with AVX2, FMA and F16C it runs the x86 kernels (AVX-512 VNNI where present);
on any other CPU (Arm: Jetson, in-car SoCs) the generic C kernels, the same arithmetic
vectorized by the compiler, which the tests check on x86 too. Their speed on Arm is not
measured yet, so ``backend="auto"`` keeps ONNX Runtime there and ``backend="native"`` opts in.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import json
import mmap
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator, Sequence
from importlib import resources
from pathlib import Path

import numpy as np

from edgeroute.bundle import NATIVE_FORMATS, Bundle, NativeTensor
from edgeroute.cpu import cpu_signature
from edgeroute.errors import BundleError, InputError, NativeBackendUnavailable
from edgeroute.kv_formats import check_int8_head_dim, check_kv_dtype, kv_row_bytes
from edgeroute.rope import rope_tables
from edgeroute.runtime.attention import KVCache, resident_zeros
from edgeroute.runtime.evaluate import tokenize_text
from edgeroute.runtime.memory import PREFILL_CHUNK
from edgeroute.runtime.model import DROP, RUN, SKIP, SKIP_MLP, LayerPlan, LayerwiseModel, plan_action
from edgeroute.texts import calibration_text

SOURCE_NAME = "edgeroute_native.c"
LIBRARY_VERSION = 5  # er_version() of the C source this module drives
KERNELS = ("auto", "x86", "avx2", "generic")
KERNEL_NAMES = {0: "generic", 1: "avx2", 2: "avx512-vnni"}  # er_kernels()
REQUIRED_FLAGS = ("avx2", "fma", "f16c")
GGML_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14}
FORMAT_NAMES = {type_id: name for name, type_id in GGML_TYPES.items()}
MODES = {RUN: 0, SKIP_MLP: 1, SKIP: 2}  # er_layer_forward's mode per plan action
TIMING_KINDS = {RUN: "layer", SKIP_MLP: "attn", SKIP: "kv"}
KV_FORMATS = {"float32": 0, "float16": 1, "int8": 2}  # er_dims.kv_format
KEY_SCALE_TOKENS = 256  # of the calibration text, for an int8 cache's key channel scales


class _Matrix(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("packed", ctypes.c_void_p), ("type", ctypes.c_int32),
                ("rows", ctypes.c_int32), ("cols", ctypes.c_int32), ("packed_rows", ctypes.c_int32)]


class _Layer(ctypes.Structure):
    _fields_ = [*((name, _Matrix) for name in ("q", "k", "v", "o", "gate", "up", "down")),
                *((name, ctypes.c_void_p)
                  for name in ("attn_norm", "ffn_norm", "q_bias", "k_bias", "v_bias", "key_scales"))]


class _Dims(ctypes.Structure):
    _fields_ = [*((name, ctypes.c_int32) for name in ("hidden", "heads", "kv_heads", "head_dim", "ffn", "capacity")),
                ("eps", ctypes.c_float), ("threads", ctypes.c_int32), ("kv_format", ctypes.c_int32)]


# -- the library --------------------------------------------------------------------------------

def native_source() -> Path:
    """The C source: inside the installed package (``edgeroute/native``) or the checkout's
    top-level ``runtime/native``."""
    packaged = resources.files("edgeroute") / "native" / SOURCE_NAME
    if packaged.is_file():
        return Path(str(packaged))
    return Path(__file__).resolve().parents[2] / "runtime" / "native" / SOURCE_NAME


def _cache_dir() -> Path:
    root = os.environ.get("EDGEROUTE_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "edgeroute"


def _x86_kernels_here() -> str | None:
    """Why this CPU cannot run the x86 kernels (None: it can)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"this CPU is {platform.machine()}"
    missing = [flag for flag in REQUIRED_FLAGS if flag not in cpu_signature()["isa"]]
    return f"this CPU lacks {', '.join(missing)}" if missing else None


def _flags(kernels: str) -> list[str]:
    if kernels == "x86":
        return ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
    if kernels == "avx2":  # the x86 kernels an AVX2-only CPU runs, buildable on any newer x86 CPU
        return ["-O3", "-march=x86-64-v3", "-mtune=native", "-fopenmp", "-shared", "-fPIC"]
    # the compiler vectorizes the generic C for this CPU; no contraction into FMAs, which it
    # would apply differently in the tile sizes' specializations (a row's bits would then
    # depend on the pass's length, and speculation would no longer be exact)
    target = "-mcpu=native" if platform.machine() in ("aarch64", "arm64") else "-march=native"
    return ["-O3", target, "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-DER_GENERIC"]


def _compile(source: Path, kernels: str) -> Path:
    """Build the library with the x86 (AVX2 / AVX-512) or the generic kernels."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise NativeBackendUnavailable("no C compiler (cc or gcc, or $CC) to build the native kernels")
    flags = _flags(kernels)
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as err:
        raise NativeBackendUnavailable(f"the C compiler {compiler} does not run ({err})") from err
    isa = cpu_signature()["isa"]
    key = hashlib.sha256("\0".join([source.read_text(), compiler, version, *flags, *isa]).encode()).hexdigest()
    target = _cache_dir() / "native" / f"libedgeroute_native-{kernels}-{key[:16]}.so"
    if target.is_file():
        return target
    with _written_atomically(target) as built:
        done = subprocess.run([compiler, *flags, "-o", str(built), str(source)], capture_output=True, text=True)
        if done.returncode != 0:
            raise NativeBackendUnavailable(f"building the native kernels failed ({compiler} {' '.join(flags)}):\n"
                                           f"{done.stderr.strip()[-2000:]}")
    return target


@contextlib.contextmanager
def _written_atomically(target: Path) -> Iterator[Path]:
    """A path to write ``target``'s new contents to, in the same directory: it replaces
    ``target`` in one step when the block ends, and is removed if the block raises, so a crash
    or a concurrent writer never leaves half a file in the cache directory."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        staged = Path(tmp) / target.name
        yield staged
        os.replace(staged, target)


_libraries: dict[str, ctypes.CDLL | NativeBackendUnavailable] = {}
_library_lock = threading.Lock()


def native_library(kernels: str = "auto") -> ctypes.CDLL:
    """The kernels, built or found once per process: "x86" (AVX2, FMA, F16C; AVX-512 VNNI where
    the CPU has it), "avx2" (the x86 kernels held to AVX2, FMA and F16C, as an AVX2-only CPU runs
    them: tests and comparisons on newer CPUs), "generic" (plain C the compiler vectorizes: any
    CPU, e.g. Arm), or "auto"
    (x86 where this CPU runs them, else generic; ``EDGEROUTE_NATIVE_LIB`` names a prebuilt
    library instead). Raises NativeBackendUnavailable with the reason (kept: later calls raise
    it again at no cost)."""
    if kernels not in KERNELS:
        raise InputError(f"kernels {kernels!r} is not one of {', '.join(KERNELS)}")
    with _library_lock:
        if kernels not in _libraries:
            try:
                prebuilt = os.environ.get("EDGEROUTE_NATIVE_LIB") if kernels == "auto" else None
                if prebuilt:
                    _libraries[kernels] = _bind(ctypes.CDLL(prebuilt))
                else:
                    why_not_x86 = _x86_kernels_here()
                    build = kernels if kernels != "auto" else ("generic" if why_not_x86 else "x86")
                    if build in ("x86", "avx2") and why_not_x86:
                        raise NativeBackendUnavailable(f"the x86 kernels need {', '.join(REQUIRED_FLAGS)}: {why_not_x86}")
                    _libraries[kernels] = _bind(ctypes.CDLL(str(_compile(native_source(), build))))
            except OSError as err:
                _libraries[kernels] = NativeBackendUnavailable(f"the native kernels do not load ({err})")
            except NativeBackendUnavailable as err:
                _libraries[kernels] = err
        library = _libraries[kernels]
        if isinstance(library, NativeBackendUnavailable):
            raise library
        return library


def native_kernels(kernels: str = "auto") -> str:
    """Which kernels the library of ``kernels`` runs: "generic", "avx2" or "avx512-vnni"."""
    return KERNEL_NAMES[native_library(kernels).er_kernels()]


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    if lib.er_version() != LIBRARY_VERSION:
        raise NativeBackendUnavailable(f"the native library is version {lib.er_version()}, this edgeroute drives "
                                       f"version {LIBRARY_VERSION}: rebuild it (unset EDGEROUTE_NATIVE_LIB)")
    pointer, size, i32 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
    signatures = {
        "er_kernels": ([], i32),
        "er_layer_forward": ([ctypes.POINTER(_Layer), ctypes.POINTER(_Dims), pointer, i32, i32, pointer, pointer,
                              pointer, pointer, pointer, i32, pointer], i32),
        "er_scratch_bytes": ([ctypes.POINTER(_Dims), i32], size),
        "er_head": ([ctypes.POINTER(_Matrix), pointer, ctypes.POINTER(_Dims), pointer, i32, pointer, pointer], i32),
        "er_head_scratch_bytes": ([i32, i32], size),
        "er_matmul": ([ctypes.POINTER(_Matrix), pointer, i32, pointer, i32, pointer], i32),
        "er_matmul_scratch_bytes": ([i32, i32], size),
        "er_attention": ([ctypes.POINTER(_Dims), pointer, pointer, pointer, pointer, i32, i32, pointer, pointer], i32),
        "er_dequantize_rows": ([ctypes.POINTER(_Matrix), pointer, i32, pointer], i32),
        "er_pack_bytes": ([ctypes.POINTER(_Matrix)], size),
        "er_pack": ([ctypes.POINTER(_Matrix), pointer], i32),
    }
    for name, (args, result) in signatures.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = args, result
    return lib


def _address(array: np.ndarray) -> int:
    return array.ctypes.data


def _pack(lib: ctypes.CDLL, matrix: _Matrix) -> np.ndarray | None:
    """Interleave the matrix's rows by 16 for the packed kernels (AVX-512 VNNI builds);
    returns the buffer the matrix now points into (keep it alive), or None."""
    size = lib.er_pack_bytes(ctypes.byref(matrix))
    if not size:
        return None
    buffer = np.empty(size, np.uint8)
    matrix.packed_rows = lib.er_pack(ctypes.byref(matrix), _address(buffer))
    matrix.packed = _address(buffer)
    return buffer


# -- the model ----------------------------------------------------------------------------------

class NativeModel(LayerwiseModel):
    """A bundle model on the native kernels; implements :class:`ModelBackend`."""

    flavour = "native"
    head_vocab = None  # export writes native weights for full-vocabulary heads only

    def __init__(self, bundle: Bundle, role: str = "llm", threads: int | None = None,
                 kv_dtype: str = "float16", kernels: str = "auto") -> None:
        """``kv_dtype``: the cache's element type, "float16" (half the bytes that attention reads
        per position), "float32" or "int8" (codes per 32 values and their float32 scales: 0.28x;
        keys scaled per channel, ``key_scales``); the kernels compute in float32 either way
        (``backend.AUTO_KV_DTYPES``: what ``kv_dtype="auto"`` picks per kernel set). ``kernels``:
        see :func:`native_library` ("generic" runs the plain C kernels on an x86 CPU too)."""
        if role not in bundle.models:
            raise InputError(f"bundle {bundle.path} has no {role!r} model (it has: {', '.join(bundle.models)})")
        entry = bundle.models[role]
        if entry.native is None:
            raise NativeBackendUnavailable(f"the {role} model of {bundle.path} has no native weights (export writes "
                                           "them for GGUF sources in the formats the kernels read)")
        self.kv_dtype = check_kv_dtype(kv_dtype)
        if kv_dtype == "int8":
            check_int8_head_dim(entry.arch.head_dim, f"{role} model")
        self.lib = native_library(kernels)
        self.kernels = KERNEL_NAMES[self.lib.er_kernels()]
        self.arch = entry.arch
        self.capacity = int(bundle.generation["context_length"])
        # every row is computed alike whatever the pass's length: steps are always exact
        self.exact_steps = True
        self.threads = threads or int(os.environ.get("EDGEROUTE_THREADS", 0)) or (os.cpu_count() or 1)
        self._file = np.memmap(bundle.file(entry.native.file), np.uint8, mode="r")
        self._tensors = entry.native.tensors
        self._where = f"the {role} model's native weights in {bundle.path}"
        a = self.arch
        q_rows, kv_rows = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        shapes = {"attn_q": (q_rows, a.hidden_size), "attn_k": (kv_rows, a.hidden_size),
                  "attn_v": (kv_rows, a.hidden_size), "attn_output": (a.hidden_size, q_rows),
                  "ffn_gate": (a.intermediate_size, a.hidden_size), "ffn_up": (a.intermediate_size, a.hidden_size),
                  "ffn_down": (a.hidden_size, a.intermediate_size)}
        self._layers = []
        for i in range(a.num_layers):
            b = f"blk.{i}"
            matrices = [self._matrix(f"{b}.{name}.weight", shape) for name, shape in shapes.items()]
            biases = [self._vector(f"{b}.{name}.bias", rows, required=a.attention_bias)
                      for name, rows in (("attn_q", q_rows), ("attn_k", kv_rows), ("attn_v", kv_rows))]
            self._layers.append(_Layer(*matrices, self._vector(f"{b}.attn_norm.weight", a.hidden_size),
                                       self._vector(f"{b}.ffn_norm.weight", a.hidden_size), *biases))
        self._embedding = self._matrix("token_embd.weight", (a.vocab_size, a.hidden_size), rows_at_least=True)
        head = "output.weight" if "output.weight" in self._tensors else "token_embd.weight"
        self._head = self._matrix(head, (a.vocab_size, a.hidden_size), rows_at_least=True)
        self._norm = self._vector("output_norm.weight", a.hidden_size)
        self._packed = self._pack_all()
        cos, sin = rope_tables(self.capacity, a.head_dim, a.rope_theta, a.rope_scaling)
        self.cos = np.ascontiguousarray(cos.reshape(self.capacity, a.head_dim), np.float32)
        self.sin = np.ascontiguousarray(sin.reshape(self.capacity, a.head_dim), np.float32)
        # sized and written at load for the longest pass (PREFILL_CHUNK rows at the full capacity):
        # grown on first need instead, the first long prompt or context-policy re-prefill raised
        # RSS mid-conversation (SmolLM2: +13 MiB, 5.6% of the process, at a 400-turn chat's first
        # context fill) and kept it
        longest = self.lib.er_scratch_bytes(ctypes.byref(self._dims(self.capacity)), PREFILL_CHUNK)
        self._scratch = resident_zeros((longest,), "uint8")
        self._lock = threading.Lock()  # one pass at a time: the passes share the scratch memory
        self.key_scales: np.ndarray | None = None  # [layers, kv_heads, head_dim], int8 caches only
        if self.kv_dtype == "int8":
            self.key_scales = self._key_scales(bundle, role)
            for layer, scales in zip(self._layers, self.key_scales, strict=True):
                layer.key_scales = _address(scales)

    def _key_scales(self, bundle: Bundle, role: str) -> np.ndarray:
        """_key_channel_peaks, kept in the cache directory under what they depend on (the
        weights, the tokenizer, the kernels): measured on the first load only (Qwen2.5-Coder-1.5B
        ~1.5 s). A cache directory that cannot be written costs the pass at every load."""
        files = bundle.manifest["files"]
        identity = [files.get(name, {}).get("sha256") for name in (bundle.models[role].native.file,
                                                                   bundle.tokenizer["file"])]
        if None in identity:  # nothing to name the scales by: measured each time
            return self._key_channel_peaks(bundle)
        key = hashlib.sha256(json.dumps([*identity, self.kernels, LIBRARY_VERSION, KEY_SCALE_TOKENS]).encode())
        path = _cache_dir() / "key-scales" / f"{key.hexdigest()[:32]}.npy"
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
            with _written_atomically(path) as staged:
                np.save(staged, peaks)
        except OSError:
            pass
        return peaks

    def _key_channel_peaks(self, bundle: Bundle) -> np.ndarray:
        """Each key channel's largest magnitude over KEY_SCALE_TOKENS of a fixed text, the divisor
        an int8 cache stores the channel's keys by (the C source's key_channel_scales says why),
        from the int8 rows of a pass without scales; a channel far quieter than its head's others
        keeps a floor of a tenth of their mean, so a key that is louder later does not take its
        block's whole range."""
        # a prefix of the text: its whole (~1 MB) took longer to tokenize than the pass to run
        ids = tokenize_text(bundle, calibration_text()[:KEY_SCALE_TOKENS * 16], KEY_SCALE_TOKENS)
        cache = self.new_cache(len(ids))
        for _ in self._passes(cache, ids, None):
            pass
        hd = self.arch.head_dim
        rows = cache.keys[:, 0, :, :len(ids)]  # [layers, kv, positions, hd codes + hd / 32 float32 scales]
        codes = rows[..., :hd].astype(np.float32).reshape(*rows.shape[:-1], hd // 32, 32)
        block_scales = np.ascontiguousarray(rows[..., hd:]).view(np.float32)[..., None]
        peaks = np.abs(codes * block_scales).reshape(*rows.shape[:-1], hd).max(axis=2)  # [layers, kv, hd]
        floor = 0.1 * peaks.mean(axis=-1, keepdims=True)
        return np.ascontiguousarray(np.maximum(peaks, np.maximum(floor, np.finfo(np.float32).tiny)), np.float32)

    # -- weights --------------------------------------------------------------------------------

    def _tensor(self, name: str) -> NativeTensor:
        if name not in self._tensors:
            raise BundleError(f"{self._where} have no {name}: export the bundle again")
        return self._tensors[name]

    def _matrix(self, name: str, shape: tuple[int, int], rows_at_least: bool = False) -> _Matrix:
        t = self._tensor(name)
        rows_ok = t.shape[0] >= shape[0] if rows_at_least else t.shape[0] == shape[0]
        if t.format not in GGML_TYPES or len(t.shape) != 2 or not rows_ok or t.shape[1] != shape[1]:
            raise BundleError(f"{self._where}: {name} is {t.format} {t.shape}, expected a block matrix of {shape}: "
                              "export the bundle again")
        return _Matrix(_address(self._file) + t.offset, None, GGML_TYPES[t.format], t.shape[0], t.shape[1], 0)

    def _pack_all(self) -> list[np.ndarray]:
        """Interleave what the packed kernel takes; the file's pages of those tensors are then
        given back (the mapping stays: nothing reads them again)."""
        buffers = []
        matrices = [getattr(layer, name) for layer in self._layers for name in ("q", "k", "v", "o", "gate", "up", "down")]
        for matrix in [*matrices, self._head]:
            buffer = _pack(self.lib, matrix)
            if buffer is None:
                continue
            buffers.append(buffer)
            values, block_bytes = NATIVE_FORMATS[FORMAT_NAMES[matrix.type]]
            start = matrix.data - _address(self._file)
            end = start + matrix.packed_rows * matrix.cols // values * block_bytes
            page = mmap.PAGESIZE
            first, last = -(-start // page) * page, end // page * page
            if last > first and hasattr(self._file._mmap, "madvise"):
                self._file._mmap.madvise(mmap.MADV_DONTNEED, first, last - first)
        return buffers

    def _vector(self, name: str, size: int, required: bool = True) -> int | None:
        if not required and name not in self._tensors:
            return None
        t = self._tensor(name)
        if t.format != "F32" or t.shape != (size,):
            raise BundleError(f"{self._where}: {name} is {t.format} {t.shape}, expected F32 ({size},)")
        return _address(self._file) + t.offset

    # -- passes ---------------------------------------------------------------------------------

    def new_cache(self, capacity: int | None = None) -> KVCache:
        capacity = capacity or self.capacity
        if capacity > self.capacity:
            raise InputError(f"a cache of {capacity} positions exceeds the bundle's context of {self.capacity}")
        return KVCache.allocate(self.num_layers, capacity, self.arch.num_kv_heads, self.arch.head_dim,
                                heads_first=True, dtype=self.kv_dtype)

    def _dims(self, capacity: int) -> _Dims:
        a = self.arch
        return _Dims(a.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim, a.intermediate_size, capacity,
                     a.rms_norm_eps, self.threads, KV_FORMATS[self.kv_dtype])

    def _scratch_of(self, size: int) -> int:
        if self._scratch.size < size:
            self._scratch = np.empty(size, np.uint8)
        return _address(self._scratch)

    def embed(self, ids: np.ndarray) -> np.ndarray:
        ids = np.ascontiguousarray(ids, np.int64).reshape(-1)
        out = np.empty((ids.shape[0], self.arch.hidden_size), np.float32)
        rc = self._timed("embed", lambda: self.lib.er_dequantize_rows(ctypes.byref(self._embedding), _address(ids),
                                                                      ids.shape[0], _address(out)))
        if rc == -2:
            raise InputError(f"token ids {ids.min()}..{ids.max()} are outside the vocabulary of {self._embedding.rows}")
        return out

    def head(self, hidden: np.ndarray) -> np.ndarray:
        hidden = np.ascontiguousarray(hidden, np.float32)
        m = hidden.shape[0]
        logits = np.empty((m, self._head.rows), np.float32)
        dims = self._dims(self.capacity)
        with self._lock:
            scratch = self._scratch_of(self.lib.er_head_scratch_bytes(m, self.arch.hidden_size))
            self._timed("head", lambda: self.lib.er_head(ctypes.byref(self._head), self._norm, ctypes.byref(dims),
                                                         _address(hidden), m, _address(logits), scratch))
        return logits[:, :self.arch.vocab_size] if self._head.rows > self.arch.vocab_size else logits

    def _check_cache(self, cache: KVCache) -> None:
        if not cache.heads_first or cache.dtype != self.kv_dtype:
            raise InputError(f"the native backend runs on its own caches (heads-first {self.kv_dtype}): use "
                             "model.new_cache()")

    def _run_layer(self, layer: int, action: str, hidden: np.ndarray, cache: KVCache, start: int) -> None:
        """One layer over ``hidden`` [T, d] (contiguous float32, updated in place; K/V only for
        SKIP) at positions start.. of the cache; the caller holds the lock."""
        t = hidden.shape[0]
        dims = self._dims(cache.capacity)
        scratch = self._scratch_of(self.lib.er_scratch_bytes(ctypes.byref(dims), t))
        masked = None if cache.dropped is None else _address(cache.dropped[layer])
        call = functools.partial(self.lib.er_layer_forward, ctypes.byref(self._layers[layer]), ctypes.byref(dims),
                                 _address(hidden), t, start, _address(self.cos), _address(self.sin),
                                 _address(cache.keys[layer, 0]), _address(cache.values[layer, 0]), masked,
                                 MODES[action], scratch)
        if self._timed(TIMING_KINDS[action], call) != 0:
            raise InputError(f"positions {start}..{start + t} do not fit a cache of {cache.capacity}")

    def _sub_layer(self, action: str, layer: int, hidden: np.ndarray, cache: KVCache, start: int) -> np.ndarray:
        self._check_cache(cache)
        out = np.array(hidden, np.float32, order="C")  # a copy: the caller's array stays as it was
        with self._lock:
            self._run_layer(layer, action, out, cache, start)
        return out

    def layer(self, layer: int, hidden: np.ndarray, cache: KVCache, start: int) -> np.ndarray:
        """The whole decoder layer (attention + MLP) over positions start.."""
        return self._sub_layer(RUN, layer, hidden, cache, start)

    def attention(self, layer: int, hidden: np.ndarray, cache: KVCache, start: int) -> np.ndarray:
        """The attention sub-layer alone (its residual included)."""
        return self._sub_layer(SKIP_MLP, layer, hidden, cache, start)

    def kv_fill(self, layer: int, hidden: np.ndarray, cache: KVCache, start: int) -> None:
        """The layer's K/V rows of ``hidden`` written at positions start.. (a skipped layer)."""
        self._sub_layer(SKIP, layer, hidden, cache, start)

    def _pass(self, cache: KVCache, ids: np.ndarray, plan: Sequence[bool] | LayerPlan | None) -> np.ndarray:
        self._check_cache(cache)
        start, t = cache.length, ids.shape[0]
        hidden = self.embed(ids)
        with self._lock:
            for layer in range(self.num_layers):
                action = plan_action(plan, layer, hidden)
                if action == DROP:
                    cache.drop(layer, start, t)
                    continue
                if callable(plan):
                    hidden = hidden.copy()  # the kernel writes in place; a plan may keep what it was shown
                self._run_layer(layer, action, hidden, cache, start)
        cache.length = start + t
        return hidden


# -- the kernels on their own (tests, kernel benchmarks) ------------------------------------------

def _standalone(tensor_format: str, blocks: np.ndarray, shape: tuple[int, int]) -> _Matrix:
    if tensor_format not in GGML_TYPES:
        raise InputError(f"format {tensor_format!r} is not one of {', '.join(GGML_TYPES)}")
    NativeTensor(tensor_format, shape, 0, blocks.nbytes).check("matrix", blocks.nbytes)
    return _Matrix(_address(blocks), None, GGML_TYPES[tensor_format], shape[0], shape[1], 0)


def native_matmul(tensor_format: str, blocks: np.ndarray, shape: tuple[int, int], x: np.ndarray,
                  threads: int | None = None, kernels: str = "auto") -> np.ndarray:
    """``x [M, cols] @ W.T`` for a matrix W of ``shape`` (rows, cols) stored as ggml ``blocks``
    (uint8, as in a GGUF file), through the layer's kernels: activations quantized to int8."""
    lib = native_library(kernels)
    blocks = np.ascontiguousarray(blocks, np.uint8)
    matrix = _standalone(tensor_format, blocks, shape)
    _packing = _pack(lib, matrix)  # the matrix points into it until the product is done
    x = np.ascontiguousarray(x, np.float32).reshape(-1, shape[1])
    y = np.empty((x.shape[0], shape[0]), np.float32)
    scratch = np.empty(lib.er_matmul_scratch_bytes(x.shape[0], shape[1]), np.uint8)
    if lib.er_matmul(ctypes.byref(matrix), _address(x), x.shape[0], _address(y), threads or os.cpu_count() or 1,
                     _address(scratch)) != 0:
        raise InputError(f"{tensor_format} {shape}: rows the kernels do not take")
    return y


def native_dequantize(tensor_format: str, blocks: np.ndarray, shape: tuple[int, int], rows: np.ndarray,
                      kernels: str = "auto") -> np.ndarray:
    """Rows of a ggml block matrix as float32 (the embedding lookup's kernel)."""
    lib = native_library(kernels)
    blocks = np.ascontiguousarray(blocks, np.uint8)
    matrix = _standalone(tensor_format, blocks, shape)
    rows = np.ascontiguousarray(rows, np.int64).reshape(-1)
    out = np.empty((rows.shape[0], shape[1]), np.float32)
    if lib.er_dequantize_rows(ctypes.byref(matrix), _address(rows), rows.shape[0], _address(out)) != 0:
        raise InputError(f"rows {rows.tolist()} are outside a matrix of {shape[0]} rows")
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
    if values.shape != keys.shape or row * keys.itemsize != kv_row_bytes(head_dim, kv_dtype):
        raise InputError(f"keys {keys.shape} and values {values.shape} are not {kv_dtype} cache rows of head_dim {head_dim}")
    dims = _Dims(0, heads, kv_heads, head_dim, 0, capacity, 0.0, threads or os.cpu_count() or 1, KV_FORMATS[kv_dtype])
    drops = None if masked is None else np.ascontiguousarray(masked, np.uint8)
    out = np.empty_like(q)
    scratch = np.empty(lib.er_scratch_bytes(ctypes.byref(dims), m), np.uint8)
    if lib.er_attention(ctypes.byref(dims), _address(q), _address(keys), _address(values),
                        None if drops is None else _address(drops), m, start, _address(out), _address(scratch)) != 0:
        raise InputError(f"attention of {m} rows at {start} over {kv_heads} x {capacity} positions of head_dim "
                         f"{head_dim} ({kv_dtype}): shapes the kernels do not take")
    return out
