"""The RMSNorm implementations compared side by side: ours (det, fast) and the peers that import here.

Each is fn(x, w, eps) -> y with autograd (x bf16 [T, H], w FP32 [H]). A peer that cannot be imported
is left out with its reason (available() returns both), never faked.
"""

from __future__ import annotations

from typing import Callable, Dict, Tuple

import torch


def eager_rmsnorm(x, w, eps):
    """The usual training RMSNorm: FP32 statistics, FP32 weight, bf16 out (torch eager kernels)."""
    var = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(var + eps) * w.float()).to(x.dtype)


def _cake(backend):
    import cake_rmsnorm
    import cake_rmsnorm.ops  # noqa: F401  (registers torch.ops.cake_rmsnorm)
    return lambda x, w, eps: cake_rmsnorm.rms_norm(x, w, eps, backend=backend)


def _compiled():
    # One specialised graph per shape, as a training job with fixed shapes gets; the benchmark
    # visits many shapes, so lift dynamo's recompile limit (8) instead of going dynamic.
    torch._dynamo.config.recompile_limit = 1024
    torch._dynamo.config.cache_size_limit = 1024
    return torch.compile(eager_rmsnorm, fullgraph=True, dynamic=False)


def _liger():
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    # in_place=False: its backward would otherwise overwrite dy, which the graph replays reuse
    return lambda x, w, eps: LigerRMSNormFunction.apply(x, w, eps, 0.0, "llama", False)


FACTORIES: Dict[str, Callable] = {
    "cake_det": lambda: _cake("det"),
    "cake_fast": lambda: _cake("fast"),
    "torch_eager": lambda: eager_rmsnorm,
    "torch_compile": _compiled,
    "liger": _liger,
}
OURS = ("cake_det", "cake_fast")


def available(names=None) -> Tuple[Dict[str, Callable], Dict[str, str]]:
    """(implementations that import, {name: why not} for the others)."""
    impls, missing = {}, {}
    for name in names or FACTORIES:
        try:
            impls[name] = FACTORIES[name]()
        except Exception as exc:  # an import error or a missing GPU dependency
            missing[name] = f"{type(exc).__name__}: {exc}"
    return impls, missing
