"""Load-time faults that must be one clear error at first use, never a crash or a wrong result:
a driver too old for the CUDA 13 runtime, and two copies of one arch's provider at different
versions on sys.path."""

import importlib.machinery
import sys

import pytest

from cake_rmsnorm import __version__
from cake_rmsnorm.errors import ProviderError
from cake_rmsnorm.manifest import MANIFEST_NAME, SCHEMA_VERSION, Manifest
from cake_rmsnorm.registry import load_registry
from cake_rmsnorm.runtime import loader

pytestmark = pytest.mark.faults
ARCH = load_registry().arch("sm_90a")
PACKAGE = "cake_rmsnorm_sm90a"


@pytest.mark.parametrize("version, says", [(12080, "supports CUDA 12.8"),
                                           (0, "is missing")])
def test_driver_too_old_names_the_version_needed(version, says):
    with pytest.raises(ProviderError, match=rf"driver {says}.*CUDA 13\.0 or newer.*R580"):
        loader._check_driver(version)


def test_driver_new_enough_passes():
    loader._check_driver(13000)
    loader._check_driver(13050)


def test_too_old_driver_is_refused_before_any_library_loads(monkeypatch):
    if not any(p.is_file() for p in loader._cudart_candidates()):
        pytest.skip("no libcudart.so.13 from the nvidia-cuda-runtime wheel here")
    monkeypatch.setattr(loader, "_cudart", None)
    monkeypatch.setattr(loader, "_driver_cuda_version", lambda cudart: 12020)
    with pytest.raises(ProviderError, match="supports CUDA 12.2"):
        loader.ensure_cudart()
    assert loader._cudart is None  # nothing cached: a later call checks again


def _copy(root, version):
    pkg = root / PACKAGE
    pkg.mkdir(parents=True)
    (pkg / MANIFEST_NAME).write_text(Manifest(SCHEMA_VERSION, version, ARCH.name, "13.5.37",
                                              ()).to_json())
    return pkg


@pytest.fixture
def two_sites(tmp_path, monkeypatch):
    monkeypatch.delenv(loader.ENV_PROVIDER_DIR, raising=False)

    def make(first_version, second_version):
        first = _copy(tmp_path / "site-a", first_version)
        second = _copy(tmp_path / "site-b", second_version)
        monkeypatch.setattr(sys, "path", [str(tmp_path / "site-a"), str(tmp_path / "site-b")])
        spec = importlib.machinery.ModuleSpec(PACKAGE, None, is_package=True)
        spec.submodule_search_locations = [str(first)]
        monkeypatch.setattr(loader, "_find_spec", lambda name: spec if name == PACKAGE else None)
        return first, second
    return make


def test_two_providers_at_different_versions_are_refused(two_sites):
    first, second = two_sites(__version__, "0.0.1")
    with pytest.raises(ProviderError) as info:
        loader.locate(ARCH)
    message = str(info.value)
    assert f"{first} (version {__version__})" in message
    assert f"{second} (version 0.0.1)" in message
    assert "pip uninstall cake-rmsnorm-sm90a" in message


def test_two_copies_at_one_version_load_the_first(two_sites):
    first, _ = two_sites(__version__, __version__)
    assert loader.locate(ARCH) == first.resolve()
