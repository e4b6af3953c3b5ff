"""The numerical contract, measured: one run's outputs against an FP64 reference of the same inputs.

Used by the GPU tests, the program check (ci/check_programs.py) and the accuracy sweep. torch is
imported by the functions that need it, never at import time. The reference is computed in row
chunks (about 16 M elements each), so T 524288 at H 8192 fits.

Tolerances (DESIGN.md):
- rstd: relative L2 to the FP64 rstd of the bf16 inputs <= 1e-5.
- y, dx (bf16): |err| <= 2^-7 |ref| + atol. Rounding the exact value to bf16 (8-bit significand)
  costs at most 2^-8 |ref|; FP32 error before that rounding can flip the rounding decision, which
  costs one more half ulp: 2^-7 |ref| in all. y has no cancellation, so atol = 1e-6. dx = rstd (g -
  x̂ c) cancels: its FP32 error is relative to the terms, not to dx, so atol = 2^-16 · rstd (|g| +
  |x̂| mean|g x̂|) (+ |dres|): 2^8 times the unit roundoff, room for a tree-reduced mean over 8192.
- dw: every element |dw - ref| <= 1e-4 + 1e-4 |ref| (the budget), relative L2 <= 1e-4; ref = FP64
  sum of dy · x̂ with x̂ = x · the forward's own FP32 rstd. A BF16 dw (BF16 weight) cannot hold
  1e-4 relative: storing the exact sum costs up to half a bf16 ulp (2^-9 to 2^-8 |ref|). Its error
  is what lies beyond that rounding, max(0, |dw - ref| - ulp/2) at the larger of |dw| and |ref|:
  0 for the correctly rounded sum, and the budget then bounds the error made before the rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

BF16_U = 2.0 ** -8  # bf16 unit roundoff
DW_ATOL = DW_RTOL = 1e-4  # the weight-gradient budget
CHUNK_ELEMENTS = 1 << 24


def bits(t):
    """The tensor's bits as integers (bf16 as int16, 32-bit floats as int32): for exact comparisons."""
    import torch
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def same_bits(a, b) -> bool:
    """Same shape, dtype and bits (NaNs compare by payload, -0.0 differs from 0.0)."""
    import torch
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


@dataclass(frozen=True)
class Measure:
    """Worst error / tolerance of y, dx, dw (1.0 = at the limit), relative L2 of rstd and dw."""

    rstd_rel: Optional[float]
    y_ratio: Optional[float]
    dx_ratio: Optional[float]
    dw_ratio: Optional[float]
    dw_rel: Optional[float]
    worst: str = ""  # the worst dw element, for messages

    def failures(self, dw_ratio_limit: float = 1.0) -> list:
        fails = []
        if self.rstd_rel is not None and not self.rstd_rel <= 1e-5:
            fails.append(f"rstd relL2 {self.rstd_rel:.3g} > 1e-5")
        if self.y_ratio is not None and not self.y_ratio <= 1:
            fails.append(f"y error up to {self.y_ratio:.3g}x its tolerance")
        if self.dx_ratio is not None and not self.dx_ratio <= 1:
            fails.append(f"dx error up to {self.dx_ratio:.3g}x its tolerance")
        if self.dw_ratio is not None and not self.dw_ratio <= dw_ratio_limit:
            fails.append(f"{self.worst}: {self.dw_ratio:.3g}x the budget (limit {dw_ratio_limit})")
        if self.dw_rel is not None and not self.dw_rel <= DW_RTOL:
            fails.append(f"dw relL2 {self.dw_rel:.3g} > {DW_RTOL:.3g}")
        return fails

    def as_dict(self) -> dict:
        return dict(rstd_rel=self.rstd_rel, y_ratio=self.y_ratio, dx_ratio=self.dx_ratio,
                    dw_ratio=self.dw_ratio, dw_rel=self.dw_rel)


