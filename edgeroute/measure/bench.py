"""``edgeroute bench``: each CPU backend's decode speed on this machine, held against the
memory bandwidth, in the spirit of llama.cpp's ``llama-bench``.

For each model of each bundle (the LLM, and the SLM of a pair), every backend that runs here
is loaded once, side by side in this process: the native backend, ONNX Runtime's CPU
provider, and llama.cpp on the bundle's source GGUF where llama-cpp-python is installed and
the GGUF recorded at export is on this machine. Each gets one cache of the bundle's capacity
(never a smaller one: a native session of less than the bundle's context is under
investigation for heap corruption).

One *run* at context C: the cache emptied, C tokens of held-out text prefilled (TTFT: until
the first token's logits are in hand), then ``steps`` greedy one-token steps (decode tok/s at
context C). After a warm-up run per backend (at the shortest context), the backends take turns, ``repeats`` runs each
per context in a rotating order, so that a machine whose speed drifts slows all of them
alike; the figures are the medians of the runs. The clock is the wall clock, or the
process's CPU time (``clock="cpu"``: every thread's, so one thread's work per token; other
processes' load does not inflate it).

Bandwidth: the weight bytes one decode step reads (:mod:`edgeroute.measure.step_bytes`; the KV
cache's reads are not counted) x decode tok/s, in GB/s; with a device profile that declares
``memory.bandwidth_gbs``, its share of the board's published peak.

The floor, measured (``floor=True``, the default): a streaming read of a buffer several times
the last-level cache (:class:`FloorProbe`, ``threads`` threads each summing its slice), taken
once per round before the backends' runs of that round, so it sees the machine's memory speed
of the same minutes (on a shared VM it moves by half from one minute to the next). A record's
``floor_share`` is the median over its rounds of (that run's GB/s / the floor read of that
round): the share of what this machine reads at the time, beside the nominal one.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgeroute import llamacpp
from edgeroute.bundle import Bundle
from edgeroute.cpu import describe_cpu, thread_count
from edgeroute.errors import InputError, NativeBackendUnavailable
from edgeroute.measure.step_bytes import gguf_step_bytes, native_step_bytes, ort_step_bytes
from edgeroute.runtime.backend import open_model
from edgeroute.runtime.evaluate import tokenize_text
from edgeroute.runtime.options import EngineOptions
from edgeroute.runtime.profiles import load_profile
from edgeroute.texts import evaluation_text

BACKENDS = ("native", "onnxruntime", "llama.cpp")
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


class Unavailable(llamacpp.Unavailable):
    """A backend that cannot run a model here; the bench skips it and says why."""


def prompt_ids(tokenizer: Bundle | str | Path, n: int) -> list[int]:
    """The first ``n`` token ids of the held-out evaluation text, the prompt every backend prefills
    (``tokenizer``: a bundle, its directory or a tokenizer.json)."""
    ids = tokenize_text(tokenizer, evaluation_text())
    if len(ids) < n:
        raise InputError(f"the evaluation text has only {len(ids)} tokens, {n} asked")
    return [int(i) for i in ids[:n]]


# -- the backends, each over one cache ------------------------------------------------------------

class EdgerouteCase:
    """A bundle's model on an edgeroute backend: ``flavour`` "native", or ONNX Runtime's
    attention graphs ("auto", "portable", "ort"); one cache of the bundle's capacity."""

    def __init__(self, bundle: Bundle | str | Path, flavour: str, kv_dtype: str = "auto", role: str = "llm",
                 threads: int | None = None, kernels: str = "auto", verify: bool = True) -> None:
        opened = bundle if isinstance(bundle, Bundle) else Bundle.open(bundle, verify=verify)
        if flavour == "native":
            options = EngineOptions(backend="native", kv_dtype=kv_dtype, threads=threads, kernels=kernels)
        else:
            options = EngineOptions(backend="onnxruntime", attention=flavour, kv_dtype=kv_dtype, threads=threads)
        self.model = open_model(opened, role, options)[0]
        self.cache = self.model.new_cache()

    def describe(self) -> str:
        m = self.model
        runs = f"{m.kernels} kernels" if m.flavour == "native" else f"{m.flavour} graphs"
        return f"{runs}, {m.kv_dtype} KV cache"

    def prefill(self, ids: list[int]) -> np.ndarray:
        return self.model.forward(self.cache, ids)

    def step(self, logits: np.ndarray) -> np.ndarray:
        return self.model.forward(self.cache, [int(logits.argmax())])

    def truncate(self, length: int) -> None:
        self.cache.truncate(length)


