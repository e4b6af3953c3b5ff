"""Find the CUDA toolchain, CMake and Ninja, preferring what PyPI installed into this interpreter.

Search order, for each tool: an explicit environment variable, the PyPI wheel importable from the
running interpreter, then PATH. A system toolkit on PATH is only the last resort, and the version
check rejects one that is too old. `preflight(archs)` raises one ToolchainError listing everything
missing, with the pip command that fixes it.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, List, Optional, Sequence, Tuple, Union

from ..errors import ToolchainError
from ..registry import Arch, load_registry

MIN_NVCC = (13, 4)
MIN_CMAKE = (3, 27)
FIX = "pip install -e '.[build]'"
CUDART_SONAME = "libcudart.so.13"


@dataclass(frozen=True)
class Toolchain:
    nvcc: Path
    nvcc_version: str  # full toolkit version for manifests, e.g. "13.5.37"
    gpu_archs: Tuple[str, ...]  # `nvcc --list-gpu-arch`: compute_NN names
    cmake: Path
    ninja: Path
    cuobjdump: Optional[Path]
    cudart_dir: Path  # holds libcudart.so.13 (nvidia/cu13/lib of the runtime wheel)
    python: Path


def _cu13_dirs() -> List[Path]:
    """nvidia/cu13 directories on this interpreter's path (the PyPI CUDA wheels share it)."""
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return []
    return [Path(loc) / "cu13" for loc in spec.submodule_search_locations
            if (Path(loc) / "cu13").is_dir()]


def _from_env_wheel_path(env: str, wheel_rel: str, exe: str) -> Optional[Path]:
    if os.environ.get(env):
        return Path(os.environ[env])
    for cu13 in _cu13_dirs():
        candidate = cu13 / wheel_rel
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which(exe)
    return Path(found) if found else None


def find_nvcc() -> Optional[Path]:
    return _from_env_wheel_path("CAKE_NVCC", "bin/nvcc", "nvcc")


def find_cuobjdump() -> Optional[Path]:
    return _from_env_wheel_path("CAKE_CUOBJDUMP", "bin/cuobjdump", "cuobjdump")


def find_cudart_dir() -> Optional[Path]:
    for cu13 in _cu13_dirs():
        if (cu13 / "lib" / CUDART_SONAME).is_file():
            return cu13 / "lib"
    return None


def find_cmake() -> Optional[Path]:
    if os.environ.get("CAKE_CMAKE"):
        return Path(os.environ["CAKE_CMAKE"])
    try:  # the PyPI `cmake` package: its real binary, not the Python wrapper script
        import cmake  # type: ignore[import-not-found]
        candidate = Path(cmake.CMAKE_BIN_DIR) / "cmake"
        if candidate.is_file():
            return candidate
    except ImportError:
        pass
    found = shutil.which("cmake")
    return Path(found) if found else None


def find_ninja() -> Optional[Path]:
    if os.environ.get("CAKE_NINJA"):
        return Path(os.environ["CAKE_NINJA"])
    try:
        import ninja  # type: ignore[import-not-found]
        candidate = Path(ninja.BIN_DIR) / "ninja"
        if ninja.BIN_DIR and candidate.is_file():
            return candidate
    except ImportError:
        pass
    found = shutil.which("ninja")
    return Path(found) if found else None


def _run(cmd: Sequence[Union[str, Path]]) -> Tuple[int, str]:
    try:
        proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 1, str(exc)
    return proc.returncode, proc.stdout + proc.stderr


def nvcc_version(nvcc: Path) -> Optional[str]:
    """'13.5.37' from `nvcc --version` ('release 13.5, V13.5.37'), None if unreadable."""
    rc, out = _run([nvcc, "--version"])
    match = re.search(r"release\s+\d+\.\d+,\s*V(\d+\.\d+\.\d+)", out)
    if rc != 0 or not match:
        match = re.search(r"release\s+(\d+\.\d+)", out) if rc == 0 else None
    return match.group(1) if match else None


