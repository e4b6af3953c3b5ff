"""The route tuner's choice and output, on made-up timings (no GPU): the fastest candidate inside
half the budget wins each grid point, det takes deterministic programs only, windows coalesce, and
the TOML it writes loads into the registry and routes as chosen."""

import json
import sys
import tomllib
from pathlib import Path

import pytest

pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import tune_routes  # noqa: E402

from cake_rmsnorm.registry import build_registry  # noqa: E402


def _rows(hidden):
    rows = []
    for tokens in tune_routes.GRID:
        small = tokens <= 256
        rows += [
            dict(H=hidden, T=tokens, program="fwd_rows4", direction="fwd", form="forward", deterministic=True,
                 ms=1.0, worst=0.0),
            dict(H=hidden, T=tokens, program="fwd_rows8", direction="fwd", form="forward", deterministic=True,
                 ms=0.9 if tokens >= 65536 else 1.1, worst=0.0),
            dict(H=hidden, T=tokens, program="det_column_task_c64s8", direction="bwd", form="column_task",
                 deterministic=True, ms=0.5 if small else 9.0, worst=0.01),
            dict(H=hidden, T=tokens, program="det_pair_ts_c64", direction="bwd", form="pair", deterministic=True,
                 ms=2.0, worst=0.05),
            # fastest everywhere, but outside half the budget at large T: must lose there
            dict(H=hidden, T=tokens, program="fast_single_b2", direction="bwd", form="single", deterministic=False,
                 ms=0.3, worst=0.9 if tokens >= 65536 else 0.05),
            dict(H=hidden, T=tokens, program="fast_single_twosum_b2", direction="bwd", form="single",
                 deterministic=False, ms=0.4, worst=0.001),
        ]
    return rows


def test_winners_respect_the_budget_and_determinism():
    rows = _rows(4096)
    det = {t: best["program"] for t, best, _ in tune_routes.winners(rows, 4096, "det", "bwd")}
    fast = {t: best["program"] for t, best, _ in tune_routes.winners(rows, 4096, "fast", "bwd")}
    assert det[1] == "det_column_task_c64s8" and det[1024] == "det_pair_ts_c64"
    assert fast[4096] == "fast_single_b2" and fast[65536] == "fast_single_twosum_b2"


def test_windows_coalesce_from_grid_point_to_grid_point():
    rows = _rows(4096)
    wins = tune_routes.windows(tune_routes.winners(rows, 4096, "det", "bwd"))
    assert [(w[0], w[1], w[2]) for w in wins] == [(1, 1023, "det_column_task_c64s8"),
                                                  (1024, None, "det_pair_ts_c64")]


def _tie_rows(direction, kept, fastest):
    """kept wins T 1; at T 4 it is 0.08 us behind, at T 65536 0.5% behind, at T 262144 1.5%."""
    form = "forward" if direction == "fwd" else "pair"
    def point(tokens, kept_ms, fastest_ms):
        return [dict(H=8192, T=tokens, program=p, direction=direction, form=form, deterministic=True,
                     ms=ms, worst=0.0) for p, ms in ((kept, kept_ms), (fastest, fastest_ms))]
    return (point(1, 0.0040, 0.0041) + point(4, 0.0042, 0.00412) + point(65536, 0.5025, 0.5)
            + point(262144, 2.03, 2.0))


def test_a_backward_tie_keeps_the_previous_winner_within_one_percent_and_a_tenth_of_a_microsecond():
    rows = _tie_rows("bwd", "det_pair_c64", "det_pair_ts_c64")
    wins = {t: best["program"] for t, best, _ in tune_routes.winners(rows, 8192, "fast", "bwd")}
    assert wins == {1: "det_pair_c64", 4: "det_pair_c64", 65536: "det_pair_c64",
                    262144: "det_pair_ts_c64"}


def test_a_forward_tie_is_within_a_tenth_of_a_microsecond_only():
    rows = _tie_rows("fwd", "fwd_rows1", "fwd_rows1_el")
    wins = {t: best["program"] for t, best, _ in tune_routes.winners(rows, 8192, "det", "fwd")}
    assert wins == {1: "fwd_rows1", 4: "fwd_rows1", 65536: "fwd_rows1_el", 262144: "fwd_rows1_el"}


def test_the_written_toml_loads_and_routes_as_chosen(scratch):
    data, _ = scratch
    rows = _rows(4096)
    (data / "tuned").mkdir(exist_ok=True)
    (data / "tuned" / "sm_90a.toml").write_text(tune_routes.toml_text(rows, [4096], "sm_90a", "test GPU"))
    reg = build_registry(data)
    route = lambda b, d, t: reg.route("sm_90a", b, d, 4096, t, "bf16", True).program.name  # noqa: E731
    assert route("det", "bwd", 300) == "det_column_task_c64s8"
    assert route("det", "bwd", 1024) == "det_pair_ts_c64"
    assert route("fast", "bwd", 16384) == "fast_single_b2"
    assert route("fast", "bwd", 70000) == "fast_single_twosum_b2"
    assert route("fast", "fwd", 70000) == "fwd_rows8" and route("det", "fwd", 100) == "fwd_rows4"
    assert reg.table(next(k for k in reg.tables if k.arch == "sm_90a" and k.hidden == 4096
                          and k.backend == "fast" and k.direction == "bwd"))[0].label == "tuned"