class LlamaCppCase:
    """A GGUF on llama-cpp-python: ``Llama.eval`` of the prompt, then of one token after a greedy
    argmax of its logits."""

    def __init__(self, gguf: Path, threads: int, n_ctx: int) -> None:
        self.gguf = gguf
        self.llm = llamacpp.open_llama(gguf, threads, n_ctx, logits_all=False)

    def describe(self) -> str:
        import llama_cpp

        return f"llama-cpp-python {llama_cpp.__version__} on {self.gguf.name}"

    @property
    def layers(self) -> int:
        """The GGUF's own layer count (all of which llama.cpp runs)."""
        metadata = self.llm.metadata
        return int(metadata[f"{metadata['general.architecture']}.block_count"])

    def _last_logits(self) -> np.ndarray:
        # the context's own output row (without logits_all, Llama keeps no scores of its own)
        return np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.llm.n_vocab(),))

    def prefill(self, ids: list[int]) -> np.ndarray:
        self.llm.eval(ids)
        return self._last_logits()

    def step(self, logits: np.ndarray) -> np.ndarray:
        self.llm.eval([int(logits.argmax())])
        return self._last_logits()

    def truncate(self, length: int) -> None:
        self.llm.n_tokens = length  # the next eval drops the cache's positions from here on


DecodeCase = EdgerouteCase | LlamaCppCase  # prefill, one greedy step, truncate; describe() says what runs


def source_gguf(bundle: Bundle, role: str) -> Path:
    """The GGUF the model was exported from, where export recorded it and it is on this machine
    (:func:`edgeroute.llamacpp.source_gguf`)."""
    try:
        return llamacpp.source_gguf(bundle, role)
    except llamacpp.Unavailable as err:
        raise Unavailable(str(err)) from None


# -- the floor: what this machine streams from memory, measured beside the runs -------------------

FLOOR_MIN_BYTES = 256 << 20  # never less than this, whatever the cache reports
FLOOR_CACHE_MULTIPLE = 4  # the buffer is this many times the last-level cache
FALLBACK_LLC_BYTES = 64 << 20  # where the cache size cannot be read (no sysfs)


def _size_bytes(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text.rstrip("KMG")) * scale


