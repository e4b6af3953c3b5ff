"""cake-rmsnorm: RMSNorm forward and backward for training, prebuilt per GPU architecture.

Importing this package does no CUDA work and loads no library; torch is imported on first use.

    import cake_rmsnorm
    y = cake_rmsnorm.rms_norm(x, weight)                       # backend: det or fast
    y, h = cake_rmsnorm.rms_norm(x, weight, residual=r)        # h = x + r
    norm = cake_rmsnorm.RMSNorm(4096)                          # drop-in for torch.nn.RMSNorm
"""

from ._version import __version__

__all__ = ["rms_norm", "RMSNorm", "__version__"]


def __getattr__(name):
    # Lazy: the op and the module import torch, which a build machine need not have.
    if name == "rms_norm":
        from .ops import rms_norm as value
    elif name == "RMSNorm":
        from .module import RMSNorm as value
    else:
        raise AttributeError(f"module 'cake_rmsnorm' has no attribute {name!r}")
    globals()[name] = value  # later lookups (cake_rmsnorm.rms_norm in a training step) skip this
    return value