def test_a_program_cannot_win_a_window_past_its_max_tokens():
    rows = [r for r in _rows(4096) if r["program"] != "fast_single_twosum_b2"]
    for r in rows:
        r["worst"] = 0.0
    pts = tune_routes.winners(rows, 4096, "fast", "bwd", {"fast_single_b2": 65536})
    won = {t: best["program"] for t, best, _ in pts}
    assert won[16384] == "fast_single_b2"  # its window ends at 65535
    assert won[65536] != "fast_single_b2"  # its window would run to 262143


def test_a_candidate_must_hold_the_budget_to_its_windows_end():
    """worst * sqrt(window end / T) * INPUT_MARGIN <= 0.25: at a grid point whose window runs 4x
    further, 0.1 loses (0.2 scaled, within 0.25 but not twice over) and 0.05 wins."""
    assert tune_routes.INPUT_MARGIN == 2.0
    rows = _rows(4096)
    for r in rows:
        if r["program"] == "fast_single_b2":
            r["worst"] = 0.1 if r["T"] == 4096 else 0.05
    won = {t: best["program"] for t, best, _ in tune_routes.winners(rows, 4096, "fast", "bwd")}
    assert won[1024] == "fast_single_b2" and won[4096] == "fast_single_twosum_b2"


def test_det_runs_a_column_task_at_t1_even_when_slower():
    rows = _rows(4096)
    for r in rows:
        if r["program"] == "det_column_task_c64s8":
            r["ms"] = 50.0
    won = {t: best["program"] for t, best, _ in tune_routes.winners(rows, 4096, "det", "bwd")}
    assert won[1] == "det_column_task_c64s8" and won[4] == "det_pair_ts_c64"


def test_plan_keeps_only_programs_built_for_every_dtype_and_residual():
    index = {"libraries": [dict(H=4096, direction="bwd", weight_dtype="fp32", residual=False, program=p)
                           for p in ("det_pair_c64", "det_pair_ts_c64")]}
    plan = {f"det_pair_c64_h4096_{wd}{res}" for wd in ("fp32", "bf16") for res in ("", "_res")}
    plan.add("det_pair_ts_c64_h4096_fp32")  # one variant only: not a candidate
    got = [e["program"] for e in tune_routes.candidates(index, 4096, "bwd", plan)]
    assert got == ["det_pair_c64"]


def test_runs_over_different_widths_merge_into_one_table(tmp_path):
    for name, hidden in (("a", 4096), ("b", 8192)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "tune.json").write_text(json.dumps(
            {"arch": "sm_90a", "device": "test GPU", "rows": _rows(hidden)}))
    runs = f"{tmp_path / 'a' / 'tune.json'},{tmp_path / 'b' / 'tune.json'}"
    assert tune_routes.main(["--from-json", runs, "--out", str(tmp_path / "out")]) == 0
    text = (tmp_path / "out" / "sm_90a.toml").read_text()
    assert "H = [4096]" in text and "H = [8192]" in text and "test GPU" in text


def test_programs_dropped_from_the_registry_since_the_run_are_left_out(tmp_path, capsys):
    rows = _rows(4096)
    # measured then, fastest everywhere, but no longer a registry program: no route may name it
    rows += [dict(r, program="det_pair_gone", ms=0.01) for r in rows if r["program"] == "det_pair_ts_c64"]
    (tmp_path / "tune.json").write_text(json.dumps({"arch": "sm_90a", "device": "test GPU", "rows": rows}))
    assert tune_routes.main(["--from-json", str(tmp_path / "tune.json"), "--out", str(tmp_path / "out")]) == 0
    assert "leaving out programs the registry no longer has: det_pair_gone" in capsys.readouterr().out
    text = (tmp_path / "out" / "sm_90a.toml").read_text()
    assert "det_pair_gone" not in text and 'program = "det_pair_ts_c64"' in text


def test_merging_runs_of_different_devices_is_refused(tmp_path):
    files = []
    for name, device in (("a", "GPU one"), ("b", "GPU two")):
        f = tmp_path / f"{name}.json"
        f.write_text(json.dumps({"arch": "sm_90a", "device": device, "rows": _rows(4096)}))
        files.append(str(f))
    with pytest.raises(SystemExit, match="one arch on one device"):
        tune_routes.main(["--from-json", ",".join(files), "--out", str(tmp_path / "out")])


