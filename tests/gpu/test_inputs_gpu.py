"""Bad and unusual input on a GPU.

- Every bad input, on real CUDA tensors: the exception and its message, the inputs' sha256 before
  and after (nothing written), no library routed, loaded or launched, no CUDA allocation. With
  $CAKE_RMSNORM_INPUTS_LOG set, one JSON line per case is appended there (the note's table).
- NaN and Inf propagate as IEEE says (det and fast, fp32 and bf16 weight): no hang, and the rows
  and columns they touch are NaN (or the exact 0 the math gives), every other value as without them.
- det in 3 separate processes prints identical sha256 digests of y, dx, dw.
- A 16-byte-misaligned offset view, strided inputs, x passed as its own residual (h = 2x), T = 0.
"""

import ctypes
import hashlib
import json
import math
import os
import subprocess
import sys
import textwrap
import time

import pytest

torch = pytest.importorskip("torch")

import cake_rmsnorm  # noqa: E402
from cake_rmsnorm import checks, ops  # noqa: E402
from cake_rmsnorm.accuracy import same_bits  # noqa: E402
from cake_rmsnorm.registry import TableKey, load_registry  # noqa: E402
from cake_rmsnorm.runtime import abi, native  # noqa: E402
from cake_rmsnorm.runtime.device import device_info  # noqa: E402

pytestmark = pytest.mark.gpu

BF, F32 = torch.bfloat16, torch.float32
T, H = 8, 256
WIDTHS = ", ".join(map(str, checks.WIDTHS))


def _digest(t) -> str:
    """sha256 of a tensor's bytes (host copy, row-major); other values by repr."""
    if not isinstance(t, torch.Tensor):
        return repr(t)
    t = t.detach().cpu().contiguous()
    return hashlib.sha256(ctypes.string_at(t.data_ptr(), t.nbytes) if t.nbytes else b"").hexdigest()


def _gen(seed: int):
    return torch.Generator(device="cuda").manual_seed(seed)


def _x(*shape, dtype=BF, device="cuda", seed=1):
    t = torch.randn(*(shape or (T, H)), generator=_gen(seed), device="cuda", dtype=F32)
    return t.to(dtype=dtype, device=device)


def _w(n=H, dtype=F32, device="cuda"):
    t = 1 + 0.1 * torch.randn(n, generator=_gen(7), device="cuda", dtype=F32)
    return t.to(dtype=dtype, device=device)


def _det_on():
    torch.use_deterministic_algorithms(True)


def _rms(**kw):
    return lambda: cake_rmsnorm.rms_norm(**kw)


# (id, builder -> (inputs dict, call), exception, message fragment (regex), setup)
def _case(**kw):
    return kw, _rms(**kw)


def _op(name, *args):
    tensors = {f"arg{i}": a for i, a in enumerate(args) if isinstance(a, torch.Tensor)}
    return tensors, lambda: getattr(torch.ops.cake_rmsnorm, name)(*args)


