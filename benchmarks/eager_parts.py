"""Where an eager training step's host time goes, on the GPU: our step beside steps that leave a
part out, timed interleaved like the benchmark's eager step (timing.eager_times_ms).

    null         torch.autograd.grad through an autograd.Function that does nothing (a view)
    null_alloc   the same, allocating what ours allocates (y and rstd forward, dx and dw backward)
    python_det   our step through the Python autograd.Function (the native C++ step left out)
    no_launch    python_det with the two library calls left out (everything else as it is)
    launches     our two library calls alone (the routed libraries, on preallocated tensors)
    cake_det, cake_fast and the peers: the benchmark's steps (the native step where installed)

Their differences give the autograd engine's part (null), the allocations' (null_alloc - null),
the Python path's own (no_launch - null_alloc), the launches' (python_det - no_launch), and what
the native step saves (python_det - cake_det).

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
from cake_rmsnorm.runtime import native  # noqa: E402


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


def _patched(step, module, name, value):
    """step() with module.name set to value while it runs."""
    def run():
        saved = getattr(module, name)
        setattr(module, name, value)
        try:
            return step()
        finally:
            setattr(module, name, saved)
    return run


def _python_path(step):
    """step() through the Python autograd.Function, the native step left out."""
    return _patched(step, native, "step_op", lambda: None)


def _without_launches(step):
    """The Python path's step() with ops._on_device (where it calls a library) doing nothing."""
    return _python_path(_patched(step, ops, "_on_device", lambda *args: None))


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
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, native step: "
          f"{native.status().detail}")
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
                steps["python_det"] = _python_path(steps["cake_det"])
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
