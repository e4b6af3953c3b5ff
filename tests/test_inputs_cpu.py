"""Input checks without a GPU: every bad argument raises a ValueError/TypeError (RuntimeError for
backend='fast' in deterministic mode) naming the argument, before anything is routed, loaded or
launched, and leaves the inputs as they were. The device check comes last, so CPU tensors reach
every other check; device mismatches use FakeTensorMode's pretend CUDA tensors."""

import ctypes
import hashlib
import math

import pytest

torch = pytest.importorskip("torch")
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from cake_rmsnorm import checks, ops  # noqa: E402

BF, F32 = torch.bfloat16, torch.float32
T, H = 4, 256
WIDTHS = ", ".join(map(str, checks.WIDTHS))


@pytest.fixture(autouse=True)
def no_launch(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("routed or launched despite bad input")
    monkeypatch.setattr(ops, "_library", boom)


def _digest(t) -> str:
    if not isinstance(t, torch.Tensor) or t.device.type == "meta" or t.numel() == 0:
        return repr(t)
    t = t.detach().cpu().contiguous()
    return hashlib.sha256(ctypes.string_at(t.data_ptr(), t.nbytes)).hexdigest()


def _x(*shape, dtype=BF):
    return torch.randn(*(shape or (T, H))).to(dtype)


def _w(n=H, dtype=F32):
    return (1 + 0.1 * torch.randn(n)).to(dtype)


# (id, kwargs for rms_norm, exception, message regex)
CASES = [
    ("x_not_tensor", lambda: dict(x=[1.0], weight=_w()), TypeError,
     r"x must be a torch.Tensor, got list"),
    ("x_fp32", lambda: dict(x=_x(dtype=F32), weight=_w()), TypeError,
     r"x has dtype torch.float32; cake_rmsnorm accepts torch.bfloat16 x only"),
    ("x_fp16", lambda: dict(x=_x(dtype=torch.float16), weight=_w()), TypeError,
     r"x has dtype torch.float16"),
    ("x_0d", lambda: dict(x=torch.zeros((), dtype=BF), weight=_w()), ValueError,
     r"x must have at least one dimension"),
    ("H_not_multiple_of_8", lambda: dict(x=_x(T, 260), weight=_w(260)), ValueError,
     rf"H=260 \(shape \(4, 260\)\); H must be a multiple of 8 from 8 to 16384; the prebuilt "
     rf"widths {WIDTHS} are the fast ones"),
    ("H_above_generic_max", lambda: dict(x=_x(T, 16392), weight=_w(16392)), ValueError,
     rf"H=16392 \(shape \(4, 16392\)\); H must be a multiple of 8 from 8 to 16384; the prebuilt "
     rf"widths {WIDTHS} are the fast ones, any other runs the generic program"),
    ("H_zero", lambda: dict(x=_x(T, 0), weight=_w(0)), ValueError,
     r"H=0 \(shape \(4, 0\)\); H must be a multiple of 8 from 8 to 16384"),
    ("weight_not_tensor", lambda: dict(x=_x(), weight=1.0), TypeError,
     r"weight must be a torch.Tensor, got float"),
    ("weight_fp16", lambda: dict(x=_x(), weight=_w(dtype=torch.float16)), TypeError,
     r"weight has dtype torch.float16; accepted: torch.float32, torch.bfloat16"),
    ("weight_fp64", lambda: dict(x=_x(), weight=_w(dtype=torch.float64)), TypeError,
     r"weight has dtype torch.float64"),
    ("weight_shape", lambda: dict(x=_x(), weight=_w(128)), ValueError,
     r"weight has shape \(128,\); expected \(256,\)"),
    ("weight_2d", lambda: dict(x=_x(), weight=_w().view(1, H)), ValueError,
     r"weight has shape \(1, 256\); expected \(256,\)"),
    ("residual_shape", lambda: dict(x=_x(), weight=_w(), residual=_x(3, H)), ValueError,
     r"residual has shape \(3, 256\); expected x's shape \(4, 256\)"),
    ("residual_dtype", lambda: dict(x=_x(), weight=_w(), residual=_x(dtype=F32)), TypeError,
     r"residual has dtype torch.float32; expected x's dtype torch.bfloat16"),
    ("residual_not_tensor", lambda: dict(x=_x(), weight=_w(), residual=1.0), TypeError,
     r"residual must be a torch.Tensor or None, got float"),
    ("eps_zero", lambda: dict(x=_x(), weight=_w(), eps=0.0), ValueError,
     r"eps must be a finite float > 0 .* got 0.0"),
    ("eps_negative", lambda: dict(x=_x(), weight=_w(), eps=-1e-6), ValueError,
     r"eps must be a finite float > 0 .* got -1e-06"),
    ("eps_nan", lambda: dict(x=_x(), weight=_w(), eps=math.nan), ValueError, r"got nan"),
    ("eps_inf", lambda: dict(x=_x(), weight=_w(), eps=math.inf), ValueError, r"got inf"),
    ("eps_float32_underflow", lambda: dict(x=_x(), weight=_w(), eps=1e-50), ValueError,
     r"float32's range.* got 1e-50"),
    ("eps_float32_overflow", lambda: dict(x=_x(), weight=_w(), eps=1e39), ValueError,
     r"float32's range.* got 1e\+39"),
    ("eps_bool", lambda: dict(x=_x(), weight=_w(), eps=True), TypeError,
     r"eps must be a finite float > 0, got bool True"),
    ("eps_str", lambda: dict(x=_x(), weight=_w(), eps="1e-6"), TypeError,
     r"eps must be a finite float > 0, got str '1e-6'"),
    ("backend_unknown", lambda: dict(x=_x(), weight=_w(), backend="turbo"), ValueError,
     r"backend 'turbo' is not one of 'det', 'fast'|backend 'turbo' is not one of"),
    ("backend_not_str", lambda: dict(x=_x(), weight=_w(), backend=1), ValueError,
     r"backend 1 is not one of"),
    ("x_on_cpu", lambda: dict(x=_x(), weight=_w()), ValueError,
     r"x is on device cpu; cake_rmsnorm runs on CUDA devices only"),
]


@pytest.mark.parametrize("name,make,exc,pattern", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_before_anything_and_touches_nothing(name, make, exc, pattern):
    kwargs = make()
    before = {k: _digest(v) for k, v in kwargs.items()}
    with pytest.raises(exc, match=pattern):
        ops.rms_norm(**kwargs)
    assert {k: _digest(v) for k, v in kwargs.items()} == before


def test_eps_accepts_ints_and_small_finite_floats():
    for eps in (1, 1e-6, 1e-12, 2.0 ** -149, 3e38):
        checks.check_eps(eps)


# ---- device mismatches, on FakeTensorMode's pretend CUDA tensors --------------------------------
DEVICE_CASES = [
    ("weight_on_cpu", dict(weight="cpu"), r"weight is on cpu, x on cuda:0: they must share"),
    ("weight_other_gpu", dict(weight="cuda:1"), r"weight is on cuda:1, x on cuda:0"),
    ("residual_on_cpu", dict(residual="cpu"), r"residual is on cpu, x on cuda:0"),
    ("residual_other_gpu", dict(residual="cuda:1"), r"residual is on cuda:1, x on cuda:0"),
    ("x_on_meta", dict(x="meta", weight="meta"), r"x is on device meta; cake_rmsnorm runs on CUDA"),
]


@pytest.mark.parametrize("name,devices,pattern", DEVICE_CASES, ids=[c[0] for c in DEVICE_CASES])
def test_device_mismatch(name, devices, pattern):
    dev = dict(dict(x="cuda:0", weight="cuda:0", residual="cuda:0"), **devices)
    cpu = {k: d for k, d in dev.items() if d == "cpu"}
    made = {k: (_w() if k == "weight" else _x()) for k in cpu}
    with FakeTensorMode(allow_non_fake_inputs=True):
        for k, d in dev.items():
            if d != "cpu":
                made[k] = torch.empty((H,) if k == "weight" else (T, H),
                                      dtype=F32 if k == "weight" else BF, device=d)
        with pytest.raises(ValueError, match=pattern):
            ops.rms_norm(made["x"], made["weight"], residual=made["residual"])


def test_good_input_on_pretend_cuda_passes_the_checks():
    with FakeTensorMode():
        x = torch.empty(2, 3, H, dtype=BF, device="cuda")
        w = torch.empty(H, device="cuda")
        checks.check_args(x, w, x, 1e-6)
        y, h = ops.rms_norm(x, w, residual=x)  # FakeTensorMode: the custom ops' fake impls
        assert y.shape == h.shape == x.shape and y.device.type == "cuda"


# ---- the custom ops' own guard (they can be called directly) -------------------------------------
OP_CASES = [
    ("fwd_eps_zero", lambda: torch.ops.cake_rmsnorm.fwd(_x(), _w(), 0.0, "det"), ValueError,
     r"eps must be a finite float > 0"),
    ("fwd_eps_nan", lambda: torch.ops.cake_rmsnorm.fwd(_x(), _w(), math.nan, "det"), ValueError,
     r"eps must be"),
    ("fwd_H_above_generic_max",
     lambda: torch.ops.cake_rmsnorm.fwd(_x(T, 16392), _w(16392), 1e-6, "det"),
     ValueError, r"H=16392 .*H must be a multiple of 8 from 8 to 16384"),
    ("fwd_H_not_multiple_of_8",
     lambda: torch.ops.cake_rmsnorm.fwd(_x(T, 260), _w(260), 1e-6, "det"), ValueError,
     r"H must be a multiple of 8"),
    ("fwd_backend", lambda: torch.ops.cake_rmsnorm.fwd(_x(), _w(), 1e-6, "turbo"), ValueError,
     r"backend 'turbo'"),
    ("fwd_x_fp32", lambda: torch.ops.cake_rmsnorm.fwd(_x(dtype=F32), _w(), 1e-6, "det"),
     ValueError, r"cake_rmsnorm ops take .* got x torch.float32"),
    ("fwd_x_3d", lambda: torch.ops.cake_rmsnorm.fwd(_x(1, T, H), _w(), 1e-6, "det"), ValueError,
     r"cake_rmsnorm ops take x, residual, dy as \[T, H\]"),
    ("fwd_residual_shape",
     lambda: torch.ops.cake_rmsnorm.fwd_residual(_x(), _x(2, H), _w(), 1e-6, "det"), ValueError,
     r"cake_rmsnorm ops take"),
    ("bwd_backend",
     lambda: torch.ops.cake_rmsnorm.bwd(_x(), None, _x(), _w(), torch.ones(T), "turbo", False),
     ValueError, r"backend 'turbo'"),
    ("bwd_rstd", lambda: torch.ops.cake_rmsnorm.bwd(_x(), None, _x(), _w(), torch.ones(3), "det",
                                                    False), ValueError, r"rstd must be"),
    ("fwd_on_cpu", lambda: torch.ops.cake_rmsnorm.fwd(_x(), _w(), 1e-6, "det"), ValueError,
     r"x is on device cpu"),
]


@pytest.mark.parametrize("name,call,exc,pattern", OP_CASES, ids=[c[0] for c in OP_CASES])
def test_custom_ops_guard(name, call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()


# ---- backend='fast' under torch.use_deterministic_algorithms ------------------------------------
@pytest.fixture
def deterministic():
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled())

    def set_mode(on: bool, warn_only: bool = False) -> None:
        torch.use_deterministic_algorithms(on, warn_only=warn_only)
    yield set_mode
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def test_fast_in_deterministic_mode_raises_like_torch(deterministic):
    deterministic(True)
    with pytest.raises(RuntimeError) as err:
        ops.rms_norm(_x(), _w(), backend="fast")
    msg = str(err.value)
    assert msg.startswith("cake_rmsnorm.rms_norm(backend='fast') does not have a deterministic "
                          "implementation, but you set 'torch.use_deterministic_algorithms(True)'")
    assert "warn_only=True" in msg and "backend='det'" in msg and "backend=None" in msg
    # backend=None and "det" still choose det; the CPU tensor then fails the device check
    assert ops.resolve_backend(None) == "det" and ops.resolve_backend("det") == "det"
    with pytest.raises(ValueError, match="x is on device cpu"):
        ops.rms_norm(_x(), _w())


def test_fast_in_warn_only_mode_warns_and_resolves_fast(deterministic):
    deterministic(True, warn_only=True)
    with pytest.warns(UserWarning, match=r"backend='fast'\) does not have a deterministic"):
        assert ops.resolve_backend("fast") == "fast"
    deterministic(False)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ops.resolve_backend("fast") == "fast"


@pytest.mark.parametrize("eps", [0.0, -1e-6, float("nan")])
def test_module_refuses_bad_eps_when_built(eps):
    import cake_rmsnorm
    with pytest.raises(ValueError, match="eps must be a finite float > 0"):
        cake_rmsnorm.RMSNorm(4096, eps=eps)
