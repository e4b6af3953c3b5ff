"""Runtime tests that need no GPU: import hygiene, the loader's errors, the C ABI mirror (against a
host-only stub compiled from the real header), argument validation, backend selection."""

import ctypes
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

import cake_rmsnorm
from cake_rmsnorm.errors import LaunchError, ProviderError
from cake_rmsnorm.manifest import LibraryEntry, Manifest, SCHEMA_VERSION, sha256_file
from cake_rmsnorm.registry import TableKey, load_registry
from cake_rmsnorm.runtime import abi, device, loader

REPO = Path(__file__).resolve().parents[1]
HEADER_DIR = REPO / "csrc" / "include"
REG = load_registry()
SM90 = REG.arch("sm_90a")


@pytest.fixture(autouse=True)
def _fresh_caches(monkeypatch):
    monkeypatch.delenv(loader.ENV_PROVIDER_DIR, raising=False)
    loader.clear_cache()
    device.clear_cache()
    yield
    loader.clear_cache()
    device.clear_cache()
    if "cake_rmsnorm.ops" in sys.modules:
        sys.modules["cake_rmsnorm.ops"]._tables.clear()


def _run(code: str) -> str:
    env = dict(os.environ)
    env.pop(loader.ENV_PROVIDER_DIR, None)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


# ---- import hygiene ----------------------------------------------------------------------------
def test_import_loads_no_torch_no_cuda_no_library():
    out = _run("""
        import sys, cake_rmsnorm, cake_rmsnorm.registry, cake_rmsnorm.runtime.loader
        maps = open('/proc/self/maps').read()
        print('torch' in sys.modules, 'libcudart' in maps, 'libcuda.so' in maps,
              'cake_rmsnorm_sm' in maps)
    """)
    assert out.split() == ["False"] * 4


def test_op_import_creates_no_cuda_context_and_maps_no_library():
    names = sorted({lib.filename for a in REG.archs for lib in REG.libraries(a.name)})
    out = _run(f"""
        import cake_rmsnorm, torch
        cake_rmsnorm.rms_norm, cake_rmsnorm.RMSNorm   # imports the op and torch
        maps = open('/proc/self/maps').read()
        print(torch.cuda.is_initialized(), any(n in maps for n in {names!r}))
    """)
    assert out.split() == ["False", "False"]


# ---- fake providers ----------------------------------------------------------------------------
def _make_provider(root: Path, libs, version=cake_rmsnorm.__version__, arch="sm_90a",
                   contents=None) -> Path:
    """A provider package dir: manifest.json and lib/<file> for each registry Library."""
    (root / "lib").mkdir(parents=True, exist_ok=True)
    entries = []
    for lib in libs:
        path = root / "lib" / lib.filename
        src = (contents or {}).get(lib.name)
        if src is not None:
            shutil.copyfile(src, path)
        else:
            path.write_bytes(b"not a library: " + lib.name.encode())
        entries.append(LibraryEntry(name=lib.name, program=lib.program.name, H=lib.hidden,
                                    weight_dtype=lib.weight_dtype, residual=lib.residual,
                                    smem_bytes=lib.smem_bytes, oversized=lib.oversized,
                                    registers=32, file=f"lib/{lib.filename}",
                                    sha256=sha256_file(path)))
    manifest = Manifest(SCHEMA_VERSION, version, arch, "cuda 13.5", tuple(entries))
    (root / "manifest.json").write_text(manifest.to_json())
    return root


def _lib(backend="det", direction="fwd", hidden=256, tokens=1, dtype="fp32", residual=False):
    return REG.route("sm_90a", backend, direction, hidden, tokens, dtype, residual).library


@pytest.mark.faults
def test_missing_provider_names_pip_command(monkeypatch):
    monkeypatch.setattr(loader, "_find_spec", lambda name: None)
    with pytest.raises(ProviderError) as err:
        loader.provider_for(SM90)
    msg = str(err.value)
    assert "cake-rmsnorm-sm90a" in msg and "not installed" in msg
    assert f"pip install 'cake-rmsnorm[sm90a]=={cake_rmsnorm.__version__}'" in msg


