"""Atomic file writing: a reader sees the old file or the new one, never half of either (and never NaN JSON)."""

from __future__ import annotations

import datetime
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["backup_file", "write_json_atomic", "write_text_atomic"]


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_bytes_atomic(path: str | os.PathLike, data: bytes | str) -> Path:
    """Temp file in the same directory + fsync + os.replace (+ fsync of the directory); keeps the file's mode."""
    path = Path(path)
    try:
        mode = path.stat().st_mode & 0o777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(path.parent)
    return path


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """`write_bytes_atomic` of UTF-8 text."""
    return write_bytes_atomic(path, text)


def write_json_atomic(path: str | os.PathLike, obj: Any) -> Path:
    """Write `obj` as JSON atomically. It is serialised first, so an unserialisable object touches nothing."""
    text = json.dumps(obj, indent=2, allow_nan=False) + "\n"
    return write_text_atomic(path, text)


def backup_file(path: str | os.PathLike) -> Path:
    """Copy `path` to `<name>.bak`, or to a timestamped `<name>.<UTC time>.bak` so no backup is ever overwritten."""
    path = Path(path)
    backup = path.with_name(path.name + ".bak")
    if backup.exists():
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S%fZ")
        backup = path.with_name(f"{path.name}.{stamp}.bak")
    tmp = backup.with_name(f".{backup.name}.tmp")
    shutil.copy2(path, tmp)
    os.replace(tmp, backup)
    return backup
