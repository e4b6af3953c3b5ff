"""Which library of a route this process can run: the gated program where the capability check says
its shared memory fits, else the program's declared fallback (same bits for det).

    lib = runnable(registry, route, capability)          # the decision (tests feed a fake Capability)
    lib = runnable_on(registry, route, device_index)     # the op's call: probes only for a gated library

Only a library above the opt-in limit (Library.oversized) is gated; every other library is returned
as is, without asking CUDA anything. Each decision for a gated library logs one debug line on the
"cake_rmsnorm" logger saying which library runs and why.
"""

from __future__ import annotations

import logging
from typing import Optional

from ..errors import CakeError, RouteError
from ..registry import Library, Registry, Route
from . import capability as _capability
from .capability import Capability, CudaQueryError

log = logging.getLogger("cake_rmsnorm")


def _fallback(registry: Registry, lib: Library) -> Library:
    fallback = registry.fallback(lib)
    if fallback is None:  # the registry refuses this at load; guard against a hand-made Library
        raise RouteError(f"{lib.name} needs {lib.smem_bytes} B of shared memory (above the "
                         f"{lib.smem_optin_bytes} B opt-in) and its program declares no fallback")
    return fallback


def decide(registry: Registry, lib: Library, cap: Optional[Capability],
           unavailable: str = "no capability answer") -> Library:
    """`lib` if it may run under `cap` (None: the probe failed, `unavailable` says why), else its
    fallback; one debug line for a gated library."""
    if not lib.oversized:
        return lib
    if cap is None:
        ok, why = False, unavailable
    else:
        ok, why = cap.fits(lib.smem_bytes)
    if ok:
        log.debug("cake_rmsnorm: running gated %s: %s", lib.name, why)
        return lib
    fallback = _fallback(registry, lib)
    device = "" if cap is None else f" on device {cap.device}"
    log.debug("cake_rmsnorm: running %s instead of gated %s (%d B of shared memory)%s: %s",
              fallback.name, lib.name, lib.smem_bytes, device, why)
    return fallback


def runnable(registry: Registry, route: Route, cap: Capability) -> Library:
    """The library to load for `route` on the device `cap` describes."""
    return decide(registry, route.library, cap)


def runnable_on(registry: Registry, route: Route, device: int) -> Library:
    """The library to load for `route` on CUDA device `device`; probes (once, cached) only when the
    route's library is gated. A probe that fails counts as "cannot": the fallback runs."""
    lib = route.library
    if not lib.oversized:
        return lib
    try:
        cap = _capability.probe(device)
    except (CakeError, CudaQueryError, OSError) as exc:
        return decide(registry, lib, None, f"capability probe failed: {exc}")
    return decide(registry, lib, cap)