@pytest.mark.faults
def test_env_dir_without_manifest(monkeypatch, tmp_path):
    monkeypatch.setenv(loader.ENV_PROVIDER_DIR, str(tmp_path))
    with pytest.raises(ProviderError, match="no manifest.json"):
        loader.provider_for(SM90)


@pytest.mark.faults
def test_provider_version_mismatch(monkeypatch, tmp_path):
    _make_provider(tmp_path, [_lib()], version="0.0.0")
    monkeypatch.setenv(loader.ENV_PROVIDER_DIR, str(tmp_path))
    with pytest.raises(ProviderError) as err:
        loader.provider_for(SM90)
    msg = str(err.value)
    assert "0.0.0" in msg and cake_rmsnorm.__version__ in msg
    assert f"pip install 'cake-rmsnorm[sm90a]=={cake_rmsnorm.__version__}'" in msg


@pytest.mark.faults
def test_provider_for_another_arch(monkeypatch, tmp_path):
    _make_provider(tmp_path, [_lib()], arch="sm_100a")
    monkeypatch.setenv(loader.ENV_PROVIDER_DIR, str(tmp_path))
    with pytest.raises(ProviderError, match="is for sm_100a.*needs sm_90a"):
        loader.provider_for(SM90)


def test_provider_found_by_find_spec_without_import(monkeypatch, tmp_path):
    pkg = _make_provider(tmp_path / "cake_rmsnorm_sm90a", [_lib()])
    (pkg / "__init__.py").write_text("raise RuntimeError('the loader must not import me')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    provider = loader.provider_for(SM90)
    assert provider.root == pkg.resolve()
    assert "cake_rmsnorm_sm90a" not in sys.modules
    assert loader.provider_for(SM90) is provider  # cached


@pytest.mark.faults
def test_hash_mismatch_names_the_file(monkeypatch, tmp_path):
    lib = _lib()
    _make_provider(tmp_path, [lib])
    (tmp_path / "lib" / lib.filename).write_bytes(b"tampered")
    monkeypatch.setenv(loader.ENV_PROVIDER_DIR, str(tmp_path))
    monkeypatch.setattr(loader, "ensure_cudart", lambda: pytest.fail("loaded before hash check"))
    with pytest.raises(ProviderError) as err:
        loader.load_library(SM90, lib)
    msg = str(err.value)
    assert lib.filename in msg and "sha256" in msg and "--force-reinstall" in msg


@pytest.mark.faults
def test_library_missing_from_manifest(monkeypatch, tmp_path):
    _make_provider(tmp_path, [_lib()])
    monkeypatch.setenv(loader.ENV_PROVIDER_DIR, str(tmp_path))
    other = _lib(hidden=4096)
    with pytest.raises(ProviderError, match=f"no library {other.name}"):
        loader.load_library(SM90, other)


@pytest.mark.faults
def test_unloadable_file_is_a_provider_error(monkeypatch, tmp_path):
    lib = _lib()
    _make_provider(tmp_path, [lib])
    monkeypatch.setenv(loader.ENV_PROVIDER_DIR, str(tmp_path))
    monkeypatch.setattr(loader, "ensure_cudart", lambda: None)
    with pytest.raises(ProviderError, match=f"cannot load library {lib.name}"):
        loader.load_library(SM90, lib)


@pytest.mark.faults
def test_unsupported_capability_lists_our_archs(monkeypatch):
    monkeypatch.setattr(device, "_query", lambda index: ("NVIDIA A100", (8, 0), 108))
    with pytest.raises(ProviderError) as err:
        device.device_info(0)
    msg = str(err.value)
    assert "A100" in msg and "8.0" in msg
    assert all(a.name in msg for a in REG.archs)


@pytest.mark.faults
def test_capability_is_matched_exactly(monkeypatch):
    monkeypatch.setattr(device, "_query", lambda index: ("NVIDIA B300?", (10, 1), 148))
    with pytest.raises(ProviderError, match="10.1"):
        device.device_info(0)
    device.clear_cache()
    monkeypatch.setattr(device, "_query", lambda index: ("NVIDIA H200", (9, 0), 132))
    info = device.device_info(0)
    assert info.arch.name == "sm_90a" and info.sm_count == 132


def test_cudart_from_the_runtime_wheel(monkeypatch):
    paths = [p for p in loader._cudart_candidates() if p.is_file()]
    if not paths:
        pytest.skip("no nvidia-cuda-runtime wheel in this environment")
    monkeypatch.setattr(loader, "_cudart", None, raising=False)  # the driver check runs again
    monkeypatch.setattr(loader, "_driver_cuda_version", lambda handle: 13000)  # no driver here
    handle = loader.ensure_cudart()
    assert handle is loader.ensure_cudart()
    assert abi._launch_message("libx", "cake_fwd", 700).endswith(
        "CUDA error 700 (cudaErrorIllegalAddress)")


# ---- the C ABI, against a host stub built from the real header ---------------------------------
STUB_C = r"""
#include <stddef.h>
#include "cake_rmsnorm/abi.h"
static cake_fwd_args_t last_fwd; static cake_bwd_args_t last_bwd; static void* last_stream;
int cake_info(cake_info_t* o) {
  o->abi_version = STUB_ABI; o->direction = STUB_DIR; o->hidden = STUB_H;
  o->weight_dtype = STUB_W; o->residual = STUB_RES; o->smem_bytes = 0; o->program = STUB_PROGRAM;
  return 0;
}
int cake_fwd(const cake_fwd_args_t* a, void* s) { last_fwd = *a; last_stream = s;
  return a->T == 13 ? 700 : 0; }
size_t cake_bwd_workspace_bytes(int64_t T, int32_t sm) { return (size_t)T * 1000 + (size_t)sm; }
int cake_bwd(const cake_bwd_args_t* a, void* s) { last_bwd = *a; last_stream = s;
  return a->T == 13 ? 700 : 0; }
const cake_fwd_args_t* stub_last_fwd(void) { return &last_fwd; }
const cake_bwd_args_t* stub_last_bwd(void) { return &last_bwd; }
void* stub_last_stream(void) { return last_stream; }
#define F(S, m) offsetof(S, m)
static const size_t layout[] = {
  sizeof(cake_info_t), F(cake_info_t, residual), F(cake_info_t, smem_bytes), F(cake_info_t, program),
  sizeof(cake_fwd_args_t), F(cake_fwd_args_t, rstd), F(cake_fwd_args_t, T), F(cake_fwd_args_t, eps),
  sizeof(cake_bwd_args_t), F(cake_bwd_args_t, workspace_bytes), F(cake_bwd_args_t, T),
  F(cake_bwd_args_t, grid_cap)};
size_t stub_layout(int i) { return layout[i]; }
"""


def _compile_stub(tmp: Path, lib, **override) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    defs = {"STUB_ABI": abi.CAKE_ABI_VERSION, "STUB_DIR": abi.DIRECTION_CODES[lib.program.direction],
            "STUB_H": lib.hidden, "STUB_W": abi.WEIGHT_CODES[lib.weight_dtype],
            "STUB_RES": int(lib.residual), "STUB_PROGRAM": f'"{lib.program.name}"'}
    defs.update(override)
    src = tmp / "stub.c"
    src.write_text(STUB_C)
    out = tmp / f"stub_{lib.name}_{len(override)}.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", f"-I{HEADER_DIR}", *[f"-D{k}={v}" for k, v
                    in defs.items()], str(src), "-o", str(out)], check=True)
    return out


