"""benchmarks/acceptance.py on made-up benchmark rows (no GPU): each goal of issue 4's acceptance 4
and 5 passes at its limit's good side and fails at its bad side, and the exit status says so."""

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import acceptance  # noqa: E402

COPY = 4000.0


def _row(impl, hidden, tokens, fwd_us, bwd_us, eager_us):
    elems = tokens * hidden
    return {"impl": impl, "H": hidden, "T": tokens, "fwd_ms": fwd_us / 1e3, "bwd_ms": bwd_us / 1e3,
            "eager_step_ms": eager_us / 1e3, "fwd_gbs": 4 * elems / (fwd_us / 1e3) / 1e6,
            "bwd_gbs": 6 * elems / (bwd_us / 1e3) / 1e6}


def _doc():
    """A point of each kind where every goal holds: large T at the copy limit, small T, T 128."""
    big = 2048 * 65536  # elements: forward at 0.95 of copy, backward at 0.90
    fwd_us, bwd_us = 4 * big / (0.95 * COPY) / 1e3, 6 * big / (0.90 * COPY) / 1e3
    rows = [_row("cake_det", 2048, 65536, fwd_us, bwd_us * 1.05, 900),
            _row("cake_fast", 2048, 65536, fwd_us, bwd_us, 900),
            _row("torch_compile", 2048, 65536, fwd_us * 1.01, bwd_us * 1.2, 900)]
    for tokens in (128, 4096):
        rows += [_row("cake_det", 2048, tokens, 5.0, 4.0, 100),
                 _row("cake_fast", 2048, tokens, 5.0, 4.0, 100),
                 _row("torch_compile", 2048, tokens, 5.1, 6.0, 250),
                 _row("liger", 2048, tokens, 5.2, 9.0, 210)]
    return {"device": "made up", "copy_gbs": COPY, "rows": rows}


def _failing(doc):
    return [c.what for c in acceptance.checks(doc) if not c.ok]


def _set(doc, impl, tokens, **fields):
    for row in doc["rows"]:
        if row["impl"] == impl and row["T"] == tokens:
            row.update(fields)


def test_every_goal_holds_on_the_made_up_run():
    checks = list(acceptance.checks(_doc()))
    assert checks and all(c.ok for c in checks), [c.line() for c in checks if not c.ok]
    # large T: 2 fwd + 2 copy + 3 bwd; T 128 and 4096: 4 kernel checks each; T 128: 2 eager
    assert len(checks) == 7 + 4 + 4 + 2


@pytest.mark.parametrize("impl,tokens,fields,expected", [
    ("cake_fast", 65536, {"fwd_ms": 1.0}, {"H 2048 T 65536 cake_fast fwd vs torch_compile"}),
    ("cake_det", 65536, {"fwd_gbs": 0.92 * COPY}, {"H 2048 T 65536 cake_det fwd of copy"}),
    ("cake_fast", 65536, {"bwd_gbs": 0.87 * COPY}, {"H 2048 T 65536 cake_fast bwd of copy"}),
    ("torch_compile", 65536, {"bwd_ms": 0.070}, {"H 2048 T 65536 cake_fast bwd vs torch_compile"}),
    ("cake_det", 65536, {"bwd_ms": 1.0}, {"H 2048 T 65536 cake_det bwd vs cake_fast"}),
    ("cake_det", 4096, {"bwd_ms": 0.0061}, {"H 2048 T 4096 cake_det bwd vs torch_compile"}),
    ("cake_fast", 128, {"eager_step_ms": 0.106}, {"H 2048 T 128 cake_fast eager step vs fastest peer"}),
])
def test_each_goal_fails_on_its_side(impl, tokens, fields, expected):
    doc = _doc()
    _set(doc, impl, tokens, **fields)
    assert set(_failing(doc)) == expected


