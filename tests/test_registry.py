"""The registry loads, validates and answers queries; every broken table is an error that names
the table and the window."""

import pytest

from cake_rmsnorm.errors import RegistryError, RouteError
from cake_rmsnorm.registry import FORMS, REDUCTIONS, TableKey, build_registry


def test_axes_are_the_four_archs_and_seven_widths(reg):
    assert reg.arch_names == ("sm_90a", "sm_100a", "sm_103a", "sm_107a")
    assert reg.widths == (256, 1536, 2048, 4096, 5120, 6144, 8192)
    assert reg.arch_for_capability(9, 0).name == "sm_90a"
    assert reg.arch_for_capability(10, 3).name == "sm_103a"
    assert reg.arch_for_capability(8, 9) is None  # exact match only, no "same major" guess
    assert reg.arch_for_capability(10, 1) is None


def test_every_table_tiles_one_to_infinity(reg):
    n_tables = len(reg.arch_names) * 2 * 2 * 2 * 2 * len(reg.widths)
    assert len(reg.tables) == n_tables
    for key, windows in reg.tables.items():
        assert windows[0].first == 1, key
        assert windows[-1].last is None, key
        for a, b in zip(windows, windows[1:]):
            assert b.first == a.last + 1, key


def test_route_picks_the_window_holding_T(reg):
    key = TableKey("sm_90a", "det", "bwd", "fp32", False, 4096)
    windows = reg.table(key)
    for window in windows:
        for tokens in {window.first, window.last or window.first + 10**6}:
            route = reg.route("sm_90a", "det", "bwd", 4096, tokens, "fp32", False)
            assert route.window == window
            assert route.library.program == window.program
            assert route.library.name.endswith("_h4096_fp32")


def test_programs_use_known_forms_and_reductions(reg):
    for program in reg.programs.values():
        assert program.form in FORMS
        assert program.reduction in REDUCTIONS


def test_every_det_reduction_a_route_runs_has_two_forms(reg):
    """det's bits belong to its reduction, not to a form: each reduction a det table routes has
    deterministic backward programs of at least two forms (pair_staged counting as pair), so
    ci/check_programs.py can compare the forms' bits."""
    routed = {w.program.reduction for key, windows in reg.tables.items() if key.backend == "det"
              and key.direction == "bwd" for w in windows if not w.program.runtime_h}
    assert {"fp64_fold", "fixed64"} <= routed
    for reduction in routed:
        forms = {"pair" if p.form.startswith("pair") else p.form for p in reg.programs.values()
                 if p.direction == "bwd" and p.deterministic and p.reduction == reduction
                 and not p.runtime_h}
        assert len(forms) >= 2, f"det reduction {reduction}: forms {sorted(forms)}"


def test_det_tables_run_only_deterministic_programs(reg):
    for key, windows in reg.tables.items():
        if key.backend == "det":
            assert all(w.program.deterministic for w in windows), key


def test_libraries_are_derived_from_the_routes(reg):
    for arch in reg.arch_names:
        libs = reg.libraries(arch)
        names = [lib.name for lib in libs]
        assert len(names) == len(set(names))
        used = {(w.program.name, k.hidden, k.weight_dtype, k.residual)
                for k, ws in reg.tables.items() if k.arch == arch for w in ws}
        # plus the fallbacks of gated (oversized) libraries: the runtime may run them instead
        used |= {(w.program.fallback, k.hidden, k.weight_dtype, k.residual)
                 for k, ws in reg.tables.items() if k.arch == arch for w in ws
                 if w.program.smem_bytes(k.hidden) > reg.smem_optin_bytes}
        # plus the generic libraries (H 0: any width that is not prebuilt; tests/test_generic_cpu.py)
        used |= {(lib.program.name, 0, lib.weight_dtype, lib.residual)
                 for lib in reg.generic_libraries(arch)}
        assert {(l.program.name, l.hidden, l.weight_dtype, l.residual) for l in libs} == used
        oversized = sorted(lib.name for lib in libs if lib.oversized)
        expected = (["det_pair_c64_staged_h4096_fp32", "fast_pair_c64_staged_h4096_fp32"]
                    if arch == "sm_107a" else [])
        assert oversized == expected, arch


def test_library_subset_by_width(reg):
    libs = reg.libraries("sm_90a", [256])
    assert libs and all(lib.hidden in (256, 0) for lib in libs)  # 0: the generic ones, always
    with pytest.raises(RouteError, match="1000"):
        reg.libraries("sm_90a", [1000])


@pytest.mark.parametrize("args, match", [
    (("sm_80", "det", "bwd", 4096, 10), "unknown arch 'sm_80'"),
    (("sm_90a", "exact", "bwd", 4096, 10), "backend 'exact'"),
    (("sm_90a", "det", "bwd", 1004, 10), "H=1004 is not a prebuilt width"),
    (("sm_90a", "det", "bwd", 4096, 0), "T=0"),
])
def test_bad_queries_name_the_argument(reg, args, match):
    with pytest.raises(RouteError, match=match):
        reg.route(*args)