def test_struct_layout_matches_header(tmp_path):
    stub = ctypes.CDLL(str(_compile_stub(tmp_path, _lib())))
    stub.stub_layout.restype = ctypes.c_size_t
    ours = [ctypes.sizeof(abi.CakeInfo), abi.CakeInfo.residual.offset,
            abi.CakeInfo.smem_bytes.offset, abi.CakeInfo.program.offset,
            ctypes.sizeof(abi.FwdArgs), abi.FwdArgs.rstd.offset, abi.FwdArgs.T.offset,
            abi.FwdArgs.eps.offset, ctypes.sizeof(abi.BwdArgs), abi.BwdArgs.workspace_bytes.offset,
            abi.BwdArgs.T.offset, abi.BwdArgs.grid_cap.offset]
    assert [stub.stub_layout(i) for i in range(len(ours))] == ours


@pytest.mark.faults
@pytest.mark.parametrize("field,value", [("STUB_H", 512), ("STUB_W", 1), ("STUB_RES", 1),
                                         ("STUB_DIR", 1), ("STUB_ABI", 99),
                                         ("STUB_PROGRAM", '"other"')])
def test_cake_info_mismatch_is_refused(tmp_path, monkeypatch, field, value):
    lib = _lib()
    stub = _compile_stub(tmp_path, lib, **{field: value})
    _make_provider(tmp_path / "prov", [lib], contents={lib.name: stub})
    monkeypatch.setenv(loader.ENV_PROVIDER_DIR, str(tmp_path / "prov"))
    monkeypatch.setattr(loader, "ensure_cudart", lambda: None)
    with pytest.raises(ProviderError, match="does not match the registry"):
        loader.load_library(SM90, lib)


