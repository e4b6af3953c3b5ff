"""Oversized shared memory (issue 6): the flag, the gate, the fallback, the capability check.

- the oversized switch (CAKE_OVERSIZED) is in exactly the gated libraries' generated sources, over
  every arch's plan, and the only code that sets the shared-memory mode sits under it;
- a program above the opt-in without a fallback fails the registry, without the flag fails the
  build, each naming it; a fallback must compute the same thing in the same order;
- the router picks the fallback when the capability says no and the gated program when it says yes,
  through the real decision function fed by a fake probe; the probe clears attribute 150's error;
- `doctor` without a GPU says so and lists the installed wheels;
- (toolchain) the staged and fallback libraries compile for sm_107a at H 4096.
"""

from __future__ import annotations

import ctypes
import logging
import re
from pathlib import Path

import pytest

from cake_rmsnorm import cli, doctor
from cake_rmsnorm.build.generate import OVERSIZED_DEFINE, render_source
from cake_rmsnorm.build.layout import default_source_root
from cake_rmsnorm.build.smem import check_oversized_flags, check_ptxas_smem
from cake_rmsnorm.errors import BuildError, ProviderError, RegistryError
from cake_rmsnorm.registry import build_registry, load_registry
from cake_rmsnorm.runtime import capability, router
from cake_rmsnorm.runtime.capability import Capability

GATED = {"det_pair_c64_staged_h4096_fp32", "fast_pair_c64_staged_h4096_fp32"}
FALLBACK = "det_pair_c64_h4096_fp32"
CSRC = default_source_root() / "csrc"


def cap(runtime=13040, driver=13040, oversized=300000, error=0, device=0) -> Capability:
    return Capability(device=device, runtime_version=runtime, driver_version=driver,
                      compute_capability=(10, 7), sm_count=212, optin_bytes=232448,
                      oversized_bytes=oversized, oversized_error=error)


# ---- the flag and the bindings --------------------------------------------------------------------

def test_plan_has_exactly_the_two_gated_libraries(reg):
    for arch in reg.arch_names:
        over = {lib.name for lib in reg.libraries(arch) if lib.smem_bytes > reg.smem_optin_bytes}
        assert over == (GATED if arch == "sm_107a" else set()), arch
        assert all(lib.smem_bytes == 271360 for lib in reg.libraries(arch) if lib.name in over)
    names = {lib.name for lib in reg.libraries("sm_107a")}
    assert FALLBACK in names  # the fallback is built wherever a gated library is


def test_oversized_flag_is_set_in_exactly_the_gated_sources(reg):
    flagged = set()
    for arch in reg.arch_names:
        for lib in reg.libraries(arch):
            src = render_source(lib)
            has = OVERSIZED_DEFINE in src
            assert has == lib.oversized, lib.name
            assert src.count("CAKE_OVERSIZED 1") == int(has)
            if has:  # before any include, so the binding header sees it
                assert src.index(OVERSIZED_DEFINE) < src.index("#include")
                flagged.add((arch, lib.name))
    assert flagged == {("sm_107a", name) for name in GATED}


def _code(path: Path) -> str:
    """The file with comments blanked (line numbers kept)."""
    text = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n"), path.read_text(), flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def _cuda_sources():
    return [p for p in CSRC.rglob("*") if p.suffix in (".cuh", ".h", ".cu")]


def test_only_code_under_the_flag_sets_the_shared_memory_mode():
    mode = re.compile(r"SharedMemoryMode|cudaFuncAttribute>\(16\)")
    hits = {}
    for path in _cuda_sources():
        lines = _code(path).splitlines()
        for i, line in enumerate(lines):
            if mode.search(line):
                hits.setdefault(path.name, []).append(i)
    assert set(hits) == {"smem_mode.cuh"}, hits
    lines = _code(CSRC / "include" / "cake_rmsnorm" / "smem_mode.cuh").splitlines()
    start = lines.index("#if CAKE_OVERSIZED")
    depth, end = 0, None
    for i in range(start, len(lines)):
        if lines[i].startswith("#if"):
            depth += 1
        elif lines[i].startswith("#endif"):
            depth -= 1
            if depth == 0:
                end = i
                break
    assert end is not None
    assert all(start < i < end for i in hits["smem_mode.cuh"])
    # nothing in csrc turns the switch on: only the generated source of a gated library does
    for path in _cuda_sources():
        for line in path.read_text().splitlines():
            if re.match(r"\s*#\s*define\s+CAKE_OVERSIZED\b", line):
                assert line.split()[-1] == "0" and path.name == "smem_mode.cuh", (path, line)
    export = (CSRC / "bindings" / "export.cuh").read_text()
    assert '#include "cake_rmsnorm/smem_mode.cuh"' in export