CASES = [
    ("x_on_cpu", lambda: _case(x=_x(device="cpu"), weight=_w(device="cpu")), ValueError,
     r"x is on device cpu; cake_rmsnorm runs on CUDA devices only", None),
    ("weight_on_cpu", lambda: _case(x=_x(), weight=_w(device="cpu")), ValueError,
     r"weight is on cpu, x on cuda:0: they must share a device", None),
    ("residual_on_cpu", lambda: _case(x=_x(), weight=_w(), residual=_x(device="cpu")),
     ValueError, r"residual is on cpu, x on cuda:0: they must share a device", None),
    ("weight_other_gpu", lambda: _case(x=_x(), weight=_w(device="cuda:1")), ValueError,
     r"weight is on cuda:1, x on cuda:0", "2gpu"),
    ("residual_other_gpu", lambda: _case(x=_x(), weight=_w(), residual=_x(device="cuda:1")),
     ValueError, r"residual is on cuda:1, x on cuda:0", "2gpu"),
    ("x_not_tensor", lambda: _case(x=[1.0], weight=_w()), TypeError,
     r"x must be a torch.Tensor, got list", None),
    ("x_fp32", lambda: _case(x=_x(dtype=F32), weight=_w()), TypeError,
     r"x has dtype torch.float32; cake_rmsnorm accepts torch.bfloat16 x only", None),
    ("x_fp16", lambda: _case(x=_x(dtype=torch.float16), weight=_w()), TypeError,
     r"x has dtype torch.float16", None),
    ("x_0d", lambda: _case(x=torch.zeros((), dtype=BF, device="cuda"), weight=_w()), ValueError,
     r"x must have at least one dimension", None),
    ("H_not_multiple_of_8", lambda: _case(x=_x(T, 260), weight=_w(260)), ValueError,
     rf"H=260 .*H must be a multiple of 8 from 8 to 16384; the prebuilt widths {WIDTHS} are the "
     rf"fast ones", None),
    ("H_above_generic_max", lambda: _case(x=_x(T, 16392), weight=_w(16392)), ValueError,
     rf"H=16392 .*H must be a multiple of 8 from 8 to 16384; the prebuilt widths {WIDTHS}", None),
    ("weight_fp16", lambda: _case(x=_x(), weight=_w(dtype=torch.float16)), TypeError,
     r"weight has dtype torch.float16; accepted: torch.float32, torch.bfloat16", None),
    ("weight_fp64", lambda: _case(x=_x(), weight=_w(dtype=torch.float64)), TypeError,
     r"weight has dtype torch.float64", None),
    ("weight_shape", lambda: _case(x=_x(), weight=_w(128)), ValueError,
     r"weight has shape \(128,\); expected \(256,\)", None),
    ("weight_2d", lambda: _case(x=_x(), weight=_w().view(1, H)), ValueError,
     r"weight has shape \(1, 256\); expected \(256,\)", None),
    ("residual_shape", lambda: _case(x=_x(), weight=_w(), residual=_x(3, H)), ValueError,
     r"residual has shape \(3, 256\); expected x's shape \(8, 256\)", None),
    ("residual_dtype", lambda: _case(x=_x(), weight=_w(), residual=_x(dtype=F32)), TypeError,
     r"residual has dtype torch.float32; expected x's dtype torch.bfloat16", None),
    ("eps_zero", lambda: _case(x=_x(), weight=_w(), eps=0.0), ValueError,
     r"eps must be a finite float > 0 .*got 0.0", None),
    ("eps_negative", lambda: _case(x=_x(), weight=_w(), eps=-1e-6), ValueError,
     r"eps must be a finite float > 0 .*got -1e-06", None),
    ("eps_nan", lambda: _case(x=_x(), weight=_w(), eps=math.nan), ValueError,
     r"eps must be a finite float > 0 .*got nan", None),
    ("eps_inf", lambda: _case(x=_x(), weight=_w(), eps=math.inf), ValueError,
     r"eps must be a finite float > 0 .*got inf", None),
    ("eps_float32_underflow", lambda: _case(x=_x(), weight=_w(), eps=1e-50), ValueError,
     r"within float32's range.*got 1e-50", None),
    ("eps_bool", lambda: _case(x=_x(), weight=_w(), eps=True), TypeError,
     r"eps must be a finite float > 0, got bool True", None),
    ("backend_unknown", lambda: _case(x=_x(), weight=_w(), backend="turbo"), ValueError,
     r"backend 'turbo' is not one of", None),
    ("fast_in_deterministic_mode", lambda: _case(x=_x(), weight=_w(), backend="fast"),
     RuntimeError, r"cake_rmsnorm.rms_norm\(backend='fast'\) does not have a deterministic "
     r"implementation, but you set 'torch.use_deterministic_algorithms\(True\)'", "det"),
    # the custom ops called directly: their own guard
    ("op_fwd_eps_zero", lambda: _op("fwd", _x(), _w(), 0.0, "det"), ValueError,
     r"eps must be a finite float > 0", None),
    ("op_fwd_H_above_generic_max", lambda: _op("fwd", _x(T, 16392), _w(16392), 1e-6, "det"),
     ValueError, r"H=16392 .*H must be a multiple of 8 from 8 to 16384", None),
    ("op_fwd_x_fp32", lambda: _op("fwd", _x(dtype=F32), _w(), 1e-6, "det"), ValueError,
     r"cake_rmsnorm ops take x, residual, dy as \[T, H\] bf16 CUDA tensors", None),
    ("op_fwd_weight_on_cpu", lambda: _op("fwd", _x(), _w(device="cpu"), 1e-6, "det"), ValueError,
     r"weight is on cpu, x on cuda:0", None),
    ("op_fwd_residual_shape", lambda: _op("fwd_residual", _x(), _x(2, H), _w(), 1e-6, "det"),
     ValueError, r"cake_rmsnorm ops take", None),
    ("op_fwd_backend", lambda: _op("fwd", _x(), _w(), 1e-6, "turbo"), ValueError,
     r"backend 'turbo'", None),
    ("op_bwd_rstd", lambda: _op("bwd", _x(), None, _x(), _w(), torch.ones(3, device="cuda"),
                                "det", False), ValueError, r"rstd must be \[T\] float32", None),
    ("op_bwd_dy_dtype", lambda: _op("bwd", _x(dtype=F32), None, _x(), _w(),
                                    torch.ones(T, device="cuda"), "det", False), ValueError,
     r"cake_rmsnorm ops take", None),
]


