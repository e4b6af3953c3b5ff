#!/usr/bin/env python3
"""Compile the generated translation unit of a sample of libraries and print ptxas usage.

Default sample: every program form (each registry program) at every width for sm_90a (fp32 weight,
residual on, plus one bf16/no-residual variant at 4096), and one width (4096) at the other archs.
Fails (exit 1) on a compile error or any spill. Uses the PyPI nvcc of the active venv.

    python csrc/tools/compile_check.py [--arch sm_90a] [--H 4096,8192] [--program NAME] [--all] [-j 2]
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python"))

from cake_rmsnorm.build.generate import render_source  # noqa: E402
from cake_rmsnorm.registry import load_registry  # noqa: E402
from cake_rmsnorm.registry.model import Library, LibraryKey  # noqa: E402


def find_nvcc() -> Path:
    import nvidia  # the PyPI toolchain

    for base in nvidia.__path__:
        p = Path(base) / "cu13" / "bin" / "nvcc"
        if p.exists():
            return p
    sys.exit("compile_check: the PyPI nvcc (nvidia-cuda-nvcc) is not installed in this venv")


def compile_one(nvcc: Path, lib: Library, tmp: Path) -> tuple[str, bool, str]:
    arch = lib.arch.replace("sm_", "")
    tag = f"{lib.arch}:{lib.program.name}:H{lib.hidden}:{lib.weight_dtype}:{'res' if lib.residual else 'nores'}"
    src = tmp / (re.sub(r"[^A-Za-z0-9_]", "_", tag) + ".cu")
    src.write_text(render_source(lib))
    cudalib = nvcc.parent.parent / "lib"
    cmd = [str(nvcc), "-shared", "-Xcompiler", "-fPIC", "-std=c++17", "-O3", "--prec-div=true",
           "--prec-sqrt=true", "--ftz=false", "-gencode", f"arch=compute_{arch},code=sm_{arch}",
           "-cudart", "none", f"-L{cudalib}", "-l:libcudart.so.13", "-Xptxas", "-v",
           "-I", str(ROOT / "csrc/include"), "-I", str(ROOT / "csrc"), "-o", str(src.with_suffix(".so")),
           str(src)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    out = p.stdout + p.stderr
    if p.returncode != 0:
        return tag, False, "\n".join(out.splitlines()[:12])
    lines, ok, kern = [], True, "?"
    for line in out.splitlines():
        m = re.search(r"Compiling entry function '(\S+)'", line)
        if m:
            kern = "reduce" if "reduce" in m.group(1) else ("main" if "kernel" in m.group(1) else m.group(1)[:24])
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and (int(m.group(1)) or int(m.group(2))):
            ok = False
            lines.append(f"  SPILL {kern}: {line.strip()}")
        m = re.search(r"Used (\d+) registers.*", line)
        if m:
            lines.append(f"  {kern}: {m.group(0).strip()}")
    return tag, ok, "\n".join(lines)


def sample(reg, args) -> list[Library]:
    progs = [p for p in reg.programs.values() if not args.program or p.name in args.program.split(",")]
    widths = [int(h) for h in args.H.split(",")] if args.H else list(reg.widths)
    archs = args.arch.split(",") if args.arch else list(reg.arch_names)
    libs = []
    for arch in archs:
        libs += [lib for lib in reg.generic_libraries(arch) if lib.program in progs]
        for p in progs:
            if p.runtime_h:
                continue
            hs = widths if (arch == "sm_90a" or args.H or args.all) else [4096]
            for h in hs:
                variants = [("fp32", True)]
                if args.all:
                    variants = [("fp32", True), ("fp32", False), ("bf16", True), ("bf16", False)]
                elif h == 4096:
                    variants.append(("bf16", False))
                for dt, res in variants:
                    libs.append(Library(arch=arch, program=p, key=LibraryKey(hidden=h, weight_dtype=dt, residual=res),
                                        smem_optin_bytes=reg.smem_optin_bytes))
    return libs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", help="comma list (default: all four)")
    ap.add_argument("--H", help="comma list of widths (default: all at sm_90a, 4096 elsewhere)")
    ap.add_argument("--program", help="comma list of registry program names (default: all)")
    ap.add_argument("--all", action="store_true", help="every width and dtype/residual variant")
    ap.add_argument("-j", type=int, default=os.cpu_count() or 2)
    args = ap.parse_args()
    reg = load_registry()
    nvcc = find_nvcc()
    libs = sample(reg, args)
    print(f"compile_check: {len(libs)} libraries with {nvcc}", flush=True)
    bad = 0
    with tempfile.TemporaryDirectory() as d, cf.ThreadPoolExecutor(args.j) as ex:
        for tag, ok, text in ex.map(lambda lib: compile_one(nvcc, lib, Path(d)), libs):
            print(("OK   " if ok else "FAIL ") + tag + "\n" + text, flush=True)
            bad += not ok
    print(f"compile_check: {len(libs) - bad} ok, {bad} failed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