def test_build_refuses_oversized_without_the_flag(reg):
    lib = next(lib for lib in reg.libraries("sm_107a") if lib.name in GATED)
    check_oversized_flags("sm_107a", [lib])  # flagged: fine
    import dataclasses
    bare = dataclasses.replace(lib, program=dataclasses.replace(lib.program, oversized=False))
    with pytest.raises(BuildError, match=lib.name) as err:
        check_oversized_flags("sm_107a", [bare])
    assert "without the oversized flag" in str(err.value)


def test_build_refuses_ptxas_static_smem_that_disagrees(reg):
    lib = next(lib for lib in reg.libraries("sm_107a") if lib.name in GATED)
    check_ptxas_smem(lib, [{"name": "k", "smem_static": 0}])
    with pytest.raises(BuildError, match=lib.name) as err:
        check_ptxas_smem(lib, [{"name": "k", "smem_static": 0}, {"name": "r", "smem_static": 16}])
    assert "271376" in str(err.value) and "271360" in str(err.value)


# ---- the registry's rules -------------------------------------------------------------------------

def test_gated_program_without_a_fallback_is_refused(scratch):
    data, edit = scratch
    edit("programs.toml", 'oversized = true\nfallback = "det_pair_c64"\nabout = "det_pair_c64\'s',
         'oversized = true\nabout = "det_pair_c64\'s')
    with pytest.raises(RegistryError, match="det_pair_c64_staged") as err:
        build_registry(data)
    assert "no fallback" in str(err.value)


def test_program_above_the_optin_without_flag_loads_but_does_not_build(scratch):
    data, edit = scratch
    edit("programs.toml", 'oversized = true\nfallback = "det_pair_c64"\nabout = "det_pair_c64\'s',
         'fallback = "det_pair_c64"\nabout = "det_pair_c64\'s')
    reg = build_registry(data)
    with pytest.raises(BuildError, match="det_pair_c64_staged_h4096_fp32"):
        check_oversized_flags("sm_107a", reg.libraries("sm_107a"))


@pytest.mark.parametrize("fallback, match", [
    ("det_column_task_c64s8", "form"),
    ("fast_single_b2", "form"),
    ("nope", "not a program"),
    ("fast_pair_c64_staged", "ordinary program"),
])
def test_fallback_must_compute_the_same_thing(scratch, fallback, match):
    data, edit = scratch
    edit("programs.toml", 'fallback = "det_pair_c64"', f'fallback = "{fallback}"')
    with pytest.raises(RegistryError, match=match):
        build_registry(data)


def test_fallback_must_keep_the_chunking(scratch):
    data, edit = scratch
    edit("programs.toml", "params = { chunk_rows = 64, stage_bytes = 271360 }",
         "params = { chunk_rows = 32, stage_bytes = 271360 }")
    with pytest.raises(RegistryError, match="chunk_rows"):
        build_registry(data)


def test_fallback_above_the_optin_is_refused(scratch):
    data, edit = scratch
    (data / "programs.toml").write_text((data / "programs.toml").read_text() + """
[program.big_pair]
kernel = "pair"
reduction = "fp64_fold"
deterministic = true
params = { chunk_rows = 64, ring_rows = 3, pull = 0 }
smem = { fixed = 240000, per_h = 0 }
""")
    edit("programs.toml", 'fallback = "det_pair_c64"', 'fallback = "big_pair"')
    with pytest.raises(RegistryError, match="also above the limit"):
        build_registry(data)


# ---- the decision ---------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["det", "fast"])
def test_router_falls_back_when_the_capability_says_no(reg, backend, caplog):
    route = reg.route("sm_107a", backend, "bwd", hidden=4096, tokens=4096)
    assert route.library.name in GATED
    no = cap(runtime=13000, driver=13000, oversized=0, error=1)  # CUDA 13.0: attribute error
    with caplog.at_level(logging.DEBUG, logger="cake_rmsnorm"):
        lib = router.runnable(reg, route, no)
    assert lib.name == FALLBACK and not lib.oversized
    lines = [r.getMessage() for r in caplog.records if r.name == "cake_rmsnorm"]
    assert len(lines) == 1
    assert FALLBACK in lines[0] and route.library.name in lines[0] and "13.0 < 13.4" in lines[0]


