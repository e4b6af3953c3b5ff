"""GPU tests: skip cleanly without a CUDA GPU, on a GPU we do not build for, or without a provider.

The provider is the installed wheel `cake-rmsnorm-<arch>` (found by importlib, as users find it),
or the provider package directory named by $CAKE_RMSNORM_PROVIDER_DIR (an uninstalled build).
A provider that is found but broken (wrong version, bad hash) fails the tests rather than skip.
"""

import functools
from typing import Optional

import pytest


@functools.lru_cache(maxsize=None)
def _skip_reason() -> Optional[str]:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    from cake_rmsnorm.errors import ProviderError
    from cake_rmsnorm.runtime import device, loader

    try:
        arch = device.device_info(torch.cuda.current_device()).arch
    except ProviderError as exc:
        return str(exc)
    try:
        loader.locate(arch)
    except ProviderError as exc:
        return f"no provider for {arch.name}: {exc}"
    return None


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    reason = _skip_reason()
    if reason:
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason=reason))
