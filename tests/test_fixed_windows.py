"""Every upstream window of WINDOWS.md (tests/data/windows.toml) is held by the registry's route
tables, checked through Registry.route (the query of the router and `explain`); a table without a
window's route fails here. No GPU."""

import dataclasses

import pytest

from cake_rmsnorm.registry import load_registry
from cake_rmsnorm.registry.load import splice
from windows_spec import check_window, load_windows

SPECS = load_windows(load_registry())


@pytest.mark.parametrize("spec", SPECS, ids=[s.id for s in SPECS])
def test_window_is_held(reg, spec):
    assert check_window(reg, spec) > 0


def test_every_window_of_windows_md_is_listed():
    ids = {s.id.split("-")[0] for s in SPECS}
    expected = {f"F{i}" for i in range(1, 19)} | {f"D{i}" for i in range(1, 7)} | {"W1"}
    assert ids == expected


def _with_route(reg, spec, program_name):
    """A copy of `reg` whose tables run `program_name` over the whole of `spec`'s window."""
    tables = dict(reg.tables)
    program = reg.programs[program_name]
    for arch, backend, hidden, wd, res in spec.keys():
        key = next(k for k in tables if (k.arch, k.backend, k.direction, k.hidden, k.weight_dtype,
                                         k.residual) == (arch, backend, spec.direction, hidden, wd, res))
        window = dataclasses.replace(tables[key][0], first=spec.first, last=spec.last,
                                     program=program, label="mutant")
        tables[key] = splice(tables[key], window)
    return dataclasses.replace(reg, tables=tables)


# A window's route replaced by a plausible wrong one: its neighbour's program, another form, another
# reduction, the program it must differ from. Each must fail the window's check.
MUTANTS = [
    ("F1", "fast_single_b2"), ("F2", "det_pair_c64"), ("F9", "fast_single_blk4_b4"),
    ("F10", "fast_single_b2"), ("F11", "fast_single_b2"), ("F12", "fast_single_b2"),
    ("F13", "fast_single_b2"), ("F14", "fast_single_twosum_b2"), ("F16", "fast_single_blk4_b4"),
    ("F17", "fast_single_b2"), ("F18", "fast_single_b2"), ("D1", "det_pair_c64"),
    ("D2", "det_column_task_f64_c64s8"), ("D3", "det_column_task_c64s8"), ("D5", "det_pair_c64"),
    ("D6", "det_pair_c64"), ("W1", "fwd_rows4"),
]


@pytest.mark.parametrize("window_id,program", MUTANTS, ids=[m[0] for m in MUTANTS])
def test_a_wrong_route_fails_the_window(reg, window_id, program):
    spec = next(s for s in SPECS if s.id == window_id)
    with pytest.raises(AssertionError):
        check_window(_with_route(reg, spec, program), spec)


@pytest.mark.parametrize("window_id,block", [
    ("F1", 'window = "F1"'), ("D3", 'window = "D3"'), ("F13", 'window = "F13"'),
])
def test_deleting_an_override_from_the_tables_fails(scratch, window_id, block):
    """Acceptance 2: delete one window's [[override]] in a scratch copy of routes.toml."""
    data, _ = scratch
    path = data / "routes.toml"
    text = path.read_text()
    parts = text.split("[[override]]")
    kept = [p for p in parts[1:] if block not in p]
    assert len(kept) == len(parts) - 2, f"{block} must be exactly one override"
    path.write_text("[[override]]".join([parts[0]] + kept))
    mutated = load_registry(str(data))
    spec = next(s for s in SPECS if s.id == window_id)
    with pytest.raises(AssertionError):
        check_window(mutated, spec)
