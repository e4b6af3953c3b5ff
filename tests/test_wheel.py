"""Wheels: reproducible to the byte, complete, atomic, and refused when the build is incomplete."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import zipfile
from pathlib import Path

import pytest

from cake_rmsnorm import __version__
from cake_rmsnorm.build import atomic
from cake_rmsnorm.build import wheel as wheel_mod
from cake_rmsnorm.build.layout import default_source_root
from cake_rmsnorm.build.wheel import write_wheels
from cake_rmsnorm.errors import PackagingError
from cake_rmsnorm.manifest import Manifest
from cake_rmsnorm.registry import load_registry

from test_build import ARCH, WIDTHS, shared_build

PROVIDER = f"cake_rmsnorm_sm90a-{__version__}-py3-none-{wheel_mod.PLATFORM}.whl"
SHIM = f"cake_rmsnorm-{__version__}-py3-none-any.whl"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return shared_build(tmp_path_factory)


def _digests(folder: Path):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*.whl"))}


# ---- the shim alone: no toolchain --------------------------------------------------------------

def test_shim_wheel_is_reproducible_and_complete(tmp_path):
    a = write_wheels([], tmp_path / "a", tmp_path / "build")
    write_wheels([], tmp_path / "b", tmp_path / "build")
    assert [p.name for p in a] == [SHIM] and _digests(tmp_path / "a") == _digests(tmp_path / "b")
    with zipfile.ZipFile(a[0]) as zf:
        names = zf.namelist()
        assert "cake_rmsnorm/registry/data/routes.toml" in names
        assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
        assert names[-1] == f"cake_rmsnorm-{__version__}.dist-info/RECORD"
        assert all(i.date_time == (1980, 1, 1, 0, 0, 0) for i in zf.infolist())
        meta = zf.read(f"cake_rmsnorm-{__version__}.dist-info/METADATA").decode()
        entry = zf.read(f"cake_rmsnorm-{__version__}.dist-info/entry_points.txt").decode()
    for arch in load_registry().archs:
        assert f"Provides-Extra: {arch.tag}\n" in meta
        assert f'Requires-Dist: cake-rmsnorm-{arch.tag}=={__version__}; extra == "{arch.tag}"' in meta
    assert f"Version: {__version__}\n" in meta and "Requires-Python: >=3.11" in meta
    assert "cake-rmsnorm = cake_rmsnorm.cli:main" in entry


def test_source_date_epoch_sets_the_timestamp(tmp_path, monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    (path,) = write_wheels([], tmp_path, tmp_path / "build")
    with zipfile.ZipFile(path) as zf:
        assert {i.date_time for i in zf.infolist()} == {(2023, 11, 14, 22, 13, 20)}


@pytest.mark.faults
def test_full_disk_leaves_no_partial_wheel(tmp_path, monkeypatch):
    """The disk fills after the first bytes of the wheel file: nothing is left in the folder."""
    real_fdopen = os.fdopen

    class FillsUp:
        def __init__(self, fh):
            self.fh = fh

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fh.close()

        def fileno(self):
            return self.fh.fileno()

        def write(self, data):
            self.fh.write(data[:100])
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic.os, "fdopen", lambda fd, mode: FillsUp(real_fdopen(fd, mode)))
    with pytest.raises(OSError, match="No space left"):
        write_wheels([], tmp_path / "out", tmp_path / "build")
    assert list((tmp_path / "out").iterdir()) == []


@pytest.mark.faults
def test_unbuilt_arch_is_refused(tmp_path):
    with pytest.raises(PackagingError, match=r"sm_90a is not built"):
        write_wheels([ARCH], tmp_path / "out", tmp_path / "build", default_source_root())
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


# ---- provider wheels ---------------------------------------------------------------------------

@pytest.mark.toolchain
def test_wheels_twice_are_identical(built, tmp_path):
    first = write_wheels([ARCH], tmp_path / "one", built.build_dir, built.source_root, widths=WIDTHS)
    second = write_wheels([ARCH], tmp_path / "two", built.build_dir, built.source_root, widths=WIDTHS)
    assert [p.name for p in first] == [SHIM, PROVIDER] == [p.name for p in second]
    assert _digests(tmp_path / "one") == _digests(tmp_path / "two")


@pytest.mark.toolchain
def test_provider_wheel_holds_manifest_and_libraries(built, tmp_path):
    write_wheels([ARCH], tmp_path, built.build_dir, built.source_root, widths=WIDTHS)
    record = json.loads(built.tree.record.read_text())
    with zipfile.ZipFile(tmp_path / PROVIDER) as zf:
        manifest = Manifest.from_json(zf.read("cake_rmsnorm_sm90a/manifest.json").decode())
        init = zf.read("cake_rmsnorm_sm90a/__init__.py").decode()
        meta = zf.read(f"cake_rmsnorm_sm90a-{__version__}.dist-info/METADATA").decode()
        wheel_meta = zf.read(f"cake_rmsnorm_sm90a-{__version__}.dist-info/WHEEL").decode()
        modes = {i.filename: (i.external_attr >> 16) & 0o777 for i in zf.infolist()}
        for entry in manifest.libraries:
            data = zf.read(f"cake_rmsnorm_sm90a/{entry.file}")
            assert hashlib.sha256(data).hexdigest() == entry.sha256
            assert modes[f"cake_rmsnorm_sm90a/{entry.file}"] == 0o755
    assert 'ARCH = "sm_90a"' in init
    assert "Requires-Dist: nvidia-cuda-runtime>=13.0,<14" in meta
    assert "Root-Is-Purelib: false" in wheel_meta
    assert manifest.arch == ARCH and manifest.version == __version__
    assert manifest.toolkit == record["toolkit"]
    by_name = {e["name"]: e for e in record["libraries"]}
    assert [e.name for e in manifest.libraries] == [lib.name for lib in built.libs()]
    for entry in manifest.libraries:
        assert entry.registers == by_name[entry.name]["registers"] > 0


@pytest.mark.toolchain
def test_missing_library_of_the_plan_is_named(built, tmp_path):
    # The shared build holds H 256 and the generic libraries (H 0) only; the full plan needs
    # every width.
    missing = next(lib.name for lib in load_registry().libraries(ARCH)
                   if lib.hidden not in (256, 0))
    with pytest.raises(PackagingError, match=missing):
        write_wheels([ARCH], tmp_path, built.build_dir, built.source_root)
    assert not list(tmp_path.glob("*.whl")) and not list(tmp_path.glob(".*"))
