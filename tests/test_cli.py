"""The CLI's registry views: `plan` and `explain`, as users and CI scripts read them."""

import json
import subprocess
import sys

import pytest

from cake_rmsnorm.cli import main
from cake_rmsnorm.registry import FORMS, REDUCTIONS, load_registry

PLAN_FIELDS = {"name", "program", "H", "weight_dtype", "residual", "smem_bytes", "oversized"}
EXPLAIN_FIELDS = {"arch", "backend", "direction", "H", "T", "weight_dtype", "residual", "program",
                  "form", "reduction", "library", "window", "window_label"}


def run_json(capsys, *argv):
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_json_lists_every_arch_with_seven_widths(capsys):
    reg = load_registry()
    plans = run_json(capsys, "plan", "--arch", "all", "--json")
    assert [p["arch"] for p in plans] == list(reg.arch_names)
    for plan in plans:
        assert plan["widths"] == list(reg.widths)
        assert plan["libraries"], plan["arch"]
        assert all(set(lib) == PLAN_FIELDS for lib in plan["libraries"])
        assert len(plan["libraries"]) == len(reg.libraries(plan["arch"]))


def test_plan_text_prints_counts(capsys):
    assert main(["plan", "--arch", "sm_90a,sm_100a"]) == 0
    out = capsys.readouterr().out
    reg = load_registry()
    n = len(reg.libraries("sm_90a"))
    assert f"counts: sm_90a {n}, sm_100a {len(reg.libraries('sm_100a'))}" in out


def test_explain_json_fields_and_window(capsys):
    doc = run_json(capsys, "explain", "--arch", "sm_90a", "--backend", "det", "--direction", "bwd",
                   "--H", "4096", "--T", "65536", "--weight-dtype", "bf16", "--residual", "--json")
    assert set(doc) == EXPLAIN_FIELDS
    route = load_registry().route("sm_90a", "det", "bwd", 4096, 65536, "bf16", True)
    assert doc["program"] == route.program.name
    assert doc["library"] == route.library.name
    assert doc["window_label"] == (route.window.label or None)
    lo, hi = doc["window"]
    assert lo <= 65536 and (hi is None or 65536 <= hi)
    assert doc["form"] in FORMS
    assert doc["reduction"] in REDUCTIONS


def test_explain_forward_form(capsys):
    doc = run_json(capsys, "explain", "--arch", "sm_107a", "--backend", "fast", "--direction",
                   "fwd", "--H", "5120", "--T", "1", "--json")
    assert doc["form"] == "forward"


@pytest.mark.parametrize("argv, message", [
    (["explain", "--arch", "sm_89", "--backend", "det", "--direction", "bwd", "--H", "4096",
      "--T", "1"], "unknown arch 'sm_89'"),
    (["explain", "--arch", "sm_90a", "--backend", "det", "--direction", "bwd", "--H", "4004",
      "--T", "1"], "H=4004 is not a prebuilt width"),
    (["plan", "--arch", "sm_90a", "--width", "300"], "--width [300]"),
])
def test_errors_exit_2_with_a_message(capsys, argv, message):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_python_dash_m_works():
    out = subprocess.run([sys.executable, "-m", "cake_rmsnorm", "plan", "--arch", "sm_90a",
                          "--json"], check=True, capture_output=True, text=True).stdout
    assert json.loads(out)[0]["arch"] == "sm_90a"


def test_explain_names_the_upstream_window_behind_a_route(capsys):
    """Issue 5, acceptance 3: sm_103a fast H 2048 runs det's program at T 58497 (F1), not at 58496
    or 61953."""
    def program(backend, tokens):
        doc = run_json(capsys, "explain", "--arch", "sm_103a", "--backend", backend, "--direction",
                       "bwd", "--H", "2048", "--T", str(tokens), "--json")
        return doc["program"], doc["window_label"]
    assert program("fast", 58497) == (program("det", 58497)[0], "F1")
    assert program("fast", 61952)[0] == program("det", 61952)[0]
    for tokens in (58496, 61953):
        assert program("fast", tokens)[0] != program("det", tokens)[0]
