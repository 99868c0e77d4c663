"""Files the package and the tools write: one atomic write, one cache folder, the check of an
output's folder before the work; and the text files users give it, read alike.

Standard library only (the bundle contract and the runtime both use it).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from edgeroute.errors import InputError

CACHE_ENV = "EDGEROUTE_CACHE"


def cache_dir() -> Path:
    """edgeroute's cache folder: ``$EDGEROUTE_CACHE``, else ``~/.cache/edgeroute`` (assembled
    named-source GGUFs, the native backend's key scales, what the tools keep between runs)."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "edgeroute").expanduser()


def fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (where the platform lets a directory be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(target: str | Path, tmp: str | Path | None = None) -> Iterator[Path]:
    """A temporary path beside ``target`` to write its new contents to. When the block ends the
    file is fsynced, renamed over ``target`` in one step and the directory fsynced; if the block
    raises, the temporary file is removed and ``target`` is untouched. ``tmp``: the temporary
    file's path (default ``.NAME.PID.tmp`` in the same directory)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staged = Path(tmp) if tmp is not None else target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        yield staged
        with open(staged, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(staged, target)
        fsync_dir(target.parent)
    finally:
        staged.unlink(missing_ok=True)


def atomic_write(target: str | Path, data: bytes | str) -> Path:
    """Write ``data`` (text as UTF-8) to ``target`` atomically and durably (:func:`atomic_path`)."""
    target = Path(target)
    with atomic_path(target) as staged:
        staged.write_bytes(data.encode() if isinstance(data, str) else data)
    return target


def check_output_folder(path: Path, what: str) -> None:
    """Refuse ``path`` before the work whose result it takes (an eval, a benchmark) where its
    folder cannot be made or written: the nearest folder that exists is a file, or one this user
    may not write in. Folders missing below it are made when the result is written."""
    existing = path.parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise InputError(f"{what} {path}: {existing} is a file, so no folder can be made there; give another path")
    if not os.access(existing, os.W_OK):
        raise InputError(f"{what} {path}: the folder {existing} is not writable; give another path")


def read_user_text(path: Path, what: str) -> str:
    """A text file a user gave (a task or prompt file): UTF-8, a leading byte-order mark (which
    Windows editors write) dropped. A file that is not UTF-8 text, or cannot be read, is an
    InputError naming the file and the line."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise InputError(f"cannot read the {what} {path}: {err.strerror}") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise InputError(f"the {what} {path} is not UTF-8 text (line {line}, byte {err.start}: "
                         f"{data[err.start:err.start + 1]!r}): save it as UTF-8 JSONL") from None
