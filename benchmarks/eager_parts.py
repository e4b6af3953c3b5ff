"""Where an eager training step's host time goes, on the GPU: our step beside steps that leave a
part out, timed interleaved like the benchmark's eager step (timing.eager_times_ms).

    null         torch.autograd.grad through an autograd.Function that does nothing (a view)
    null_alloc   the same, allocating what ours allocates (y and rstd forward, dx and dw backward)
    no_launch    our step with the two library calls left out (everything else as it is)
    launches     our two library calls alone (the routed libraries, on preallocated tensors)
    cake_det, cake_fast and the peers: the benchmark's steps

Their differences give the autograd engine's part (null), the allocations' (null_alloc - null),
our Python's (no_launch - null_alloc) and the launches' (cake_det - no_launch).

    python3 benchmarks/eager_parts.py [--widths 256,2048] [--tokens 128] [--trials 3]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import available  # noqa: E402
from timing import eager_times_ms  # noqa: E402

from cake_rmsnorm import ops  # noqa: E402

EPS = 1e-6


class _Null(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        return dy, None


class _NullAlloc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):  # type: ignore[override]
        rstd = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
        ctx.save_for_backward(x, w, rstd)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x, w, _ = ctx.saved_tensors
        return torch.empty_like(x), torch.empty_like(w)


def _without_launches(step):
    """step() with ops._on_device (the one place a library is called) doing nothing."""
    def run():
        saved = ops._on_device
        ops._on_device = lambda *args: None
        try:
            return step()
        finally:
            ops._on_device = saved
    return run


def _launches(x, w, dy, backend):
    """Our routed forward and backward library calls on preallocated outputs (det at T 128 routes
    a backward with no workspace; one with a workspace is given one)."""
    index, (tokens, hidden) = x.get_device(), x.shape
    fwd, _ = ops._library(index, backend, "fwd", hidden, tokens, "fp32", False)
    bwd, sm = ops._library(index, backend, "bwd", hidden, tokens, "fp32", False)
    y, dx, dw = torch.empty_like(x), torch.empty_like(x), torch.empty_like(w)
    rstd = torch.empty(tokens, dtype=torch.float32, device=x.device)
    ws_bytes = bwd.bwd_workspace_bytes(tokens, sm)
    ws = torch.empty(max(ws_bytes, 1), dtype=torch.uint8, device=x.device)

    def run():
        stream = ops._stream(index)
        fwd.fwd(x.data_ptr(), 0, w.data_ptr(), y.data_ptr(), 0, rstd.data_ptr(), tokens, EPS,
                stream)
        bwd.bwd(dy.data_ptr(), 0, x.data_ptr(), w.data_ptr(), rstd.data_ptr(), dx.data_ptr(),
                dw.data_ptr(), ws.data_ptr(), ws_bytes, tokens, 0, stream)
    return run, f"{fwd.program} + {bwd.program}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--widths", default="256,2048")
    ap.add_argument("--tokens", default="128")
    ap.add_argument("--trials", type=int, default=3)
    args = ap.parse_args(argv)
    impls, missing = available()
    for name, why in missing.items():
        print(f"left out {name}: {why}")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for hidden in map(int, args.widths.split(",")):
        for tokens in map(int, args.tokens.split(",")):
            gen = torch.Generator(device="cuda").manual_seed(hidden + tokens)
            x = torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16()
            w = 1 + 0.1 * torch.randn(hidden, device="cuda", generator=gen)
            dy = torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16()
            launches, programs = _launches(x, w, dy, "det")
            x.requires_grad_(), w.requires_grad_()

            def grad(fn, inputs=(x, w)):
                return lambda: torch.autograd.grad(fn(), inputs, dy)
            steps = {name: grad(lambda impl=impl: impl(x, w, EPS)) for name, impl in impls.items()}
            steps["null"] = grad(lambda: _Null.apply(x, w), (x,))
            steps["null_alloc"] = grad(lambda: _NullAlloc.apply(x, w))
            if "cake_det" in steps:
                steps["no_launch"] = _without_launches(steps["cake_det"])
            steps["launches"] = launches
            print(f"H {hidden} T {tokens} (det: {programs}), us per step, fastest first:")
            for trial in range(args.trials):
                us = {k: v * 1e3 for k, v in eager_times_ms(steps).items()}
                print(f"  trial {trial}: " + "; ".join(
                    f"{k} {v:.1f}" for k, v in sorted(us.items(), key=lambda kv: kv[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
