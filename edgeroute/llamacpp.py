"""llama.cpp (llama-cpp-python) as the peer that benchmarks hold edgeroute against: the one
place that constructs a ``Llama``, and the one check that the GGUF it runs is the model a
bundle was exported from (so a benchmark never times another model by mistake)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from edgeroute.bundle import Bundle, sha256_file
from edgeroute.errors import EdgerouteError


class Unavailable(EdgerouteError):
    """llama.cpp cannot run the bundle's model here (no source GGUF, or not on this machine)."""


class NotTheSource(EdgerouteError):
    """A GGUF given for a bundle's model is not the file that model was exported from."""


def open_llama(gguf: str | Path, threads: int, n_ctx: int, **options: Any):
    """``llama_cpp.Llama`` on ``gguf``: ``threads`` for decode and batches alike, a context of
    ``n_ctx``, quiet; ``options`` go to the constructor (``logits_all``, ``draft_model``, ...)."""
    from llama_cpp import Llama

    return Llama(model_path=str(gguf), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx, verbose=False,
                 **options)


def source_gguf(bundle: Bundle | str | Path, role: str = "llm", given: str | Path | None = None) -> Path:
    """The GGUF the bundle's ``role`` model was exported from. Without ``given``: the path export
    recorded, where it is on this machine. With ``given``: that file, once its sha256 is the one
    export recorded for the source; anything else (another model, another quantization, a
    bundle that recorded no digest) raises :class:`NotTheSource` instead of timing another model."""
    opened = Bundle.open(bundle, verify=False) if isinstance(bundle, (str, Path)) else bundle
    if role not in opened.models:
        raise Unavailable(f"bundle {opened.path} has no {role!r} model")
    source = opened.models[role].source
    if source.get("format") != "gguf":
        raise Unavailable(f"the {role} model was exported from a {source.get('format')} source, not a GGUF")
    if given is None:
        path = Path(source.get("path", ""))
        if not source.get("path") or not path.is_file():
            raise Unavailable(f"the {role} model's source GGUF {source.get('path')} (recorded at export) is not on "
                              "this machine: give its file (--gguf)")
        return path
    path = Path(given)
    if not path.is_file():
        raise NotTheSource(f"{path} is not a file")
    recorded = source.get("sha256")
    if not recorded:
        raise NotTheSource(f"bundle {opened.path} records no sha256 for its {role} model's source "
                           f"({source.get('name')}), so {path.name} cannot be checked against it: export the bundle "
                           "again, or leave --gguf out to use the recorded path")
    digest = sha256_file(path)
    if digest != recorded:
        raise NotTheSource(f"{path} is not the GGUF bundle {opened.path}'s {role} model was exported from "
                           f"({source.get('name')}, sha256 {recorded[:12]}..., recorded at {source.get('path')}); "
                           f"this file's sha256 is {digest[:12]}...: llama.cpp would time another model")
    return path