# Bad registry data: (case, file, text, replacement, the error it must raise). Each edit must
# find its text (the scratch fixture asserts it), and each error names where the data is wrong.
BAD_DATA = [
    ("gap", "routes.toml", '{ first = 257, program = "det_pair_c64" }',
     '{ first = 300, program = "det_pair_c64" }',
     r"gap at window T 300\.\.inf.*expected it to start at T 257"),
    ("overlap", "routes.toml", '{ first = 257, program = "det_pair_c64" }',
     '{ first = 200, program = "det_pair_c64" }',
     r"table sm_90a det bwd H=1536.*overlap at window T 200"),
    ("missing end window", "routes.toml", '{ first = 65537, program = "fast_single_twosum_b2" }',
     '{ first = 65537, last = 100000, program = "fast_single_twosum_b2" }', "gap after T 100000"),
    ("unknown program", "routes.toml", 'program = "det_pair_c64" }', 'program = "det_pair_c65" }',
     r"window T 257\.\.inf: unknown program 'det_pair_c65'"),
    ("key given twice", "routes.toml", "H = [256]", "H = [256, 2048]", "H=2048.*already given by"),
    ("missing table", "routes.toml", 'residual = "all"\nH = [256]', 'residual = false\nH = [256]',
     r"gap: no table for sm_90a det bwd H=256 fp32 weight, residual"),
    ("det runs a fast program", "routes.toml", 'program = "det_pair_c64" }',
     'program = "fast_single_b2" }', "det may not run non-deterministic program"),
    ("forward table names a backward program", "routes.toml", '"fwd_rows4"', '"det_pair_c64"',
     "'det_pair_c64' is a bwd program"),
    ("params not the kernel's", "programs.toml", "params = { chunk_rows = 64, ring_rows = 3, pull = 0 }",
     "params = { rows = 64 }", "program 'det_pair_c64': params"),
    ("route past max_tokens", "routes.toml",
     '{ first = 1, last = 65536, program = "fast_single_b2" },\n  '
     '{ first = 65537, program = "fast_single_twosum_b2" },',
     '{ first = 1, program = "fast_single_b2" },',
     r"window T 1\.\.inf: program 'fast_single_b2' may run only up to T 65536 \(its max_tokens\)"),
    ("overlapping overrides", "routes.toml", "first = 1025\nlast = 16384", "first = 100\nlast = 16384",
     r"override #\d+ \(F3\).*sm_107a fast bwd H=2048.*overlap: window T 100\.\.16384 meets T 65\.\.127"),
    ("override names an unknown program", "routes.toml",
     'first = 58497\nlast = 61952\nprogram = "det_pair_c64"',
     'first = 58497\nlast = 61952\nprogram = "det_pair_c99"', r"\(F1\).*unknown program 'det_pair_c99'"),
    ("det override runs a fast program", "routes.toml",
     'last = 256\nprogram = "det_column_task_f64_c64s8"', 'last = 256\nprogram = "fast_single_b2"',
     r"\(D3\).*det may not run non-deterministic"),
    ("reduction not the kernel's", "programs.toml", 'kernel = "single"\nreduction = "twosum"',
     'kernel = "single"\nreduction = "blocked"',
     r"fast_single_twosum_b2.*reduction 'blocked' is not one kernel 'single' implements"),
]


@pytest.mark.parametrize("case,name,old,new,match", BAD_DATA, ids=[c[0] for c in BAD_DATA])
def test_bad_data_is_an_error_naming_where(scratch, case, name, old, new, match):
    data, edit = scratch
    edit(name, old, new)
    with pytest.raises(RegistryError, match=match):
        build_registry(data)


# ---- [[override]] windows ------------------------------------------------------------------------

def test_override_splices_its_window_and_keeps_the_rest(reg):
    windows = reg.table(TableKey("sm_103a", "fast", "bwd", "fp32", False, 2048))
    spans = [(w.first, w.last, w.program.name, w.label) for w in windows]
    assert spans == [(1, 58496, "fast_single_b2", ""), (58497, 61952, "det_pair_c64", "F1"),
                     (61953, 65536, "fast_single_b2", ""), (65537, None, "fast_single_twosum_b2", "")]


def test_readme_states_the_library_counts_plan_prints(reg):
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    stated = dict(re.findall(r"(sm_\d+a) (\d+)[,;. ]", text.split("Libraries per arch")[1][:300]))
    assert {a: int(n) for a, n in stated.items()} == {a: len(reg.libraries(a)) for a in reg.arch_names}