@pytest.fixture
def launches(monkeypatch):
    """Counts every routing (ops._library) and every library call (abi.Library.fwd/bwd, and the
    native step's forward)."""
    count = {"route": 0, "fwd": 0, "bwd": 0}
    real_library = ops._library

    def library(*args, **kwargs):
        count["route"] += 1
        return real_library(*args, **kwargs)
    monkeypatch.setattr(ops, "_library", library)
    for name in ("fwd", "bwd"):
        real = getattr(abi.Library, name)

        def counted(self, *args, _real=real, _name=name):
            count[_name] += 1
            return _real(self, *args)
        monkeypatch.setattr(abi.Library, name, counted)
    real_step_op = native.step_op

    def step_op():  # the native step: its forward counted here, its backward runs in C++
        op = real_step_op()
        if op is None:
            return None

        def counted(*args):
            count["fwd"] += 1
            return op(*args)
        return counted
    monkeypatch.setattr(native, "step_op", step_op)
    return count


def _log(record: dict) -> None:
    path = os.environ.get("CAKE_RMSNORM_INPUTS_LOG")
    if path:
        with open(path, "a") as fh:
            fh.write(json.dumps(record) + "\n")


@pytest.mark.parametrize("name,build,exc,pattern,setup", CASES, ids=[c[0] for c in CASES])
def test_bad_input(name, build, exc, pattern, setup, launches):
    if setup == "2gpu" and torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    inputs, call = build()
    torch.cuda.synchronize()
    before = {k: _digest(v) for k, v in inputs.items()}
    det = (torch.are_deterministic_algorithms_enabled(),
           torch.is_deterministic_algorithms_warn_only_enabled())
    allocs = torch.cuda.memory_stats().get("allocation.all.allocated", 0)
    try:
        if setup == "det":
            _det_on()
        with pytest.raises(exc, match=pattern) as err:
            call()
    finally:
        torch.use_deterministic_algorithms(det[0], warn_only=det[1])
    new_allocs = torch.cuda.memory_stats().get("allocation.all.allocated", 0) - allocs
    torch.cuda.synchronize()
    after = {k: _digest(v) for k, v in inputs.items()}
    _log(dict(case=name, exception=type(err.value).__name__, message=str(err.value),
              inputs_sha256={k: before[k][:16] for k in before}, unchanged=before == after,
              launches=dict(launches), cuda_allocations=new_allocs))
    assert type(err.value) is exc
    assert before == after, "an input changed"
    assert launches == {"route": 0, "fwd": 0, "bwd": 0}, f"launched despite bad input: {launches}"
    assert new_allocs == 0, f"{new_allocs} CUDA allocations before the error"


