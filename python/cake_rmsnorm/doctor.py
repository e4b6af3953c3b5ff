"""`cake-rmsnorm doctor`: what this machine and process have, and what the op would run on them.

Reports the CUDA runtime and driver versions, each device (name, compute capability and arch, SM
count, opt-in and oversized shared-memory limits), the installed provider wheels and their
versions (importlib metadata and find_spec: no provider is imported), and per device which gated
programs (above the opt-in limit) this process would run or skip, with the fallback used.
Needs no torch; without a GPU (no libcudart, no driver, no device) it says so and still reports the
installed wheels, and (where torch is installed) whether the eager step runs as the native C++
node. Always exits 0: it diagnoses, it does not judge.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Tuple

from ._version import __version__
from .errors import CakeError
from .manifest import MANIFEST_NAME, Manifest, ManifestError, provider_distribution, provider_package
from .registry import Registry
from .runtime import capability
from .runtime.capability import Capability, CudaQueryError, version_text
from .runtime.router import decide

OTHER_DISTRIBUTIONS = ("cake-rmsnorm-native", "nvidia-cuda-runtime", "torch")


@dataclass
class DeviceReport:
    index: int
    name: str
    cap: Optional[Capability]
    arch: Optional[str]
    error: str = ""
    gated: List[Tuple[str, int, str, str]] = field(default_factory=list)  # (lib, B, runs, why)


@dataclass
class Report:
    runtime: str = "none"
    driver: str = "none"
    gpu_problem: str = ""  # non-empty: no usable GPU, and why
    devices: List[DeviceReport] = field(default_factory=list)
    wheels: List[Tuple[str, str]] = field(default_factory=list)  # (distribution, version / status)
    native: str = ""  # the eager step's native C++ node: in use (from where) or why not


def _dist_version(name: str) -> Optional[str]:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _provider_status(reg: Registry, tag: str) -> str:
    version = _dist_version(provider_distribution(tag))
    try:
        spec = importlib.util.find_spec(provider_package(tag))
    except (ImportError, ValueError):
        spec = None
    where = list(spec.submodule_search_locations or []) if spec is not None else []
    if version is None and not where:
        return "not installed"
    text = version or "found on sys.path without distribution metadata"
    if where:
        try:
            manifest = Manifest.read(Path(where[0]) / MANIFEST_NAME)
            text += f" (manifest {manifest.version}, {len(manifest.libraries)} libraries)"
        except (ManifestError, OSError, AttributeError) as exc:
            text += f" (manifest unreadable: {exc})"
        text += f" at {where[0]}"
    return text


def installed_wheels(reg: Registry) -> List[Tuple[str, str]]:
    rows = [("cake-rmsnorm", _dist_version("cake-rmsnorm") or f"{__version__} (source tree)")]
    rows += [(provider_distribution(a.tag), _provider_status(reg, a.tag)) for a in reg.archs]
    rows += [(name, _dist_version(name) or "not installed") for name in OTHER_DISTRIBUTIONS]
    return rows


def _device_name(cudart: ctypes.CDLL, index: int) -> str:
    """cudaDeviceProp.name (its first field) through an oversized buffer: layout-proof."""
    buf = ctypes.create_string_buffer(16384)
    fn = getattr(cudart, "cudaGetDeviceProperties", None) or getattr(
        cudart, "cudaGetDeviceProperties_v2", None)
    if fn is None:
        return "?"
    if fn(buf, index) != 0:
        cudart.cudaGetLastError()
        return "?"
    return buf.raw[:256].split(b"\0", 1)[0].decode("utf-8", "replace")


def _gated(reg: Registry, arch: str, cap: Capability) -> List[Tuple[str, int, str, str]]:
    rows = []
    for lib in reg.gated(arch):
        chosen = decide(reg, lib, cap)
        ok, why = cap.fits(lib.smem_bytes)
        rows.append((lib.name, lib.smem_bytes, "run" if chosen is lib else
                     f"skip -> {chosen.name}", why))
    return rows


def _native_status() -> str:
    """runtime/native.py's verdict; it needs torch, so only where torch is installed."""
    if importlib.util.find_spec("torch") is None:
        return "not used (torch is not installed)"
    from .runtime import native
    status = native.status()
    return f"in use ({status.detail})" if status.op is not None else f"not used: {status.detail}"


