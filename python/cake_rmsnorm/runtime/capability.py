"""What this process can run on a device: the CUDA runtime capability check (no torch needed).

Asked through libcudart with ctypes (runtime.loader.ensure_cudart gives the handle), on first use
per device and then cached; importing this module touches no GPU. The oversized limit is device
attribute 150 (cudaDevAttrOversizedSharedMemoryPerBlock, CUDA 13.4+): any error asking for it
means 0 (an older runtime or driver answers cudaErrorInvalidValue), and the error is cleared with
cudaGetLastError so nothing sticky remains.

    cap = probe(0)                   # Capability, cached per device index
    ok, why = cap.fits(271360)       # the decision: runtime and driver >= 13.4, attribute 150 >= bytes
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

OVERSIZED_MIN_VERSION = 13040  # CUDA 13.4 in cudaRuntimeGetVersion / cudaDriverGetVersion encoding
ATTR_MULTIPROCESSOR_COUNT = 16  # cudaDevAttrMultiProcessorCount
ATTR_CC_MAJOR = 75  # cudaDevAttrComputeCapabilityMajor
ATTR_CC_MINOR = 76  # cudaDevAttrComputeCapabilityMinor
ATTR_SMEM_OPTIN = 97  # cudaDevAttrMaxSharedMemoryPerBlockOptin
ATTR_SMEM_OVERSIZED = 150  # cudaDevAttrOversizedSharedMemoryPerBlock (CUDA 13.4)


def version_text(version: int) -> str:
    """13040 -> '13.4'; 0 -> 'none'."""
    return f"{version // 1000}.{version % 1000 // 10}" if version > 0 else "none"


@dataclass(frozen=True)
class Capability:
    """One device's answers. oversized_error: the CUDA error attribute 150 gave (0: none)."""

    device: int
    runtime_version: int
    driver_version: int
    compute_capability: Tuple[int, int]
    sm_count: int
    optin_bytes: int
    oversized_bytes: int
    oversized_error: int = 0

    @property
    def oversized_supported(self) -> bool:
        return (self.runtime_version >= OVERSIZED_MIN_VERSION
                and self.driver_version >= OVERSIZED_MIN_VERSION and self.oversized_bytes > 0)

    def fits(self, smem_bytes: int) -> Tuple[bool, str]:
        """Can one block of this device take `smem_bytes` of shared memory, and why (not)."""
        if smem_bytes <= self.optin_bytes:
            return True, f"{smem_bytes} B is within the {self.optin_bytes} B opt-in limit"
        why = []
        if self.runtime_version < OVERSIZED_MIN_VERSION:
            why.append(f"CUDA runtime {version_text(self.runtime_version)} < 13.4")
        if self.driver_version < OVERSIZED_MIN_VERSION:
            why.append(f"driver supports CUDA {version_text(self.driver_version)} < 13.4")
        if self.oversized_error:
            why.append(f"oversized limit unavailable (attribute {ATTR_SMEM_OVERSIZED}: CUDA "
                       f"error {self.oversized_error})")
        elif self.oversized_bytes < smem_bytes:
            why.append(f"oversized limit {self.oversized_bytes} B < {smem_bytes} B")
        if why:
            return False, "; ".join(why)
        return True, (f"{smem_bytes} B is within the {self.oversized_bytes} B oversized limit "
                      f"(runtime {version_text(self.runtime_version)}, driver "
                      f"{version_text(self.driver_version)})")


class CudaQueryError(RuntimeError):
    """A CUDA call the probe needs failed (no device, no driver); carries the error code."""

    def __init__(self, call: str, code: int) -> None:
        self.call, self.code = call, code
        super().__init__(f"{call} failed: CUDA error {code}")


def _int_call(fn, *args) -> Tuple[int, int]:
    value = ctypes.c_int(0)
    rc = fn(ctypes.byref(value), *args)
    return int(rc), value.value


def query(cudart: ctypes.CDLL, device: int) -> Capability:
    """Ask libcudart about `device` (CudaQueryError if a required answer fails)."""
    get_last = cudart.cudaGetLastError
    rc, runtime = _int_call(cudart.cudaRuntimeGetVersion)
    if rc:
        raise CudaQueryError("cudaRuntimeGetVersion", rc)
    rc, driver = _int_call(cudart.cudaDriverGetVersion)
    if rc:
        get_last()
        driver = 0
    attrs = {}
    for attr in (ATTR_CC_MAJOR, ATTR_CC_MINOR, ATTR_MULTIPROCESSOR_COUNT, ATTR_SMEM_OPTIN):
        rc, attrs[attr] = _int_call(cudart.cudaDeviceGetAttribute, attr, device)
        if rc:
            get_last()
            raise CudaQueryError(f"cudaDeviceGetAttribute({attr}, device {device})", rc)
    rc, oversized = _int_call(cudart.cudaDeviceGetAttribute, ATTR_SMEM_OVERSIZED, device)
    if rc:
        oversized = 0
        get_last()  # an unknown attribute is not sticky, but leave nothing behind
    return Capability(device=device, runtime_version=runtime, driver_version=driver,
                      compute_capability=(attrs[ATTR_CC_MAJOR], attrs[ATTR_CC_MINOR]),
                      sm_count=attrs[ATTR_MULTIPROCESSOR_COUNT],
                      optin_bytes=attrs[ATTR_SMEM_OPTIN], oversized_bytes=max(0, oversized),
                      oversized_error=int(rc))


def device_count(cudart: ctypes.CDLL) -> int:
    """cudaGetDeviceCount (CudaQueryError when it fails: no driver, no device)."""
    rc, count = _int_call(cudart.cudaGetDeviceCount)
    if rc:
        cudart.cudaGetLastError()
        raise CudaQueryError("cudaGetDeviceCount", rc)
    return count


def _cudart() -> ctypes.CDLL:
    from .loader import ensure_cudart  # first use only: importing us loads nothing

    return ensure_cudart()


_lock = threading.Lock()
_cache: Dict[int, Capability] = {}
# What `probe` asks (device index -> Capability); tests replace it with a fake.
_prober: Callable[[int], Capability] = lambda device: query(_cudart(), device)


def probe(device: int) -> Capability:
    """The cached Capability of CUDA device `device` (asked once per process and device)."""
    cap = _cache.get(device)
    if cap is not None:
        return cap
    with _lock:
        cap = _cache.get(device)
        if cap is None:
            cap = _cache[device] = _prober(device)
    return cap


def set_prober(prober: Optional[Callable[[int], Capability]]) -> None:
    """Replace (None: restore) what `probe` asks, and forget cached answers (tests)."""
    global _prober
    with _lock:
        _prober = prober if prober is not None else (lambda device: query(_cudart(), device))
        _cache.clear()


def clear_cache() -> None:
    with _lock:
        _cache.clear()
