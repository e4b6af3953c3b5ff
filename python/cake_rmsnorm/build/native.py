"""Build the native eager step (csrc/native/eager_step.cpp) and its wheel, for one torch version.

The C++ compiles against a torch's headers and links against its libc10 and libtorch_cpu, which
the running torch has already loaded (found by soname). The torch comes from either
  - the installed one (`installed_torch`): the tests, or a build for this machine's own torch;
  - a torch wheel of a given version, downloaded without its dependencies and unpacked under
    build/native/ (`fetch_torch`): the build for a GPU machine whose torch is not this one's.
The wheel, `cake-rmsnorm-native` at version <ours>+torch<T>, requires torch==T; runtime/native.py
loads it only under that torch. It needs a C++17 compiler ($CXX, else g++ or c++). The wheel's
manylinux tag is the build platform's raised to the glibc the library names (`native_platform`):
a current g++'s libstdc++ headers name GLIBC_2.32 (`__libc_single_threaded`), so a build on such a
machine is manylinux_2_32, not the providers' manylinux_2_28.

    python -m cake_rmsnorm.build.native --torch 2.11.0 --out dist   # or --torch installed
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Optional, Sequence

from ..errors import BuildError, PackagingError
from ..runtime.native import PACKAGE, public_version
from .elf import MANYLINUX, glibc_needed, libstdcxx_problem
from .layout import default_source_root
from .wheel import Files, _project, _wheel_file, _write_wheel, wheel_platform

DISTRIBUTION = "cake-rmsnorm-native"
LIBRARY_NAME = "libcake_rmsnorm_native.so"
SOURCE = Path("csrc/native/eager_step.cpp")
# what the compile and link take from a torch wheel
_TORCH_MEMBERS = re.compile(r"torch/(include/.*|lib/libc10\.so|lib/libtorch_cpu\.so|version\.py)")


def installed_torch() -> Path:
    """The installed torch's package folder (its include/ and lib/)."""
    try:
        import torch
    except ImportError as exc:
        raise BuildError("--torch installed: torch is not installed here") from exc
    return Path(torch.__file__).parent


def torch_version(root: Path) -> str:
    """The public version (no local tag) of the torch at `root`, read from its version.py."""
    try:
        text = (root / "version.py").read_text()
    except OSError as exc:
        raise BuildError(f"{root}: not a torch package folder (no version.py)") from exc
    match = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", text, re.M)
    if not match:
        raise BuildError(f"{root}/version.py states no __version__")
    return public_version(match.group(1))


def fetch_torch(version: str, cache: Path) -> Path:
    """torch `version`'s headers and the two libraries linked against, from its wheel on the
    package index (pip download, no dependencies), unpacked once into cache/torch-<version>."""
    if not re.fullmatch(r"\d+\.\d+\.\d+", version):
        raise BuildError(f"--torch {version!r}: expected a release such as 2.11.0, or 'installed'")
    root = cache / f"torch-{version}" / "torch"
    if (root / "version.py").is_file():
        return root
    with tempfile.TemporaryDirectory(dir=cache.parent if cache.parent.is_dir() else None) as tmp:
        print(f"native: downloading torch=={version} (headers and libc10/libtorch_cpu are used)",
              flush=True)
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
               "--platform", f"manylinux_2_28_{os.uname().machine}", "-d", tmp, f"torch=={version}"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("torch-*.whl"))
        if done.returncode or not wheels:
            raise BuildError(f"pip download torch=={version} failed:\n{done.stderr.strip()}")
        staging = Path(tmp) / "unpacked"
        with zipfile.ZipFile(wheels[0]) as zf:
            zf.extractall(staging, [n for n in zf.namelist() if _TORCH_MEMBERS.fullmatch(n)])
        root.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(root, ignore_errors=True)
        os.replace(staging / "torch", root)  # version.py last in place: a whole tree or none
    return root


def find_cxx() -> str:
    for name in (os.environ.get("CXX"), "g++", "c++"):
        if name and shutil.which(name):
            return name
    raise BuildError("the native step needs a C++17 compiler: set $CXX or install g++")