def test_fast_in_warn_only_mode_warns_and_runs_fast(launches):
    x, w = _x(), _w()
    det = (torch.are_deterministic_algorithms_enabled(),
           torch.is_deterministic_algorithms_warn_only_enabled())
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
        with pytest.warns(UserWarning, match=r"rms_norm\(backend='fast'\) does not have a "
                                             r"deterministic implementation"):
            y = cake_rmsnorm.rms_norm(x, w, backend="fast")
    finally:
        torch.use_deterministic_algorithms(det[0], warn_only=det[1])
    torch.cuda.synchronize()
    assert launches["fwd"] == 1
    assert same_bits(y, cake_rmsnorm.rms_norm(x, w, backend="fast"))


# ---- NaN and Inf ---------------------------------------------------------------------------------
def _finish(timeout_s: float = 120.0) -> None:
    """Wait for the GPU by polling an event: a hung kernel fails the test instead of blocking."""
    event = torch.cuda.Event()
    event.record()
    deadline = time.monotonic() + timeout_s
    while not event.query():
        assert time.monotonic() < deadline, f"the GPU did not finish within {timeout_s}s (hang?)"
        time.sleep(0.001)
    torch.cuda.synchronize()


def _fwd_bwd(x, w, dy, backend):
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    y, rstd = torch.ops.cake_rmsnorm.fwd(x, w, 1e-6, backend)
    torch.autograd.backward([y], [dy])
    _finish()
    return dict(y=y.detach(), rstd=rstd.detach(), dx=x.grad, dw=w.grad)


def _close(got, want, what):
    if got.dtype == BF or want.dtype == BF:
        rtol, atol = 2.0 ** -7, 1e-5
    else:
        rtol, atol = 1e-5, 1e-5
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol,
                               msg=lambda m: f"{what}: {m}")


def _all_nan(t, what):
    assert torch.isnan(t.float()).all(), f"{what}: expected all NaN, got {t}"


def _all_finite(t, what):
    assert torch.isfinite(t.float()).all(), f"{what}: expected finite, got non-finite values"


# "fixed64": a ragged T (a window's first + 1, from 1026 on) where det routes a fixed64 program at
# NAN_HIDDEN on this GPU (a NaN or Inf term sends it to its FP64 fallback), read from the
# registry; 4097 where none does.
NAN_HIDDEN, NAN_TOKENS = 4096, (7, 1025, "fixed64")


def _det_fixed64_tokens(hidden, wdtype):
    reg = load_registry()
    arch = device_info(torch.cuda.current_device()).arch.name
    wd = checks.WEIGHT_DTYPES[wdtype]
    for w in reg.table(TableKey(arch, "det", "bwd", wd, False, hidden)):
        tokens = max(w.first, 1025) + 1
        if reg.route(arch, "det", "bwd", hidden, tokens, wd, False).program.reduction == "fixed64":
            return tokens
    return 4097


