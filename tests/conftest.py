"""Fixtures shared by the CPU tests."""

import shutil

import pytest

from cake_rmsnorm.registry import load_registry
from cake_rmsnorm.registry.load import DATA_DIR


@pytest.fixture
def reg():
    return load_registry()


@pytest.fixture
def scratch(tmp_path):
    """A writable copy of the registry data; returns (dir, edit(file, old, new))."""
    data = tmp_path / "data"
    shutil.copytree(DATA_DIR, data)

    def edit(name, old, new):
        path = data / name
        text = path.read_text()
        assert old in text, f"{old!r} not in {name}"
        path.write_text(text.replace(old, new, 1))
    return data, edit


@pytest.fixture(scope="session")
def native_library(tmp_path_factory):
    """csrc/native/eager_step.cpp built against the installed torch (once per session: a process
    can register its op namespace once)."""
    pytest.importorskip("torch")
    from cake_rmsnorm.build import native
    if not (shutil.which("g++") or shutil.which("c++")):
        pytest.skip("no C++ compiler")
    out = tmp_path_factory.mktemp("native") / native.LIBRARY_NAME
    return native.compile_native(native.installed_torch(), out)