def test_eager_goal_is_against_the_fastest_peer():
    doc = _doc()
    _set(doc, "liger", 128, eager_step_ms=0.190)  # 100 / 190 > 0.5, though 100 / 250 < 0.5
    assert set(_failing(doc)) == {f"H 2048 T 128 cake_{b} eager step vs fastest peer"
                                  for b in ("det", "fast")}


def test_exit_status_and_report(tmp_path, capsys):
    doc = _doc()
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(doc))
    assert acceptance.main([str(path)]) == 0
    assert "17 of 17 checks pass, 0 fail" in capsys.readouterr().out
    _set(doc, "cake_det", 128, fwd_ms=0.0052)
    path.write_text(json.dumps(doc))
    assert acceptance.main([str(path), "--failures-only"]) == 1
    out = capsys.readouterr().out
    assert "FAIL H 2048 T 128 cake_det fwd vs torch_compile: 0.981 (goal >= 1; 5.20 us vs 5.10 us)" in out
    assert "ok " not in out


def test_a_failing_line_gives_the_replays_quartiles_where_recorded():
    doc = _doc()
    _set(doc, "cake_det", 128, fwd_ms=0.0052, fwd_q_ms=[0.0050, 0.0056])
    _set(doc, "torch_compile", 128, fwd_q_ms=[0.0049, 0.0052])
    line = next(c.line() for c in acceptance.checks(doc) if not c.ok)
    assert line.endswith("(goal >= 1; 5.20 us (5.00-5.60) vs 5.10 us (4.90-5.20))"), line
    _set(doc, "cake_det", 128, fwd_iqm_ms=0.005213)
    _set(doc, "torch_compile", 128, fwd_iqm_ms=0.005087)
    line = next(c.line() for c in acceptance.checks(doc) if not c.ok)
    assert line.endswith("(5.00-5.60, IQM 5.213) vs 5.10 us (4.90-5.20, IQM 5.087))"), line
    _set(doc, "cake_det", 128, bwd_ms=0.0062)  # no quartiles for a backward (step less forward)
    assert "6.20 us vs 6.00 us)" in next(c.line() for c in acceptance.checks(doc) if "det bwd" in c.what)


def test_several_runs_list_each_miss_with_its_value_in_every_run(tmp_path, capsys):
    docs = [_doc(), _doc()]
    _set(docs[0], "cake_det", 128, fwd_ms=0.0052)   # a miss in both runs
    _set(docs[1], "cake_det", 128, fwd_ms=0.0053)
    _set(docs[1], "cake_fast", 4096, fwd_ms=0.0052)  # a miss in one
    paths = []
    for i, doc in enumerate(docs):
        paths.append(tmp_path / f"run{i}.json")
        paths[-1].write_text(json.dumps(doc))
    assert acceptance.main([str(p) for p in paths] + ["--failures-only"]) == 1
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[-3:] == [
        "FAIL in 2 of 2 runs: H 2048 T 128 cake_det fwd vs torch_compile: 0.981, 0.962 (goal >= 1)",
        "FAIL in 1 of 2 runs: H 2048 T 4096 cake_fast fwd vs torch_compile: 1.020, 0.981 (goal >= 1)",
        "across 2 runs: 15 of 17 checks pass in every run, 1 fail in every run, 1 in some"]
    assert f"{paths[0]}: made up: copy 4000 GB/s" in out


def test_runs_of_different_devices_are_refused(tmp_path):
    docs = [_doc(), dict(_doc(), device="other")]
    paths = []
    for i, doc in enumerate(docs):
        paths.append(str(tmp_path / f"run{i}.json"))
        Path(paths[-1]).write_text(json.dumps(doc))
    with pytest.raises(SystemExit, match="runs of different devices"):
        acceptance.main(paths)


def test_unreadable_file_is_named(tmp_path):
    with pytest.raises(SystemExit) as e:
        acceptance.main([str(tmp_path / "missing.json")])
    assert "missing.json" in str(e.value)
