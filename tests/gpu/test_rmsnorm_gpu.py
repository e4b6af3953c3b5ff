"""The op on a GPU against an FP64 reference: every prebuilt width, T in {1, 7, 128, 4096, 65536},
FP32 and BF16 weight, with and without residual, det and fast; det's bits across runs and grid
caps (and in both of sm_103a's det column-task windows, through this GPU's routes at those T);
torch.compile(fullgraph=True) and CUDA-graph replay against eager; import hygiene.
Tolerances: cake_rmsnorm.accuracy (the numerical contract of DESIGN.md).
"""

import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

import cake_rmsnorm  # noqa: E402
from cake_rmsnorm import accuracy, ops  # noqa: E402
from cake_rmsnorm.accuracy import same_bits  # noqa: E402
import op_runs  # noqa: E402  (tests/gpu/op_runs.py)
from cake_rmsnorm.registry import load_registry  # noqa: E402

pytestmark = pytest.mark.gpu

WIDTHS = load_registry().widths
TOKENS = (1, 7, 128, 4096, 65536)
EPS = 1e-6
WDTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _inputs(hidden: int, tokens: int):
    return op_runs.inputs(hidden, tokens, salt=0)


_run = op_runs.run


# Measured ratios of every checked case; written as JSON to $CAKE_RMSNORM_ACCURACY_LOG if set,
# so a GPU run can report its figures (worst error / tolerance), not only pass or fail.
MEASURED = []


@pytest.fixture(scope="module", autouse=True)
def _write_measured():
    yield
    path = os.environ.get("CAKE_RMSNORM_ACCURACY_LOG")
    if path and MEASURED:
        import json
        with open(path, "w") as fh:
            json.dump(MEASURED, fh, indent=1)


def _check(xn, w, dy, dh, out, case="") -> list:
    """Compare one run with the FP64 reference, in row chunks; return the failures."""
    m = accuracy.measure(xn, w, dy, dh, out, EPS)
    MEASURED.append(dict(case=case, H=xn.shape[1], T=xn.shape[0], **m.as_dict()))
    return m.failures()


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("hidden", WIDTHS)
def test_accuracy_and_det_bits(hidden, tokens):
    inp = _inputs(hidden, tokens)
    x, dy = inp["x"], inp["dy"]
    fails = []
    for residual, r, dh, xn, wname, w in op_runs.cases(inp):
        for backend in ("det", "fast"):
            case = f"{backend} {wname} weight{' +residual' if residual else ''}"
            out = _run(x, r, w, dy, dh, backend)
            if residual and not same_bits(out["h"], xn):
                fails.append(f"{case}: h != bf16(x + residual)")
            fails += [f"{case}: {f}" for f in _check(xn, w, dy, dh, out, case)]
            if backend == "det":
                again = _run(x, r, w, dy, dh, backend)
                for key in ("y", "rstd", "dx", "dw"):
                    if not same_bits(out[key], again[key]):
                        fails.append(f"{case}: {key} differs bitwise between two runs")
            del out
    assert not fails, f"H={hidden} T={tokens}:\n  " + "\n  ".join(fails)


@pytest.mark.parametrize("tokens", [4096, 65537])
@pytest.mark.parametrize("hidden", WIDTHS)
def test_det_bits_do_not_depend_on_grid_cap(hidden, tokens):
    """All SMs (cap 0) against about half of them, and two small caps."""
    inp = _inputs(hidden, tokens)
    w = inp["w"]["fp32"]
    base = _run(inp["x"], None, w, inp["dy"], None, "det")
    half = torch.cuda.get_device_properties(inp["x"].device).multi_processor_count // 2
    try:
        for cap in (1, 7, half):
            ops.set_grid_cap(cap)
            capped = _run(inp["x"], None, w, inp["dy"], None, "det")
            assert same_bits(base["dx"], capped["dx"]) and same_bits(base["dw"], capped["dw"]), \
                f"grid_cap={cap} changed det's bits"
    finally:
        ops.set_grid_cap(0)


