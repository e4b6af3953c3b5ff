"""Compile one library: the command every CMake custom command runs (stdlib only, run as a script).

    python nvcc_step.py --nvcc NVCC --gencode arch=compute_90a,code=sm_90a --source X.cu
        --output lib/libX.so --ptxas-json ptxas/X.json --depfile deps/X.d
        --cudart-dir .../nvidia/cu13/lib --include csrc/include --include csrc [--toolkit 13.5.37]

Atomic: nvcc writes a temp file beside the output, the ptxas record is written next, and the
library is renamed onto its final name last, so a killed compile never leaves a half library under
the name Ninja and the packager trust. The depfile names the final output (not the temp file) with
absolute paths, so touching a header rebuilds exactly the libraries that include it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

# The flags every library is built with (DESIGN.md: exact IEEE division and sqrt, no FTZ; SASS
# only; the CUDA runtime is found through the nvidia-cuda-runtime wheel beside the provider).
# `-Xlinker -s` drops the static symbol table, where nvcc leaves its temp file's name (tmpxft_<pid>_…):
# with it two builds of one source give the same bytes. The exported ABI (.dynsym) stays.
# `-fvisibility=hidden`: only the ABI (marked default-visible in bindings/export.cuh) is exported.
# Without it the host code's template statics (the shared-memory attribute flag of prepare_smem,
# the occupancy cache) are STB_GNU_UNIQUE, which the dynamic linker binds process-wide even under
# RTLD_LOCAL: a second copy of one library (e.g. the installed wheel's and a tool's build folder's)
# then used the first copy's "attributes set" flag and failed its launch above 48 KiB.
FLAGS = ["-shared", "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden", "-std=c++17", "-O3", "--prec-div=true",
         "--prec-sqrt=true", "--ftz=false", "-Xfatbin=-compress-all", "-cudart", "none",
         "-l:libcudart.so.13", "-Xlinker", "-rpath,$ORIGIN/../../nvidia/cu13/lib", "-Xlinker", "-s",
         "-Xptxas", "-v"]
TMP_SUFFIX = ".tmp"  # temp names: .<output name>.<pid>.tmp; the orchestrator sweeps stale ones


def tmp_name(output: Path) -> Path:
    return output.with_name(f".{output.name}.{os.getpid()}{TMP_SUFFIX}")


def parse_ptxas(text: str) -> List[Dict[str, object]]:
    """Per-kernel resource usage from `ptxas -v` output (entry functions only)."""
    kernels: Dict[str, Dict[str, object]] = {}
    current = props = None
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            current = m.group(1)
            kernels.setdefault(current, {"name": current, "registers": 0, "smem_static": 0,
                                         "stack": 0, "spill_stores": 0, "spill_loads": 0})
            continue
        m = re.search(r"Function properties for (\S+)", line)
        if m:
            props = m.group(1)
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
                      line)
        if m and props in kernels:
            rec = kernels[props]
            rec["stack"], rec["spill_stores"], rec["spill_loads"] = map(int, m.groups())
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m and current in kernels:
            kernels[current]["registers"] = int(m.group(1))
            s = re.search(r"(\d+) bytes smem", line)
            if s:
                kernels[current]["smem_static"] = int(s.group(1))
    return [kernels[k] for k in sorted(kernels)]


def _split_make_deps(text: str) -> List[str]:
    """The prerequisites of a one-rule Makefile depfile (backslash-newline continued)."""
    body = text.replace("\\\n", " ")
    _, _, prereqs = body.partition(": ")
    words, cur, i = [], "", 0
    while i < len(prereqs):
        ch = prereqs[i]
        if ch == "\\" and i + 1 < len(prereqs) and prereqs[i + 1] == " ":
            cur, i = cur + " ", i + 2
            continue
        if ch.isspace():
            if cur:
                words.append(cur)
            cur = ""
        else:
            cur += ch
        i += 1
    if cur:
        words.append(cur)
    return words


def _escape(path: str) -> str:
    return path.replace(" ", "\\ ").replace("$", "$$")


def write_atomic(path: Path, text: str) -> None:
    tmp = tmp_name(path)
    tmp.write_text(text)
    os.replace(tmp, path)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for opt in ("--nvcc", "--gencode", "--source", "--output", "--ptxas-json", "--depfile",
                "--cudart-dir"):
        ap.add_argument(opt, required=True)
    ap.add_argument("--include", action="append", default=[])
    ap.add_argument("--toolkit", default="", help="recorded; also makes a toolkit change rebuild")
    ap.add_argument("--name", default="")
    args = ap.parse_args(argv)
    output, record, depfile = (Path(p).resolve() for p in (args.output, args.ptxas_json,
                                                           args.depfile))
    for directory in {output.parent, record.parent, depfile.parent}:
        directory.mkdir(parents=True, exist_ok=True)
    tmp_lib, tmp_dep = tmp_name(output), tmp_name(depfile)
    cmd = [args.nvcc, *FLAGS, "-gencode", args.gencode, f"-L{args.cudart_dir}"]
    for inc in args.include:
        cmd += ["-I", inc]
    cmd += ["-MD", "-MF", str(tmp_dep), args.source, "-o", str(tmp_lib)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        log = proc.stdout + proc.stderr
        if proc.returncode != 0:
            sys.stderr.write(log)
            sys.stderr.write(f"nvcc failed ({proc.returncode}): {' '.join(cmd)}\n")
            return proc.returncode or 1
        # Show what the compiler said besides the resource report (warnings, notes).
        chatter = [ln for ln in log.splitlines()
                   if not ln.startswith("ptxas info") and not re.match(r"\s+\d+ bytes stack", ln)]
        if chatter:
            sys.stderr.write("\n".join(chatter) + "\n")
        kernels = parse_ptxas(log)
        name = args.name or output.stem
        doc = {"name": name, "file": output.name, "gencode": args.gencode,
               "toolkit": args.toolkit, "sha256": sha256(tmp_lib),
               "registers": max((int(k["registers"]) for k in kernels), default=0),
               "kernels": kernels}
        # Depfile: the final output as target, every prerequisite absolute (Ninja's cwd differs).
        cwd = Path.cwd()
        deps = [str((cwd / d).resolve()) if not os.path.isabs(d) else d
                for d in _split_make_deps(tmp_dep.read_text())]
        write_atomic(depfile, _escape(str(output)) + ": \\\n  "
                     + " \\\n  ".join(_escape(d) for d in deps) + "\n")
        write_atomic(record, json.dumps(doc, indent=2, sort_keys=True) + "\n")
        os.replace(tmp_lib, output)  # last: the library appears whole or not at all
        return 0
    finally:
        for tmp in (tmp_lib, tmp_dep):
            if tmp.exists():
                tmp.unlink()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
