"""Atomic bundle writing.

Everything goes into a hidden sibling directory ``.NAME.partial-PID``; the manifest is written
last, and only then is the directory renamed onto ``NAME``. A killed or failed export leaves
at most that hidden directory, which has no manifest and so never loads as a bundle; the
next export removes it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import onnx

from edgeroute.bundle import MANIFEST, build_manifest, sha256_file, write_manifest
from edgeroute.errors import EdgerouteError
from edgeroute.export.graphs import graph_flavour

DTYPE_NAMES = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.FLOAT16: "float16", onnx.TensorProto.INT64: "int64",
               onnx.TensorProto.INT32: "int32"}


def _signature(values) -> list[dict[str, Any]]:
    return [{"name": v.name, "dtype": DTYPE_NAMES.get(v.type.tensor_type.elem_type, "?"),
             "shape": [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]} for v in values]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class BundleWriter:
    def __init__(self, out: Path, force: bool = False) -> None:
        self.out = Path(out)
        if self.out.exists() and not self.out.is_dir():  # --force or not: a bundle is a folder
            raise EdgerouteError(f"{self.out} exists and is a file, not a bundle: refusing to replace it; "
                                 "choose another --out")
        if self.out.exists() and not force:
            raise EdgerouteError(f"{self.out} already exists: pass --force to replace it, or choose another --out")
        if self.out.exists() and not (self.out / MANIFEST).is_file() and any(self.out.iterdir()):
            raise EdgerouteError(f"{self.out} exists and is not a bundle: refusing to replace it")
        try:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self._remove_stale_partials()
            self.tmp = self.out.parent / f".{self.out.name}.partial-{os.getpid()}"
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp.mkdir()
        except (FileExistsError, NotADirectoryError):
            raise EdgerouteError(f"cannot write the bundle {self.out}: part of {self.out.parent} is a file; "
                                 "choose another --out") from None
        except OSError as err:
            raise EdgerouteError(f"cannot write the bundle {self.out} in {self.out.parent}: {err.strerror}; "
                                 "choose another --out") from None
        self.files: dict[str, dict[str, Any]] = {}

    def _remove_stale_partials(self) -> None:
        for stale in self.out.parent.glob(f".{self.out.name}.partial-*"):
            pid = stale.name.rsplit("-", 1)[-1]
            if not pid.isdigit() or not pid_alive(int(pid)):
                shutil.rmtree(stale, ignore_errors=True)

    def record(self, rel: str) -> None:
        """Checksum a file written into the bundle (graphs, weight files, texts)."""
        path = self.tmp / rel
        self.files[rel] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}

    def path(self, rel: str) -> Path:
        path = self.tmp / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def write_graph(self, rel: str, model: onnx.ModelProto) -> dict[str, Any]:
        """Save a graph (its large initializers already point into a weight file) and
        return its flavour and I/O signature for the manifest."""
        onnx.save_model(model, str(self.path(rel)))
        self.record(rel)
        return {"flavour": graph_flavour(model), "inputs": _signature(model.graph.input),
                "outputs": _signature(model.graph.output)}

    def write_text(self, rel: str, text: str) -> None:
        (self.tmp / rel).write_text(text)
        self.record(rel)

    def commit(self, manifest: dict[str, Any]) -> Path:
        """``manifest``: the keyword arguments of :func:`edgeroute.bundle.build_manifest` but ``files``."""
        write_manifest(self.tmp, build_manifest(**manifest, files=self.files))
        previous = None
        if self.out.exists():
            previous = self.out.parent / f".{self.out.name}.old-{os.getpid()}"
            self.out.rename(previous)
        self.tmp.rename(self.out)
        if previous is not None:
            shutil.rmtree(previous, ignore_errors=True)
        return self.out

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> BundleWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
