"""The standalone GPU tools in csrc/tools build against the current headers with the programs' own
numerics flags: nothing else compiles them, and smoke_test.cu (the four program forms of one width
against an FP64 reference, through the exported ABI's argument checks) had fallen behind the
backward templates' parameters.
"""
from __future__ import annotations

import subprocess

import pytest

from cake_rmsnorm.build.layout import default_source_root
from cake_rmsnorm.build.nvcc_step import FLAGS
from cake_rmsnorm.build.toolchain import find_cudart_dir, find_nvcc
from test_build import require_toolchain

NUMERICS = ("-std=c++17", "-O3", "--prec-div=true", "--prec-sqrt=true", "--ftz=false")
TOOLS = {"smoke_test.cu": ("-DSMOKE_H=4096",)}


def tool_path(name: str):
    return default_source_root() / "csrc" / "tools" / name


@pytest.mark.parametrize("name", sorted(TOOLS))
def test_tool_documents_the_programs_numerics_flags(name):
    # a tool built otherwise than the programs checks other bits than theirs
    assert set(NUMERICS) <= set(FLAGS)
    header = tool_path(name).read_text().split("#include")[0]
    for flag in NUMERICS:
        assert flag in header, f"{name}: {flag}"


@pytest.mark.toolchain
@pytest.mark.parametrize("name", sorted(TOOLS))
def test_tool_builds(name, tmp_path):
    require_toolchain()
    root = default_source_root()
    cmd = [str(find_nvcc()), *NUMERICS, *TOOLS[name], "-gencode", "arch=compute_90a,code=sm_90a",
           "-cudart", "static", f"-L{find_cudart_dir()}", "-I", str(root / "csrc" / "include"),
           "-I", str(root / "csrc"), "-o", str(tmp_path / "tool"), str(tool_path(name))]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