@pytest.mark.parametrize("tokens", NAN_TOKENS)
@pytest.mark.parametrize("wdtype", [F32, BF], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", ["det", "fast"])
def test_nan_and_inf_propagate(backend, wdtype, tokens):
    hidden = NAN_HIDDEN
    if tokens == "fixed64":
        tokens = _det_fixed64_tokens(hidden, wdtype)
    gen = _gen(hidden + tokens)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=F32)

    x = randn(tokens, hidden).to(BF)
    dy = randn(tokens, hidden).to(BF)
    w = (1 + 0.1 * randn(hidden)).to(wdtype)
    rn, cn, ri, ci, cw, rd, cd = 3, 5, 2, 7, 9, 4, 11
    other_rows = [r for r in range(tokens) if r not in (rn, ri, rd)]
    fails = []

    def check(fn, what):
        try:
            fn()
        except AssertionError as exc:
            fails.append(f"{what}: {exc}")

    # x: NaN at (rn, cn). Row rn: rstd, y, dx NaN; dw NaN in every column (row rn touches all).
    bad = x.clone()
    bad[rn, cn] = float("nan")
    clean = x.clone()
    clean[rn, cn] = 0
    got, ref = _fwd_bwd(bad, w, dy, backend), _fwd_bwd(clean, w, dy, backend)
    check(lambda: _all_nan(got["rstd"][rn], "x NaN: rstd[row]"), "x NaN")
    check(lambda: _all_nan(got["y"][rn], "x NaN: y[row]"), "x NaN")
    check(lambda: _all_nan(got["dx"][rn], "x NaN: dx[row]"), "x NaN")
    check(lambda: _all_nan(got["dw"], "x NaN: dw"), "x NaN")
    for key in ("y", "rstd", "dx"):
        check(lambda: _close(got[key][other_rows], ref[key][other_rows],
                             f"x NaN: {key} other rows"), "x NaN")

    # x: Inf at (ri, ci). sum x^2 = Inf, rstd = 0; y[ri] = Inf*0 = NaN at ci, 0 elsewhere;
    # dx[ri] NaN (its mean term is NaN); dw NaN at ci only, other columns as with row ri = 0.
    bad = x.clone()
    bad[ri, ci] = float("inf")
    clean = x.clone()
    clean[ri] = 0
    got, ref = _fwd_bwd(bad, w, dy, backend), _fwd_bwd(clean, w, dy, backend)
    cols = [c for c in range(hidden) if c != ci]
    check(lambda: _close(got["rstd"][ri], torch.zeros((), device="cuda"), "x Inf: rstd[row]"),
          "x Inf")
    check(lambda: _all_nan(got["y"][ri, ci], "x Inf: y[row, col]"), "x Inf")
    check(lambda: _close(got["y"][ri, cols], torch.zeros(hidden - 1, device="cuda"),
                         "x Inf: y[row, other cols]"), "x Inf")
    check(lambda: _all_nan(got["dx"][ri], "x Inf: dx[row]"), "x Inf")
    check(lambda: _all_nan(got["dw"][ci], "x Inf: dw[col]"), "x Inf")
    check(lambda: _close(got["dw"][cols], ref["dw"][cols], "x Inf: dw other cols"), "x Inf")
    for key in ("y", "rstd", "dx"):
        check(lambda: _close(got[key][other_rows], ref[key][other_rows],
                             f"x Inf: {key} other rows"), "x Inf")

    # weight: NaN at cw. y[:, cw] NaN, other columns as before; rstd and dw (= sum dy x̂) do not
    # involve the weight: finite and as before; dx = rstd (g - x̂ mean(g x̂)), g = dy w: all NaN.
    bad_w = w.clone()
    bad_w[cw] = float("nan")
    clean_w = w.clone()
    clean_w[cw] = 1
    got, ref = _fwd_bwd(x, bad_w, dy, backend), _fwd_bwd(x, clean_w, dy, backend)
    cols = [c for c in range(hidden) if c != cw]
    check(lambda: _all_nan(got["y"][:, cw], "w NaN: y[:, col]"), "w NaN")
    check(lambda: _close(got["y"][:, cols], ref["y"][:, cols], "w NaN: y other cols"), "w NaN")
    check(lambda: _close(got["rstd"], ref["rstd"], "w NaN: rstd"), "w NaN")
    check(lambda: _all_finite(got["dw"], "w NaN: dw"), "w NaN")
    check(lambda: _close(got["dw"], ref["dw"], "w NaN: dw"), "w NaN")
    check(lambda: _all_nan(got["dx"], "w NaN: dx"), "w NaN")

    # dy: NaN at (rd, cd). Forward untouched; dx[rd] NaN, other rows as before; dw NaN at cd only.
    bad_dy = dy.clone()
    bad_dy[rd, cd] = float("nan")
    clean_dy = dy.clone()
    clean_dy[rd, cd] = 0
    got, ref = _fwd_bwd(x, w, bad_dy, backend), _fwd_bwd(x, w, clean_dy, backend)
    rows = [r for r in range(tokens) if r != rd]
    cols = [c for c in range(hidden) if c != cd]
    check(lambda: _close(got["y"], ref["y"], "dy NaN: y"), "dy NaN")
    check(lambda: _all_nan(got["dx"][rd], "dy NaN: dx[row]"), "dy NaN")
    check(lambda: _close(got["dx"][rows], ref["dx"][rows], "dy NaN: dx other rows"), "dy NaN")
    check(lambda: _all_nan(got["dw"][cd], "dy NaN: dw[col]"), "dy NaN")
    check(lambda: _all_finite(got["dw"][cols], "dy NaN: dw other cols"), "dy NaN")
    check(lambda: _close(got["dw"][cols], ref["dw"][cols], "dy NaN: dw other cols"), "dy NaN")
    assert not fails, f"{backend} {wdtype} T={tokens}:\n  " + "\n  ".join(fails)