def _tune(tmp_path, rows, *extra):
    """The tuner on `rows` (written as a run.json) with `extra` arguments: its exit status."""
    (tmp_path / "run.json").write_text(json.dumps({"arch": "sm_90a", "device": "GPU", "rows": rows}))
    return tune_routes.main(["--from-json", str(tmp_path / "run.json"), *extra, "--out", str(tmp_path / "out")])


def _table_from(tmp_path, rows, *extra):
    """The table the tuner wrote from `rows`, as text."""
    assert _tune(tmp_path, rows, *extra) == 0
    return (tmp_path / "out" / "sm_90a.toml").read_text()


def test_a_run_over_some_widths_keeps_the_other_widths_of_an_earlier_table(tmp_path):
    """--keep: the earlier table's windows of the widths this run did not measure are written
    unchanged; the measured width's windows are this run's, and the header names both."""
    earlier = tmp_path / "earlier.toml"
    earlier.write_text("# 2026-01-02: earlier run\n" + tune_routes.toml_text(_rows(4096), [4096], "sm_90a", "GPU")
                       + "\n" + tune_routes.toml_text(_rows(8192), [8192], "sm_90a", "GPU"))
    rows = _rows(8192)
    for r in rows:
        if r["program"] == "det_column_task_c64s8":
            r["ms"] = 0.1  # now fastest at every T of H 8192
    text = _table_from(tmp_path, rows, "--keep", str(earlier))
    assert "# H 8192 measured in this run; H 4096 kept from the run of 2026-01-02" in text
    new = tomllib.loads(text)["override"]
    old = tomllib.loads(earlier.read_text())["override"]
    assert [o for o in new if o["H"] == [4096]] == [o for o in old if o["H"] == [4096]]
    det8 = [o["program"] for o in new if o["H"] == [8192] and o["backend"] == "det"]
    assert det8 == ["det_column_task_c64s8"]


def test_keep_refuses_a_table_that_names_programs_no_longer_in_the_registry(tmp_path):
    earlier = tmp_path / "earlier.toml"
    earlier.write_text(tune_routes.toml_text(_rows(4096), [4096], "sm_90a", "GPU")
                       .replace('"det_pair_ts_c64"', '"det_pair_gone"'))
    with pytest.raises(SystemExit, match="det_pair_gone"):
        _tune(tmp_path, _rows(8192), "--keep", str(earlier))


def test_a_forward_only_run_keeps_the_earlier_tables_backward_windows(tmp_path):
    """--keep at direction level: a run that timed forward programs only writes its forward windows
    and the earlier table's backward windows of the same width, and says which is which."""
    earlier = tmp_path / "earlier.toml"
    earlier.write_text("# 2026-01-02: earlier run\n" + tune_routes.toml_text(_rows(4096), [4096], "sm_90a", "GPU"))
    rows = [r for r in _rows(4096) if r["direction"] == "fwd"]
    for r in rows:
        if r["program"] == "fwd_rows8":
            r["ms"] = 0.5  # now fastest at every T
    text = _table_from(tmp_path, rows, "--keep", str(earlier))
    assert "# fwd at H 4096 measured in this run; bwd at H 4096 kept from the run of 2026-01-02" in text
    new = tomllib.loads(text)["override"]
    old = tomllib.loads(earlier.read_text())["override"]
    assert [o for o in new if o["direction"] == "bwd"] == [o for o in old if o["direction"] == "bwd"]
    assert [o["program"] for o in new if o["direction"] == "fwd"] == ["fwd_rows8"]


def test_windows_kept_twice_keep_the_date_of_the_run_that_measured_them(tmp_path):
    """A table that kept H 4096's backward from an older run, kept again by a forward-only run:
    the header dates those windows by the run that measured them, the forward by the table's run."""
    earlier = tmp_path / "earlier.toml"
    earlier.write_text("# 2026-01-02: earlier run\n# fwd at H 4096 measured in this run; bwd at H 4096 kept "
                       "from the run of 2025-12-30\n" + tune_routes.toml_text(_rows(4096), [4096], "sm_90a", "GPU"))
    forward = [r for r in _rows(4096) if r["direction"] == "fwd"]
    assert "# fwd at H 4096 measured in this run; bwd at H 4096 kept from the run of 2025-12-30" in (
        _table_from(tmp_path, forward, "--keep", str(earlier)))
    rows = [r for r in _rows(8192) if r["direction"] == "fwd"]
    for r in rows:
        r["H"] = 4096
    both = tmp_path / "both.toml"
    both.write_text(earlier.read_text() + "\n" + tune_routes.toml_text(_rows(8192), [8192], "sm_90a", "GPU"))
    assert ("# fwd at H 4096 measured in this run; H 8192 kept from the run of 2026-01-02; bwd at H 4096 kept "
            "from the run of 2025-12-30") in _table_from(tmp_path, rows, "--keep", str(both))


def test_a_forward_only_run_without_keep_says_what_is_missing(tmp_path):
    with pytest.raises(SystemExit, match="H 4096 bwd: not measured"):
        _tune(tmp_path, [r for r in _rows(4096) if r["direction"] == "fwd"])
