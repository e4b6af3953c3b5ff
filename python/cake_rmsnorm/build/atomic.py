"""Atomic file writes for the build: a reader (or a later step) sees the old file or the whole new
one, never a half-written file, even if the build is killed or the disk fills mid-write."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def atomic_write(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Write `data` to a temp file beside `path`, then rename it over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            os.fchmod(fh.fileno(), mode)  # mkstemp makes 0600 files
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_if_changed(path: Path, text: str) -> bool:
    """Atomically write `text` to `path` unless it already holds exactly that; True if written."""
    try:
        if Path(path).read_text() == text:
            return False
    except OSError:
        pass
    atomic_write(path, text.encode())
    return True
