"""Generic H without a GPU: the widths that are not prebuilt (any multiple of 8 up to 16384) run the
generic programs, whose H is a run-time argument.

- registry: one generic library per (arch, direction, weight dtype, residual) in every plan; routes
  of such H (every T, both backends) name them; the data's rules (max_hidden, one per direction).
- build: the generated source (no H in the template, the H-taking exports); (toolchain) every sm_90a
  generic library compiles without spills and its exports answer the ABI's argument checks.
- the op, through host-only stub libraries compiled against abi.h: H reaches cake_fwd_h / cake_bwd_h
  in eager mode, through the custom ops, under torch.compile, with a residual.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

from cake_rmsnorm.build.generate import render_source
from cake_rmsnorm.cli import main
from cake_rmsnorm.errors import BuildError, ProviderError, RegistryError, RouteError
from cake_rmsnorm.registry import (GENERIC_HIDDEN, GENERIC_LABEL, Library, LibraryKey,
                                   build_registry, load_registry)
from cake_rmsnorm.runtime import abi, device, loader

from test_runtime_cpu import HEADER_DIR, _make_provider, pretend_h200

REG = load_registry()
SM90 = REG.arch("sm_90a")
GENERIC_H = (8, 264, 1000, 3000, 12288, 16384)
REFUSED_H = (0, 4, 260, 1004, 16392, 16640)


# ---- registry and plan ---------------------------------------------------------------------------

def test_every_plan_holds_the_eight_generic_libraries(reg):
    assert {d: p.name for d, p in reg.generic.items()} == {"fwd": "fwd_generic",
                                                           "bwd": "bwd_generic_pair"}
    assert reg.max_hidden == 16384
    for arch in reg.arch_names:
        libs = reg.libraries(arch)
        generic = [lib for lib in libs if lib.hidden == GENERIC_HIDDEN]
        assert sorted(lib.name for lib in generic) == sorted(
            f"{p}_hany_{wd}{'_res' if res else ''}" for p in ("fwd_generic", "bwd_generic_pair")
            for wd in ("fp32", "bf16") for res in (False, True))
        assert all(lib.program.runtime_h and lib.generic and not lib.oversized for lib in generic)
        assert all(lib.smem_bytes == lib.program.smem_fixed for lib in generic)
        prebuilt = {lib.name for lib in libs} - {lib.name for lib in generic}
        assert len(libs) == len(prebuilt) + 2 * 2 * 2
        # whatever width subset is asked for, the generic libraries stay in the plan
        assert set(lib.name for lib in generic) <= {lib.name for lib in reg.libraries(arch, [256])}


def test_generic_programs_declare_their_largest_H(reg):
    for program in reg.generic.values():
        params = dict(program.params)
        assert program.max_hidden == params["threads"] * params["vecs_per_thread"] * 8 == 16384
        assert program.deterministic and program.smem_per_h == 0 and program.max_tokens is None
    assert not any(p.max_hidden for p in reg.programs.values() if not p.runtime_h)


@pytest.mark.parametrize("hidden", GENERIC_H)
def test_other_widths_route_to_the_generic_program_at_every_T(reg, hidden):
    for arch in reg.arch_names:
        for direction in ("fwd", "bwd"):
            names = set()
            for backend in ("det", "fast"):
                for tokens in (1, 3, 1025, 70000, 10**7):
                    route = reg.route(arch, backend, direction, hidden, tokens, "bf16", True)
                    assert route.program is reg.generic[direction]
                    assert (route.window.first, route.window.last) == (1, None)
                    assert route.window.label == GENERIC_LABEL
                    assert route.library.hidden == GENERIC_HIDDEN and route.table.hidden == hidden
                    names.add(route.library.name)
            assert names == {f"{reg.generic[direction].name}_hany_bf16_res"}  # det and fast alike


def test_prebuilt_widths_route_as_before(reg):
    for key, windows in reg.tables.items():
        assert not any(w.program.runtime_h for w in windows), key
    route = reg.route("sm_90a", "det", "bwd", 4096, 70000)
    assert not route.library.generic and route.library.hidden == 4096


@pytest.mark.parametrize("hidden", REFUSED_H)
def test_other_H_is_refused_naming_what_is_accepted(reg, hidden):
    assert not reg.accepts_hidden(hidden)
    with pytest.raises(RouteError, match=rf"H={hidden} is not a prebuilt width.*multiple of 8 from "
                                         rf"8 to 16384; the prebuilt widths 256, 1536"):
        reg.route("sm_90a", "det", "bwd", hidden, 10)


GENERIC_FWD = 'kernel = "generic_forward"\nreduction = "fp32"\ndeterministic = true\n'


@pytest.mark.parametrize("old, new, match", [
    ("max_hidden = 16384\nsmem = { fixed = 128", "smem = { fixed = 128",
     r"fwd_generic.*must declare max_hidden"),
    ("max_hidden = 16384\nsmem = { fixed = 128", "max_hidden = 1004\nsmem = { fixed = 128",
     r"fwd_generic.*multiple of 8; got 1004"),
    ("smem = { fixed = 128, per_h = 0 }\nabout = \"any H", "smem = { fixed = 128, per_h = 2 }\n"
     "about = \"any H", r"fwd_generic.*cannot depend on H"),
    ("params = { threads = 256, vecs_per_thread = 8 }",
     "params = { threads = 256, vecs_per_thread = 8 }\nmax_tokens = 100", r"no oversized, fallback"),
    ('reduction = "fp64_fold"\ndeterministic = true\nparams = { threads = 512',
     'reduction = "fp64_fold"\ndeterministic = false\nparams = { threads = 512',
     r"generic program 'bwd_generic_pair' must be deterministic"),
    ('[program.fwd_rows1]\nkernel = "forward"\n', '[program.fwd_rows1]\nkernel = "forward"\n'
     'max_hidden = 4096\n', r"fwd_rows1.*max_hidden is for programs whose kernel takes H at run"),
])
def test_generic_program_data_is_checked(scratch, old, new, match):
    data, edit = scratch
    edit("programs.toml", old, new)
    with pytest.raises(RegistryError, match=match):
        build_registry(data)


def test_exactly_one_generic_program_per_direction(scratch):
    data, edit = scratch
    path = data / "programs.toml"
    path.write_text(path.read_text() + "\n[program.fwd_generic_copy]\n" + GENERIC_FWD
                    + "params = { threads = 128, vecs_per_thread = 16 }\nmax_hidden = 16384\n"
                      "smem = { fixed = 128, per_h = 0 }\n")
    with pytest.raises(RegistryError, match=r"exactly one runtime-H \(generic\) fwd program, found "
                                            r"\['fwd_generic', 'fwd_generic_copy'\]"):
        build_registry(data)


# ---- generated sources ---------------------------------------------------------------------------

def test_generic_source_takes_no_H_and_exports_the_H_calls(reg):
    fwd, bwd = (next(lib for lib in reg.generic_libraries("sm_90a")
                     if lib.program.direction == d and lib.weight_dtype == "bf16" and lib.residual)
                for d in ("fwd", "bwd"))
    src = render_source(fwd)
    assert "cake::GenericForward<__nv_bfloat16, true, cake::Reduction::kFp32, 256, 8>" in src
    assert "static_assert(CakeProgram::kMaxHidden == 16384" in src
    assert 'CAKE_EXPORT_FWD_H(CakeProgram, "fwd_generic", CAKE_WEIGHT_BF16, 1)' in src
    src = render_source(bwd)
    assert "cake::GenericBwdPair<__nv_bfloat16, true, cake::Reduction::kFp64Fold, 512, 4>" in src
    assert 'CAKE_EXPORT_BWD_H(CakeProgram, "bwd_generic_pair", CAKE_WEIGHT_BF16, 1)' in src
    # a generic program has no per-H library, and a prebuilt one no generic library
    with pytest.raises(BuildError, match="takes H at run time"):
        render_source(Library("sm_90a", fwd.program, LibraryKey(4096, "bf16", True),
                              reg.smem_optin_bytes))
    with pytest.raises(BuildError, match="needs a prebuilt H"):
        render_source(Library("sm_90a", reg.programs["det_pair_c64"],
                              LibraryKey(GENERIC_HIDDEN, "fp32", False), reg.smem_optin_bytes))


# ---- CLI -----------------------------------------------------------------------------------------

def test_explain_shows_the_generic_program(capsys):
    assert main(["explain", "--arch", "sm_90a", "--backend", "det", "--direction", "bwd",
                 "--H", "3000", "--T", "70000"]) == 0
    out = capsys.readouterr().out
    assert "runs program bwd_generic_pair" in out and "libbwd_generic_pair_hany_fp32.so" in out
    assert "H=3000 is not a prebuilt width" in out
    assert main(["explain", "--arch", "sm_100a", "--backend", "fast", "--direction", "fwd",
                 "--H", "3000", "--T", "5", "--residual", "--json"]) == 0
    import json
    doc = json.loads(capsys.readouterr().out)
    assert (doc["program"], doc["library"], doc["window"], doc["window_label"]) == (
        "fwd_generic", "fwd_generic_hany_fp32_res", [1, None], "generic")


def test_plan_counts_the_generic_libraries(capsys):
    assert main(["plan", "--arch", "sm_90a", "--json"]) == 0
    import json
    [plan] = json.loads(capsys.readouterr().out)
    assert sum(lib["H"] == 0 for lib in plan["libraries"]) == 8


# ---- the op through stub libraries ---------------------------------------------------------------

GENERIC_STUB_C = r"""
#include <stddef.h>
#include "cake_rmsnorm/abi.h"
static cake_fwd_args_t last_fwd; static cake_bwd_args_t last_bwd; static int32_t last_h;
int cake_info(cake_info_t* o) {
  o->abi_version = CAKE_ABI_VERSION; o->direction = STUB_DIR; o->hidden = 0;
  o->weight_dtype = STUB_W; o->residual = STUB_RES; o->smem_bytes = 0; o->program = STUB_PROGRAM;
  return 0;
}
#if STUB_DIR == CAKE_DIRECTION_FWD
int cake_fwd_h(const cake_fwd_args_t* a, int32_t H, void* s) { last_fwd = *a; last_h = H;
  (void)s; return 0; }
