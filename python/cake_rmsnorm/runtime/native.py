"""The optional native eager step: one C++ autograd node (csrc/native/eager_step.cpp) that the op
takes in eager mode when a build of it for the running torch is installed.

Why: at small T the eager step is host time, and a Python autograd.Function costs a Python forward,
a Python backward that the engine calls back into, and Python's per-call parsing of every
allocation. The C++ node allocates and launches without Python; its backward runs in the engine's
thread. The same provider libraries run, so the bits are the Python path's.

Where it comes from, in order:
  CAKE_RMSNORM_NATIVE=0        off: the Python path
  CAKE_RMSNORM_NATIVE_LIB=PATH a library built by hand (build/native.py); its torch is not checked
  the cake_rmsnorm_native wheel   built for one torch version (ci/build-wheels.sh --native TORCH):
                               used only under that version (major.minor.patch), as its C++ is
                               tied to it
Anything else keeps the Python path (another torch, or a library that does not load, with one
RuntimeWarning); `status()` says which and why (`cake-rmsnorm doctor` prints it). Resolved on
first use, never at import.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

ENV_OFF = "CAKE_RMSNORM_NATIVE"
ENV_LIB = "CAKE_RMSNORM_NATIVE_LIB"
PACKAGE = "cake_rmsnorm_native"
NAMESPACE = "cake_rmsnorm_native"  # TORCH_LIBRARY namespace of eager_step.cpp


@dataclass(frozen=True)
class NativeStatus:
    """op: torch.ops.cake_rmsnorm_native.step.default, or None (the Python path); where it came
    from, or why it is not used."""

    op: Optional[Callable]
    detail: str


_status: Optional[NativeStatus] = None


def public_version(version: str) -> str:
    """'2.11.0+cu130' -> '2.11.0' (a local build tag changes nothing the C++ API sees)."""
    return version.split("+", 1)[0]


def _load(path: str, source: str) -> NativeStatus:
    import torch

    try:
        torch.ops.load_library(path)
        op = getattr(torch.ops, NAMESPACE).step.default
    except (OSError, RuntimeError, AttributeError) as exc:
        reason = f"{source} {path} did not load ({exc}); the op keeps its Python path"
        warnings.warn(f"cake_rmsnorm: native eager step: {reason}", RuntimeWarning, stacklevel=3)
        return NativeStatus(None, reason)
    return NativeStatus(op, f"{source} {path}")


def _resolve() -> NativeStatus:
    if os.environ.get(ENV_OFF, "").strip() == "0":
        return NativeStatus(None, f"turned off ({ENV_OFF}=0)")
    path = os.environ.get(ENV_LIB, "").strip()
    if path:
        return _load(path, f"${ENV_LIB}")
    if importlib.util.find_spec(PACKAGE) is None:
        return NativeStatus(None, f"not installed (the {PACKAGE} wheel for this torch: "
                                  f"ci/build-wheels.sh --native <torch version>)")
    package = importlib.import_module(PACKAGE)
    import torch

    built, running = package.TORCH_VERSION, public_version(torch.__version__)
    if built != running:  # installed to be used: say once why it is not
        reason = (f"{PACKAGE} {package.__version__} is built for torch {built}, this is torch "
                  f"{running}: the Python path runs")
        warnings.warn(f"cake_rmsnorm: native eager step: {reason}", RuntimeWarning, stacklevel=3)
        return NativeStatus(None, reason)
    return _load(str(package.LIBRARY), f"{PACKAGE} {package.__version__}:")


def status() -> NativeStatus:
    global _status
    if _status is None:
        _status = _resolve()
    return _status


def step_op() -> Optional[Callable]:
    """The native step op, or None for the Python path (resolved once)."""
    return (_status or status()).op


def reset() -> None:
    """Resolve again on next use (tests; a changed environment)."""
    global _status
    _status = None
