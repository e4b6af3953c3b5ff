"""Call prebuilt libraries directly (not through the router), on the GPU: what the program check
(ci/check_programs.py) and the route tuner (benchmarks/tune_routes.py) share.

A library folder is what ci/program_libs.py writes: lib*.so files and index.json.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from cake_rmsnorm.runtime import abi

EPS = 1e-6
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def read_index(folder: Path) -> dict:
    return json.loads((Path(folder) / "index.json").read_text())


def load_folder(path) -> tuple:
    """(folder, index) of a library folder built for this GPU's arch; exits naming both otherwise."""
    from cake_rmsnorm.runtime import device

    folder = Path(path).resolve()
    index = read_index(folder)
    arch = device.device_info(torch.cuda.current_device()).arch.name
    if index["arch"] != arch:
        raise SystemExit(f"{folder}: libraries for {index['arch']}, but this GPU is {arch}")
    return folder, index


def open_entry(folder: Path, entry: dict) -> abi.Library:
    return abi.Library.open(Path(folder) / entry["file"], name=entry["name"], program=entry["program"],
                            direction=entry["direction"], hidden=entry["H"],
                            weight_dtype=entry["weight_dtype"], residual=entry["residual"])


def inputs(hidden, tokens, wd, res, seed=0):
    """x, residual (or None), dy, dresidual (or None), weight: bf16 randn, weight 1 + 0.1 randn."""
    g = torch.Generator(device="cuda").manual_seed(seed * 7919 + hidden * 1_000_003 + tokens)
    rn = lambda *s: torch.randn(*s, generator=g, device="cuda")  # noqa: E731
    x = rn(tokens, hidden).bfloat16()
    r = rn(tokens, hidden).bfloat16() if res else None
    dy = rn(tokens, hidden).bfloat16()
    dh = rn(tokens, hidden).bfloat16() if res else None
    w = (1 + 0.1 * rn(hidden)).to(DTYPES[wd])
    return x, r, dy, dh, w


class FwdCall:
    """One forward launch of `lib` with preallocated outputs (capturable in a CUDA graph); with
    `like`, an earlier call on the same inputs, it writes that call's outputs (calls timed one
    after another need one set of outputs between them, not one each)."""

    def __init__(self, lib, x, r, w, like=None):
        self.lib, self.x, self.r, self.w = lib, x, r, w
        if like is not None:
            self.y, self.h, self.rstd = like.y, like.h, like.rstd
            return
        self.y = torch.empty_like(x)
        self.h = torch.empty_like(x) if r is not None else None
        self.rstd = torch.empty(x.shape[0], device="cuda", dtype=torch.float32)

    def __call__(self):
        self.lib.fwd(self.x.data_ptr(), self.r.data_ptr() if self.r is not None else 0,
                     self.w.data_ptr(), self.y.data_ptr(), self.h.data_ptr() if self.h is not None else 0,
                     self.rstd.data_ptr(), self.x.shape[0], EPS, torch.cuda.current_stream().cuda_stream)


class BwdCall:
    """One backward launch of `lib` (dx, dw, workspace preallocated; capturable in a CUDA graph);
    `like`: as FwdCall's (the workspace too, where it is large enough)."""

    def __init__(self, lib, xn, dy, dh, w, rstd, sm_count, grid_cap=0, like=None):
        self.lib, self.xn, self.dy, self.dh, self.w, self.rstd = lib, xn, dy, dh, w, rstd
        self.grid_cap = grid_cap
        self.nbytes = lib.bwd_workspace_bytes(xn.shape[0], sm_count)
        if like is not None:
            self.dx, self.dw = like.dx, like.dw
            self.ws = like.ws if like.ws.numel() >= self.nbytes else torch.empty(self.nbytes, device="cuda",
                                                                                   dtype=torch.uint8)
            return
        self.dx = torch.empty_like(xn)
        self.dw = torch.empty(xn.shape[1], device="cuda", dtype=w.dtype)
        self.ws = torch.empty(max(self.nbytes, 1), device="cuda", dtype=torch.uint8)

    def __call__(self):
        self.lib.bwd(self.dy.data_ptr(), self.dh.data_ptr() if self.dh is not None else 0,
                     self.xn.data_ptr(), self.w.data_ptr(), self.rstd.data_ptr(), self.dx.data_ptr(),
                     self.dw.data_ptr(), self.ws.data_ptr(), self.nbytes, self.xn.shape[0],
                     self.grid_cap, torch.cuda.current_stream().cuda_stream)


def fp32_rstd(xn):
    return torch.rsqrt(xn.float().pow(2).mean(1) + EPS)