def _fixed64_point():
    """The first (hidden, tokens) whose det backward route on this GPU sums dw in 64-bit fixed point
    (reduction fixed64), or None."""
    from cake_rmsnorm.runtime import device

    reg = load_registry()
    arch = device.device_info(torch.cuda.current_device()).arch.name
    for tokens in (4097, 16385, 65537):
        for hidden in WIDTHS:
            if reg.route(arch, "det", "bwd", hidden, tokens, "fp32", False).program.reduction == "fixed64":
                return hidden, tokens
    return None


@pytest.mark.parametrize("scale", [1.0, 2.0 ** 16], ids=["in_range", "out_of_range"])
def test_det_fixed_point_dw_in_and_out_of_its_range(scale):
    """fixed64 programs (bwd_single.cuh): with randn dy the 64-bit sums hold every term; with dy
    scaled by 2^16 (T·max|term|·2^34 past 2^62) det's FP64 column tasks write dw instead. Both:
    inside the dw budget, and det's bits across runs and grid caps."""
    point = _fixed64_point()
    if point is None:
        pytest.skip("no det route on this GPU runs a fixed64 program at T 4097-65537")
    hidden, tokens = point
    inp = _inputs(hidden, tokens)
    x, w = inp["x"], inp["w"]["fp32"]
    dy = (inp["dy"].float() * scale).bfloat16()
    base = _run(x, None, w, dy, None, "det")
    # the case is what its id says: T·(max|dy·x·rstd|·2^34 + 1) past 2^62 exactly when scaled
    biggest = max(float((dy[i:i + 4096].float() * x[i:i + 4096].float()).double().abs()
                        .mul(base["rstd"][i:i + 4096].double()[:, None]).max())
                  for i in range(0, tokens, 4096))
    assert (tokens * (biggest * 2.0 ** 34 + 1) > 2.0 ** 62) == (scale > 1), (tokens, biggest, scale)
    fails = _check(x, w, dy, None, base, f"det fixed64 dy x{scale:g}")
    runs = [_run(x, None, w, dy, None, "det")]
    try:
        for cap in (7, torch.cuda.get_device_properties(x.device).multi_processor_count // 2):
            ops.set_grid_cap(cap)
            runs.append(_run(x, None, w, dy, None, "det"))
    finally:
        ops.set_grid_cap(0)
    for other in runs:
        if not (same_bits(base["dx"], other["dx"]) and same_bits(base["dw"], other["dw"])):
            fails.append("det bits differ between runs or grid caps")
    assert not fails, f"H={hidden} T={tokens} dy x{scale:g}:\n  " + "\n  ".join(fails)


def test_public_api_shapes_strides_and_empty():
    hidden = 2048
    inp = _inputs(hidden, 24)
    w = inp["w"]["fp32"]
    y2 = cake_rmsnorm.rms_norm(inp["x"], w, backend="det")
    y3 = cake_rmsnorm.rms_norm(inp["x"].view(2, 3, 4, hidden), w, backend="det")
    assert y3.shape == (2, 3, 4, hidden) and same_bits(y3.reshape(24, hidden), y2)
    strided = inp["x"].t().contiguous().t()  # same values, column-major
    assert not strided.is_contiguous()
    assert same_bits(cake_rmsnorm.rms_norm(strided, w, backend="det"), y2)
    y, h = cake_rmsnorm.rms_norm(inp["x"], w, residual=inp["r"])
    assert same_bits(h, inp["x"] + inp["r"])
    empty = torch.zeros(0, 5, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    wg = w.detach().requires_grad_()
    out = cake_rmsnorm.rms_norm(empty, wg)
    assert out.shape == empty.shape
    out.sum().backward()
    assert torch.equal(wg.grad, torch.zeros_like(w)) and empty.grad.shape == empty.shape


def _eager_paths():
    """The op's paths to compare: the custom ops, the Python eager path, and the native C++ step
    where it is in use here."""
    from cake_rmsnorm.runtime import native
    native.reset()
    return ["custom_op", "python"] + (["native"] if native.step_op() is not None else [])


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("backend", ["det", "fast"])
def test_eager_paths_match_the_custom_ops_bitwise(backend, residual, monkeypatch):
    """The same libraries run on every path: y, h and dx bitwise equal; dw too for det (fast's dw
    combine order is free)."""
    from cake_rmsnorm.runtime import native
    inp = _inputs(4096, 300)
    r, dh = (inp["r"], inp["dh"]) if residual else (None, None)
    got = {}
    step = native.status().op
    for path in _eager_paths():
        monkeypatch.setattr(ops, "EAGER_FAST_PATH", path != "custom_op")
        monkeypatch.setattr(native, "step_op", lambda op=step if path == "native" else None: op)
        x = inp["x"].clone().requires_grad_()
        w = inp["w"]["fp32"].clone().requires_grad_()
        rr = None if r is None else r.clone().requires_grad_()
        out = cake_rmsnorm.rms_norm(x, w, residual=rr, backend=backend)
        outs, grads = ([out], [inp["dy"]]) if r is None else (list(out), [inp["dy"], dh])
        torch.autograd.backward(outs, grads)
        got[path] = [o.detach() for o in outs] + [x.grad] + ([w.grad] if backend == "det" else [])
        if rr is not None:
            assert same_bits(rr.grad, x.grad), path
    for path, tensors in got.items():
        for i, (a, b) in enumerate(zip(tensors, got["custom_op"])):
            assert same_bits(a, b), f"{path}: output {i} differs from the custom ops'"


def test_native_step_is_in_use_where_installed():
    """An installed native wheel built for this torch must load (else the op would silently run
    its slower Python path)."""
    import importlib.util
    from cake_rmsnorm.runtime import native
    if importlib.util.find_spec(native.PACKAGE) is None:
        pytest.skip(f"{native.PACKAGE} is not installed")
    native.reset()
    status = native.status()
    import cake_rmsnorm_native
    if cake_rmsnorm_native.TORCH_VERSION != native.public_version(torch.__version__):
        pytest.skip(status.detail)
    assert status.op is not None, status.detail


class _Net(torch.nn.Module):
    def __init__(self, hidden: int, backend: str, wdtype: torch.dtype, residual: bool) -> None:
        super().__init__()
        kw = dict(device="cuda", dtype=torch.bfloat16)
        self.a = torch.nn.Linear(64, hidden, **kw)
        self.a2 = torch.nn.Linear(64, hidden, **kw) if residual else None
        self.norm = cake_rmsnorm.RMSNorm(hidden, device="cuda", dtype=wdtype, backend=backend)
        with torch.no_grad():
            self.norm.weight.add_(0.1 * torch.randn_like(self.norm.weight))
        self.b = torch.nn.Linear(hidden, 64, **kw)

    def forward(self, x):
        if self.a2 is None:
            return self.b(self.norm(self.a(x)))
        y, h = self.norm(self.a(x), residual=self.a2(x))
        return self.b(y) + self.b(h)


def _step(model, x, target):
    loss = (model(x).float() * target).sum()
    loss.backward()
    return loss


MODEL_CASES = [("det", torch.float32, False), ("fast", torch.bfloat16, True)]


def _model_and_data(backend, wdtype, residual):
    torch.manual_seed(0)
    model = _Net(4096, backend, wdtype, residual)
    x = torch.randn(4, 128, 64, device="cuda", dtype=torch.bfloat16)
    target = torch.randn(4, 128, 64, device="cuda")
    return model, x, target


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _assert_grads_close(got, want, exact_norm: bool):
    assert got.keys() == want.keys()
    for name in want:
        if exact_norm and name == "norm.weight":
            assert same_bits(got[name], want[name]), f"{name}: det grad not bitwise equal"
        scale = want[name].abs().max().item()
        torch.testing.assert_close(got[name], want[name], rtol=1e-2, atol=1e-2 * scale,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("backend,wdtype,residual", MODEL_CASES)
def test_model_step_under_torch_compile(backend, wdtype, residual):
    model, x, target = _model_and_data(backend, wdtype, residual)
    _step(model, x, target)
    eager = _grads(model)
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    loss = (compiled(x).float() * target).sum()
    loss.backward()
    _assert_grads_close(_grads(model), eager, exact_norm=False)


@pytest.mark.parametrize("backend,wdtype,residual", MODEL_CASES)
def test_model_step_under_cuda_graph_replay(backend, wdtype, residual):
    model, x, target = _model_and_data(backend, wdtype, residual)
    static_x, static_t = x.clone(), target.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up: loads the libraries, fills the allocator
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            _step(model, static_x, static_t)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    model.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        _step(model, static_x, static_t)
    new_x = torch.randn_like(x)
    static_x.copy_(new_x)
    graph.replay()
    torch.cuda.synchronize()
    replayed = _grads(model)
    model.zero_grad(set_to_none=True)
    _step(model, new_x, target)
    _assert_grads_close(replayed, _grads(model), exact_norm=False)


def test_norm_alone_under_cuda_graph_is_bitwise_eager():
    inp = _inputs(4096, 4096)
    x = inp["x"].clone().requires_grad_()
    w = inp["w"]["fp32"].clone().requires_grad_()
    dy = inp["dy"].clone()

    def step():
        y = cake_rmsnorm.rms_norm(x, w, backend="det")
        y.backward(dy)
        # Detached: a captured y would keep its autograd graph (and the leaves' AccumulateGrad
        # nodes, made on the capture stream) alive into the eager step below, which torch warns of.
        return y.detach()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    x.grad = w.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_static = step()
    with torch.no_grad():
        x.copy_(x * 1.5)
    graph.replay()
    torch.cuda.synchronize()
    got = (y_static.clone(), x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    want = (step(), x.grad, w.grad)
    for name, a, b in zip(("y", "dx", "dw"), got, want):
        assert same_bits(a, b), f"{name}: graph replay differs from eager"


def test_import_creates_no_cuda_context_and_first_use_loads():
    reg = load_registry()
    names = sorted({lib.filename for a in reg.archs for lib in reg.libraries(a.name)})
    code = textwrap.dedent(f"""
        import torch, cake_rmsnorm
        cake_rmsnorm.rms_norm, cake_rmsnorm.RMSNorm
        before = torch.cuda.is_initialized()
        mapped = lambda: sum(n in open('/proc/self/maps').read() for n in {names!r})
        n0 = mapped()
        x = torch.randn(8, 256, device='cuda', dtype=torch.bfloat16)
        cake_rmsnorm.rms_norm(x, torch.ones(256, device='cuda'))
        torch.cuda.synchronize()
        print(before, n0, mapped())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ), timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "0", "1"]  # the one forward library, on first use


@pytest.mark.parametrize("window", ["D2", "D3"])
def test_det_repeats_bit_for_bit_in_both_column_task_windows(window):
    """sm_103a's two det column-task windows at H 2048 (WINDOWS.md D2, D3), at their ends, through
    this GPU's routes: two runs and two grid caps give the same dx and dw bits."""
    from windows_spec import load_windows

    spec = next(s for s in load_windows(load_registry()) if s.id == window)
    for tokens in (spec.first, spec.last):
        inp = _inputs(2048, tokens)
        for wname, w in inp["w"].items():
            base = _run(inp["x"], None, w, inp["dy"], None, "det")
            runs = [_run(inp["x"], None, w, inp["dy"], None, "det")]
            try:
                ops.set_grid_cap(7)
                runs.append(_run(inp["x"], None, w, inp["dy"], None, "det"))
            finally:
                ops.set_grid_cap(0)
            for other in runs:
                assert same_bits(base["dx"], other["dx"]) and same_bits(base["dw"], other["dw"]), \
                    f"{window} T {tokens} {wname}: det bits differ"
