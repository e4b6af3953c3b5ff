"""The benchmark's markdown table: a column per figure and a peer-over-ours ratio per key."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from report import RATIOS, markdown  # noqa: E402


def _row(impl, scale):
    return {"impl": impl, "H": 256, "T": 128, "fwd_ms": 0.004 * scale, "fwd_nograd_ms": 0.002 * scale,
            "bwd_ms": 0.005 * scale, "eager_step_ms": 0.1 * scale, "fwd_gbs": 100.0, "bwd_gbs": 100.0}


def test_ratio_columns_follow_their_keys():
    table = markdown([_row("cake_det", 1.0), _row("torch_compile", 2.0)], 3000.0, ["cake_det"])
    lines = [line for line in table.splitlines() if line.startswith("| ")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    ours = [c.strip() for c in lines[1].strip("|").split("|")]
    assert len(head) == len(ours)
    for label, _ in RATIOS:
        assert ours[head.index(f"{label} torch_compile/ours")] == "2.00"
    assert ours[head.index("fwd no_grad ms")] == "0.0020"
