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
from library_calls import EPS, BwdCall, FwdCall  # noqa: E402
from peers import available  # noqa: E402
from timing import eager_batches_for, eager_times_ms  # noqa: E402

from cake_rmsnorm import ops  # noqa: E402


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
    """Our routed forward and backward libraries called on preallocated tensors (library_calls),
    and their programs."""
    index, (tokens, hidden) = x.get_device(), x.shape
    fwd, _ = ops._library(index, backend, "fwd", hidden, tokens, "fp32", False)
    bwd, sm = ops._library(index, backend, "bwd", hidden, tokens, "fp32", False)
    fwd_call = FwdCall(fwd, x, None, w)
    bwd_call = BwdCall(bwd, x, dy, None, w, fwd_call.rstd, sm)

    def run():
        fwd_call()
        bwd_call()
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
            calls, batches = eager_batches_for(tokens)  # as the benchmark's eager step
            for trial in range(args.trials):
                us = {k: v * 1e3 for k, v in eager_times_ms(steps, calls, batches).items()}
                print(f"  trial {trial}: " + "; ".join(
                    f"{k} {v:.1f}" for k, v in sorted(us.items(), key=lambda kv: kv[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