# ---- the op's host path on CPU tensors, through stub libraries ----------------------------------
@pytest.fixture(params=["native", "eager", "custom_op"])
def stub_op(request, monkeypatch, tmp_path):
    """ops with a pretend H200 and stub libraries for H=256, fp32 weight (pointers only recorded);
    eager calls through the native C++ step, through the autograd.Function fast path, then
    through the custom ops."""
    torch = pytest.importorskip("torch")
    from cake_rmsnorm import checks, ops
    from cake_rmsnorm.runtime import native

    monkeypatch.setattr(ops, "EAGER_FAST_PATH", request.param != "custom_op")
    if request.param == "native":
        monkeypatch.setenv(native.ENV_LIB, str(request.getfixturevalue("native_library")))
    else:
        monkeypatch.setenv(native.ENV_OFF, "0")
    native.reset()
    request.addfinalizer(native.reset)
    assert (native.step_op() is not None) == (request.param == "native"), native.status().detail

    # every window of H 256's tables at FP32 weight: the tests' T may land in any of them
    libs = [_lib(b, d, 256, w.first, "fp32", r) for b in ("det", "fast") for d in ("fwd", "bwd")
            for r in (False, True)
            for w in REG.table(TableKey("sm_90a", b, d, "fp32", r, 256))]
    libs = list({lib.name: lib for lib in libs}.values())
    contents = {lib.name: _compile_stub(tmp_path, lib) for lib in libs}
    _make_provider(tmp_path / "prov", libs, contents=contents)
    pretend_h200(monkeypatch, ops, checks, tmp_path / "prov")
    return torch, ops


def pretend_h200(monkeypatch, ops, checks, provider_dir) -> None:
    """The op's host path on CPU tensors: a pretend H200 serving the stub libraries in
    provider_dir, stream 0x5EED. CPU tensors' device index (-1) is taken as current, so the real
    _on_device runs without switching, and as device 0 by the router."""
    monkeypatch.setenv(loader.ENV_PROVIDER_DIR, str(provider_dir))
    monkeypatch.setattr(loader, "ensure_cudart", lambda: None)
    monkeypatch.setattr(device, "_query", lambda index: ("NVIDIA H200", (9, 0), 132))
    monkeypatch.setattr(checks, "check_device", lambda *a: None)
    monkeypatch.setattr(ops, "_current_device", lambda: -1)
    monkeypatch.setattr(ops, "_stream", lambda index: 0x5EED)
    real_library = ops._library
    monkeypatch.setattr(ops, "_library", lambda index, *args: real_library(max(index, 0), *args))
    ops._tables.clear()


def test_launch_switches_device_only_when_needed(monkeypatch):
    """_on_device: no switch when the device is current; else switch, launch, and restore the
    caller's device even when the launch raises."""
    torch = pytest.importorskip("torch")
    from cake_rmsnorm import ops
    switched = []
    monkeypatch.setattr(ops, "_current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", switched.append)
    monkeypatch.setattr(ops, "_stream", lambda index: 100 + index)
    calls = []
    ops._on_device(0, lambda *a: calls.append(a), 7)
    assert calls == [(7, 100)] and switched == []
    ops._on_device(1, lambda *a: calls.append(a), 8)
    assert calls[-1] == (8, 101) and switched == [1, 0]

    def fail(*a):
        raise LaunchError("boom")
    with pytest.raises(LaunchError, match="boom"):
        ops._on_device(2, fail)
    assert switched == [1, 0, 2, 0]


