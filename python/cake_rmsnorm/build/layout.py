"""The build tree's layout and its lock: one place that names every path under build/.

    build/.lock                       held (fcntl) by a build or a packaging run
    build/<arch>/gen/<name>.cu        generated sources (written only when changed)
    build/<arch>/libraries.cmake      the plan for CMake (written only when changed)
    build/<arch>/cmake/               CMake + Ninja binary dir (deps/<name>.d: depfiles)
    build/<arch>/lib/lib<name>.so     libraries (renamed into place whole)
    build/<arch>/ptxas/<name>.json    ptxas resource usage and the sha256 nvcc_step saw
    build/<arch>/build.json           the arch's build record, written last
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

from ..errors import BuildError

BUILD_RECORD = "build.json"
BUILD_SCHEMA = 1
LOCK_NAME = ".lock"

Progress = Callable[[str], None]


def default_source_root() -> Path:
    """The repository holding CMakeLists.txt and csrc/ (this package lives at python/cake_rmsnorm)."""
    return Path(__file__).resolve().parents[3]


@dataclass(frozen=True)
class ArchTree:
    root: Path

    @classmethod
    def of(cls, build_dir: Path, arch: str) -> "ArchTree":
        return cls(Path(build_dir).resolve() / arch)

    @property
    def gen(self) -> Path:
        return self.root / "gen"

    @property
    def cmake(self) -> Path:
        return self.root / "cmake"

    @property
    def lib(self) -> Path:
        return self.root / "lib"

    @property
    def ptxas(self) -> Path:
        return self.root / "ptxas"

    @property
    def libraries_cmake(self) -> Path:
        return self.root / "libraries.cmake"

    @property
    def record(self) -> Path:
        return self.root / BUILD_RECORD

    def source(self, name: str) -> Path:
        return self.gen / f"{name}.cu"

    def library(self, filename: str) -> Path:
        return self.lib / filename

    def ptxas_record(self, name: str) -> Path:
        return self.ptxas / f"{name}.json"

    def read_record(self) -> Optional[dict]:
        """build.json, or None when this arch was never built (or its record is unreadable)."""
        try:
            doc = json.loads(self.record.read_text())
        except (OSError, ValueError):
            return None
        return doc if isinstance(doc, dict) and doc.get("schema") == BUILD_SCHEMA else None


@contextmanager
def build_lock(build_dir: Path, progress: Optional[Progress] = None) -> Iterator[None]:
    """Hold build/.lock exclusively; a second holder waits and says so."""
    build_dir = Path(build_dir)
    build_dir.mkdir(parents=True, exist_ok=True)
    path = build_dir / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise BuildError(f"cannot lock {path}: {exc}") from exc
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"
            if progress:
                progress(f"waiting for the build lock {path} (held by pid {holder}) ...")
            fcntl.flock(fd, fcntl.LOCK_EX)
            if progress:
                progress("build lock acquired")
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)  # closing releases the flock
