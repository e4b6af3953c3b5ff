"""The CI build matrix (ci/matrix.toml, cake_rmsnorm.matrix, `cake-rmsnorm matrix`), the wheelhouse
writer (ci/wheelhouse.py) on small fake wheels, and the workflow that reads the matrix. CPU only."""

import fnmatch
import hashlib
import importlib.util
import json
import platform
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from cake_rmsnorm.build import wheel as wheel_mod
from cake_rmsnorm.cli import main
from cake_rmsnorm.errors import CakeError, PackagingError
from cake_rmsnorm.manifest import LibraryEntry, Manifest, SCHEMA_VERSION
from cake_rmsnorm.matrix import MatrixError, default_matrix_path, load_matrix

ROOT = Path(__file__).resolve().parents[1]
MATRIX = ROOT / "ci" / "matrix.toml"
WORKFLOW = ROOT / ".github" / "workflows" / "build-wheels.yml"


def _load_wheelhouse():
    spec = importlib.util.spec_from_file_location("ci_wheelhouse", ROOT / "ci" / "wheelhouse.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


wh = _load_wheelhouse()


# ---- the matrix ------------------------------------------------------------------------------
def test_default_path_is_the_checkouts_matrix():
    assert default_matrix_path().resolve() == MATRIX.resolve()


def test_cells_are_registry_archs_times_platforms(reg):
    matrix = load_matrix()
    platforms = [p.id for p in matrix.platforms]
    assert {p.machine for p in matrix.platforms} >= {"x86_64", "aarch64"}
    assert len(reg.archs) >= 4
    providers = [c for c in matrix.cells if c.kind == "provider"]
    assert len(providers) == len(reg.archs) * len(matrix.platforms)
    expected = [f"{a.tag}-{p}" for a in reg.archs for p in platforms]
    assert [c.identifier for c in providers] == expected
    for cell in providers:
        assert cell.arch == reg.arch(cell.arch).name and cell.arch_tag == reg.arch(cell.arch).tag
        assert cell.toolkit is matrix.toolkit


def test_native_cells_are_torch_releases_times_platforms():
    """After the provider cells: one native cell per torch release of [native] and host platform."""
    matrix = load_matrix()
    releases = tomllib.loads(MATRIX.read_text())["native"]["torch"]
    assert releases and matrix.native.torch == tuple(releases)
    expected = [f"native-torch{t}-{p.id}" for t in releases for p in matrix.platforms]
    kinds = [c.kind for c in matrix.cells]
    assert kinds == sorted(kinds, key=["provider", "native"].index)
    natives = [c for c in matrix.cells if c.kind == "native"]
    assert [c.identifier for c in natives] == expected
    for cell in natives:
        assert cell.torch in releases and cell.platform in matrix.platforms
        assert matrix.cell(cell.identifier) is cell


def test_without_a_native_table_there_are_no_native_cells(tmp_path):
    path = tmp_path / "matrix.toml"
    path.write_text(re.sub(r"(?m)^\[native\]\ntorch = .*\n", "", MATRIX.read_text()))
    matrix = load_matrix(path)
    assert matrix.native.torch == () and {c.kind for c in matrix.cells} == {"provider"}


def test_matrix_file_lists_no_arch(reg):
    """The archs are the registry's: the data part of the matrix names none."""
    data = "\n".join(line.split("#", 1)[0] for line in MATRIX.read_text().splitlines())
    for arch in reg.archs:
        assert arch.name not in data and arch.tag not in data


def test_native_platform_tag_is_what_the_packager_writes():
    matrix = load_matrix()
    native = [p for p in matrix.platforms if p.machine == platform.machine()]
    if not native:
        pytest.skip(f"the matrix has no {platform.machine()} platform")
    assert native[0].wheel_tag == wheel_mod.PLATFORM


def test_toolkit_pins_its_nvcc_and_runtime():
    toolkit = load_matrix().toolkit
    assert f"nvidia-cuda-nvcc=={toolkit.nvcc}" in toolkit.requirements
    assert toolkit.runtime.startswith("nvidia-cuda-runtime==")
    assert any(r.startswith("nvidia-cuda-cuobjdump==") for r in toolkit.verify_tools)


def test_pip_platforms_admit_older_manylinux_tags():
    for p in load_matrix().platforms:
        tags = p.pip_platforms
        assert tags[0] == p.wheel_tag and f"manylinux2014_{p.machine}" in tags
        assert all(t.endswith(p.machine) for t in tags)


@pytest.mark.parametrize("glob", ["*", "sm10*-*_x86_64", "*aarch64", "sm90a-*", "*-manylinux_x86_64",
                                  "native-*", "native-torch*-*_aarch64"])
def test_select_glob(glob):
    matrix = load_matrix()
    chosen = matrix.select(glob)
    assert [c.identifier for c in chosen] == [i for i in matrix.identifiers
                                              if fnmatch.fnmatchcase(i, glob)]
    assert chosen


def test_select_several_globs_keeps_matrix_order():
    matrix = load_matrix()
    first, last = matrix.identifiers[0], matrix.identifiers[-1]
    for spec in (f"{last} {first}", f"{last},{first}", [last, first]):
        assert [c.identifier for c in matrix.select(spec)] == [first, last]
    assert matrix.select(None) == matrix.cells


def test_select_nothing_is_an_error():
    with pytest.raises(MatrixError, match=r"--select 'sm11\*' matches no cell.*cells: "):
        load_matrix().select("sm11*")


def test_unknown_cell():
    matrix = load_matrix()
    assert matrix.cell(matrix.identifiers[0]) is matrix.cells[0]
    with pytest.raises(MatrixError, match="no cell 'sm100a-windows'"):
        matrix.cell("sm100a-windows")


def test_builds_on():
    for p in load_matrix().platforms:
        assert p.builds_on(p.machine) == "native"
        for m in p.cross_from:
            assert p.builds_on(m) == "cross"


# ---- bad matrix data -------------------------------------------------------------------------
BAD = [
    ("schema = 1", "schema = 2", r"schema = 2; this cake-rmsnorm reads 1"),
    ('id = "cu13"', 'id = "cu13"\ncolour = "blue"', r"\[toolkit\]: unknown colour; accepted fields"),
    ('nvcc = "13.5.37"', 'nvcc = "13.5"', r"nvcc = '13.5': expected a full nvcc version"),
    ('machine = "aarch64"', 'machine = "arm64"', r"machine = 'arm64': expected one of x86_64, aarch64"),
    ('wheel_tag = "manylinux_2_28_aarch64"', 'wheel_tag = "manylinux_2_28_x86_64"',
     r"(does not end in its machine|share a wheel_tag)"),
    ('wheel_tag = "manylinux_2_28_aarch64"', 'wheel_tag = "linux_aarch64"',
     r"wheel_tag = 'linux_aarch64': expected a tag like manylinux_2_28_<machine>"),
    ('id = "manylinux_aarch64"', 'id = "manylinux_x86_64"', r"platform id\(s\) manylinux_x86_64 appear"),
    ('id = "manylinux_aarch64"', 'id = "Many-Linux"', r"id = 'Many-Linux': expected lower-case"),
    ('cross_from = ["x86_64"]', 'cross_from = ["aarch64"]', r"aarch64 is not another known machine"),
    ('cross_compiler = "ziglang==0.17.1"', '', r"cross_compiler \(a pip pin\) is required"),
    ('runtime = "nvidia-cuda-runtime==13.5.37"', 'runtime = "nvidia-cuda-runtime>=13"',
     r"runtime = 'nvidia-cuda-runtime>=13': expected a pip pin"),
    ("skip = []", 'skip = ["sm1*-nowhere"]', r"skip 'sm1\*-nowhere' matches no cell"),
    ("skip = []", 'skip = ["*"]', r"removes every cell"),
    ("[toolkit]", "[toolkits]", r"missing toolkit; unknown toolkits"),
    ("[[platform]]", "[[platform]", r"not valid TOML"),
    ('torch = ["2.11.0"]', 'torch = ["2.11"]',
     r"\[native\]: torch = \['2\.11'\]: expected a list of torch releases like 2\.11\.0"),
    ('torch = ["2.11.0"]', 'torch = ["2.11.0", "2.10.0", "2.11.0"]',
     r"\[native\]: torch = \['2\.11\.0', '2\.10\.0', '2\.11\.0'\]: release\(s\) 2\.11\.0 appear "
     r"more than once"),
    ('torch = ["2.11.0"]', 'torch = "2.11.0"', r"\[native\]: torch = '2\.11\.0': expected a list"),
    ('torch = ["2.11.0"]', 'torch = ["2.11.0"]\narch = "sm_90a"',
     r"\[native\]: unknown arch; accepted fields: torch"),
]


@pytest.mark.parametrize("old, new, message", BAD)
def test_bad_matrix_data_is_a_clear_error(tmp_path, old, new, message):
    text = MATRIX.read_text()
    assert old in text
    path = tmp_path / "matrix.toml"
    path.write_text(text.replace(old, new, 1))
    with pytest.raises(MatrixError, match=message) as info:
        load_matrix(path)
    assert str(path) in str(info.value)
    assert isinstance(info.value, CakeError) and isinstance(info.value, ValueError)


def test_missing_matrix_file(tmp_path):
    with pytest.raises(MatrixError, match=r"cannot read the build matrix .*pass --matrix PATH"):
        load_matrix(tmp_path / "nope.toml")


def test_skip_removes_native_cells(tmp_path):
    path = tmp_path / "matrix.toml"
    path.write_text(MATRIX.read_text().replace("skip = []", 'skip = ["native-*_aarch64"]', 1))
    gone = set(load_matrix().identifiers) - set(load_matrix(path).identifiers)
    assert gone and all(i.startswith("native-") and i.endswith("_aarch64") for i in gone)


def test_skip_removes_cells(tmp_path):
    path = tmp_path / "matrix.toml"
    path.write_text(MATRIX.read_text().replace("skip = []", 'skip = ["sm90a-*aarch64"]', 1))
    full, skipped = load_matrix(), load_matrix(path)
    gone = set(full.identifiers) - set(skipped.identifiers)
    assert gone == {i for i in full.identifiers if fnmatch.fnmatchcase(i, "sm90a-*aarch64")}
    assert gone


# ---- the CLI ---------------------------------------------------------------------------------
def test_cli_print_build_identifiers(capsys):
    assert main(["matrix", "--print-build-identifiers"]) == 0
    assert capsys.readouterr().out.split() == list(load_matrix().identifiers)


def test_cli_select(capsys):
    assert main(["matrix", "--print-build-identifiers", "--select", "*_x86_64"]) == 0
    out = capsys.readouterr().out.split()
    assert out == [i for i in load_matrix().identifiers if i.endswith("_x86_64")]


PROVIDER_JOB_FIELDS = {"identifier", "kind", "arch", "arch_tag", "platform", "machine", "wheel_tag",
                       "runner", "cross_from", "cross_compiler", "toolkit", "nvcc",
                       "toolkit_requirements", "runtime", "verify_tools"}


def test_cli_json_is_one_line_job_matrix(capsys):
    assert main(["matrix", "--print-build-identifiers", "--json"]) == 0
    text = capsys.readouterr().out
    assert text.count("\n") == 1  # $GITHUB_OUTPUT takes one line
    cells = json.loads(text)["include"]
    matrix = load_matrix()
    assert [c["identifier"] for c in cells] == list(matrix.identifiers)
    assert {c["kind"] for c in cells} == {"provider", "native"}
    for entry, cell in zip(cells, matrix.cells):
        assert entry["kind"] == cell.kind
        assert entry["runner"] == cell.platform.runner and entry["machine"] == cell.platform.machine
        assert entry["wheel_tag"] == cell.platform.wheel_tag
        if cell.kind == "provider":  # the fields run-cell.sh and run-matrix.sh have always read
            assert set(entry) == PROVIDER_JOB_FIELDS and entry["arch"] == cell.arch
        else:  # a native cell needs no toolkit
            assert entry["torch"] == cell.torch and "nvcc" not in entry


def test_cli_select_native_cells(capsys):
    assert main(["matrix", "--print-build-identifiers", "--select", "native-*", "--json"]) == 0
    cells = json.loads(capsys.readouterr().out)["include"]
    assert cells and all(c["kind"] == "native" for c in cells)
    natives = [c for c in load_matrix().cells if c.kind == "native"]
    assert [c["torch"] for c in cells] == [c.torch for c in natives]
    assert main(["matrix", "--select", "native-*"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(cells)
    assert all(f"torch {c['torch']}" in line for c, line in zip(cells, lines))


def test_cli_bad_select_exits_2(capsys):
    assert main(["matrix", "--print-build-identifiers", "--select", "sm11*"]) == 2
    assert "matches no cell" in capsys.readouterr().err


def test_cli_matrix_option(tmp_path, capsys):
    path = tmp_path / "m.toml"
    path.write_text(MATRIX.read_text().replace("skip = []", 'skip = ["*aarch64"]', 1))
    assert main(["matrix", "--print-build-identifiers", "--matrix", str(path)]) == 0
    assert all(i.endswith("_x86_64") for i in capsys.readouterr().out.split())


# ---- the packager's platform tag (cross-built cells) ----------------------------------------
def test_wheel_platform_default_and_override(monkeypatch):
    monkeypatch.delenv(wheel_mod.PLATFORM_ENV, raising=False)
    assert wheel_mod.wheel_platform() == wheel_mod.PLATFORM
    for p in load_matrix().platforms:
        monkeypatch.setenv(wheel_mod.PLATFORM_ENV, p.wheel_tag)
        assert wheel_mod.wheel_platform() == p.wheel_tag
    monkeypatch.setenv(wheel_mod.PLATFORM_ENV, "win_amd64")
    with pytest.raises(PackagingError, match=r"CAKE_RMSNORM_WHEEL_PLATFORM = 'win_amd64': expected"):
        wheel_mod.wheel_platform()


# ---- the wheelhouse, on fake wheels ----------------------------------------------------------
EM = {"x86_64": 62, "aarch64": 183}


def fake_library(machine: str, glibc: str = "2.17", glibcxx: str = "3.4.21") -> bytes:
    header = b"\x7fELF" + bytes([2, 1, 1, 0]) + bytes(8) + (3).to_bytes(2, "little")
    header += EM[machine].to_bytes(2, "little")
    names = f"\0libc.so.6\0GLIBC_{glibc}\0GLIBC_2.2\0libstdc++.so.6\0GLIBCXX_{glibcxx}\0"
    return header + bytes(44) + names.encode() + bytes(64)


def fake_wheel(folder: Path, dist: str, version: str, plat: str, files: dict) -> Path:
    path = folder / f"{dist}-{version}-py3-none-{plat}.whl"
    folder.mkdir(parents=True, exist_ok=True)
    files = dict(files)
    files[f"{dist}-{version}.dist-info/WHEEL"] = f"Wheel-Version: 1.0\nTag: py3-none-{plat}\n".encode()
    with zipfile.ZipFile(path, "w") as zf:
        for name in sorted(files):
            zf.writestr(zipfile.ZipInfo(name, (1980, 1, 1, 0, 0, 0)), files[name])
    return path


def fake_shim(folder: Path, version: str = "1.2.3") -> Path:
    return fake_wheel(folder, "cake_rmsnorm", version, "any",
                      {"cake_rmsnorm/__init__.py": b"__version__ = '%s'\n" % version.encode()})


def fake_provider(folder: Path, arch: str, machine: str, n_libs: int = 3, version: str = "1.2.3",
                  lib_machine: str = None, glibc: str = "2.17", pad: int = 0) -> Path:
    tag = arch.replace("_", "")
    pkg = f"cake_rmsnorm_{tag}"
    files, entries = {}, []
    for i in range(n_libs):
        data = fake_library(lib_machine or machine, glibc) + bytes(pad) + bytes([i])
        name = f"prog{i}_h256_fp32"
        files[f"{pkg}/lib/lib{name}.so"] = data
        entries.append(LibraryEntry(name=name, program=f"prog{i}", H=256, weight_dtype="fp32",
                                    residual=False, smem_bytes=1024, oversized=False, registers=32,
                                    file=f"lib/lib{name}.so",
                                    sha256=hashlib.sha256(data).hexdigest()))
    manifest = Manifest(SCHEMA_VERSION, version, arch, "13.5.37", tuple(entries))
    files[f"{pkg}/manifest.json"] = manifest.to_json().encode()
    return fake_wheel(folder, pkg, version, f"manylinux_2_28_{machine}", files)


def fake_native(folder: Path, torch: str = "2.11.0", machine: str = "x86_64", version: str = "1.2.3",
                glibc: str = "2.17", plat: str = None, requires: str = None,
                glibcxx: str = "3.4.21") -> Path:
    """A cake-rmsnorm-native wheel as build/native.py writes it: <ours>+torch<T>, one library."""
    full = f"{version}+torch{torch}"
    metadata = (f"Name: cake-rmsnorm-native\nVersion: {full}\n"
                f"Requires-Dist: {requires or f'torch=={torch}'}\n")
    return fake_wheel(folder, wh.NATIVE_DIST, full, plat or f"manylinux_2_28_{machine}", {
        f"{wh.NATIVE_DIST}/__init__.py": f"TORCH_VERSION = '{torch}'\n".encode(),
        f"{wh.NATIVE_DIST}/{wh.NATIVE_LIBRARY}": fake_library(machine, glibc, glibcxx),
        f"{wh.NATIVE_DIST}-{full}.dist-info/METADATA": metadata.encode()})


@pytest.fixture
def cells(tmp_path):
    """Two cells' output folders (each with the same shim) and a dependency folder."""
    a, b, deps = tmp_path / "cells" / "a", tmp_path / "cells" / "b", tmp_path / "deps"
    fake_shim(a)
    fake_provider(a, "sm_100a", "x86_64", n_libs=3)
    fake_shim(b)
    fake_provider(b, "sm_103a", "aarch64", n_libs=5)
    fake_wheel(deps, "nvidia_cuda_runtime", "13.5.37",
               "manylinux2014_x86_64.manylinux_2_17_x86_64", {"nvidia/cu13/lib/x": b"x"})
    return tmp_path


def test_wheelhouse_index_and_sums(cells):
    out = cells / "house"
    entries = wh.assemble([cells / "cells"], out, [cells / "deps"])
    names = sorted(p.name for p in out.glob("*.whl"))
    assert names == sorted(e.file for e in entries) and len(names) == 4
    sums = (out / "SHA256SUMS").read_text().splitlines()
    assert sums == [f"{hashlib.sha256((out / n).read_bytes()).hexdigest()}  {n}" for n in names]
    doc = json.loads((out / "index.json").read_text())
    assert doc["version"] == "1.2.3"
    by_file = {w["file"]: w for w in doc["wheels"]}
    for name in names:
        assert by_file[name]["size"] == (out / name).stat().st_size
    providers = {w["arch"]: w for w in doc["wheels"] if w["kind"] == "provider"}
    assert providers["sm_100a"]["libraries"] == 3 and providers["sm_100a"]["machine"] == "x86_64"
    assert providers["sm_103a"]["libraries"] == 5
    assert providers["sm_103a"]["platform"] == "manylinux_2_28_aarch64"
    assert all(w["version"] == "1.2.3" for w in doc["wheels"] if w["kind"] != "dependency")
    assert [w["kind"] for w in doc["wheels"]] == ["shim", "provider", "provider", "dependency"]
    table = (out / "index.md").read_text()
    for name in names:
        assert f"| {name} |" in table
    assert re.search(r"\| sm_103a \| manylinux_2_28_aarch64 \| 1\.2\.3 \| \d+ \| 5 \|", table)


def test_wheelhouse_indexes_native_wheels(cells):
    """One native wheel per (torch release, machine), indexed with its torch, summed, and at our
    version once its +torch tag is set aside."""
    fake_native(cells / "cells" / "n1", machine="x86_64")
    fake_native(cells / "cells" / "n2", machine="aarch64")
    fake_native(cells / "cells" / "n3", torch="2.10.0", machine="x86_64")
    out = cells / "house"
    entries = wh.assemble([cells / "cells"], out, [cells / "deps"])
    natives = [e for e in entries if e.kind == "native"]
    assert [(e.torch, e.machine) for e in natives] == [("2.10.0", "x86_64"), ("2.11.0", "aarch64"),
                                                       ("2.11.0", "x86_64")]
    kinds = ["shim", "provider", "provider", "native", "native", "native", "dependency"]
    assert [e.kind for e in entries] == kinds
    doc = json.loads((out / "index.json").read_text())
    assert doc["version"] == "1.2.3"
    by_file = {w["file"]: w for w in doc["wheels"]}
    for e in natives:
        assert e.version == "1.2.3" and e.file.startswith(f"{wh.NATIVE_DIST}-1.2.3+torch{e.torch}-")
        assert (by_file[e.file]["kind"], by_file[e.file]["torch"]) == ("native", e.torch)
    sums = (out / "SHA256SUMS").read_text()
    for e in natives:
        assert f"{hashlib.sha256((out / e.file).read_bytes()).hexdigest()}  {e.file}\n" in sums
    table = (out / "index.md").read_text()
    for e in natives:
        assert re.search(rf"\| {re.escape(e.file)} \| native \| - \| {e.platform} \| 1\.2\.3 \| "
                         rf"{e.size} \| - \| - \| {re.escape(e.torch)} \|", table)


def test_wheelhouse_is_deterministic(cells):
    first = wh.assemble([cells / "cells" / "a", cells / "cells" / "b"], cells / "h1", [cells / "deps"])
    second = wh.assemble([cells / "cells" / "b", cells / "cells" / "a"], cells / "h2", [cells / "deps"])
    assert first == second
    for name in wh.OWN_FILES:
        assert (cells / "h1" / name).read_bytes() == (cells / "h2" / name).read_bytes()


def test_wheelhouse_replaces_a_former_one_whole(cells):
    out = cells / "house"
    wh.assemble([cells / "cells"], out)
    (out / "stale-0.0.1-py3-none-any.whl").write_bytes(b"old")
    wh.assemble([cells / "cells" / "a"], out)
    assert sorted(p.name for p in out.glob("*.whl")) == sorted(
        p.name for p in (cells / "cells" / "a").glob("*.whl"))


def test_wheelhouse_refuses_a_foreign_folder(cells):
    out = cells / "house"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(wh.WheelhouseError, match=r"holds files a wheelhouse does not \(notes.txt\)"):
        wh.assemble([cells / "cells"], out)
    assert (out / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("make, message", [
    (lambda d: fake_provider(d, "sm_90a", "aarch64", lib_machine="x86_64"),
     r"ELF machine x86_64, the wheel is tagged manylinux_2_28_aarch64"),
    (lambda d: fake_provider(d, "sm_90a", "x86_64", glibc="2.34"),
     r"needs GLIBC_2\.34, newer than its tag manylinux_2_28_x86_64"),
    (lambda d: fake_provider(d, "sm_90a", "x86_64", version="9.9.9"),
     r"several versions \['1\.2\.3', '9\.9\.9'\]"),
    (lambda d: fake_provider(d, "sm_100a", "x86_64", n_libs=2),
     r"two different files under one name"),
    (lambda d: fake_native(d, version="9.9.9"), r"several versions \['1\.2\.3', '9\.9\.9'\]"),
    (lambda d: (fake_native(d / "x"), fake_native(d / "y", plat="manylinux_2_34_x86_64")),
     r"torch 2\.11\.0 on x86_64: several native wheels \['cake_rmsnorm_native-1\.2\.3\+torch2\.11\.0-"),
    (lambda d: fake_native(d, machine="aarch64", plat="manylinux_2_28_x86_64"),
     r"libcake_rmsnorm_native\.so: ELF machine aarch64, the wheel is tagged manylinux_2_28_x86_64"),
    (lambda d: fake_native(d, glibc="2.32"),
     r"libcake_rmsnorm_native\.so: needs GLIBC_2\.32, newer than its tag manylinux_2_28_x86_64"),
    (lambda d: fake_native(d, glibcxx="3.4.29"),
     r"libcake_rmsnorm_native\.so: needs GLIBCXX_3\.4\.29, newer than the GLIBCXX_3\.4\.25 of "
     r"manylinux_2_28's libstdc\+\+"),
    (lambda d: fake_native(d, requires="torch>=2.11"),
     r"does not say Requires-Dist: torch==2\.11\.0, which its version \+torch2\.11\.0 promises"),
    (lambda d: fake_wheel(d, wh.NATIVE_DIST, "1.2.3", "manylinux_2_28_x86_64", {}),
     r"version '1\.2\.3': a native wheel's is <ours>\+torch<release>"),
])
def test_wheelhouse_refuses_inconsistent_wheels(cells, make, message):
    make(cells / "cells" / "c")
    with pytest.raises(wh.WheelhouseError, match=message):
        wh.assemble([cells / "cells"], cells / "house")
    assert not (cells / "house").exists()


def test_wheelhouse_size_limits(cells, monkeypatch):
    monkeypatch.setattr(wh, "PROVIDER_MAX_BYTES", 100)
    with pytest.raises(wh.WheelhouseError, match=r"over the 100 limit"):
        wh.assemble([cells / "cells"], cells / "house")


def test_wheelhouse_native_size_limit(cells, monkeypatch):
    native = fake_native(cells / "cells" / "n")
    monkeypatch.setattr(wh, "NATIVE_MAX_BYTES", native.stat().st_size - 1)
    with pytest.raises(wh.WheelhouseError, match=rf"{re.escape(native.name)}: \d+ bytes, over the "
                                                 rf"{native.stat().st_size - 1} limit"):
        wh.assemble([cells / "cells"], cells / "house")


def test_check_takes_a_native_cell_alone(cells, capsys):
    """A native cell has no shim beside it: `check` holds each wheel to its own checks, `assemble`
    wants the shim too."""
    cell = cells / "native-cell"
    fake_native(cell)
    assert [e.kind for e in wh.check([cell])] == ["native"]
    assert wh.main(["check", str(cell)]) == 0
    assert "native torch 2.11.0" in capsys.readouterr().out
    with pytest.raises(wh.WheelhouseError, match="no cake-rmsnorm shim wheel"):
        wh.assemble([cell], cells / "house")
    fake_native(cells / "bad", glibc="2.34")
    assert wh.main(["check", str(cells / "bad")]) == 2
    assert "needs GLIBC_2.34" in capsys.readouterr().err


def test_the_built_native_library_makes_a_wheel_check_accepts(native_library, tmp_path):
    """The library built against the installed torch: its wheel's tag covers the glibc it names
    (wheelhouse's own reading of tag and library), and its libstdc++ stays within manylinux_2_28's."""
    from cake_rmsnorm.build import elf, native as build_native
    wheel = build_native.write_native_wheel(native_library, "2.11.0", tmp_path)
    assert [e.kind for e in wh.check([wheel])] == ["native"]
    assert elf.newest_version(native_library.read_bytes(), "GLIBCXX") <= elf.MAX_GLIBCXX


def test_deps_skip_native_cells(tmp_path, monkeypatch):
    """Native cells ship no dependency (their torch is the user's): nothing to download."""
    def no_pip(*args, **kwargs):
        raise AssertionError(f"pip ran for native cells: {args}")
    monkeypatch.setattr(wh.subprocess, "run", no_pip)
    assert wh.download_deps(tmp_path / "deps", "native-*") == []


def test_wheelhouse_needs_the_shim(cells):
    for shim in (cells / "cells").rglob("cake_rmsnorm-*.whl"):
        shim.unlink()
    with pytest.raises(wh.WheelhouseError, match="no cake-rmsnorm shim wheel"):
        wh.assemble([cells / "cells"], cells / "house")


def test_wheelhouse_cli(cells, capsys):
    assert wh.main(["assemble", "--out", str(cells / "house"), str(cells / "cells")]) == 0
    assert "provider sm_103a 5 libraries" in capsys.readouterr().out
    assert wh.main(["assemble", "--out", str(cells / "h2"), str(cells / "missing")]) == 2
    assert "no such wheel or folder" in capsys.readouterr().err


def test_elf_facts():
    assert wh.elf_machine(fake_library("aarch64")) == "aarch64"
    assert wh.elf_machine(fake_library("x86_64")) == "x86_64"
    assert wh.elf_machine(b"#!/bin/sh\n") == "not ELF"
    assert wh.glibc_needed(fake_library("x86_64", "2.28")) == (2, 28)
    assert wh.glibc_needed(b"no versions") == (0, 0)


# ---- the workflow and the scripts ------------------------------------------------------------
def test_workflow_reads_the_matrix_instead_of_listing_cells(reg):
    text = WORKFLOW.read_text()
    assert "cake-rmsnorm matrix --print-build-identifiers" in text
    assert "fromJSON(needs.matrix.outputs.cells)" in text
    assert "runs-on: ${{ matrix.runner }}" in text
    assert "ci/run-cell.sh" in text and "ci/wheelhouse.py assemble" in text
    assert "matrix.kind" in text  # native cells skip the toolkit and the install test
    matrix = load_matrix()
    for name in [a.name for a in reg.archs] + [a.tag for a in reg.archs] + \
            [p.wheel_tag for p in matrix.platforms] + [p.id for p in matrix.platforms] + \
            list(matrix.native.torch):
        assert name not in text, f"{name} is matrix data; the workflow must read it, not repeat it"


def test_ci_scripts_parse():
    scripts = sorted((ROOT / "ci").glob("*.sh")) + sorted((ROOT / "ci" / "cross").glob("*.sh"))
    assert {p.name for p in scripts} >= {"run-cell.sh", "run-matrix.sh", "install_test.sh",
                                         "ci-cells.sh", "setup.sh", "smoke.sh"}
    for script in scripts:
        proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert proc.returncode == 0, f"{script}: {proc.stderr}"
