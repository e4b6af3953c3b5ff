"""The native eager step's plumbing on CPU: where runtime/native.py finds it and when it declines,
and the wheel build/native.py writes. (The op through it: test_runtime_cpu.py's stub_op
'native'.)"""

import ctypes
import platform
import shutil
import subprocess
import sys
import zipfile

import pytest

from cake_rmsnorm.build import native as build_native
from cake_rmsnorm.errors import BuildError, PackagingError
from cake_rmsnorm.runtime import native

torch = pytest.importorskip("torch")


@pytest.fixture(autouse=True)
def _resolve_fresh(monkeypatch):
    monkeypatch.delenv(native.ENV_OFF, raising=False)
    monkeypatch.delenv(native.ENV_LIB, raising=False)
    # A fake package a test imports must not outlive it (a later test's doctor would load it).
    installed = sys.modules.pop(native.PACKAGE, None)
    native.reset()
    yield
    sys.modules.pop(native.PACKAGE, None)
    if installed is not None:
        sys.modules[native.PACKAGE] = installed
    native.reset()


def _fake_package(root, torch_version, library="libnope.so"):
    pkg = root / native.PACKAGE
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        f"from pathlib import Path\n__version__ = '9.9'\nTORCH_VERSION = '{torch_version}'\n"
        f"LIBRARY = Path(__file__).with_name('{library}')\n")
    return pkg


def test_turned_off_by_environment(monkeypatch):
    monkeypatch.setenv(native.ENV_OFF, "0")
    status = native.status()
    assert status.op is None and native.ENV_OFF in status.detail
    assert native.step_op() is None


def test_not_installed_names_the_wheel(monkeypatch):
    monkeypatch.setattr(native.importlib.util, "find_spec", lambda name: None)
    status = native.status()
    assert status.op is None and "not installed" in status.detail
    assert native.PACKAGE in status.detail


def test_another_torch_keeps_the_python_path(monkeypatch, tmp_path):
    _fake_package(tmp_path, "0.0.1")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.warns(RuntimeWarning, match="built for torch 0.0.1"):
        status = native.status()
    running = native.public_version(torch.__version__)
    assert status.op is None
    assert "built for torch 0.0.1" in status.detail and f"this is torch {running}" in status.detail


def test_a_library_that_does_not_load_warns_and_falls_back(monkeypatch, tmp_path):
    bad = tmp_path / "libbad.so"
    bad.write_bytes(b"not an ELF file")
    monkeypatch.setenv(native.ENV_LIB, str(bad))
    with pytest.warns(RuntimeWarning, match="did not load"):
        status = native.status()
    assert status.op is None and str(bad) in status.detail
    assert native.step_op() is None  # resolved once: no second warning, no second try


def test_public_version_drops_the_local_tag():
    assert native.public_version("2.11.0+cu130") == "2.11.0"
    assert native.public_version("2.13.0") == "2.13.0"


def test_wheel_holds_library_and_pins_torch(tmp_path):
    lib = tmp_path / "lib.so"
    lib.write_bytes(b"\x7fELF pretend")
    wheel = build_native.write_native_wheel(lib, "2.11.0", tmp_path / "out")
    assert wheel.name.startswith(f"{native.PACKAGE}-0.1.0+torch2.11.0-py3-none-manylinux_2_28_")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        init = zf.read(f"{native.PACKAGE}/__init__.py").decode()
        metadata = zf.read(f"{native.PACKAGE}-0.1.0+torch2.11.0.dist-info/METADATA").decode()
        assert zf.read(f"{native.PACKAGE}/{build_native.LIBRARY_NAME}") == lib.read_bytes()
    assert f"{native.PACKAGE}-0.1.0+torch2.11.0.dist-info/RECORD" in names
    assert "Requires-Dist: torch==2.11.0" in metadata
    scope: dict = {"__file__": "/site/cake_rmsnorm_native/__init__.py"}
    exec(init, scope)
    assert scope["TORCH_VERSION"] == "2.11.0"
    assert str(scope["LIBRARY"]) == f"/site/cake_rmsnorm_native/{build_native.LIBRARY_NAME}"


@pytest.mark.parametrize("names, glibc", [(b"GLIBC_2.2.5\0GLIBC_2.17\0", "2_28"),
                                          (b"GLIBC_2.14\0GLIBC_2.32\0GLIBCXX_3.4.21\0", "2_32")])
def test_the_wheel_tag_keeps_the_glibc_its_library_names(tmp_path, monkeypatch, names, glibc):
    monkeypatch.delenv("CAKE_RMSNORM_WHEEL_PLATFORM", raising=False)
    lib = tmp_path / "lib.so"
    lib.write_bytes(b"\x7fELF pretend\0" + names)
    wheel = build_native.write_native_wheel(lib, "2.11.0", tmp_path / "out")
    tag = f"manylinux_{glibc}_{platform.machine()}"
    assert wheel.name.endswith(f"-py3-none-{tag}.whl")
    with zipfile.ZipFile(wheel) as zf:
        assert f"Tag: py3-none-{tag}" in zf.read(
            f"{native.PACKAGE}-0.1.0+torch2.11.0.dist-info/WHEEL").decode().splitlines()


