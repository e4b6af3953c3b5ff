"""benchmarks/ab_forward.py without a GPU: which programs two library folders pair up at a key, the
bit comparison of two builds' outputs, and the report's lines (bits, each trial's order, the
medians' ratios to torch.compile)."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import ab_forward  # noqa: E402


def _entry(program, hidden=256, direction="fwd", wd="fp32", res=False):
    return {"program": program, "H": hidden, "direction": direction, "weight_dtype": wd,
            "residual": res, "file": f"lib{program}_h{hidden}.so"}


def test_pairs_only_programs_both_folders_hold_at_the_key():
    old = {"libraries": [_entry("fwd_rows1_wa"), _entry("fwd_rows2_wa"), _entry("fwd_ring_b8"),
                         _entry("fwd_rows2_wa", hidden=4096), _entry("det_pair_c64", direction="bwd"),
                         _entry("fwd_rows1_wa", wd="bf16", res=True)]}
    new = {"libraries": [_entry("fwd_rows2_wa"), _entry("fwd_rows1_wa"), _entry("fwd_rows1_wa_t4")]}
    pairs, unpaired = ab_forward.paired_programs(old, new, 256)
    assert list(pairs) == ["fwd_rows1_wa", "fwd_rows2_wa"]
    assert pairs["fwd_rows2_wa"] == (_entry("fwd_rows2_wa"), _entry("fwd_rows2_wa"))
    assert unpaired == ["fwd_ring_b8", "fwd_rows1_wa_t4"]
    assert ab_forward.paired_programs(old, new, 8192) == ({}, [])
    pairs, _ = ab_forward.paired_programs(old, {"libraries": [_entry("fwd_rows1_wa", wd="bf16", res=True)]},
                                          256, "bf16", True)
    assert list(pairs) == ["fwd_rows1_wa"]


def test_report_names_differing_bits_and_ratios_to_the_peer():
    point = {"T": 4096, "bits": {"fwd_rows2_wa": True, "fwd_rows1_wa_t4": False},
             "trials": [{"old/fwd_rows2_wa": 6.0, "new/fwd_rows2_wa": 5.0, "torch_compile": 5.5},
                        {"old/fwd_rows2_wa": 6.2, "new/fwd_rows2_wa": 5.2, "torch_compile": 5.5}]}
    lines = ab_forward.report(point)
    assert lines[0] == "T 4096: bits fwd_rows2_wa same, fwd_rows1_wa_t4 DIFFER"
    assert lines[1] == "T 4096 trial 0: new/fwd_rows2_wa 5.00; torch_compile 5.50; old/fwd_rows2_wa 6.00"
    # medians: new 5.1, old 6.1; the peer's over ours
    assert "new/fwd_rows2_wa 5.10 (1.078)" in lines[3]
    assert "old/fwd_rows2_wa 6.10 (0.902)" in lines[3]
    assert lines[3].endswith("torch_compile 5.50")
    assert lines[3].index("new/") < lines[3].index("old/")


def test_same_outputs_compares_bits_of_y_and_rstd():
    import torch
    from types import SimpleNamespace

    y = torch.tensor([[1.0, -0.0]], dtype=torch.bfloat16)
    rstd = torch.tensor([0.5])
    a = SimpleNamespace(y=y, rstd=rstd)
    assert ab_forward.same_outputs(a, SimpleNamespace(y=y.clone(), rstd=rstd.clone()))
    # -0.0 against 0.0 (equal as numbers, other bits), and a last-bit change of rstd
    assert not ab_forward.same_outputs(a, SimpleNamespace(y=y.abs(), rstd=rstd.clone()))
    assert not ab_forward.same_outputs(a, SimpleNamespace(y=y.clone(), rstd=torch.nextafter(
        rstd, torch.tensor([1.0]))))
