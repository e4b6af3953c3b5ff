"""Which registry arch the current CUDA device is, and its SM count.

Asked through torch.cuda (the op has imported torch already), on first use only: importing this
module imports no torch and touches no GPU. The answers are cached per device index.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Dict, Tuple

from ..errors import ProviderError
from ..registry import Arch, Registry, load_registry


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    name: str
    capability: Tuple[int, int]
    sm_count: int
    arch: Arch


_lock = threading.Lock()
_cache: Dict[int, DeviceInfo] = {}


def _query(index: int) -> Tuple[str, Tuple[int, int], int]:
    """(name, compute capability, SM count) of CUDA device `index`. Tests monkeypatch this."""
    import torch

    props = torch.cuda.get_device_properties(index)
    return props.name, (int(props.major), int(props.minor)), int(props.multi_processor_count)


def arch_for(name: str, capability: Tuple[int, int], registry: Registry) -> Arch:
    """The registry arch built for exactly `capability`; else a ProviderError listing ours."""
    arch = registry.arch_for_capability(*capability)
    if arch is None:
        built = ", ".join(f"{a.name} (compute capability {a.compute_capability[0]}."
                          f"{a.compute_capability[1]}: {a.gpus})" for a in registry.archs)
        raise ProviderError(f"unsupported GPU: {name} has compute capability {capability[0]}."
                            f"{capability[1]}; cake-rmsnorm is built only for {built}")
    return arch


def device_info(index: int) -> DeviceInfo:
    """The cached DeviceInfo of CUDA device `index` (ProviderError for a GPU we do not build)."""
    info = _cache.get(index)
    if info is not None:
        return info
    with _lock:
        info = _cache.get(index)
        if info is None:
            name, capability, sm_count = _query(index)
            arch = arch_for(name, capability, load_registry())
            info = DeviceInfo(index, name, capability, sm_count, arch)
            _cache[index] = info
    return info


def clear_cache() -> None:
    """Forget every device answer (tests)."""
    with _lock:
        _cache.clear()