def _rows(hidden: int) -> int:
    return max(1, CHUNK_ELEMENTS // hidden)


def reference_rstd(xn, eps: float):
    """FP64 rstd of each row of `xn`, in row chunks."""
    import torch

    tokens, hidden = xn.shape
    out = torch.empty(tokens, dtype=torch.float64, device=xn.device)
    for s in range(0, tokens, _rows(hidden)):
        xs = xn[s:s + _rows(hidden)].double()
        out[s:s + _rows(hidden)] = torch.rsqrt((xs * xs).mean(1) + eps)
    return out


def reference_dw(xn, dy, rstd):
    """FP64 Σ_rows dy · (xn · rstd) in row chunks (rstd: the forward's own FP32 rstd)."""
    import torch

    tokens, hidden = xn.shape
    out = torch.zeros(hidden, dtype=torch.float64, device=xn.device)
    for s in range(0, tokens, _rows(hidden)):
        e = min(tokens, s + _rows(hidden))
        out += (dy[s:e].double() * (xn[s:e].double() * rstd[s:e].double()[:, None])).sum(0)
    return out


def eager_fp32_dw(xn, dy, rstd):
    """The eager FP32 reduction peers use: (dy · x̂) in FP32, summed over rows by torch in FP32.
    Above 8 chunks of elements it sums FP32 chunk sums instead (to fit GPU memory): a slightly
    different order than one torch sum, so the comparison there is with an eager-like reduction."""
    import torch

    tokens, hidden = xn.shape
    rows = tokens if tokens * hidden <= CHUNK_ELEMENTS * 8 else _rows(hidden)
    parts = [(dy[s:s + rows].float() * (xn[s:s + rows].float() * rstd[s:s + rows].float()[:, None])).sum(0)
             for s in range(0, tokens, rows)]
    return parts[0] if len(parts) == 1 else torch.stack(parts).sum(0)


def bf16_half_ulp(v):
    """Half a bf16 ulp at |v| (FP64 tensor): the most that rounding v to bf16 may move it."""
    import torch

    _, e = torch.frexp(v)  # |v| in [2^(e-1), 2^e): the bf16 ulp (8-bit significand) is 2^(e-8)
    return torch.where(v == 0, torch.zeros_like(v), torch.ldexp(torch.ones_like(v), e - 9))


def dw_errors(dw, ref):
    """(worst element / budget, relative L2, message) of `dw` against the FP64 `ref`; a bf16 dw
    by its error beyond its own rounding (module docstring)."""
    import torch

    err = (dw.double() - ref).abs()
    if dw.dtype == torch.bfloat16:
        err = (err - bf16_half_ulp(torch.maximum(dw.double().abs(), ref.abs()))).clamp_min(0)
    ratios = err / (DW_ATOL + DW_RTOL * ref.abs())
    i = int(ratios.argmax())
    rel = (err.norm() / ref.norm()).item() if ref.norm() > 0 else err.norm().item()
    return ratios[i].item(), rel, f"dw[{i}] = {dw[i].item():.9g}, ref {ref[i].item():.9g}"


def measure(xn, w, dy, dh, out: dict, eps: float) -> Measure:
    """Compare one run (out: y, rstd, dx, dw; any may be missing) with the FP64 reference.
    xn: the normalised input (x, or h = x + residual); dh: the residual's own gradient or None."""
    tokens, hidden = xn.shape
    w64 = w.double()
    rstd_ref = reference_rstd(xn, eps)
    y_ratio = dx_ratio = 0.0
    rstd_out = out.get("rstd")
    for s in range(0, tokens, _rows(hidden)):
        e = min(tokens, s + _rows(hidden))
        xs = xn[s:e].double()
        rr = rstd_ref[s:e]
        if out.get("y") is not None:
            y_ref = xs * rr[:, None] * w64
            y_tol = 2 * BF16_U * y_ref.abs() + 1e-6
            y_ratio = max(y_ratio, ((out["y"][s:e].double() - y_ref).abs() / y_tol).max().item())
        if out.get("dx") is not None:
            rf = (rstd_out[s:e] if rstd_out is not None else rr).double()[:, None]
            xhat = xs * rf
            g = dy[s:e].double() * w64
            gx = g * xhat
            dx_ref = rf * (g - xhat * gx.mean(1, keepdim=True))
            scale = rf * (g.abs() + xhat.abs() * gx.abs().mean(1, keepdim=True))
            if dh is not None:
                dx_ref += dh[s:e].double()
                scale += dh[s:e].double().abs()
            dx_tol = 2 * BF16_U * dx_ref.abs() + 2.0 ** -16 * scale
            dx_ratio = max(dx_ratio, ((out["dx"][s:e].double() - dx_ref).abs() / dx_tol).max().item())
    rstd_rel = None
    if rstd_out is not None:
        rstd_rel = ((rstd_out.double() - rstd_ref).norm() / rstd_ref.norm()).item()
    dw_ratio = dw_rel = None
    worst = ""
    if out.get("dw") is not None:
        rstd_used = rstd_out if rstd_out is not None else rstd_ref.float()
        ref = reference_dw(xn, dy, rstd_used)
        dw_ratio, dw_rel, worst = dw_errors(out["dw"], ref)
    return Measure(rstd_rel, y_ratio if out.get("y") is not None else None,
                   dx_ratio if out.get("dx") is not None else None, dw_ratio, dw_rel, worst=worst)
