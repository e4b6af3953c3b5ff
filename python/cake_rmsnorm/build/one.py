"""Compile one library outside the plan (tests, and test libraries for a GPU check): the same
generated source, the same nvcc_step (flags, ptxas record) and the same shared-memory checks as a
planned build, into a folder of the caller's choosing. No CMake, no lock, no build record.

    compile_one(lib, out_dir)  ->  CompiledLibrary(path=out_dir/lib<name>.so, record={...ptxas...})
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..errors import BuildError
from ..registry import Library, load_registry
from .generate import render_source
from .layout import default_source_root
from .orchestrate import NVCC_STEP
from .smem import check_oversized_flags, check_ptxas_smem
from .toolchain import Toolchain, preflight


@dataclass(frozen=True)
class CompiledLibrary:
    library: Library
    path: Path
    record: dict  # nvcc_step's ptxas JSON


def compile_one(lib: Library, out_dir: Path, tc: Optional[Toolchain] = None,
                source_root: Optional[Path] = None) -> CompiledLibrary:
    """Generate, compile and check `lib` into `out_dir` (BuildError on any failure)."""
    arch = load_registry().arch(lib.arch)
    check_oversized_flags(arch.name, [lib])
    tc = tc or preflight([arch])
    root = Path(source_root) if source_root else default_source_root()
    out_dir = Path(out_dir).resolve()
    (out_dir / "gen").mkdir(parents=True, exist_ok=True)
    source = out_dir / "gen" / f"{lib.name}.cu"
    source.write_text(render_source(lib))
    output, record = out_dir / lib.filename, out_dir / f"{lib.name}.ptxas.json"
    cmd = [sys.executable, str(NVCC_STEP), "--name", lib.name, "--nvcc", str(tc.nvcc),
           "--toolkit", tc.nvcc_version, "--gencode", arch.gencode,
           "--cudart-dir", str(tc.cudart_dir), "--include", str(root / "csrc" / "include"),
           "--include", str(root / "csrc"), "--source", str(source), "--output", str(output),
           "--ptxas-json", str(record), "--depfile", str(out_dir / "gen" / f"{lib.name}.d")]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError(f"compile failed for {lib.name} ({arch.name}):\n"
                         f"{proc.stdout}{proc.stderr}")
    doc = json.loads(record.read_text())
    check_ptxas_smem(lib, doc.get("kernels", []))
    return CompiledLibrary(lib, output, doc)
