"""csrc/tools/smoke_test.cu (the four program forms of one width against an FP64 reference, through
the exported ABI's argument checks, as a standalone GPU binary) builds against the current headers
with the programs' own numerics flags: nothing else compiles it, and it had fallen behind the
backward templates' parameters.
"""
from __future__ import annotations

import subprocess

import pytest

from cake_rmsnorm.build.layout import default_source_root
from cake_rmsnorm.build.nvcc_step import FLAGS
from cake_rmsnorm.build.toolchain import find_cudart_dir, find_nvcc
from test_build import require_toolchain

# the programs' flags that decide their arithmetic (and the language level its headers need)
NUMERICS = tuple(f for f in FLAGS if f.startswith(("--prec-", "--ftz", "-O", "-std=")))
SMOKE = default_source_root() / "csrc" / "tools" / "smoke_test.cu"


def test_smoke_documents_the_programs_numerics_flags():
    # built otherwise than the programs, it would check other bits than theirs
    assert {"--prec-div=true", "--prec-sqrt=true", "--ftz=false"} <= set(NUMERICS)
    header = SMOKE.read_text().split("#include")[0]
    for flag in NUMERICS:
        assert flag in header, flag


@pytest.mark.toolchain
def test_smoke_builds(tmp_path):
    require_toolchain()
    root = default_source_root()
    cmd = [str(find_nvcc()), *NUMERICS, "-DSMOKE_H=4096", "-gencode", "arch=compute_90a,code=sm_90a",
           "-cudart", "static", f"-L{find_cudart_dir()}", "-I", str(root / "csrc" / "include"),
           "-I", str(root / "csrc"), "-o", str(tmp_path / "smoke"), str(SMOKE)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
