"""PNG plots: matplotlib's file backend, loaded only when a plot is asked for (the device
runtime does not need it), and the plot's path checked before the work that leads to it."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from edgeroute.errors import EdgerouteError, InputError
from edgeroute.files import check_output_folder


def png_path(path: str | Path) -> Path:
    """``path`` if a PNG can be written there: not a folder, named .png, in a folder that can be
    made and written."""
    path = Path(path)
    if path.is_dir():
        raise InputError(f"{path} is a folder: give the PNG's file path, e.g. {path / 'plot.png'}")
    if path.suffix.lower() != ".png":
        raise InputError(f"{path}: the plot is a PNG; give a path ending in .png")
    check_output_folder(path, "the plot")
    return path


def pyplot() -> ModuleType:
    """``matplotlib.pyplot`` on the Agg backend (files, no screen)."""
    try:
        import matplotlib
    except ImportError:
        raise EdgerouteError("plots need matplotlib, which this install lacks: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
