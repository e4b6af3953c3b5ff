"""Argument checks for cake_rmsnorm.ops: every error is raised before anything is allocated or
launched, and names the argument, what it got and what is accepted.

Order (public rms_norm): backend name and deterministic mode, x, hidden size, weight, residual,
eps, then devices last (so every other check runs on CPU tensors too).
"""

import warnings
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from .registry import load_registry

_REGISTRY = load_registry()
WIDTHS: Tuple[int, ...] = _REGISTRY.widths
BACKENDS: Tuple[str, ...] = _REGISTRY.backends
_WIDTH_SET = frozenset(WIDTHS)
MAX_HIDDEN: int = _REGISTRY.max_hidden  # any multiple of 8 up to this runs (the generic programs)
WEIGHT_DTYPES: Dict[torch.dtype, str] = {torch.float32: "fp32", torch.bfloat16: "bf16"}
# The kernels take eps as float32: it must stay finite and > 0 after that rounding.
_EPS_MIN = 2.0 ** -149             # the smallest positive float32 (subnormal)
_EPS_MAX = 3.4028234663852886e38   # the largest finite float32

_NONDET = ("cake_rmsnorm.rms_norm(backend='fast') does not have a deterministic implementation, "
           "but you set 'torch.use_deterministic_algorithms(True)'. You can turn off determinism "
           "just for this operation, or you can use the 'warn_only=True' option, if that's "
           "acceptable for your application. Or use backend='det' (bitwise-reproducible) or "
           "backend=None (det whenever deterministic algorithms are enabled).")


def resolve_backend(backend: Optional[str]) -> str:
    """None → "det" under torch.use_deterministic_algorithms(True), else "fast". An explicit
    "fast" in deterministic mode raises RuntimeError (a UserWarning under warn_only=True), as
    torch's own non-deterministic ops do."""
    if backend is None:
        return "det" if torch.are_deterministic_algorithms_enabled() else "fast"
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not one of {', '.join(map(repr, BACKENDS))} "
                         f"(or None: det when deterministic algorithms are enabled, else fast)")
    if backend == "fast" and torch.are_deterministic_algorithms_enabled():
        if not torch.is_deterministic_algorithms_warn_only_enabled():
            raise RuntimeError(_NONDET)
        warnings.warn(_NONDET, UserWarning, stacklevel=3)
    return backend


def _check_hidden(hidden: int, shape) -> None:
    """A prebuilt width, or any other multiple of 8 up to MAX_HIDDEN (the generic programs)."""
    if hidden not in _WIDTH_SET and not _REGISTRY.is_generic_width(hidden):
        raise ValueError(f"x has hidden size H={hidden} (shape {tuple(shape)}); H must be "
                         f"{_REGISTRY.describe_hidden()}")


def check_eps(eps) -> None:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a finite float > 0, got {type(eps).__name__} {eps!r}")
    if not _EPS_MIN <= eps <= _EPS_MAX:  # also refuses nan
        raise ValueError(f"eps must be a finite float > 0 (and within float32's range: "
                         f"{_EPS_MIN:.3g} to {_EPS_MAX:.4g}), got {eps!r}")


def check_args(x: Tensor, weight: Tensor, residual: Optional[Tensor], eps) -> None:
    """The public rms_norm's checks (x of any rank >= 1; the wrapper flattens it)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.bfloat16:
        raise TypeError(f"x has dtype {x.dtype}; cake_rmsnorm accepts torch.bfloat16 x only")
    if x.dim() < 1:
        raise ValueError(f"x must have at least one dimension (..., H), got shape {tuple(x.shape)}")
    hidden = x.shape[-1]
    _check_hidden(hidden, x.shape)
    if not isinstance(weight, Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    if weight.dtype not in WEIGHT_DTYPES:
        raise TypeError(f"weight has dtype {weight.dtype}; accepted: torch.float32, torch.bfloat16")
    if tuple(weight.shape) != (hidden,):
        raise ValueError(f"weight has shape {tuple(weight.shape)}; expected ({hidden},) to match "
                         f"x's last dimension")
    if residual is not None:
        if not isinstance(residual, Tensor):
            raise TypeError(f"residual must be a torch.Tensor or None, got "
                            f"{type(residual).__name__}")
        if residual.dtype != torch.bfloat16:
            raise TypeError(f"residual has dtype {residual.dtype}; expected x's dtype "
                            f"torch.bfloat16")
        if residual.shape != x.shape:
            raise ValueError(f"residual has shape {tuple(residual.shape)}; expected x's shape "
                             f"{tuple(x.shape)}")
    check_eps(eps)
    check_device(x, weight, residual)


def check_device(x: Tensor, weight: Tensor, residual: Optional[Tensor]) -> None:
    if not x.is_cuda:  # (x.device builds a device object: on the hot path, once is enough)
        raise ValueError(f"x is on device {x.device}; cake_rmsnorm runs on CUDA devices only")
    device = x.device
    if weight.device != device:
        raise ValueError(f"weight is on {weight.device}, x on {x.device}: they must share a device")
    if residual is not None and residual.device != device:
        raise ValueError(f"residual is on {residual.device}, x on {device}: they must share "
                         f"a device")


def check_op(x: Tensor, weight: Tensor, *like_x: Optional[Tensor], eps=None,
             backend: Optional[str] = None, rstd: Optional[Tensor] = None) -> None:
    """The custom ops' own guard (they may be called directly): wrong dtypes, shapes, widths,
    eps or backend never reach a kernel. The public rms_norm has already given the detailed
    error for anything it passes on."""
    ok = (x.dim() == 2 and x.dtype == torch.bfloat16 and weight.dtype in WEIGHT_DTYPES
          and weight.shape == (x.shape[1],))
    for t in like_x:
        ok = ok and (t is None or (t.shape == x.shape and t.dtype == torch.bfloat16
                                   and t.device == x.device))
    if not ok:
        raise ValueError("cake_rmsnorm ops take x, residual, dy as [T, H] bf16 CUDA tensors and "
                         f"weight [H] fp32/bf16 on x's device; got x {x.dtype} "
                         f"{tuple(x.shape)} on {x.device}, weight {weight.dtype} "
                         f"{tuple(weight.shape)} on {weight.device}")
    _check_hidden(x.shape[1], x.shape)
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not one of {', '.join(map(repr, BACKENDS))}")
    if eps is not None:
        check_eps(eps)
    if rstd is not None and (rstd.shape != (x.shape[0],) or rstd.dtype != torch.float32
                             or rstd.device != x.device):
        raise ValueError(f"rstd must be [T] float32 on x's device, got {rstd.dtype} "
                         f"{tuple(rstd.shape)} on {rstd.device}")
    check_device(x, weight, None)