@pytest.mark.parametrize("kw, why", [
    ({"runtime": 13000}, "CUDA runtime 13.0"),
    ({"driver": 13030}, "driver supports CUDA 13.3"),
    ({"oversized": 0, "error": 1}, "attribute 150"),
    ({"oversized": 262144}, "262144 B < 271360 B"),
])
def test_each_missing_piece_alone_means_fallback(reg, kw, why):
    route = reg.route("sm_107a", "det", "bwd", hidden=4096, tokens=257)
    c = cap(**kw)
    assert router.runnable(reg, route, c).name == FALLBACK
    assert why in c.fits(271360)[1]


def test_router_runs_the_gated_program_when_the_capability_says_yes(reg, caplog):
    route = reg.route("sm_107a", "det", "bwd", hidden=4096, tokens=65536)
    with caplog.at_level(logging.DEBUG, logger="cake_rmsnorm"):
        lib = router.runnable(reg, route, cap(runtime=13040, driver=13050, oversized=300000))
    assert lib is route.library
    assert len([r for r in caplog.records if r.name == "cake_rmsnorm"]) == 1


def test_ungated_routes_never_probe(reg):
    capability.set_prober(lambda device: pytest.fail("probed for an ungated library"))
    try:
        for T in (1, 256, 257, 65536):
            route = reg.route("sm_90a", "det", "bwd", hidden=4096, tokens=T)
            assert router.runnable_on(reg, route, 0) is route.library
    finally:
        capability.set_prober(None)


def test_runnable_on_probes_once_per_device_and_a_failed_probe_means_fallback(reg):
    calls = []

    def prober(device):
        calls.append(device)
        return cap(runtime=13000, driver=13000, oversized=0, error=1, device=device)
    capability.set_prober(prober)
    try:
        route = reg.route("sm_107a", "fast", "bwd", hidden=4096, tokens=1000)
        for _ in range(3):
            assert router.runnable_on(reg, route, 1).name == FALLBACK
        assert calls == [1]

        def broken(device):
            raise ProviderError("no driver")
        capability.set_prober(broken)
        assert router.runnable_on(reg, route, 0).name == FALLBACK
    finally:
        capability.set_prober(None)


# ---- the probe, through a fake libcudart ------------------------------------------------------------

class FakeCudart:
    """Answers like CUDA 13.0 on an H200: attribute 150 is cudaErrorInvalidValue (1)."""

    def __init__(self, runtime=13000, driver=13000, count=1, attr150=None):
        self.runtime, self.driver, self.count, self.attr150 = runtime, driver, count, attr150
        self.pending = 0
        self.cleared = 0

    @staticmethod
    def _set(ref, value):
        ref._obj.value = value
        return 0

    def cudaRuntimeGetVersion(self, ref):
        return self._set(ref, self.runtime)

    def cudaDriverGetVersion(self, ref):
        return self._set(ref, self.driver)

    def cudaGetDeviceCount(self, ref):
        return self._set(ref, self.count)

    def cudaDeviceGetAttribute(self, ref, attr, device):
        answers = {75: 9, 76: 0, 16: 132, 97: 232448}
        if attr == 150:
            if self.attr150 is None:
                self.pending = 1
                return 1
            return self._set(ref, self.attr150)
        return self._set(ref, answers[attr])

    def cudaGetLastError(self):
        rc, self.pending = self.pending, 0
        self.cleared += 1
        return rc

    def cudaGetDeviceProperties(self, buf, device):
        ctypes.memmove(buf, b"NVIDIA H200\0", 12)
        return 0


def test_probe_reads_attribute_150_error_as_zero_and_clears_it():
    fake = FakeCudart()
    c = capability.query(fake, 0)
    assert (c.oversized_bytes, c.oversized_error) == (0, 1)
    assert fake.pending == 0 and fake.cleared >= 1
    assert c.compute_capability == (9, 0) and c.sm_count == 132 and c.optin_bytes == 232448
    assert not c.oversized_supported and not c.fits(271360)[0] and c.fits(200704)[0]
    ok = capability.query(FakeCudart(runtime=13040, driver=13040, attr150=300000), 0)
    assert ok.oversized_supported and ok.fits(271360)[0]