def _last(ops, kind: str):
    """(library name, last args, last stream) of the most recently called stub of `kind`."""
    loaded = loader.provider_for(SM90).loaded
    for table in ops._tables.values():
        for lib in table.libs:
            if lib is not None and lib.direction == kind and lib.name in loaded:
                fn = getattr(lib.cdll, f"stub_last_{kind}")
                fn.restype = ctypes.POINTER(abi.FwdArgs if kind == "fwd" else abi.BwdArgs)
                lib.cdll.stub_last_stream.restype = ctypes.c_void_p
                yield lib.name, fn().contents, lib.cdll.stub_last_stream()


def test_op_forward_and_backward_pass_the_right_pointers(stub_op):
    torch, ops = stub_op
    x = torch.randn(2, 150, 256, dtype=torch.bfloat16, requires_grad=True)  # T = 300
    w = torch.ones(256, requires_grad=True)
    y = ops.rms_norm(x, w, eps=0.5, backend="det")
    assert y.shape == x.shape and y.dtype == torch.bfloat16
    node = y.grad_fn.next_functions[0][0]  # under the view back to 3-D
    native = ops.native.step_op() is not None
    assert ("_Eager" in type(node).__name__) == (ops.EAGER_FAST_PATH and not native), type(node)
    assert ("Step" in node.name()) == native, node.name()
    [(name, args, stream)] = [t for t in _last(ops, "fwd") if t[1].T]
    assert name == _lib("det", "fwd", 256, 300).name
    assert (args.x, args.weight, args.residual, args.T, args.eps, stream) == (
        x.data_ptr(), w.data_ptr(), None, 300, 0.5, 0x5EED)
    assert args.y == y.data_ptr()
    y.backward(torch.ones_like(y))
    assert x.grad.shape == x.shape and w.grad.dtype == torch.float32
    [(name, args, stream)] = [t for t in _last(ops, "bwd") if t[1].T]
    assert name == _lib("det", "bwd", 256, 300).name
    assert (args.x, args.weight, args.dx, args.dw) == (x.data_ptr(), w.data_ptr(),
                                                      x.grad.data_ptr(), w.grad.data_ptr())
    assert (args.T, args.workspace_bytes, args.grid_cap, args.dresidual_out) == (
        300, 300 * 1000 + 132, 0, None)


def test_workspace_size_is_remembered_per_token_count():
    """The hot path asks the library once per (T, SM count); the memory stays bounded."""
    lib = abi.Library.__new__(abi.Library)
    calls = []
    lib._ws = lambda t, sm: calls.append((t, sm)) or t * 10 + sm
    lib._ws_bytes = {}
    assert [lib.bwd_workspace_bytes(t, 132) for t in (5, 5, 7, 5)] == [182, 182, 202, 182]
    assert calls == [(5, 132), (7, 132)]
    for t in range(abi._WS_CACHE_SIZE + 3):
        assert lib.bwd_workspace_bytes(t, 1) == t * 10 + 1
    assert len(lib._ws_bytes) <= abi._WS_CACHE_SIZE