# ---- determinism across processes ----------------------------------------------------------------
DIGEST_CODE = textwrap.dedent("""
    import ctypes, hashlib, json, sys, torch, cake_rmsnorm

    def sha(t):
        t = t.detach().cpu().contiguous()
        return hashlib.sha256(ctypes.string_at(t.data_ptr(), t.nbytes)).hexdigest()

    out = {}
    for hidden, tokens in ((4096, 1025), (4096, 65536), (256, 300)):
        for wname, wdtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            gen = torch.Generator(device="cuda").manual_seed(hidden * 7919 + tokens)
            rand = lambda *s: torch.randn(*s, generator=gen, device="cuda", dtype=torch.float32)
            x = rand(tokens, hidden).to(torch.bfloat16).requires_grad_()
            w = (1 + 0.1 * rand(hidden)).to(wdtype).requires_grad_()
            dy = rand(tokens, hidden).to(torch.bfloat16)
            y = cake_rmsnorm.rms_norm(x, w, backend="det")
            y.backward(dy)
            torch.cuda.synchronize()
            out[f"H{hidden} T{tokens} {wname}"] = dict(y=sha(y), dx=sha(x.grad), dw=sha(w.grad))
    print(json.dumps(out, sort_keys=True))
""")


def test_det_digests_identical_across_three_processes():
    runs = []
    for _ in range(3):
        proc = subprocess.run([sys.executable, "-c", DIGEST_CODE], capture_output=True, text=True,
                              env=dict(os.environ), timeout=600)
        assert proc.returncode == 0, proc.stderr
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert len(runs[0]) == 6
    assert runs[0] == runs[1] == runs[2], json.dumps(runs, indent=1)
    _log(dict(case="det_digests_3_processes", digests=runs[0], identical=True))


# ---- layouts: misaligned offset views, strided inputs, x as its own residual, T = 0 ------------
def _offset(t):
    """A copy of t whose data pointer is one element past an allocation (not 16-byte aligned)."""
    base = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = base[1:].view(t.shape)
    view.copy_(t)
    assert view.data_ptr() % 16 != 0 and view.is_contiguous()
    return view


def _strided(t):
    """Same values, non-contiguous: every other column of a wider buffer (last dim stride 2)."""
    base = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    view = base[..., ::2]
    view.copy_(t)
    assert not view.is_contiguous()
    return view


