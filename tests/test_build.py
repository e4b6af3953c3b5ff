"""The build orchestrator: preflight, no-op rebuilds, header-precise rebuilds, atomicity, the lock.

Tests that run nvcc are marked `toolchain` and skip cleanly without the build extra. They share one
small build (sm_90a, H 256) through `shared_build`, which test_wheel and test_verify import too: it
builds into a fixed folder under pytest's base temp, so a second caller gets a no-op rebuild.
Set CAKE_TEST_SOURCE_ROOT to build another csrc (e.g. a stub) than this repository's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from cake_rmsnorm.build import orchestrate
from cake_rmsnorm.build.layout import ArchTree, default_source_root
from cake_rmsnorm.build.nvcc_step import _split_make_deps, parse_ptxas
from cake_rmsnorm.build.toolchain import preflight
from cake_rmsnorm.errors import BuildError, PackagingError, ToolchainError
from cake_rmsnorm.manifest import sha256_file
from cake_rmsnorm.registry import load_registry

ARCH, WIDTHS = "sm_90a", (256,)
COPIED = ("CMakeLists.txt", "csrc", "pyproject.toml", "README.md", "python/cake_rmsnorm")


@dataclasses.dataclass(frozen=True)
class Built:
    source_root: Path
    build_dir: Path

    @property
    def tree(self) -> ArchTree:
        return ArchTree.of(self.build_dir, ARCH)

    def libs(self):
        return load_registry().libraries(ARCH, WIDTHS)

    def stamps(self):
        return {lib.name: os.stat(self.tree.library(lib.filename)).st_mtime_ns
                for lib in self.libs()}

    def build(self, **kw):
        return orchestrate.build([ARCH], WIDTHS, jobs=2, build_dir=self.build_dir,
                                 source_root=self.source_root, **kw)


def copy_source_root(dst: Path) -> Path:
    """A private copy of what a build reads, so tests may touch headers freely."""
    import shutil
    origin = Path(os.environ.get("CAKE_TEST_SOURCE_ROOT") or default_source_root())
    for rel in COPIED:
        src = origin / rel if (origin / rel).exists() else default_source_root() / rel
        if src.is_dir():
            shutil.copytree(src, dst / rel, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
                            dirs_exist_ok=True)
        elif src.is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)
    return dst


def require_toolchain():
    try:
        preflight([ARCH], need_cuobjdump=True)
    except ToolchainError as exc:
        pytest.skip(f"no CUDA build toolchain: {exc}")


def shared_build(tmp_path_factory) -> Built:
    require_toolchain()
    base = tmp_path_factory.getbasetemp()
    src = base / "cake-shared-src"
    if not (src / "CMakeLists.txt").exists():
        copy_source_root(src)
    built = Built(src, base / "cake-shared-build")
    built.build()  # idempotent: the first caller compiles, later ones (other modules) do nothing
    return built


@pytest.fixture(scope="session")
def built(tmp_path_factory) -> Built:
    return shared_build(tmp_path_factory)


# ---- without a toolchain -------------------------------------------------------------------------

def _fake_nvcc(tmp_path: Path, version: str, archs: str) -> Path:
    nvcc = tmp_path / "nvcc"
    nvcc.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        case "$1" in
          --version) echo "Cuda compilation tools, release {version[:4]}, V{version}";;
          --list-gpu-arch) printf '%s\\n' {archs};;
        esac
        """))
    nvcc.chmod(0o755)
    return nvcc


@pytest.mark.faults
def test_preflight_rejects_old_nvcc_in_one_message(tmp_path, monkeypatch):
    monkeypatch.setenv("CAKE_NVCC", str(_fake_nvcc(tmp_path, "13.0.88", "compute_90")))
    with pytest.raises(ToolchainError) as err:
        preflight([ARCH])
    text = str(err.value)
    assert "nvcc 13.0.88" in text and "older than 13.4" in text
    assert "pip install -e '.[build]'" in text
    assert text.count("pip install") == 1


