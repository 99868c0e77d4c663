"""Errors users see. Each names the thing, the value and the fix."""


class EdgerouteError(Exception):
    """Base class: the CLI prints these without a traceback."""


class SourceError(EdgerouteError):
    """A model source (path, file, architecture, tokenizer) cannot be exported."""


class UnsupportedArchitecture(SourceError):
    pass


class TokenizerMismatch(SourceError):
    pass


class BundleError(EdgerouteError):
    """A bundle is missing, incomplete, corrupted or from an incompatible version."""


class InputError(EdgerouteError):
    """A bad argument at run time: prompt, threshold, option."""


class EngineClosed(InputError):
    """A call that would run a model on an engine that was closed (``engine.close()``, or the
    end of its ``with`` block): its models and caches are freed; open the bundle again."""


class SessionBusy(EdgerouteError):
    """A Session got a second call while one was running (one call at a time per session)."""


class CalibrationDeviceWarning(UserWarning):
    """A calibrated bundle runs on a CPU with other instruction sets than it was calibrated on:
    its quality budget holds, but its timing-based choices (draft length, ``--mode auto``) may
    not be the fastest here."""


class DamagedShardWarning(UserWarning):
    """A label shard in calibrate's work directory does not read back (damaged after it was
    written): it is labelled again and replaced."""


class UnmeasuredQualityWarning(UserWarning):
    """A lossy mode runs with settings no calibration measured (e.g. ``--mode skip`` on a bundle
    whose calibration kept no skip setting): it uses conservative defaults, and what it costs in
    quality is unknown until ``edgeroute calibrate`` has judged it on held-out tasks."""


class NativeBackendUnavailable(EdgerouteError):
    """The native CPU backend cannot run here (no native weights in the bundle, a library that
    does not load, kernels this CPU lacks): ``backend="auto"`` then runs ONNX Runtime."""