def compile_native(torch_root: Path, out: Path, source_root: Optional[Path] = None) -> Path:
    """eager_step.cpp against the torch at torch_root → out (written whole or not at all)."""
    source_root = Path(source_root or default_source_root())
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    include = torch_root / "include"
    tmp = out.with_name(f".{out.name}.tmp")
    cmd = [find_cxx(), "-O2", "-std=c++17", "-fPIC", "-shared", "-D_GLIBCXX_USE_CXX11_ABI=1",
           f"-I{source_root / 'csrc/include'}", f"-I{include}",
           f"-I{include / 'torch/csrc/api/include'}", str(source_root / SOURCE),
           f"-L{torch_root / 'lib'}", "-lc10", "-ltorch_cpu", "-o", str(tmp)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        tmp.unlink(missing_ok=True)
        raise BuildError(f"compiling {SOURCE} against torch {torch_version(torch_root)} failed:\n"
                         f"{done.stderr[-4000:]}")
    os.replace(tmp, out)
    return out


def _package_init(version: str, torch_ver: str) -> bytes:
    return (f'"""cake-rmsnorm\'s native eager step, built for torch {torch_ver} '
            f'(cake_rmsnorm.runtime.native loads it)."""\n'
            f"from pathlib import Path\n\n"
            f'__version__ = "{version}"\n'
            f'TORCH_VERSION = "{torch_ver}"\n'
            f'LIBRARY = Path(__file__).with_name("{LIBRARY_NAME}")\n').encode()


def native_platform(library: bytes) -> str:
    """The wheel tag a native library keeps: the build platform's (wheel_platform(), manylinux_2_28)
    with its glibc raised to what the library names. Its libstdc++ must stay within the base's
    (libstdcxx_problem); C++17 keeps it there (C++20's ref-qualified ostringstream::str() needs
    GLIBCXX_3.4.29)."""
    major, minor, machine = MANYLINUX.fullmatch(wheel_platform()).groups()
    problem = libstdcxx_problem(library)
    if problem:
        raise PackagingError(f"the native library {problem}: build it with an older g++ (or "
                             f"without the C++ feature that needs it)")
    glibc = max((int(major), int(minor)), glibc_needed(library))
    return f"manylinux_{glibc[0]}_{glibc[1]}_{machine}"


def write_native_wheel(library: Path, torch_ver: str, out_dir: Path,
                       source_root: Optional[Path] = None) -> Path:
    """The cake-rmsnorm-native wheel around a compiled library, for torch `torch_ver`."""
    project, ours = _project(Path(source_root or default_source_root()))
    version = f"{ours}+torch{torch_ver}"
    try:
        data = Path(library).read_bytes()
    except OSError as exc:
        raise PackagingError(f"native library {library}: {exc}") from exc
    dist_info = f"{PACKAGE}-{version}.dist-info"
    platform_tag = native_platform(data)
    metadata = [
        "Metadata-Version: 2.1", f"Name: {DISTRIBUTION}", f"Version: {version}",
        f"Summary: {project.get('name', 'cake-rmsnorm')}'s eager step as one C++ autograd node, "
        f"for torch {torch_ver}",
        f"Requires-Dist: torch=={torch_ver}", f"Requires-Dist: {project['name']}=={ours}"]
    files: Files = {
        f"{PACKAGE}/__init__.py": (_package_init(version, torch_ver), 0o644),
        f"{PACKAGE}/{LIBRARY_NAME}": (data, 0o755),
        f"{dist_info}/METADATA": (("\n".join(metadata) + "\n").encode(), 0o644),
        f"{dist_info}/WHEEL": (_wheel_file(False, f"py3-none-{platform_tag}"), 0o644),
        f"{dist_info}/top_level.txt": (f"{PACKAGE}\n".encode(), 0o644),
    }
    name = f"{PACKAGE}-{version}-py3-none-{platform_tag}.whl"
    return _write_wheel(Path(out_dir), name, dist_info, files)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cake_rmsnorm.build.native",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--torch", required=True,
                        help="a torch release (2.11.0: its wheel is downloaded) or 'installed'")
    parser.add_argument("--out", default="dist", help="the wheel's folder (default dist)")
    parser.add_argument("--cache", default="build/native", help="download and build folder")
    args = parser.parse_args(argv)
    cache = Path(args.cache)
    root = installed_torch() if args.torch == "installed" else fetch_torch(args.torch, cache)
    ver = torch_version(root)
    print(f"native: compiling {SOURCE} against torch {ver}", flush=True)
    library = compile_native(root, cache / f"torch-{ver}" / LIBRARY_NAME)
    wheel = write_native_wheel(library, ver, Path(args.out))
    print(f"native: {wheel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
