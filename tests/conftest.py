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