def test_importing_capability_probes_nothing():
    assert capability._cache == {} or all(isinstance(v, Capability) for v in capability._cache.values())
    src = Path(capability.__file__).read_text()
    assert "ensure_cudart()" in src and not re.search(r"^[a-z_]+\s*=\s*query\(", src, re.M)


# ---- doctor ---------------------------------------------------------------------------------------

def test_doctor_without_a_gpu_says_so_and_lists_wheels(monkeypatch, capsys):
    def no_cudart():
        raise ProviderError("libcudart.so.13 cannot be found")
    monkeypatch.setattr(capability, "_cudart", no_cudart)
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "no GPU" in out and "installed wheels:" in out
    for tag in ("sm90a", "sm100a", "sm103a", "sm107a"):
        assert f"cake-rmsnorm-{tag}:" in out
    assert "det_pair_c64_staged_h4096_fp32 on sm_107a" in out


def test_doctor_with_zero_devices(monkeypatch, capsys):
    monkeypatch.setattr(capability, "_cudart", lambda: FakeCudart(count=0))
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "no GPU" in out and "0 devices" in out and "installed wheels:" in out


def test_doctor_on_an_h200_with_cuda_13_0(monkeypatch, capsys):
    fake = FakeCudart()
    monkeypatch.setattr(capability, "_cudart", lambda: fake)
    capability.set_prober(lambda device: capability.query(fake, device))
    try:
        assert cli.main(["doctor"]) == 0
    finally:
        capability.set_prober(None)
    out = capsys.readouterr().out
    assert "CUDA runtime 13.0; driver supports CUDA 13.0" in out
    assert "device 0: NVIDIA H200, compute capability 9.0 (sm_90a), 132 SMs" in out
    assert "oversized shared memory: unsupported" in out
    assert "gated programs on sm_90a: none" in out


def test_doctor_on_an_r200_reports_run_or_skip(monkeypatch):
    reg = load_registry()
    fake = FakeCudart()
    monkeypatch.setattr(capability, "_cudart", lambda: fake)
    for c, expect in ((cap(runtime=13000, driver=13000, oversized=0, error=1), "skip -> "),
                      (cap(), "run (")):
        capability.set_prober(lambda device, c=c: c)
        try:
            text = doctor.doctor(reg)
        finally:
            capability.set_prober(None)
        for name in GATED:
            line = next(ln for ln in text.splitlines() if f"gated {name}" in ln)
            assert expect in line, line
            if expect.startswith("skip"):
                assert FALLBACK in line


# ---- compile (toolchain) --------------------------------------------------------------------------

@pytest.mark.toolchain
def test_staged_and_fallback_libraries_compile_for_sm_107a(reg, tmp_path):
    from cake_rmsnorm.build.one import compile_one
    from cake_rmsnorm.build.toolchain import preflight
    from cake_rmsnorm.errors import ToolchainError
    try:
        tc = preflight(["sm_107a"])
    except ToolchainError as exc:
        pytest.skip(f"no CUDA build toolchain: {exc}")
    libs = {lib.name: lib for lib in reg.libraries("sm_107a", [4096])}
    staged = compile_one(libs["det_pair_c64_staged_h4096_fp32"], tmp_path, tc)
    fallback = compile_one(libs[FALLBACK], tmp_path, tc)
    for built in (staged, fallback):
        assert built.path.is_file()
        assert all(k["smem_static"] == 0 for k in built.record["kernels"])
    # the main kernel is det_pair_c64's very kernel; only the reduce differs
    main = lambda b: {k["name"] for k in b.record["kernels"] if "bwd_pair_kernel" in k["name"]}
    assert main(staged) == main(fallback) and len(main(staged)) == 1
    assert any("BwdPairStaged" in k["name"] and "271360" in k["name"]
               for k in staged.record["kernels"])


def test_explain_names_the_gate_and_the_fallback(capsys):
    assert cli.main(["explain", "--arch", "sm_107a", "--backend", "fast", "--direction", "bwd",
                     "--H", "4096", "--T", "4096", "--json"]) == 0
    import json
    doc = json.loads(capsys.readouterr().out)
    assert doc["program"] == "fast_pair_c64_staged"
    assert doc["gated"] == {"smem_bytes": 271360, "fallback": FALLBACK}
    assert cli.main(["explain", "--arch", "sm_90a", "--backend", "det", "--direction", "bwd",
                     "--H", "4096", "--T", "65536", "--json"]) == 0
    assert "gated" not in json.loads(capsys.readouterr().out)