#else
size_t cake_bwd_workspace_bytes_h(int64_t T, int32_t H, int32_t sm) {
  (void)sm; return (size_t)T * 1000 + (size_t)H; }
int cake_bwd_h(const cake_bwd_args_t* a, int32_t H, void* s) { last_bwd = *a; last_h = H;
  (void)s; return 0; }
#endif
const cake_fwd_args_t* stub_last_fwd(void) { return &last_fwd; }
const cake_bwd_args_t* stub_last_bwd(void) { return &last_bwd; }
int32_t stub_last_h(void) { return last_h; }
"""


def _compile_generic_stub(tmp: Path, lib) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    src = tmp / "generic_stub.c"
    src.write_text(GENERIC_STUB_C)
    out = tmp / f"stub_{lib.name}.so"
    defs = {"STUB_DIR": abi.DIRECTION_CODES[lib.program.direction],
            "STUB_W": abi.WEIGHT_CODES[lib.weight_dtype], "STUB_RES": int(lib.residual),
            "STUB_PROGRAM": f'"{lib.program.name}"'}
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-Wall", "-Werror", f"-I{HEADER_DIR}",
                    *[f"-D{k}={v}" for k, v in defs.items()], str(src), "-o", str(out)], check=True)
    return out


@pytest.fixture(params=["eager", "custom_op"])
def generic_op(request, monkeypatch, tmp_path):
    """ops with a pretend H200 and stub generic libraries (fp32 weight): pointers and H recorded."""
    torch = pytest.importorskip("torch")
    from cake_rmsnorm import checks, ops

    monkeypatch.delenv(loader.ENV_PROVIDER_DIR, raising=False)
    loader.clear_cache()
    device.clear_cache()
    monkeypatch.setattr(ops, "EAGER_FAST_PATH", request.param == "eager")
    libs = [lib for lib in REG.generic_libraries("sm_90a") if lib.weight_dtype == "fp32"]
    contents = {lib.name: _compile_generic_stub(tmp_path, lib) for lib in libs}
    _make_provider(tmp_path / "prov", libs, contents=contents)
    pretend_h200(monkeypatch, ops, checks, tmp_path / "prov")
    yield torch, ops
    ops._tables.clear()
    loader.clear_cache()
    device.clear_cache()


def _stub(name: str):
    """(last args, last H) that the loaded stub library `name` recorded."""
    lib = loader.provider_for(SM90).loaded[name]
    kind = lib.direction
    fn = getattr(lib.cdll, f"stub_last_{kind}")
    fn.restype = ctypes.POINTER(abi.FwdArgs if kind == "fwd" else abi.BwdArgs)
    lib.cdll.stub_last_h.restype = ctypes.c_int32
    return fn().contents, lib.cdll.stub_last_h()


@pytest.mark.parametrize("hidden", [264, 3000])
def test_generic_H_reaches_the_library(generic_op, hidden):
    torch, ops = generic_op
    x = torch.randn(2, 150, hidden, dtype=torch.bfloat16, requires_grad=True)  # T = 300
    w = torch.ones(hidden, requires_grad=True)
    y = ops.rms_norm(x, w, eps=0.5, backend="det")
    args, h = _stub("fwd_generic_hany_fp32")
    assert h == hidden
    assert (args.x, args.weight, args.y, args.residual, args.T, args.eps) == (
        x.data_ptr(), w.data_ptr(), y.data_ptr(), None, 300, 0.5)
    y.backward(torch.ones_like(y))
    args, h = _stub("bwd_generic_pair_hany_fp32")
    assert h == hidden
    assert (args.x, args.weight, args.dx, args.dw) == (x.data_ptr(), w.data_ptr(),
                                                      x.grad.data_ptr(), w.grad.data_ptr())
    assert (args.T, args.workspace_bytes, args.grid_cap) == (300, 300 * 1000 + hidden, 0)
    assert w.grad.shape == (hidden,)


def test_generic_residual_and_fast_run_the_same_backward(generic_op):
    torch, ops = generic_op
    x = torch.randn(5, 264, dtype=torch.bfloat16, requires_grad=True)
    r = torch.randn(5, 264, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(264, requires_grad=True)
    y, h = ops.rms_norm(x, w, residual=r, backend="fast")
    args, hid = _stub("fwd_generic_hany_fp32_res")
    assert hid == 264 and (args.residual, args.residual_out) == (r.data_ptr(), h.data_ptr())
    (y.float().sum() + h.float().sum()).backward()
    args, hid = _stub("bwd_generic_pair_hany_fp32_res")
    assert hid == 264 and args.dresidual_out and args.x == h.data_ptr()
    assert set(loader.provider_for(SM90).loaded) == {"fwd_generic_hany_fp32_res",
                                                     "bwd_generic_pair_hany_fp32_res"}


def test_generic_H_under_torch_compile(generic_op):
    torch, ops = generic_op
    torch._dynamo.reset()

    def step(x, r, w):
        y, h = ops.rms_norm(x, w, residual=r, backend="det")
        return (y.float() * 2).sum() + h.float().sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    x = torch.randn(3, 100, 1000, dtype=torch.bfloat16, requires_grad=True)
    r = torch.randn(3, 100, 1000, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(1000, requires_grad=True)
    compiled(x, r, w).backward()
    args, hid = _stub("bwd_generic_pair_hany_fp32_res")
    assert hid == 1000 and args.T == 300 and w.grad.shape == (1000,)
    torch._dynamo.reset()


def test_generic_H_passes_the_public_and_the_custom_op_checks():
    torch = pytest.importorskip("torch")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from cake_rmsnorm import checks, ops
    for hidden in GENERIC_H:
        with FakeTensorMode():
            x = torch.empty(2, 3, hidden, dtype=torch.bfloat16, device="cuda")
            w = torch.empty(hidden, device="cuda")
            checks.check_args(x, w, x, 1e-6)
            checks.check_op(x.view(6, hidden), w, x.view(6, hidden), eps=1e-6, backend="det")
            y, h = ops.rms_norm(x, w, residual=x)
            assert y.shape == h.shape == x.shape


def test_a_generic_library_is_called_with_H(tmp_path):
    lib = next(lib for lib in REG.generic_libraries("sm_90a") if lib.program.direction == "bwd")
    loaded = abi.Library.open(_compile_generic_stub(tmp_path, lib), name=lib.name,
                              program=lib.program.name, direction="bwd", hidden=0,
                              weight_dtype=lib.weight_dtype, residual=lib.residual)
    assert loaded.generic
    with pytest.raises(ProviderError, match=f"{lib.name} is generic.*at\\(H\\)"):
        loaded.bwd_workspace_bytes(10, 132)
    at = loaded.at(3000)
    assert at.bwd_workspace_bytes(10, 132) == 10 * 1000 + 3000 and at.name == lib.name
    at.bwd(1, 0, 2, 3, 4, 5, 6, 7, 8, 10, 0, 0)
    loaded.cdll.stub_last_bwd.restype = ctypes.POINTER(abi.BwdArgs)
    loaded.cdll.stub_last_h.restype = ctypes.c_int32
    args = loaded.cdll.stub_last_bwd().contents
    assert (args.dy, args.x, args.dw, args.T, loaded.cdll.stub_last_h()) == (1, 2, 6, 10, 3000)
    prebuilt = REG.route("sm_90a", "det", "bwd", 4096, 4096).library
    from test_runtime_cpu import _compile_stub
    plain = abi.Library.open(_compile_stub(tmp_path, prebuilt), name=prebuilt.name,
                             program=prebuilt.program.name, direction="bwd", hidden=4096,
                             weight_dtype=prebuilt.weight_dtype, residual=prebuilt.residual)
    assert not plain.generic
    with pytest.raises(ValueError, match="only a generic library"):
        plain.at(3000)


def test_a_generic_library_without_the_H_calls_is_refused(tmp_path, monkeypatch):
    from test_runtime_cpu import _compile_stub
    lib = next(lib for lib in REG.generic_libraries("sm_90a") if lib.program.direction == "fwd")
    stub = _compile_stub(tmp_path, lib)  # exports cake_fwd, not cake_fwd_h
    with pytest.raises(ProviderError, match=f"library {lib.name} does not export cake_fwd_h"):
        abi.Library.open(stub, name=lib.name, program=lib.program.name, direction="fwd", hidden=0,
                         weight_dtype=lib.weight_dtype, residual=lib.residual)


# ---- the real libraries (toolchain) --------------------------------------------------------------

@pytest.mark.toolchain
def test_sm90a_generic_libraries_compile_without_spills_and_check_their_arguments(reg, tmp_path):
    from cake_rmsnorm.build.one import compile_one
    from cake_rmsnorm.build.toolchain import preflight
    from cake_rmsnorm.errors import ToolchainError
    try:
        tc = preflight(["sm_90a"])
    except ToolchainError as exc:
        pytest.skip(f"no CUDA build toolchain: {exc}")
    cudart = [p for p in loader._cudart_candidates() if p.is_file()]
    wanted = [lib for lib in reg.generic_libraries("sm_90a") if lib.weight_dtype == "bf16"
              and lib.residual]
    for lib in wanted:
        built = compile_one(lib, tmp_path, tc)
        for k in built.record["kernels"]:
            assert k["spill_stores"] == 0 and k["spill_loads"] == 0 and k["smem_static"] == 0, k
            assert 0 < k["registers"] <= 128, k
        if not cudart:
            continue
        ctypes.CDLL(str(cudart[0]), mode=ctypes.RTLD_GLOBAL)
        so = ctypes.CDLL(str(built.path))
        info = abi.CakeInfo()
        assert so.cake_info(ctypes.byref(info)) == 0
        assert (info.hidden, info.program.decode()) == (0, lib.program.name)
        assert not hasattr(so, "cake_fwd") and not hasattr(so, "cake_bwd")
        invalid = 1  # cudaErrorInvalidValue; none of these calls reaches CUDA
        if lib.program.direction == "fwd":
            fwd = so.cake_fwd_h
            fwd.argtypes = [ctypes.POINTER(abi.FwdArgs), ctypes.c_int32, ctypes.c_void_p]
            args = abi.FwdArgs(T=0)
            assert fwd(args, 264, None) == 0  # T = 0: nothing to do
            for bad in (0, 260, 16392):
                assert fwd(args, bad, None) == invalid
            assert fwd(None, 264, None) == invalid
            args.T = 5  # NULL pointers
            assert fwd(args, 264, None) == invalid
        else:
            ws = so.cake_bwd_workspace_bytes_h
            ws.restype = ctypes.c_size_t
            ws.argtypes = [ctypes.c_int64, ctypes.c_int32, ctypes.c_int32]
            assert ws(100, 264, 132) == 4352  # 2 chunks x 264 doubles, 256-byte aligned
            assert ws(100, 264, 7) == ws(100, 264, 132)
            assert ws(0, 264, 132) == 0 and ws(100, 260, 132) == 0
            bwd = so.cake_bwd_h
            bwd.argtypes = [ctypes.POINTER(abi.BwdArgs), ctypes.c_int32, ctypes.c_void_p]
            args = abi.BwdArgs(T=5, dw=1)
            for bad in (0, 260, 16392):
                assert bwd(args, bad, None) == invalid
            assert bwd(None, 264, None) == invalid
            assert bwd(args, 264, None) == invalid  # NULL dy, x, ...
