"""cake_rmsnorm.accuracy on CPU tensors: the reference and the budget checks the GPU tests rely on."""

import pytest

torch = pytest.importorskip("torch")

from cake_rmsnorm import accuracy  # noqa: E402

EPS = 1e-6


def _case(tokens=64, hidden=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).bfloat16()
    dy = torch.randn(tokens, hidden, generator=g).bfloat16()
    w = 1 + 0.1 * torch.randn(hidden, generator=g)
    rstd = torch.rsqrt(x.double().pow(2).mean(1) + EPS).float()
    return x, dy, w, rstd


def _exact_outputs(x, dy, w, rstd):
    xhat = x.double() * rstd.double()[:, None]
    g = dy.double() * w.double()
    dx = rstd.double()[:, None] * (g - xhat * (g * xhat).mean(1, keepdim=True))
    return dict(y=(xhat * w.double()).bfloat16(), rstd=rstd, dx=dx.bfloat16(),
                dw=accuracy.reference_dw(x, dy, rstd).float())


def test_exact_outputs_pass_with_margin():
    x, dy, w, rstd = _case()
    m = accuracy.measure(x, w, dy, None, _exact_outputs(x, dy, w, rstd), EPS)
    assert m.failures() == []
    assert m.y_ratio <= 0.5 and m.dx_ratio <= 0.5 and m.dw_ratio < 1e-2 and m.dw_rel < 1e-6


def test_one_dw_element_over_the_budget_is_named():
    x, dy, w, rstd = _case()
    out = _exact_outputs(x, dy, w, rstd)
    ref = accuracy.reference_dw(x, dy, rstd)
    out["dw"][17] += 3 * (1e-4 + 1e-4 * abs(ref[17].item()))
    m = accuracy.measure(x, w, dy, None, out, EPS)
    assert 2.5 < m.dw_ratio < 3.5
    assert any("dw[17]" in f for f in m.failures())
    assert m.failures(dw_ratio_limit=4.0) == []


def test_chunked_reference_equals_the_whole_sum(monkeypatch):
    x, dy, w, rstd = _case(tokens=300)
    whole = accuracy.reference_dw(x, dy, rstd)
    monkeypatch.setattr(accuracy, "CHUNK_ELEMENTS", 256 * 7)  # 7-row chunks
    chunked = accuracy.reference_dw(x, dy, rstd)
    assert torch.allclose(whole, chunked, rtol=1e-13, atol=1e-12)


def test_bad_dx_and_y_are_reported():
    x, dy, w, rstd = _case()
    out = _exact_outputs(x, dy, w, rstd)
    out["dx"] = out["dx"] * 1.05
    out["y"] = out["y"] * 0.9
    fails = accuracy.measure(x, w, dy, None, out, EPS).failures()
    assert any(f.startswith("dx error") for f in fails) and any(f.startswith("y error") for f in fails)


def test_eager_fp32_reduction_is_close_but_not_exact():
    x, dy, w, rstd = _case(tokens=4096)
    ref = accuracy.reference_dw(x, dy, rstd)
    ratio, rel, _ = accuracy.dw_errors(accuracy.eager_fp32_dw(x, dy, rstd), ref)
    assert 0 < rel < 1e-5 and ratio < 1


def test_bf16_dw_is_measured_beyond_its_own_rounding():
    x, dy, w, rstd = _case(tokens=256)
    ref = accuracy.reference_dw(x, dy, rstd)
    rounded = ref.bfloat16()  # the correctly rounded sum: no error beyond bf16's own
    ratio, rel, _ = accuracy.dw_errors(rounded, ref)
    assert ratio == 0 and rel == 0
    # the same values against the old-style relative budget would fail: rounding alone is 2^-9+
    assert ((rounded.double() - ref).abs() / (1e-4 + 1e-4 * ref.abs())).max() > 1
    # 5% off at element 5 (several bf16 ulps, even across a binade): far beyond the rounding
    off = rounded.clone()
    off[5] = (off[5].float() * 1.05).bfloat16()
    ratio, rel, msg = accuracy.dw_errors(off, ref)
    assert ratio > 1 and "dw[5]" in msg and rel > 1e-4 / 256 ** 0.5


def test_bf16_half_ulp():
    v = torch.tensor([0.0, 1.0, 1.5, -3.0, 2.0 ** -20], dtype=torch.float64)
    assert accuracy.bf16_half_ulp(v).tolist() == [0.0, 2.0 ** -8, 2.0 ** -8, 2.0 ** -7, 2.0 ** -28]