def test_op_residual_backward_passes_dresidual(stub_op):
    torch, ops = stub_op
    x = torch.randn(5, 256, dtype=torch.bfloat16, requires_grad=True)
    r = torch.randn(5, 256, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(256, requires_grad=True)
    y, h = ops.rms_norm(x, w, residual=r, backend="fast")
    [(name, args, _)] = [t for t in _last(ops, "fwd") if t[1].T]
    assert name == _lib("fast", "fwd", 256, 5, residual=True).name
    assert (args.residual, args.residual_out) == (r.data_ptr(), h.data_ptr())
    (y.float().sum() + h.float().sum()).backward()
    [(name, args, _)] = [t for t in _last(ops, "bwd") if t[1].T]
    assert name == _lib("fast", "bwd", 256, 5, residual=True).name
    assert args.dresidual_out and args.x == h.data_ptr()
    # dx is the gradient of x and of residual alike (the stub leaves it uninitialised: compare bits)
    assert torch.equal(x.grad.view(torch.int16), r.grad.view(torch.int16))
    assert args.dx in (x.grad.data_ptr(), r.grad.data_ptr())


def test_launch_error_names_library_and_code(stub_op):
    torch, ops = stub_op
    x = torch.randn(13, 256, dtype=torch.bfloat16)
    with pytest.raises(LaunchError, match=rf"{_lib('det', 'fwd', 256, 13).name} failed: CUDA error 700"):
        ops.rms_norm(x, torch.ones(256), backend="det")


def test_default_backend_follows_deterministic_mode(stub_op):
    torch, ops = stub_op
    x = torch.randn(300, 256, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(256, requires_grad=True)
    before = torch.are_deterministic_algorithms_enabled()
    try:
        for mode, backend in ((True, "det"), (False, "fast")):
            torch.use_deterministic_algorithms(mode)
            assert ops.resolve_backend(None) == backend
            ops.rms_norm(x, w).sum().backward()
            names = [n for n, a, _ in _last(ops, "bwd") if a.T == 300]
            assert _lib(backend, "bwd", 256, 300).name in names
    finally:
        torch.use_deterministic_algorithms(before)
    assert ops.resolve_backend("fast") == "fast"
    with pytest.raises(ValueError, match="'turbo'"):
        ops.resolve_backend("turbo")


def test_fast_under_deterministic_mode_raises_or_warns(stub_op):
    """As torch's own non-deterministic ops: RuntimeError, or a UserWarning under warn_only (and
    fast runs); backend=None still picks det."""
    torch, ops = stub_op
    x = torch.randn(300, 256, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(256, requires_grad=True)
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled())
    try:
        torch.use_deterministic_algorithms(True)
        with pytest.raises(RuntimeError, match=r"rms_norm\(backend='fast'\) does not have a "
                           r"deterministic implementation, but you set "
                           r"'torch.use_deterministic_algorithms\(True\)'"):
            ops.rms_norm(x, w, backend="fast")
        torch.use_deterministic_algorithms(True, warn_only=True)
        with pytest.warns(UserWarning, match="does not have a deterministic implementation"):
            y = ops.rms_norm(x, w, backend="fast")
        y.sum().backward()
        names = [n for n, a, _ in _last(ops, "bwd") if a.T == 300]
        assert names == [_lib("fast", "bwd", 256, 300).name]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ops.rms_norm(x, w).sum().backward()  # None: det, no warning
        names = [n for n, a, _ in _last(ops, "bwd") if a.T == 300]
        assert _lib("det", "bwd", 256, 300).name in names
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


# ---- argument validation (before any launch) ----------------------------------------------------
@pytest.fixture
def no_launch(monkeypatch):
    torch = pytest.importorskip("torch")
    from cake_rmsnorm import ops

    def boom(*args, **kwargs):
        raise AssertionError("routed or launched despite bad input")
    monkeypatch.setattr(ops, "_library", boom)
    return torch, ops


def test_bad_arguments_raise_naming_the_argument(no_launch):
    torch, ops = no_launch
    bf, f32 = torch.bfloat16, torch.float32
    x = torch.zeros(4, 256, dtype=bf)
    w = torch.ones(256)
    cases = [
        (dict(x=x.float(), weight=w), TypeError, r"x has dtype torch.float32.*bfloat16"),
        (dict(x=torch.zeros(4, 1004, dtype=bf), weight=torch.ones(1004)), ValueError,
         r"H=1004.*256, 1536, 2048, 4096, 5120, 6144, 8192"),
        (dict(x=torch.zeros((), dtype=bf), weight=w), ValueError, "at least one dimension"),
        (dict(x=x, weight=w.half()), TypeError, r"weight has dtype torch.float16"),
        (dict(x=x, weight=torch.ones(128)), ValueError, r"weight has shape \(128,\)"),
        (dict(x=x, weight=w, residual=x.float()), TypeError, r"residual has dtype"),
        (dict(x=x, weight=w, residual=torch.zeros(3, 256, dtype=bf)), ValueError,
         r"residual has shape \(3, 256\)"),
        (dict(x=x, weight=w, eps=-1.0), ValueError, r"eps must be .* got -1.0"),
        (dict(x=x, weight=w, eps=float("nan")), ValueError, r"eps must be"),
        (dict(x=x, weight=w, backend="turbo"), ValueError, r"backend 'turbo'"),
        (dict(x=x, weight=w), ValueError, r"x is on device cpu.*CUDA"),
        (dict(x=[1.0], weight=w), TypeError, r"x must be a torch.Tensor"),
    ]
    for kwargs, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            ops.rms_norm(**kwargs)
    assert f32 is torch.float32


def test_module_mirrors_torch_rmsnorm_constructor():
    torch = pytest.importorskip("torch")
    norm = cake_rmsnorm.RMSNorm(256)
    assert norm.weight.dtype == torch.float32 and torch.equal(norm.weight, torch.ones(256))
    assert norm.eps == 1e-6 and norm.normalized_shape == (256,)
    assert cake_rmsnorm.RMSNorm((256,), eps=None, dtype=torch.bfloat16).weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="elementwise_affine"):
        cake_rmsnorm.RMSNorm(256, elementwise_affine=False)
    with pytest.raises(ValueError, match="last dimension only"):
        cake_rmsnorm.RMSNorm((4, 256))
    with pytest.raises(TypeError, match="float16"):
        cake_rmsnorm.RMSNorm(256, dtype=torch.float16)
    with pytest.raises(ValueError, match="'turbo'"):
        cake_rmsnorm.RMSNorm(256, backend="turbo")
    with pytest.raises(ValueError, match="on device cpu"):
        norm(torch.zeros(2, 256, dtype=torch.bfloat16))


def test_op_traces_whole_under_torch_compile(stub_op):
    """fullgraph=True: the wrapper (backend choice, checks, flattening) traces without a break and
    the custom ops stay opaque; forward and backward launch the stubs from the compiled graph."""
    torch, ops = stub_op
    torch._dynamo.reset()

    def step(x, r, w):
        y, h = ops.rms_norm(x, w, residual=r)
        return (y.float() * 2).sum() + h.float().sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    x = torch.randn(3, 100, 256, dtype=torch.bfloat16, requires_grad=True)
    r = torch.randn(3, 100, 256, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(256, requires_grad=True)
    compiled(x, r, w).backward()
    assert w.grad is not None and x.grad.shape == x.shape
    [(name, args, _)] = [t for t in _last(ops, "bwd") if t[1].T]
    assert name == _lib("fast", "bwd", 256, 300, residual=True).name and args.T == 300
    torch._dynamo.reset()


def test_custom_ops_called_directly_guard_their_inputs(stub_op):
    torch, ops = stub_op
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    w = torch.ones(256)
    with pytest.raises(ValueError, match="cake_rmsnorm ops take"):
        torch.ops.cake_rmsnorm.fwd(x.float(), w, 1e-6, "det")
    with pytest.raises(ValueError, match="cake_rmsnorm ops take"):
        torch.ops.cake_rmsnorm.fwd_residual(x, x[:2], w, 1e-6, "det")
    with pytest.raises(ValueError, match="rstd must be"):
        torch.ops.cake_rmsnorm.bwd(x, None, x, w, torch.zeros(3), "det", False)
    y, rstd = torch.ops.cake_rmsnorm.fwd(x, w, 1e-6, "det")  # and the good call goes through
    assert y.shape == x.shape and rstd.shape == (4,)


def test_a_call_wanting_no_gradient_loads_no_backward_library(stub_op):
    torch, ops = stub_op
    x = torch.randn(300, 256, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(256, requires_grad=True)
    with torch.no_grad():
        y = ops.rms_norm(x, w, backend="det")
    assert y.grad_fn is None
    ops.rms_norm(x.detach(), w.detach(), backend="fast")
    assert [n for n, a, _ in _last(ops, "fwd") if a.T == 300]
    assert not [n for n, _, _ in _last(ops, "bwd")]