def collect(reg: Registry) -> Report:
    report = Report(wheels=installed_wheels(reg), native=_native_status())
    try:
        cudart = capability._cudart()
    except (CakeError, OSError) as exc:
        report.gpu_problem = f"no GPU: no usable CUDA runtime or driver: {exc}"
        return report
    version = ctypes.c_int(0)
    if cudart.cudaRuntimeGetVersion(ctypes.byref(version)) == 0:
        report.runtime = version_text(version.value)
    if cudart.cudaDriverGetVersion(ctypes.byref(version)) == 0:
        report.driver = version_text(version.value)
    try:
        count = capability.device_count(cudart)
    except CudaQueryError as exc:
        report.gpu_problem = f"no GPU: {exc}"
        return report
    if count == 0:
        report.gpu_problem = "no GPU: cudaGetDeviceCount reports 0 devices"
        return report
    for index in range(count):
        name = _device_name(cudart, index)
        try:
            cap = capability.probe(index)
        except CudaQueryError as exc:
            report.devices.append(DeviceReport(index, name, None, None, error=str(exc)))
            continue
        arch = reg.arch_for_capability(*cap.compute_capability)
        dev = DeviceReport(index, name, cap, arch.name if arch else None)
        if arch is not None:
            dev.gated = _gated(reg, arch.name, cap)
        report.devices.append(dev)
    return report


def render(report: Report, reg: Registry) -> str:
    lines = [f"cake-rmsnorm {__version__}",
             f"CUDA runtime {report.runtime}; driver supports CUDA {report.driver}"]
    if report.gpu_problem:
        lines.append(report.gpu_problem)
        gated = [lib for a in reg.arch_names for lib in reg.gated(a)]
        if gated:
            lines.append("gated programs (need oversized shared memory; cannot tell without a GPU): "
                         + ", ".join(f"{lib.name} on {lib.arch} ({lib.smem_bytes} B, fallback "
                                     f"{lib.program.fallback})" for lib in gated))
    for dev in report.devices:
        if dev.cap is None:
            lines.append(f"device {dev.index}: {dev.name}: cannot query: {dev.error}")
            continue
        cap = dev.cap
        cc = f"{cap.compute_capability[0]}.{cap.compute_capability[1]}"
        arch = dev.arch or "not an arch cake-rmsnorm builds"
        lines.append(f"device {dev.index}: {dev.name}, compute capability {cc} ({arch}), "
                     f"{cap.sm_count} SMs")
        over = (f"{cap.oversized_bytes} B" if not cap.oversized_error else
                f"0 B (attribute {capability.ATTR_SMEM_OVERSIZED}: CUDA error "
                f"{cap.oversized_error})")
        lines.append(f"  shared memory per block: opt-in limit {cap.optin_bytes} B, oversized limit "
                     f"{over}")
        state = "supported" if cap.oversized_supported else "unsupported"
        lines.append(f"  oversized shared memory: {state} (needs CUDA runtime and driver >= 13.4 "
                     f"and attribute {capability.ATTR_SMEM_OVERSIZED} > 0)")
        if dev.arch is not None:
            if not dev.gated:
                lines.append(f"  gated programs on {dev.arch}: none")
            for name, need, runs, why in dev.gated:
                lines.append(f"  gated {name} ({need} B): {runs} ({why})")
    lines.append("installed wheels:")
    lines += [f"  {name}: {status}" for name, status in report.wheels]
    if report.native:
        lines.append(f"native eager step: {report.native}")
    return "\n".join(lines)


def doctor(reg: Registry) -> str:
    return render(collect(reg), reg)
