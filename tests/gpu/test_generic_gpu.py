"""Generic H on a GPU: widths that are not prebuilt run the generic programs (H at run time), held
to the same contract as the prebuilt ones (cake_rmsnorm.accuracy, DESIGN.md):

- H in {264, 1000, 3000, 12288, 16384}, T in {1, 3, 1025} (and 70000 at H 1000 and 3000), FP32 and
  BF16 weight, with and without residual, det and fast: rstd, y, dx within tolerance of the FP64
  reference; every dw element within the budget (atol 1e-4 + rtol 1e-4) of the FP64 chunked
  reference, worst at most a quarter of it; det's bits identical across two runs; fast runs the same
  deterministic backward (same bits as det).
- det's bits do not depend on the grid: grid_cap 0 (all SMs) against about half the SMs and 7.
- The generic backward sums dw in det's canonical FP64 order: at a prebuilt width where det routes a
  fp64_fold program (det_pair_c64, the FP64 column task; H 4096 if it does there), the generic
  library called directly gives det's dw bits.
- eager, the custom ops and torch.compile(fullgraph=True) agree bitwise at a generic H.
"""

import pytest

torch = pytest.importorskip("torch")

import cake_rmsnorm  # noqa: E402
from cake_rmsnorm import accuracy, ops  # noqa: E402
from cake_rmsnorm.accuracy import same_bits  # noqa: E402
import op_runs  # noqa: E402  (tests/gpu/op_runs.py)
from cake_rmsnorm.registry import load_registry  # noqa: E402
from cake_rmsnorm.runtime import device, loader  # noqa: E402

pytestmark = pytest.mark.gpu

REG = load_registry()
EPS = 1e-6
DW_WORST = 0.25  # of the dw budget
CASES = [(h, t) for h in (264, 1000, 3000, 12288, 16384) for t in (1, 3, 1025)]
CASES += [(1000, 70000), (3000, 70000)]


def _inputs(hidden: int, tokens: int):
    return op_runs.inputs(hidden, tokens, salt=17)


_run = op_runs.run


def _arch() -> str:
    return device.device_info(torch.cuda.current_device()).arch.name


@pytest.mark.parametrize("hidden,tokens", CASES)
def test_generic_accuracy_and_det_bits(hidden, tokens):
    arch = _arch()
    for direction in ("fwd", "bwd"):
        for backend in ("det", "fast"):
            assert REG.route(arch, backend, direction, hidden, tokens).library.generic
    inp = _inputs(hidden, tokens)
    x, dy = inp["x"], inp["dy"]
    fails = []
    for residual, r, dh, xn, wname, w in op_runs.cases(inp):
        runs = {}
        for backend in ("det", "fast"):
            case = f"{backend} {wname} weight{' +residual' if residual else ''}"
            out = runs[backend] = _run(x, r, w, dy, dh, backend)
            if residual and not same_bits(out["h"], xn):
                fails.append(f"{case}: h != bf16(x + residual)")
            m = accuracy.measure(xn, w, dy, dh, out, EPS)
            # a BF16 dw is stored in bf16: its own rounding (up to 2^-8 |ref|, inside the
            # contract, accuracy.py) takes it near 1.0 whatever the sum's accuracy
            limit = DW_WORST if w.dtype == torch.float32 else 1.0
            fails += [f"{case}: {f}" for f in m.failures(dw_ratio_limit=limit)]
        again = _run(x, r, w, dy, dh, "det")
        for key in ("y", "rstd", "dx", "dw"):
            if not same_bits(runs["det"][key], again[key]):
                fails.append(f"det {wname} res={residual}: {key} differs between two runs")
            if not same_bits(runs["det"][key], runs["fast"][key]):
                fails.append(f"{wname} res={residual}: fast's {key} differs from det's (both "
                             f"run the generic programs)")
        del runs, again
    assert not fails, f"H={hidden} T={tokens}:\n  " + "\n  ".join(fails)


