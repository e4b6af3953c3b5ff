"""verify: wheels, build trees and installed providers; every problem names the file at fault."""

from __future__ import annotations

import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from cake_rmsnorm import __version__
from cake_rmsnorm.build.toolchain import find_cudart_dir, preflight
from cake_rmsnorm.build.verify import check_sass, verify_installed, verify_path
from cake_rmsnorm.build.wheel import write_wheels

from test_build import ARCH, WIDTHS, require_toolchain, shared_build

pytestmark = pytest.mark.toolchain


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return shared_build(tmp_path_factory)


@pytest.fixture(scope="module")
def wheels(built, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheels")
    write_wheels([ARCH], out, built.build_dir, built.source_root, widths=WIDTHS)
    return out


def _provider(folder: Path) -> Path:
    return next(folder.glob("cake_rmsnorm_sm90a-*.whl"))


def _rewrite(src: Path, dst: Path, member_filter) -> None:
    """Copy a wheel, passing each member's bytes through member_filter(name, data)."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            zout.writestr(info, member_filter(info.filename, zin.read(info.filename)))


def test_built_wheels_and_tree_verify_clean(built, wheels):
    assert verify_path(wheels, widths=WIDTHS) == []
    assert verify_path(built.build_dir) == []
    assert verify_path(built.tree.root) == []


@pytest.mark.faults
def test_full_plan_reports_missing_libraries(wheels):
    problems = verify_path(_provider(wheels))
    assert problems and all("of the plan is missing" in p for p in problems)


@pytest.mark.faults
def test_corrupted_library_in_a_wheel_is_named(wheels, tmp_path):
    victim = "lib/" + sorted(_names(wheels))[0]

    def corrupt(name, data):
        return data[:4096] + bytes([data[4096] ^ 0xFF]) + data[4097:] if name.endswith(victim) else data
    bad = tmp_path / _provider(wheels).name
    _rewrite(_provider(wheels), bad, corrupt)
    problems = verify_path(bad, widths=WIDTHS)
    assert any(victim in p and "RECORD" in p for p in problems), problems
    assert any(victim in p and "sha256" in p for p in problems), problems


@pytest.mark.faults
def test_corrupted_library_in_a_build_tree_is_named(built, tmp_path):
    copy = tmp_path / ARCH
    shutil.copytree(built.tree.root, copy, ignore=shutil.ignore_patterns("cmake", "gen"))
    victim = sorted(copy.glob("lib/*.so"))[0]
    data = bytearray(victim.read_bytes())
    data[4096] ^= 0xFF
    victim.write_bytes(bytes(data))
    problems = verify_path(tmp_path)
    assert len(problems) >= 1 and all(victim.name in p for p in problems), problems


@pytest.mark.faults
def test_wrong_version_in_manifest_is_reported(wheels, tmp_path):
    bad = tmp_path / _provider(wheels).name

    def bump(name, data):
        return data.replace(f'"version": "{__version__}"'.encode(), b'"version": "0.0.0"') \
            if name.endswith("manifest.json") else data
    _rewrite(_provider(wheels), bad, bump)
    problems = verify_path(bad, widths=WIDTHS)
    assert any("version 0.0.0" in p for p in problems), problems


@pytest.mark.faults
def test_ptx_and_foreign_sass_are_reported(tmp_path):
    require_toolchain()
    tc = preflight([ARCH], need_cuobjdump=True)
    src = tmp_path / "k.cu"
    src.write_text("__global__ void k(float* p) { p[threadIdx.x] *= 2.0f; }\n")
    lib = tmp_path / "libk.so"
    subprocess.run([str(tc.nvcc), "-shared", "-Xcompiler", "-fPIC", "-cudart", "none",
                    "-gencode", "arch=compute_100a,code=[sm_100a,compute_100a]", str(src),
                    "-o", str(lib)], check=True, capture_output=True)
    problems = check_sass(lib, ARCH, tc.cuobjdump)
    assert any("another arch" in p and "sm_100a" in p for p in problems), problems
    assert any("holds PTX" in p for p in problems), problems
    assert all(str(lib) in p for p in problems)


def test_installed_providers(wheels, tmp_path, monkeypatch):
    assert find_cudart_dir() is not None
    site = tmp_path / "site"
    with zipfile.ZipFile(_provider(wheels)) as zf:
        zf.extractall(site)
    monkeypatch.syspath_prepend(str(site))
    assert verify_installed(widths=WIDTHS) == []
    victim = sorted((site / "cake_rmsnorm_sm90a" / "lib").glob("*.so"))[-1]
    victim.write_bytes(victim.read_bytes()[:-16])
    problems = verify_installed(widths=WIDTHS)
    assert problems and all(victim.name in p for p in problems), problems


@pytest.mark.faults
def test_nothing_installed_is_a_problem(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("cake_rmsnorm_") else real(name, *a))
    assert any("pip install" in p for p in verify_installed())


def _names(wheels: Path):
    with zipfile.ZipFile(_provider(wheels)) as zf:
        return [Path(n).name for n in zf.namelist() if n.endswith(".so")]
