"""`RMSNorm`: a drop-in for torch.nn.RMSNorm backed by cake_rmsnorm.rms_norm."""

from numbers import Integral
from typing import Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from .checks import check_eps
from .ops import BACKENDS, rms_norm

__all__ = ["RMSNorm"]

DEFAULT_EPS = 1e-6


class RMSNorm(torch.nn.Module):
    """RMSNorm over the last dimension, with a learnable weight (initialised to ones).

    Matches torch.nn.RMSNorm's constructor for what this op supports: `normalized_shape` an int
    or a 1-tuple, `eps` (None → 1e-6), `elementwise_affine` must be True, `dtype` is the weight's
    (float32, the training default, or bfloat16). `backend`: "det", "fast" or None (det under
    torch.use_deterministic_algorithms(True), else fast). forward(x, residual=None) returns y, or
    (y, x + residual) with a residual.
    """

    __constants__ = ["normalized_shape", "eps", "backend"]
    normalized_shape: Tuple[int]
    eps: float
    backend: Optional[str]

    def __init__(self, normalized_shape: Union[int, Sequence[int]], eps: Optional[float] = None,
                 elementwise_affine: bool = True, device=None, dtype=None,
                 backend: Optional[str] = None) -> None:
        super().__init__()
        if isinstance(normalized_shape, Integral):
            shape = (int(normalized_shape),)
        else:
            shape = tuple(int(s) for s in normalized_shape)
        if len(shape) != 1:
            raise ValueError(f"normalized_shape {normalized_shape!r}: cake_rmsnorm normalises over "
                             f"the last dimension only (an int or a 1-tuple)")
        if not elementwise_affine:
            raise ValueError("elementwise_affine=False is not supported: cake_rmsnorm always "
                             "applies a weight")
        dtype = torch.float32 if dtype is None else dtype
        if dtype not in (torch.float32, torch.bfloat16):
            raise TypeError(f"dtype {dtype} is not supported for the weight; accepted: "
                            f"torch.float32, torch.bfloat16")
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"backend {backend!r} is not one of "
                             f"{', '.join(map(repr, BACKENDS))} or None")
        self.normalized_shape = shape  # type: ignore[assignment]
        if eps is not None:
            check_eps(eps)  # refuse a bad eps when the module is built, not at its first call
        self.eps = DEFAULT_EPS if eps is None else float(eps)
        self.elementwise_affine = True
        self.backend = backend
        self.weight = torch.nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        torch.nn.init.ones_(self.weight)

    def forward(self, x: Tensor, residual: Optional[Tensor] = None):
        return rms_norm(x, self.weight, self.eps, residual=residual, backend=self.backend)

    def extra_repr(self) -> str:
        backend = "" if self.backend is None else f", backend={self.backend!r}"
        return (f"{self.normalized_shape}, eps={self.eps}, elementwise_affine=True, "
                f"dtype={self.weight.dtype}{backend}")