def test_a_library_needing_a_newer_libstdcxx_is_refused(tmp_path):
    lib = tmp_path / "lib.so"
    lib.write_bytes(b"\x7fELF pretend\0GLIBCXX_3.4.21\0GLIBCXX_3.4.29\0")
    with pytest.raises(PackagingError, match=r"GLIBCXX_3\.4\.29, newer than the GLIBCXX_3\.4\.25"):
        build_native.write_native_wheel(lib, "2.11.0", tmp_path / "out")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_bad_torch_version_and_folder_are_build_errors(tmp_path):
    with pytest.raises(BuildError, match=r"--torch '2\.11'.*such as 2\.11\.0"):
        build_native.fetch_torch("2.11", tmp_path)
    with pytest.raises(BuildError, match="not a torch package folder"):
        build_native.torch_version(tmp_path)


def test_the_built_library_registers_the_step(native_library, monkeypatch):
    monkeypatch.setenv(native.ENV_LIB, str(native_library))
    op = native.step_op()
    assert op is not None and "cake_rmsnorm_native::step" in str(op._schema)
    x = torch.zeros(0, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="T > 0"):
        op(x, None, torch.ones(8), 1e-6, 1, 1, 0, 0, 0, 0)


def test_verify_accepts_the_native_wheel_and_names_a_missing_library(tmp_path):
    from cake_rmsnorm.build import verify
    lib = tmp_path / "lib.so"
    lib.write_bytes(b"\x7fELF pretend")
    wheel = build_native.write_native_wheel(lib, "2.11.0", tmp_path / "out")
    assert verify._verify_wheel(wheel, None, tmp_path / "no-cuobjdump") == []
    broken = tmp_path / wheel.name
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(broken, "w") as dst:
        for item in src.infolist():
            if not item.filename.endswith(build_native.LIBRARY_NAME):
                dst.writestr(item, src.read(item))
    problems = verify._verify_wheel(broken, None, tmp_path / "no-cuobjdump")
    assert any(f"lacks {native.PACKAGE}/{build_native.LIBRARY_NAME}" in p for p in problems)


ENTRIES_C = r"""
#include <stdint.h>
static int64_t seen_hidden;
int ok(const void* a, void* s) { return 0; }
int failed(const void* a, void* s) { return 700; }
int ok_h(const void* a, int32_t h, void* s) { seen_hidden = h; return 0; }
int64_t last_hidden(void) { int64_t h = seen_hidden; seen_hidden = 0; return h; }
"""


@pytest.fixture
def entries(tmp_path):
    """Entry points with the ABI's signatures that succeed, fail (CUDA error 700), or take H."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    (tmp_path / "entries.c").write_text(ENTRIES_C)
    out = tmp_path / "libentries.so"
    subprocess.run([cc, "-shared", "-fPIC", str(tmp_path / "entries.c"), "-o", str(out)], check=True)
    lib = ctypes.CDLL(str(out))
    lib.last_hidden.restype = ctypes.c_int64
    return lib, {name: ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
                 for name in ("ok", "failed", "ok_h")}


def test_the_step_reports_failed_launches_and_passes_hidden(native_library, entries, monkeypatch):
    monkeypatch.setenv(native.ENV_LIB, str(native_library))
    op = native.step_op()
    lib, at = entries
    x = torch.zeros(4, 8, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(8, requires_grad=True)
    with pytest.raises(RuntimeError, match="the forward launch failed with CUDA error 700"):
        op(x, None, w, 1e-6, at["failed"], at["ok"], 0, 0, 0, 0)
    [y] = op(x, None, w, 1e-6, at["ok"], at["failed"], 0, 0, 0, 0)
    with pytest.raises(RuntimeError, match="the backward launch failed with CUDA error 700"):
        torch.autograd.grad(y, (x, w), torch.ones_like(y))
    [y] = op(x, None, w, 1e-6, at["ok_h"], at["ok_h"], 8, 0, 0, 0)  # a generic library's calls
    assert lib.last_hidden() == 8  # (and cleared)
    dx, dw = torch.autograd.grad(y, (x, w), torch.ones_like(y))
    assert dx.shape == x.shape and dw.shape == w.shape and lib.last_hidden() == 8
    with torch.no_grad():  # no gradient wanted: no backward entry needed, no node made
        [y] = op(x, None, w, 1e-6, at["ok"], 0, 0, 0, 0, 0)
    assert y.grad_fn is None
