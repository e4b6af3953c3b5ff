"""benchmarks/graph_offsets.py's report on made-up graphs (no GPU): every pair of graphs compared,
so a gap that holds for every graph reads apart from one inside the graphs' own offsets."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import graph_offsets  # noqa: E402
from timing import Spread  # noqa: E402


def _graphs(*iqms_us):
    return [Spread((v - 0.1) / 1e3, (v + 0.1) / 1e3, v / 1e3) for v in iqms_us]  # in ms


def test_a_gap_of_every_graph_counts_every_pair():
    lines = graph_offsets.report(256, 128, {"ours": _graphs(4.3, 4.25, 4.28),
                                            "peer": _graphs(4.2, 4.22)})
    assert lines[0] == "H 256 T 128 ours: graphs' IQM 4.250-4.300 us, median of them 4.280 (4.250 4.280 4.300)"
    assert lines[2] == ("H 256 T 128: ours above peer in 6 of 6 graph pairs; "
                        "median IQM ratio peer/ours 0.9836")


def test_overlapping_offsets_count_only_the_pairs_above():
    lines = graph_offsets.report(256, 128, {"ours": _graphs(4.1, 4.3), "peer": _graphs(4.2, 4.2)})
    assert "ours above peer in 2 of 4 graph pairs" in lines[2]


def test_one_implementation_gives_no_comparison():
    assert len(graph_offsets.report(256, 128, {"ours": _graphs(4.1)})) == 1