@pytest.mark.parametrize("hidden,tokens", [(264, 4097), (3000, 4097), (16384, 4097), (1000, 70000)])
def test_generic_det_bits_do_not_depend_on_the_grid(hidden, tokens):
    inp = _inputs(hidden, tokens)
    half = torch.cuda.get_device_properties(inp["x"].device).multi_processor_count // 2
    for wname, w in inp["w"].items():
        for r, dh in ((None, None), (inp["r"], inp["dh"])):
            base = _run(inp["x"], r, w, inp["dy"], dh, "det")
            try:
                for cap in (half, 7):
                    ops.set_grid_cap(cap)
                    capped = _run(inp["x"], r, w, inp["dy"], dh, "det")
                    for key in ("dx", "dw"):
                        assert same_bits(base[key], capped[key]), \
                            f"H={hidden} T={tokens} {wname}: grid_cap={cap} changed det's {key}"
            finally:
                ops.set_grid_cap(0)


@pytest.mark.parametrize("tokens", [257, 4096, 4097])
@pytest.mark.parametrize("wname", ["fp32", "bf16"])
def test_generic_dw_has_det_fp64_bits_at_a_prebuilt_width(tokens, wname):
    arch = REG.arch(_arch())
    # H 4096 first, else the first prebuilt width whose det route at this T sums in FP64
    fp64 = [h for h in sorted(REG.widths, key=lambda h: h != 4096)
            if REG.route(arch.name, "det", "bwd", h, tokens, wname, False).program.reduction == "fp64_fold"]
    if not fp64:
        pytest.skip(f"no prebuilt width's det route sums dw in FP64 at T {tokens}")
    hidden = fp64[0]
    route = REG.route(arch.name, "det", "bwd", hidden, tokens, wname, False)
    inp = _inputs(hidden, tokens)
    w = inp["w"][wname]
    want = _run(inp["x"], None, w, inp["dy"], None, "det")
    generic = next(lib for lib in REG.generic_libraries(arch.name) if lib.program.direction == "bwd"
                   and lib.weight_dtype == wname and not lib.residual)
    lib = loader.load_library(arch, generic).at(hidden)
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    x, dy, rstd = inp["x"], inp["dy"], want["rstd"]
    ws = lib.bwd_workspace_bytes(tokens, sm)
    workspace = torch.empty(max(ws, 1), dtype=torch.uint8, device="cuda")
    dx, dw = torch.empty_like(x), torch.empty_like(w)
    stream = torch.cuda.current_stream().cuda_stream
    lib.bwd(dy.data_ptr(), 0, x.data_ptr(), w.data_ptr(), rstd.data_ptr(), dx.data_ptr(),
            dw.data_ptr(), workspace.data_ptr(), ws, tokens, 0, stream)
    torch.cuda.synchronize()
    assert same_bits(dw, want["dw"]), f"generic dw differs from {route.program.name}'s"
    m = accuracy.measure(x, w, dy, None, dict(rstd=rstd, dx=dx), EPS)
    assert not m.failures(), m.failures()


@pytest.mark.parametrize("residual", [False, True])
def test_generic_eager_custom_ops_and_compile_agree(residual, monkeypatch):
    hidden, tokens = 3000, 333
    inp = _inputs(hidden, tokens)
    r, dh = (inp["r"], inp["dh"]) if residual else (None, None)

    def step(x, w, rr):
        out = cake_rmsnorm.rms_norm(x, w, residual=rr, backend="det")
        outs = [out] if rr is None else list(out)
        return outs

    got = {}
    for mode in ("eager", "custom_op", "compile"):
        monkeypatch.setattr(ops, "EAGER_FAST_PATH", mode == "eager")
        x = inp["x"].clone().requires_grad_()
        w = inp["w"]["fp32"].clone().requires_grad_()
        rr = None if r is None else r.clone().requires_grad_()
        if mode == "compile":
            torch._dynamo.reset()
            outs = torch.compile(step, fullgraph=True)(x, w, rr)
        else:
            outs = step(x, w, rr)
        torch.autograd.backward(outs, [inp["dy"]] if r is None else [inp["dy"], dh])
        got[mode] = [o.detach() for o in outs] + [x.grad, w.grad]
    torch._dynamo.reset()
    for mode in ("custom_op", "compile"):
        for a, b in zip(got["eager"], got[mode]):
            assert same_bits(a, b), f"{mode} differs from eager"
