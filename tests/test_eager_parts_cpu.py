"""benchmarks/eager_parts.py's pieces that need no GPU: the step without launches takes the
Python path and leaves ops._on_device and native.step_op untouched afterwards (also when the step fails), and the null Function with
allocations allocates what ours does and gives gradients of the inputs' shapes."""

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import eager_parts  # noqa: E402
from cake_rmsnorm import ops  # noqa: E402


def test_the_step_without_launches_calls_no_library_and_restores_the_launcher():
    original = ops._on_device
    calls, seen = [], []

    def step():
        seen.append(eager_parts.native.step_op())
        ops._on_device(0, lambda *a: calls.append(a), 1, 2)
        return "done"

    step_op = eager_parts.native.step_op
    assert eager_parts._without_launches(step)() == "done"
    assert calls == [] and seen == [None]  # the Python path, without its library calls
    assert ops._on_device is original and eager_parts.native.step_op is step_op

    def failing():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        eager_parts._without_launches(failing)()
    assert ops._on_device is original


def test_null_with_allocations_gives_gradients_shaped_like_the_inputs():
    x = torch.randn(16, 256).bfloat16().requires_grad_()
    w = torch.randn(256).requires_grad_()
    y = eager_parts._NullAlloc.apply(x, w)
    assert y.shape == x.shape and y.dtype == x.dtype
    dx, dw = torch.autograd.grad(y, (x, w), torch.ones_like(y))
    assert dx.shape == x.shape and dw.shape == w.shape and dw.dtype == w.dtype
    (dx_null,) = torch.autograd.grad(eager_parts._Null.apply(x, w), (x,), torch.ones_like(y))
    assert torch.equal(dx_null, torch.ones_like(y))