@pytest.mark.faults
def test_preflight_names_arch_nvcc_cannot_target(tmp_path, monkeypatch):
    monkeypatch.setenv("CAKE_NVCC", str(_fake_nvcc(tmp_path, "13.4.10", "compute_90 compute_100")))
    with pytest.raises(ToolchainError, match="cannot target sm_107a"):
        preflight(["sm_90a", "sm_107a"])


def test_parse_ptxas_takes_entry_functions():
    log = textwrap.dedent("""\
        ptxas info    : 0 bytes gmem
        ptxas info    : Compiling entry function '_Z4mainPf' for 'sm_90a'
        ptxas info    : Function properties for _Z4mainPf
            16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
        ptxas info    : Used 40 registers, used 1 barriers, 512 bytes smem, 400 bytes cmem[0]
        ptxas info    : Compiling entry function '_Z6reducePf' for 'sm_90a'
        ptxas info    : Function properties for _Z6reducePf
            0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
        ptxas info    : Used 72 registers, used 0 barriers
        """)
    kernels = {k["name"]: k for k in parse_ptxas(log)}
    assert kernels["_Z4mainPf"] == {"name": "_Z4mainPf", "registers": 40, "smem_static": 512,
                                    "stack": 16, "spill_stores": 8, "spill_loads": 4}
    assert kernels["_Z6reducePf"]["registers"] == 72


def test_depfile_parsing_keeps_escaped_spaces():
    text = "out.so : a.cu \\\n    /x/my\\ dir/b.h \\\n    c.h\n"
    assert _split_make_deps(text) == ["a.cu", "/x/my dir/b.h", "c.h"]


@pytest.mark.faults
def test_oversized_library_without_the_flag_is_refused_before_compiling(tmp_path, monkeypatch):
    # Above the opt-in is allowed only with the program's `oversized = true` (tests/test_oversized.py
    # builds such libraries); without it the build stops before touching the toolchain or the tree.
    reg = load_registry()
    lib = reg.libraries(ARCH, WIDTHS)[0]
    big = dataclasses.replace(lib, program=dataclasses.replace(
        lib.program, smem_fixed=reg.smem_optin_bytes + 1024, smem_per_h=0, oversized=False))

    class OneLibrary:  # the registry, except that it plans one oversized library
        def __getattr__(self, name):
            return getattr(reg, name)

        def libraries(self, arch, widths=None):
            return (big,)

    monkeypatch.setattr(orchestrate, "load_registry", lambda: OneLibrary())
    monkeypatch.setattr(orchestrate, "preflight", lambda archs: pytest.fail("preflight ran"))
    with pytest.raises(BuildError, match=big.name) as err:
        orchestrate.build([ARCH], WIDTHS, build_dir=tmp_path / "b",
                          source_root=default_source_root())
    assert "without the oversized flag" in str(err.value)
    assert not (tmp_path / "b").exists()


# ---- with the toolchain --------------------------------------------------------------------------

@pytest.mark.toolchain
def test_cold_build_records_every_library(built):
    record = json.loads(built.tree.record.read_text())
    assert [e["name"] for e in record["libraries"]] == [lib.name for lib in built.libs()]
    for entry in record["libraries"]:
        assert entry["sha256"] == sha256_file(built.tree.library(entry["file"]))
        assert entry["registers"] > 0 and entry["kernels"]
    assert not list(built.tree.lib.glob(".*"))


@pytest.mark.toolchain
def test_second_build_compiles_and_rewrites_nothing(built):
    watched = [built.tree.record, built.tree.libraries_cmake,
               *(built.tree.source(lib.name) for lib in built.libs())]
    before = {p: p.stat().st_mtime_ns for p in watched}
    lib_before = built.stamps()
    start = time.monotonic()
    summary = built.build()
    elapsed = time.monotonic() - start
    assert summary.compiled == 0 and summary.archs[0].up_to_date == len(built.libs())
    assert elapsed < 3.0, f"no-op rebuild took {elapsed:.2f} s"
    assert {p: p.stat().st_mtime_ns for p in watched} == before
    assert built.stamps() == lib_before
    assert "0 compiled" in summary.text()