def _version_tuple(text: str) -> Tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:3])


def _resolve_archs(archs: Iterable[Union[Arch, str]]) -> Tuple[Arch, ...]:
    reg = None
    out = []
    for arch in archs:
        if isinstance(arch, str):
            reg = reg or load_registry()
            arch = reg.arch(arch)
        out.append(arch)
    return tuple(out)


def preflight(archs: Iterable[Union[Arch, str]], need_cuobjdump: bool = False) -> Toolchain:
    """Everything a build of `archs` needs, or one ToolchainError naming every problem."""
    arch_list = _resolve_archs(archs)
    problems: List[str] = []
    nvcc, version, gpu_archs = find_nvcc(), None, ()
    if nvcc is None:
        problems.append("nvcc not found (looked at $CAKE_NVCC, the nvidia-cuda-nvcc wheel, PATH)")
    else:
        version = nvcc_version(nvcc)
        if version is None:
            problems.append(f"{nvcc}: cannot read its version (`nvcc --version` failed)")
        elif _version_tuple(version)[:2] < MIN_NVCC:
            problems.append(f"nvcc {version} at {nvcc} is older than "
                            f"{'.'.join(map(str, MIN_NVCC))} (needed for sm_107a and the "
                            f"oversized shared-memory mode)")
        else:
            rc, out = _run([nvcc, "--list-gpu-arch"])
            gpu_archs = tuple(out.split()) if rc == 0 else ()
            missing = [a.name for a in arch_list if a.virtual_arch not in gpu_archs]
            if missing:
                problems.append(f"nvcc {version} at {nvcc} cannot target {', '.join(missing)} "
                                f"(`nvcc --list-gpu-arch` lacks "
                                f"{', '.join(a.virtual_arch for a in arch_list if a.name in missing)})")
    cmake, ninja = find_cmake(), find_ninja()
    if cmake is None:
        problems.append("cmake not found (the PyPI `cmake` package, or PATH)")
    else:
        rc, out = _run([cmake, "--version"])
        match = re.search(r"cmake version (\d+\.\d+(\.\d+)?)", out)
        if rc != 0 or not match or _version_tuple(match.group(1))[:2] < MIN_CMAKE:
            found = match.group(1) if match else "unknown"
            problems.append(f"cmake {found} at {cmake} is older than "
                            f"{'.'.join(map(str, MIN_CMAKE))}")
    if ninja is None:
        problems.append("ninja not found (the PyPI `ninja` package, or PATH)")
    cudart = find_cudart_dir()
    if cudart is None:
        problems.append(f"{CUDART_SONAME} not found (the nvidia-cuda-runtime wheel's nvidia/cu13/lib)")
    cuobjdump = find_cuobjdump()
    if need_cuobjdump and cuobjdump is None:
        problems.append("cuobjdump not found (the nvidia-cuda-cuobjdump wheel, or PATH)")
    if problems:
        raise ToolchainError("the CUDA build toolchain is not usable:\n"
                             + "\n".join(f"  - {p}" for p in problems)
                             + f"\nfix: {FIX}   (from the repository root, in this environment: "
                             f"{sys.executable})")
    assert nvcc and version and cmake and ninja and cudart
    return Toolchain(nvcc=nvcc, nvcc_version=version, gpu_archs=gpu_archs, cmake=cmake,
                     ninja=ninja, cuobjdump=cuobjdump, cudart_dir=cudart,
                     python=Path(sys.executable))


def require_cuobjdump() -> Path:
    """cuobjdump for `verify`, which needs neither nvcc nor CMake."""
    found = find_cuobjdump()
    if found is None:
        raise ToolchainError("cuobjdump not found (the nvidia-cuda-cuobjdump wheel, or PATH); "
                             "fix: pip install 'nvidia-cuda-cuobjdump>=13.4,<14'")
    return found
