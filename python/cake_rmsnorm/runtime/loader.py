"""Find, check and load the provider wheel's libraries, on first use and once.

Per arch, on first use: locate the provider package `cake_rmsnorm_<tag>` without importing it
(importlib.util.find_spec) or take $CAKE_RMSNORM_PROVIDER_DIR, read its manifest and check its
version and arch. Per library, on first use: check the file's sha256 against the manifest, make
sure libcudart.so.13 is loadable, dlopen by absolute path, check cake_info, cache.
Every failure is one ProviderError that says what to install.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
import threading
from pathlib import Path
from typing import Dict, List, Optional

from .._version import __version__
from ..errors import ProviderError
from ..manifest import (MANIFEST_NAME, Manifest, ManifestError, provider_distribution,
                        provider_package, sha256_file)
from ..registry import Arch
from ..registry import Library as RegistryLibrary
from . import abi

ENV_PROVIDER_DIR = "CAKE_RMSNORM_PROVIDER_DIR"
# The provider libraries link the CUDA 13 runtime; CUDA's minor-version compatibility lets them run
# on any driver that supports CUDA 13.0 (the R580 branch or newer).
CUDA_MAJOR = 13
CUDART_SONAME = f"libcudart.so.{CUDA_MAJOR}"
MIN_DRIVER_CUDA = CUDA_MAJOR * 1000  # cudaDriverGetVersion's encoding: 1000 * major + 10 * minor


def pip_command(arch: Arch, force: bool = False) -> str:
    flag = " --force-reinstall" if force else ""
    return f"pip install{flag} 'cake-rmsnorm[{arch.tag}]=={__version__}'"


def _find_spec(name: str):
    """importlib.util.find_spec for a top-level name: locates, never imports. Tests patch this."""
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None


# ---- libcudart ---------------------------------------------------------------------------------
_cudart_lock = threading.Lock()
_cudart: Optional[ctypes.CDLL] = None


def _cudart_candidates() -> List[Path]:
    """libcudart.so.13 inside the nvidia-cuda-runtime wheel, wherever `nvidia` is installed."""
    spec = _find_spec("nvidia")
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    return [Path(root) / sub / "lib" / CUDART_SONAME for root in roots
            for sub in ("cu13", "cuda_runtime")]


def ensure_cudart() -> ctypes.CDLL:
    """Make libcudart.so.13 resolvable for our libraries' DT_NEEDED (torch usually loaded it)."""
    global _cudart
    if _cudart is not None:
        return _cudart
    with _cudart_lock:
        if _cudart is not None:
            return _cudart
        handle = None
        try:  # already in the process (torch's CUDA 13 build loads it at import)
            handle = ctypes.CDLL(CUDART_SONAME, mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL)
        except OSError:
            tried = []
            for path in _cudart_candidates():
                tried.append(str(path))
                if path.is_file():
                    try:
                        handle = ctypes.CDLL(str(path), mode=os.RTLD_GLOBAL)
                        break
                    except OSError:
                        continue
            if handle is None:
                try:
                    handle = ctypes.CDLL(CUDART_SONAME, mode=os.RTLD_GLOBAL)
                except OSError as exc:
                    raise ProviderError(
                        f"{CUDART_SONAME} (the CUDA 13 runtime) is not loaded and cannot be "
                        f"found (tried {', '.join(tried) or 'no nvidia wheel'} and the system "
                        f"library path: {exc}); run: pip install 'nvidia-cuda-runtime>=13,<14'"
                    ) from exc
        _check_driver(_driver_cuda_version(handle))
        get_name = handle.cudaGetErrorName
        get_name.restype, get_name.argtypes = ctypes.c_char_p, [ctypes.c_int]
        abi.set_error_namer(lambda rc: (get_name(rc) or b"?").decode())
        _cudart = handle
        return handle


def _driver_cuda_version(cudart: ctypes.CDLL) -> int:
    """The CUDA version the installed driver supports (0: no driver). Tests patch this."""
    version = ctypes.c_int(0)
    if cudart.cudaDriverGetVersion(ctypes.byref(version)) != 0:
        return 0
    return version.value


def _check_driver(version: int) -> None:
    if version < MIN_DRIVER_CUDA:
        have = (f"supports CUDA {version // 1000}.{version % 1000 // 10}" if version
                else "is missing (cudaDriverGetVersion reports none)")
        raise ProviderError(f"the NVIDIA driver {have}; cake-rmsnorm's provider libraries use the "
                            f"CUDA {CUDA_MAJOR} runtime and need a driver that supports CUDA "
                            f"{CUDA_MAJOR}.0 or newer (the R580 driver branch or later): update "
                            f"the driver")