@pytest.mark.toolchain
def test_touching_a_header_rebuilds_exactly_its_includers(built):
    libs = built.libs()
    header = libs[-1].program.kernel.header  # one program form's header
    full = str((built.source_root / "csrc" / "include" / header).resolve())
    # Who includes it, as the compiler reported (programs may share headers).
    includers = {lib.name for lib in libs
                 if full in (built.tree.cmake / "deps" / f"{lib.name}.d").read_text()}
    assert 0 < len(includers) < len(libs)
    before = built.stamps()
    time.sleep(0.01)
    (built.source_root / "csrc" / "include" / header).touch()
    summary = built.build()
    after = built.stamps()
    assert {name for name in before if after[name] != before[name]} == includers
    assert summary.compiled == len(includers)


@pytest.mark.faults
@pytest.mark.toolchain
def test_interrupted_compile_is_not_trusted(built):
    lib = built.libs()[0]
    path = built.tree.library(lib.filename)
    path.unlink()  # killed before the rename: only a temp file is left
    stale = path.with_name(f".{path.name}.99999.tmp")
    stale.write_bytes(b"half a library")
    with pytest.raises(PackagingError, match=lib.name):
        from cake_rmsnorm.build.wheel import write_wheels
        write_wheels([ARCH], built.build_dir / "no-wheels", built.build_dir, built.source_root,
                     widths=WIDTHS)
    summary = built.build()
    assert summary.compiled == 1 and path.is_file() and not stale.exists()


@pytest.mark.faults
@pytest.mark.toolchain
def test_library_that_disagrees_with_its_record_is_recompiled(built):
    lib = built.libs()[1]
    path = built.tree.library(lib.filename)
    path.write_bytes(b"not what nvcc wrote")  # newer than its inputs: Ninja alone would trust it
    summary = built.build()
    assert summary.compiled == 1
    assert sha256_file(path) == json.loads(built.tree.ptxas_record(lib.name).read_text())["sha256"]


@pytest.mark.faults
@pytest.mark.toolchain
def test_killed_build_leaves_nothing_trusted(built):
    header = built.libs()[0].program.kernel.header
    time.sleep(0.01)
    (built.source_root / "csrc" / "include" / header).touch()
    code = (f"from cake_rmsnorm.build.orchestrate import build; "
            f"build([{ARCH!r}], {list(WIDTHS)!r}, jobs=1, build_dir={str(built.build_dir)!r}, "
            f"source_root={str(built.source_root)!r})")
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not list(built.tree.cmake.glob("deps/.*.tmp")):
        time.sleep(0.05)
    _kill_everything_touching(proc, str(built.build_dir))
    from cake_rmsnorm.build.wheel import write_wheels
    with pytest.raises(PackagingError, match="not up to date|not built"):
        write_wheels([ARCH], built.build_dir / "no-wheels", built.build_dir, built.source_root,
                     widths=WIDTHS)
    built.build()
    assert not list(built.tree.lib.glob(".*.tmp"))
    record = json.loads(built.tree.record.read_text())
    for entry in record["libraries"]:
        assert entry["sha256"] == sha256_file(built.tree.library(entry["file"]))


def _kill_everything_touching(proc: subprocess.Popen, marker: str) -> None:
    """SIGKILL the build we started and every process of it (Ninja gives each job its own
    process group), found by our unique build folder on their command lines."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for _ in range(50):
        pids = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    if marker.encode() in (entry / "cmdline").read_bytes():
                        pids.append(int(entry.name))
                except OSError:
                    pass
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.1)


@pytest.mark.faults
@pytest.mark.toolchain
def test_two_builds_serialise_on_the_lock(built):
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""\
            import fcntl, os, sys, time
            fd = os.open({str(built.build_dir / '.lock')!r}, os.O_RDWR | os.O_CREAT)
            fcntl.flock(fd, fcntl.LOCK_EX)
            print("locked", flush=True)
            time.sleep(2)
            """)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    said = []
    start = time.monotonic()
    summary = built.build(progress=said.append)
    waited = time.monotonic() - start
    holder.wait()
    assert any("waiting for the build lock" in m for m in said), said
    assert waited > 1.0 and summary.compiled == 0
