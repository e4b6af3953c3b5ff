"""ci/program_libs.py without nvcc: which libraries --keys selects, and --reuse keeping a library
only while its generated source and build inputs are unchanged."""

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("program_libs", ROOT / "ci" / "program_libs.py")
program_libs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(program_libs)

from cake_rmsnorm.build.generate import render_source  # noqa: E402


def test_keys_select_weight_and_residual():
    fp32 = list(program_libs.libraries("sm_90a", ["fwd_rows1"], [256], [program_libs.KEYS["fp32"]]))
    both = list(program_libs.libraries("sm_90a", ["fwd_rows1"], [256], program_libs.KEYS.values()))
    assert [(lib.key.weight_dtype, lib.key.residual) for lib in fp32] == [("fp32", False)]
    assert sorted((lib.key.weight_dtype, lib.key.residual) for lib in both) == [("bf16", True),
                                                                                ("fp32", False)]


def test_unknown_key_is_refused_naming_the_accepted_ones():
    with pytest.raises(SystemExit) as e:
        program_libs.main(["--keys", "fp16", "--programs", "fwd_rows1"])
    assert "fp16" in str(e.value) and "fp32" in str(e.value) and "bf16_res" in str(e.value)


def _fake_built(lib, out: Path) -> None:
    """What compile_one leaves for lib: the library, its ptxas record and its generated source."""
    (out / "gen").mkdir(parents=True, exist_ok=True)
    (out / "gen" / f"{lib.name}.cu").write_text(render_source(lib))
    (out / f"{lib.name}.ptxas.json").write_text(json.dumps({"registers": 40, "kernels": []}))
    (out / lib.filename).write_bytes(b"\x7fELF")


def test_reuse_keeps_only_an_unchanged_newer_library(tmp_path):
    lib = next(program_libs.libraries("sm_90a", ["fwd_rows1"], [256], [program_libs.KEYS["fp32"]]))
    assert program_libs.reusable(lib, tmp_path) is None  # nothing built yet
    _fake_built(lib, tmp_path)
    kept = program_libs.reusable(lib, tmp_path)
    assert kept is not None and kept.path == tmp_path / lib.filename and kept.record["registers"] == 40

    source = tmp_path / "gen" / f"{lib.name}.cu"
    source.write_text(source.read_text() + "// edited\n")  # generated from another registry entry
    assert program_libs.reusable(lib, tmp_path) is None

    _fake_built(lib, tmp_path)
    older = program_libs.newest_build_input() - 10  # built before a header or build step changed
    os.utime(tmp_path / lib.filename, (older, older))
    assert program_libs.reusable(lib, tmp_path) is None