def _train(x, r, w, dy, dh, backend):
    x = x.detach().requires_grad_()
    w = w.detach().requires_grad_()
    if r is None:
        y = cake_rmsnorm.rms_norm(x, w, backend=backend)
        torch.autograd.backward([y], [dy])
        out = dict(y=y, dx=x.grad, dw=w.grad)
    else:
        r = r.detach().requires_grad_()
        y, h = cake_rmsnorm.rms_norm(x, w, residual=r, backend=backend)
        torch.autograd.backward([y, h], [dy, dh])
        out = dict(y=y, h=h, dx=x.grad, dres=r.grad, dw=w.grad)
    torch.cuda.synchronize()
    return {k: v.detach() for k, v in out.items()}


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("layout", ["offset", "strided"])
@pytest.mark.parametrize("backend", ["det", "fast"])
def test_misaligned_and_strided_inputs_match_aligned(backend, layout, residual):
    tokens, hidden = 300, 4096
    move = _offset if layout == "offset" else _strided
    x, r, dy, dh = (_x(tokens, hidden, seed=s) for s in (1, 2, 3, 4))
    for w in (_w(hidden), _w(hidden, dtype=BF)):
        rr, dhh = (r, dh) if residual else (None, None)
        want = _train(x, rr, w, dy, dh, backend)
        got = _train(move(x), None if rr is None else move(rr), move(w), move(dy),
                     None if dhh is None else move(dhh), backend)
        for key in want:
            if backend == "det" or key != "dw":
                assert same_bits(got[key].contiguous(), want[key]), f"{layout} {key} differs"
            else:  # fast's dw order may vary between runs
                _close(got[key], want[key], f"{layout} {key}")


@pytest.mark.parametrize("backend", ["det", "fast"])
def test_x_as_its_own_residual(backend):
    tokens, hidden = 300, 4096
    x, dy, dh = _x(tokens, hidden, seed=1), _x(tokens, hidden, seed=3), _x(tokens, hidden, seed=4)
    w = _w(hidden)
    same = x.detach().clone().requires_grad_()
    wg = w.detach().clone().requires_grad_()
    y, h = cake_rmsnorm.rms_norm(same, wg, residual=same, backend=backend)
    torch.autograd.backward([y, h], [dy, dh])
    torch.cuda.synchronize()
    assert same_bits(h, x + x), "h != 2x"
    want = _train(x, x.clone(), w, dy, dh, backend)
    assert same_bits(y, want["y"]) and same_bits(h, want["h"])
    assert same_bits(same.grad, want["dx"] + want["dres"]), "dx of x-as-residual != dx + dres"
    if backend == "det":
        assert same_bits(wg.grad, want["dw"])
    else:
        _close(wg.grad, want["dw"], "dw")


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("wdtype", [F32, BF], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", ["det", "fast"])
def test_empty_tokens(backend, wdtype, residual):
    hidden = 4096
    x = torch.zeros(0, hidden, dtype=BF, device="cuda", requires_grad=True)
    r = torch.zeros(0, hidden, dtype=BF, device="cuda", requires_grad=True) if residual else None
    w = _w(hidden, dtype=wdtype).requires_grad_()
    out = cake_rmsnorm.rms_norm(x, w, residual=r, backend=backend)
    outs = [out] if r is None else list(out)
    assert all(o.shape == (0, hidden) and o.dtype == BF for o in outs)
    sum(o.float().sum() for o in outs).backward()
    torch.cuda.synchronize()
    assert x.grad.shape == (0, hidden)
    assert w.grad.dtype == wdtype and torch.equal(w.grad, torch.zeros_like(w))
    y, rstd = torch.ops.cake_rmsnorm.fwd(x.detach(), w.detach(), 1e-6, backend)
    assert y.shape == (0, hidden) and rstd.shape == (0,)
