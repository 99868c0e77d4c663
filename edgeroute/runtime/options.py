"""How an engine runs a bundle: one dataclass that profiles produce, the CLI fills from its
flags, and :class:`edgeroute.runtime.Engine` takes, so that ``Engine(bundle,
profile="jetson-orin-nano-8gb", task="voice-command")`` and ``edgeroute run BUNDLE --profile
jetson-orin-nano-8gb,voice-command`` run alike.

Precedence, lowest first: the defaults here, the profiles in the order given (device, then
task), then what the caller sets explicitly (keyword arguments, or the CLI's flags).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from edgeroute.cpu import thread_count
from edgeroute.errors import InputError
from edgeroute.runtime.decoding import DecodeOptions
from edgeroute.runtime.profiles import Profile, load_profile


@dataclass(frozen=True)
class EngineOptions:
    """Everything an engine is set up with; ``decoding`` are its sessions' defaults."""

    backend: str = "auto"  # auto | native | onnxruntime | onnxruntime-cuda | tensorrt (see backend.backend_for)
    kernels: str = "auto"  # the native kernels to load (native.KERNELS): auto, the best this CPU runs
    kv_dtype: str = "auto"  # auto | float32 | float16 | int8 (edgeroute.kv_formats)
    attention: str = "auto"  # ONNX Runtime's attention graphs: auto | portable | ort
    providers: tuple[Any, ...] | None = None  # ONNX Runtime execution providers (names or (name, options))
    threads: int | None = None  # None: $EDGEROUTE_THREADS, else default_threads, else every core
    activations: str = "int8"  # int8 (fast int4 kernels) | fp32 (ONNX Runtime only)
    exact_steps: bool = False  # ONNX Runtime: one-token steps as two rows, so speculate == full exactly
    engine_cache: str | None = None  # tensorrt: the build-engines cache (None: .BUNDLE.engines beside the bundle)
    context_length: int | None = None  # KV capacity per session (None: default_context, else the bundle's)
    default_context: int | None = None  # a device profile's context, taken up to the bundle's
    default_threads: int | None = None  # a device profile's threads (its cores), below $EDGEROUTE_THREADS
    memory_budget: int | None = None  # bytes: refuse a bundle that would not fit, before loading it
    slm: bool = True  # False: never load the bundle's SLM
    decoding: DecodeOptions = field(default_factory=DecodeOptions)
    profiles: tuple[str, ...] = ()  # the names of the profiles merged in

    @classmethod
    def from_profile(cls, profile: str | Sequence[str] | None = None, task: str | None = None,
                     decoding: dict[str, Any] | None = None, **settings: Any) -> EngineOptions:
        """The options ``profile`` (names or JSON files, comma-separated or a list) and the task
        profile ``task`` give, with ``settings`` (fields of this class; None means "not given")
        and ``decoding`` (fields of ``DecodeOptions``) on top."""
        names = [profile] if isinstance(profile, str) else list(profile or ())
        if task is not None:
            names.append(task)
        merged = load_profile(",".join(names)) if names else Profile()
        known = {f.name for f in dataclasses.fields(cls)} - {"decoding", "profiles"}
        if unknown := set(settings) - known:
            raise InputError(f"unknown engine option(s): {', '.join(sorted(unknown))} (known: {', '.join(sorted(known))}; "
                             "decoding options go in decoding={...})")
        given = {k: v for k, v in settings.items() if v is not None}
        from_profiles = {"attention": merged.attention, "kv_dtype": merged.kv_dtype, "default_threads": merged.threads,
                         "default_context": merged.context_length, "memory_budget": merged.memory_budget,
                         "providers": tuple(merged.providers) if merged.providers else None}
        return cls(**{**from_profiles, **given}, profiles=tuple(merged.names),
                   decoding=DecodeOptions().updated(**{**merged.decoding, **(decoding or {})}))

    def session_context(self, exported: int) -> int:
        """The KV capacity a session allocates for a bundle exported with ``exported``
        positions: the explicit context, else the device's default up to the bundle's."""
        if self.context_length is not None:
            return self.context_length
        return min(self.default_context, exported) if self.default_context else exported

    def model_threads(self) -> int:
        """The threads each model runs on (``edgeroute.cpu.thread_count``): the explicit threads,
        else $EDGEROUTE_THREADS, else the device profile's, else every CPU the OS lists."""
        return thread_count(self.threads, self.default_threads)