def llc_bytes(sysfs: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int | None:
    """The last-level cache of CPU 0 in bytes (the highest level's data or unified cache), or
    None where sysfs does not say."""
    best: tuple[int, int] | None = None
    for index in sysfs.glob("index*"):
        try:
            if (index / "type").read_text().strip() == "Instruction":
                continue
            level, size = int((index / "level").read_text()), _size_bytes((index / "size").read_text())
        except (OSError, ValueError):
            continue
        if best is None or (level, size) > best:
            best = (level, size)
    return best[1] if best else None


def floor_buffer_bytes(llc: int | None) -> int:
    """Bytes the floor read streams: several times the last-level cache, at least 256 MiB, so no
    cache holds it and every pass comes from memory."""
    return max(FLOOR_CACHE_MULTIPLE * (llc or FALLBACK_LLC_BYTES), FLOOR_MIN_BYTES)


class FloorProbe:
    """A streaming read of a buffer larger than the last-level cache, ``threads`` threads each
    summing its own slice (numpy releases the GIL in its reductions): the memory bandwidth this
    machine gives a reader now, in GB/s."""

    def __init__(self, threads: int, nbytes: int | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        self.llc_bytes = llc_bytes()
        self.nbytes = nbytes or floor_buffer_bytes(self.llc_bytes)
        self.threads = max(1, threads)
        words = self.nbytes // 8
        self.buffer = np.ones(words, dtype=np.uint64)  # written once, so every page is really there
        self.slices = np.array_split(self.buffer, self.threads)
        self.pool = ThreadPoolExecutor(self.threads) if self.threads > 1 else None
        self.clock = clock
        self.samples: list[float] = []

    def _read(self) -> None:
        if self.pool is None:
            np.add.reduce(self.buffer)
        else:
            list(self.pool.map(np.add.reduce, self.slices))

    def measure(self, passes: int = 2) -> float:
        """GB/s of ``passes`` reads of the whole buffer (the fastest pass); kept in ``samples``."""
        best = float("inf")
        for _ in range(passes):
            start = self.clock()
            self._read()
            best = min(best, self.clock() - start)
        gb_s = self.buffer.nbytes / max(best, 1e-9) / 1e9
        self.samples.append(gb_s)
        return gb_s

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()
        self.buffer = self.slices = None


def floor_share(gb_s_runs: Sequence[float | None], floor_runs: Sequence[float]) -> float | None:
    """The median over rounds of each run's GB/s over the floor read of its own round."""
    shares = [g / f for g, f in zip(gb_s_runs, floor_runs, strict=True) if g and f]
    return statistics.median(shares) if shares else None


# -- the results ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class BenchOptions:
    """What :func:`run_bench` measures; None threads: ``edgeroute.cpu.thread_count`` with the
    profile's threads (its board's cores)."""

    contexts: tuple[int, ...] = (32, 1024)
    steps: int = 16
    repeats: int = 3
    threads: int | None = None
    clock: str = "wall"
    profile: str | None = None  # device profile: memory.bandwidth_gbs and threads
    backends: tuple[str, ...] = BACKENDS
    roles: tuple[str, ...] | None = None  # None: every model of each bundle
    kernels: str = "auto"  # the native kernel set (native.KERNELS)
    verify: bool = True  # check each bundle's files (sha256) and native weights (digest) first: --no-verify skips
    floor: bool = True  # measure the memory floor beside the rounds (FloorProbe): --no-floor skips


@dataclass(frozen=True)
class BenchRecord:
    """One backend on one model at one context: the medians of its runs."""

    bundle: str
    role: str
    backend: str
    runs_on: str  # e.g. "avx2 kernels, float16 KV cache"
    context: int
    steps: int
    decode_tok_s: float
    ttft_s: float
    prefill_tok_s: float
    decode_runs_tok_s: list[float]  # every run's, in order
    step_bytes: int | None  # weight bytes per decode step (None: not known here)
    gb_s: float | None  # step_bytes x decode tok/s
    bandwidth_share: float | None  # of the profile's memory.bandwidth_gbs
    floor_gb_s: float | None = None  # median of the floor reads of this context's rounds
    floor_runs_gb_s: list[float] = field(default_factory=list)  # the floor read of each round, with the runs
    floor_share: float | None = None  # median over rounds of (the run's GB/s / that round's floor read)


@dataclass(frozen=True)
class Skipped:
    bundle: str
    role: str
    backend: str
    reason: str


@dataclass
class BenchReport:
    cpu: dict[str, Any]  # edgeroute.cpu.describe_cpu()
    kernels: str  # the native kernel set that runs here, or why none does
    threads: int
    clock: str
    steps: int
    repeats: int
    contexts: list[int]
    profile: str | None
    bandwidth_gbs: float | None
    versions: dict[str, str]
    floor: dict[str, Any] | None = None  # the floor read: bytes, llc_bytes, threads, every sample (GB/s)
    records: list[BenchRecord] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# -- the measurement ------------------------------------------------------------------------------

def _check(options: BenchOptions) -> None:
    if not options.contexts:
        raise InputError("give at least one context (a prompt length, e.g. 32,1024)")
    if bad := [c for c in options.contexts if c < 1]:
        raise InputError(f"context {bad[0]} is not a prompt length: contexts are at least 1 token")
    for name in ("steps", "repeats"):
        if getattr(options, name) < 1:
            raise InputError(f"{name} must be at least 1 (got {getattr(options, name)})")
    if options.threads is not None and options.threads < 1:
        raise InputError(f"threads must be at least 1 (got {options.threads})")
    if options.clock not in CLOCKS:
        raise InputError(f"clock {options.clock!r} is not one of {', '.join(CLOCKS)}")
    if unknown := [b for b in options.backends if b not in BACKENDS]:
        raise InputError(f"backend {unknown[0]!r} is not one of {', '.join(BACKENDS)}")
    if not options.backends:
        raise InputError(f"give at least one backend ({', '.join(BACKENDS)})")


def _open_bundle(path: str | Path, options: BenchOptions) -> tuple[Bundle, list[str]]:
    """The bundle and the roles to measure, checked against the contexts before anything loads."""
    bundle = Bundle.open(path, verify=options.verify)
    capacity = int(bundle.generation["context_length"])
    longest = max(options.contexts)
    if longest + options.steps > capacity:
        raise InputError(f"context {longest} + {options.steps} steps needs {longest + options.steps} positions, more "
                         f"than the context of {capacity} that bundle {bundle.path} was exported with: give contexts "
                         f"up to {capacity - options.steps}")
    roles = list(options.roles or bundle.models)
    if missing := [r for r in roles if r not in bundle.models]:
        raise InputError(f"bundle {bundle.path} has no {missing[0]!r} model (it has: {', '.join(bundle.models)})")
    return bundle, roles


def _open_case(bundle: Bundle, role: str, backend: str, options: BenchOptions, threads: int) -> DecodeCase:
    if backend == "native":
        return EdgerouteCase(bundle, "native", role=role, threads=threads, kernels=options.kernels)
    if backend == "onnxruntime":
        return EdgerouteCase(bundle, "auto", role=role, threads=threads)
    try:
        import llama_cpp  # noqa: F401 - only whether it is installed
    except ImportError:
        raise Unavailable("llama-cpp-python is not installed (pip install llama-cpp-python)") from None
    case = LlamaCppCase(source_gguf(bundle, role), threads, int(bundle.generation["context_length"]))
    used = bundle.models[role].num_layers
    if case.layers != used:  # e.g. the demo's slm: the LLM's GGUF cut to its first layers
        raise Unavailable(f"the {role} model is the first {used} of its GGUF's {case.layers} layers, and llama.cpp "
                          "would run them all: not the same model")
    return case


def _step_bytes(bundle: Bundle, role: str, backend: str, case: DecodeCase) -> tuple[int | None, str | None]:
    """The weight bytes per decode step of ``case``, or None and why they are not known here."""
    try:
        if isinstance(case, LlamaCppCase):
            return gguf_step_bytes(case.gguf), None
        model = case.model
        if model.flavour == "native":
            return native_step_bytes(bundle.models[role]), None
        return ort_step_bytes(bundle, role, model.flavour, model.kv_dtype), None
    except ImportError as err:  # gguf, for llama.cpp's
        return None, f"{backend}'s bytes per token need the {err.name} package, not installed here"


def _run(case: DecodeCase, ids: list[int], steps: int, clock: Callable[[], float]) -> tuple[float, float]:
    """One run from an empty cache: (seconds to the first token's logits, seconds of ``steps`` steps)."""
    case.truncate(0)
    start = clock()
    logits = case.prefill(ids)
    ttft = clock() - start
    start = clock()
    for _ in range(steps):
        logits = case.step(logits)
    return ttft, clock() - start


def _bench_model(bundle: Bundle, role: str, options: BenchOptions, threads: int, bandwidth_gbs: float | None,
                report: BenchReport, progress: Callable[[str], None] | None = None,
                floor: FloorProbe | None = None) -> None:
    """Every backend of ``options`` on one model, interleaved; records and skips go into ``report``."""
    cases: dict[str, DecodeCase] = {}
    for backend in options.backends:
        if backend.startswith("onnxruntime") and not bundle.target.graphs:
            report.skipped.append(Skipped(str(bundle.path), role, backend, f"the bundle was exported with --target "
                                          f"{bundle.target.name}: no ONNX graphs"))
            continue
        try:
            cases[backend] = _open_case(bundle, role, backend, options, threads)
        except (Unavailable, NativeBackendUnavailable) as err:
            report.skipped.append(Skipped(str(bundle.path), role, backend, str(err)))
    if not cases:
        return
    step_bytes = {}
    for backend, case in cases.items():
        step_bytes[backend], why = _step_bytes(bundle, role, backend, case)
        if why and why not in report.notes:
            report.notes.append(why)
    ids = prompt_ids(bundle, max(options.contexts))
    clock = CLOCKS[options.clock]
    for case in cases.values():  # the warm-up: a run at the shortest context, untimed
        _run(case, ids[:min(options.contexts)], options.steps, clock)
    backends = list(cases)
    for context in options.contexts:
        runs: dict[str, list[tuple[float, float]]] = {backend: [] for backend in backends}
        floors: list[float] = []  # one floor read per round, just before the round's runs
        for repeat in range(options.repeats):
            if floor is not None:
                floors.append(floor.measure())
            turn = repeat % len(backends)  # who goes first rotates: drift in the machine's speed hits all alike
            for backend in backends[turn:] + backends[:turn]:
                runs[backend].append(_run(cases[backend], ids[:context], options.steps, clock))
        for backend, timings in runs.items():
            decode = [options.steps / seconds for _, seconds in timings]
            tok_s, ttft = statistics.median(decode), statistics.median(t for t, _ in timings)
            gb_s = step_bytes[backend] * tok_s / 1e9 if step_bytes[backend] else None
            run_gb_s = [step_bytes[backend] * d / 1e9 if step_bytes[backend] else None for d in decode]
            report.records.append(BenchRecord(
                str(bundle.path), role, backend, cases[backend].describe(), context, options.steps, tok_s, ttft,
                context / ttft, decode, step_bytes[backend], gb_s,
                gb_s / bandwidth_gbs if gb_s and bandwidth_gbs else None,
                statistics.median(floors) if floors else None, list(floors),
                floor_share(run_gb_s, floors) if floors else None))
            if progress:
                progress(f"{bundle.path} {role} {backend} at {context}: {tok_s:.1f} tok/s, TTFT {ttft:.3f} s")
    cases.clear()
    gc.collect()  # this model's weights and caches go before the next model loads


def _versions() -> dict[str, str]:
    import onnxruntime

    import edgeroute

    versions = {"edgeroute": edgeroute.__version__, "onnxruntime": onnxruntime.__version__}
    try:
        import llama_cpp
    except ImportError:
        return versions
    return {**versions, "llama-cpp-python": llama_cpp.__version__}


def _native_kernels(kernels: str) -> str:
    from edgeroute.runtime.backends.native import native_kernels

    try:
        chosen = native_kernels(kernels)
    except NativeBackendUnavailable as err:
        return f"none ({err})"
    forced = os.environ.get("EDGEROUTE_KERNELS")
    return f"{chosen} (EDGEROUTE_KERNELS={forced})" if forced else chosen


def run_bench(bundles: Sequence[str | Path], options: BenchOptions | None = None,
              progress: Callable[[str], None] | None = None) -> BenchReport:
    """Measure every model of ``bundles`` on every backend of ``options`` (see the module's
    docstring); ``progress`` is told each result as it comes. Every bundle and option is
    checked before any model loads."""
    options = options or BenchOptions()
    _check(options)
    opened = [_open_bundle(path, options) for path in bundles]
    if not opened:
        raise InputError("give at least one bundle directory")
    profile = load_profile(options.profile) if options.profile else None
    bandwidth = profile.bandwidth_gbs if profile else None
    threads = thread_count(options.threads, profile.threads if profile else None)
    report = BenchReport(describe_cpu(), _native_kernels(options.kernels), threads, options.clock, options.steps,
                         options.repeats, list(options.contexts), ",".join(profile.names) if profile else None,
                         bandwidth, _versions())
    if bandwidth is None:
        report.notes.append(f"no memory bandwidth known{f' in profile {options.profile}' if profile else ''}: give "
                            "--profile DEVICE with memory.bandwidth_gbs (e.g. jetson-orin-nano-8gb) for the share")
    floor = FloorProbe(threads) if options.floor else None
    if floor is not None:
        report.floor = {"bytes": floor.nbytes, "llc_bytes": floor.llc_bytes, "threads": floor.threads,
                        "samples_gb_s": floor.samples}
        if options.clock == "cpu":
            report.notes.append("the floor read is timed on the wall clock; with --clock cpu the runs are not, so "
                                "their share of it is not a share of the same minutes' bandwidth")
    try:
        for bundle, roles in opened:
            for role in roles:
                _bench_model(bundle, role, options, threads, bandwidth, report, progress, floor)
    finally:
        if floor is not None:
            floor.close()
    return report