# ---- providers ---------------------------------------------------------------------------------
class Provider:
    """One arch's provider package: its checked manifest and the libraries loaded so far."""

    def __init__(self, arch: Arch, root: Path, manifest: Manifest) -> None:
        self.arch = arch
        self.root = root
        self.manifest = manifest
        self._libs: Dict[str, abi.Library] = {}
        self._lock = threading.Lock()

    def library(self, lib: RegistryLibrary) -> abi.Library:
        """The loaded, checked library for a registry Library (cached)."""
        loaded = self._libs.get(lib.name)
        if loaded is not None:
            return loaded
        with self._lock:
            loaded = self._libs.get(lib.name)
            if loaded is None:
                loaded = self._load(lib)
                self._libs[lib.name] = loaded
        return loaded

    @property
    def loaded(self) -> Dict[str, abi.Library]:
        return dict(self._libs)

    def _load(self, lib: RegistryLibrary) -> abi.Library:
        dist = provider_distribution(self.arch.tag)
        try:
            entry = self.manifest.library(lib.name)
        except ManifestError:
            raise ProviderError(f"provider {dist} at {self.root} has no library {lib.name}; "
                                f"run: {pip_command(self.arch, force=True)}") from None
        want = (lib.program.name, lib.hidden, lib.weight_dtype, lib.residual)
        have = (entry.program, entry.H, entry.weight_dtype, entry.residual)
        if want != have:
            raise ProviderError(f"provider {dist} at {self.root}: manifest entry {lib.name} says "
                                f"(program, H, weight dtype, residual) = {have}, the registry "
                                f"{want}; run: {pip_command(self.arch, force=True)}")
        path = (self.root / entry.file).resolve()
        if not path.is_file():
            raise ProviderError(f"provider {dist}: library file {path} is missing; "
                                f"run: {pip_command(self.arch, force=True)}")
        digest = sha256_file(path)
        if digest != entry.sha256:
            raise ProviderError(f"provider {dist}: library file {path} has sha256 {digest}, "
                                f"the manifest says {entry.sha256} (corrupted or replaced); "
                                f"run: {pip_command(self.arch, force=True)}")
        ensure_cudart()
        return abi.Library.open(path, name=lib.name, program=lib.program.name,
                                direction=lib.program.direction, hidden=lib.hidden,
                                weight_dtype=lib.weight_dtype, residual=lib.residual)


_providers_lock = threading.Lock()
_providers: Dict[str, Provider] = {}


def locate(arch: Arch) -> Path:
    """The provider package directory for `arch` ($CAKE_RMSNORM_PROVIDER_DIR first)."""
    env = os.environ.get(ENV_PROVIDER_DIR)
    if env:
        root = Path(env).expanduser().resolve()
        if not (root / MANIFEST_NAME).is_file():
            raise ProviderError(f"{ENV_PROVIDER_DIR}={env}: no {MANIFEST_NAME} in {root}; point it "
                                f"at a provider package directory (holding {MANIFEST_NAME} and "
                                f"lib/) or unset it and run: {pip_command(arch)}")
        return root
    package = provider_package(arch.tag)
    spec = _find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ProviderError(f"no provider for this GPU's architecture {arch.name}: package "
                            f"{provider_distribution(arch.tag)} ({package}) is not installed; "
                            f"run: {pip_command(arch)}")
    root = Path(locations[0]).resolve()
    _refuse_mixed_versions(arch, root, _installed_copies(package))
    return root


def _installed_copies(package: str) -> List[Path]:
    """Every directory on sys.path that holds a copy of `package` with a manifest, in path order."""
    found: List[Path] = []
    for entry in sys.path:
        candidate = (Path(entry or ".") / package).resolve()
        if (candidate / MANIFEST_NAME).is_file() and candidate not in found:
            found.append(candidate)
    return found


def _refuse_mixed_versions(arch: Arch, chosen: Path, copies: List[Path]) -> None:
    """Two copies of one arch's provider at different versions (say a user site and a venv):
    which one loads would depend on sys.path order, so refuse and name both."""
    versions = {}
    for copy in copies:
        try:
            versions[copy] = Manifest.read(copy / MANIFEST_NAME).version
        except ManifestError:
            versions[copy] = "unreadable"
    if len(set(versions.values())) > 1:
        listed = "; ".join(f"{path} (version {version})" for path, version in versions.items())
        raise ProviderError(f"{len(versions)} copies of {provider_distribution(arch.tag)} are on "
                            f"sys.path at different versions: {listed}; would load {chosen}. "
                            f"Uninstall all but one (pip uninstall {provider_distribution(arch.tag)}"
                            f" in each environment), then run: {pip_command(arch)}")


def open_provider(arch: Arch, root: Path) -> Provider:
    """Read and check the manifest under `root` for `arch` (version and arch must match ours)."""
    dist = provider_distribution(arch.tag)
    try:
        manifest = Manifest.read(root / MANIFEST_NAME)
    except ManifestError as exc:
        raise ProviderError(f"provider {dist} at {root}: {exc}; "
                            f"run: {pip_command(arch, force=True)}") from exc
    if manifest.version != __version__:
        raise ProviderError(f"provider {dist} at {root} is version {manifest.version}, but "
                            f"cake-rmsnorm is {__version__}: versions must match; "
                            f"run: {pip_command(arch)}")
    if manifest.arch != arch.name:
        raise ProviderError(f"provider at {root} is for {manifest.arch}, this GPU needs "
                            f"{arch.name}; run: {pip_command(arch)}")
    return Provider(arch, root, manifest)


def provider_for(arch: Arch) -> Provider:
    """The checked provider of `arch`, located and read once per process."""
    provider = _providers.get(arch.name)
    if provider is not None:
        return provider
    with _providers_lock:
        provider = _providers.get(arch.name)
        if provider is None:
            provider = open_provider(arch, locate(arch))
            _providers[arch.name] = provider
    return provider


def load_library(arch: Arch, lib: RegistryLibrary) -> abi.Library:
    return provider_for(arch).library(lib)


def clear_cache() -> None:
    """Forget located providers (tests; loaded libraries stay mapped: dlclose is not attempted)."""
    with _providers_lock:
        _providers.clear()
