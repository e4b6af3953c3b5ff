"""Build every registry program for one arch at a sample of keys, routed there or not, into a
git-ignored folder that travels to the GPU machine (ci/check_programs.py runs them):

    python ci/program_libs.py [--arch sm_90a] [--programs A,B] [--widths 256,4096] [--keys fp32]
                              [--reuse] [--out DIR] [-j 2]

Why: programs that only the Blackwell tables route to (single-kernel TwoSum and FP32 sums, the
TwoSum pair, the FP64 column task, the 8-row forward) can still be checked for correctness on an
H200, compiled for sm_90a. Programs whose shared memory passes the opt-in are skipped (they cannot
run there). Keys: every width, FP32 weight without residual and BF16 weight with residual
(--keys fp32: the first only, all the tuner times). --reuse keeps a library already in the folder
whose generated source is unchanged and that is newer than every file under csrc/ and the build
package (a build cut short goes on where it stopped).
Same generated source, nvcc flags and checks as a planned build (build/one.py). Writes index.json,
keeping the entries of earlier runs into the same folder that this run did not rebuild.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import functools
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))

from cake_rmsnorm.build.generate import render_source  # noqa: E402
from cake_rmsnorm.build.one import CompiledLibrary, compile_one  # noqa: E402
from cake_rmsnorm.build.toolchain import preflight  # noqa: E402
from cake_rmsnorm.registry import Library, LibraryKey, load_registry  # noqa: E402

# what a library is compiled from besides its generated source: headers, nvcc flags and steps
BUILD_INPUTS = (ROOT / "csrc", ROOT / "python" / "cake_rmsnorm" / "build")
KEYS = {"fp32": ("fp32", False), "bf16_res": ("bf16", True)}


def libraries(arch: str, programs, widths, keys):
    reg = load_registry()
    for name in programs or sorted(reg.programs):
        program = reg.programs[name]
        if program.runtime_h:  # one library per key, H a run-time argument
            yield from (lib for lib in reg.generic_libraries(arch) if lib.program.name == name
                        and (lib.key.weight_dtype, lib.key.residual) in keys)
            continue
        for hidden in widths or reg.widths:
            for wd, res in keys:
                lib = Library(arch, program, LibraryKey(hidden, wd, res), reg.smem_optin_bytes)
                if not lib.oversized:
                    yield lib


@functools.cache
def newest_build_input() -> float:
    return max(f.stat().st_mtime for d in BUILD_INPUTS for f in d.rglob("*")
               if f.is_file() and f.suffix != ".pyc")


def reusable(lib: Library, out: Path):
    """The library built earlier into `out` from the same source, or None."""
    so, record, source = out / lib.filename, out / f"{lib.name}.ptxas.json", out / "gen" / f"{lib.name}.cu"
    if not (so.is_file() and record.is_file() and source.is_file()):
        return None
    if so.stat().st_mtime <= newest_build_input() or source.read_text() != render_source(lib):
        return None
    return CompiledLibrary(lib, so, json.loads(record.read_text()))


def main(argv) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--programs", default="", help="comma list (default: every program)")
    ap.add_argument("--widths", default="", help="comma list (default: every prebuilt width)")
    ap.add_argument("--keys", default=",".join(KEYS),
                    help=f"comma list of {', '.join(KEYS)} (default: both)")
    ap.add_argument("--reuse", action="store_true",
                    help="keep libraries already built into --out from the same source")
    ap.add_argument("--out", default=str(ROOT / ".carry" / "programs"))
    ap.add_argument("-j", type=int, default=2)
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    reg = load_registry()
    programs = [p for p in args.programs.split(",") if p]
    unknown = [p for p in programs if p not in reg.programs]
    if unknown:
        sys.exit(f"--programs {unknown}: not registry programs; known: {', '.join(sorted(reg.programs))}")
    widths = [int(w) for w in args.widths.split(",") if w]
    keys = args.keys.split(",")
    if not all(k in KEYS for k in keys):
        sys.exit(f"--keys {args.keys!r}: accepted keys are {', '.join(KEYS)} (comma list)")
    libs = list(libraries(args.arch, programs, widths, [KEYS[k] for k in keys]))
    tc = preflight([reg.arch(args.arch)])
    index_file = out / "index.json"
    earlier = json.loads(index_file.read_text())["libraries"] if index_file.is_file() else []
    index = [e for e in earlier  # earlier runs' libraries of programs that still exist, not rebuilt
             if e["name"] not in {lib.name for lib in libs} and e["program"] in reg.programs]
    compiled_now = 0
    with cf.ThreadPoolExecutor(max_workers=args.j) as pool:
        def build(lib):  # (the library, whether it was compiled now)
            kept = args.reuse and reusable(lib, out)
            return (kept, False) if kept else (compile_one(lib, out, tc), True)
        futures = {pool.submit(build, lib): lib for lib in libs}
        for n, fut in enumerate(cf.as_completed(futures), 1):
            lib = futures[fut]
            built, compiled = fut.result()
            compiled_now += compiled
            print(f"[{n}/{len(libs)}] {built.path.name}: registers {built.record['registers']}"
                  + ("" if compiled else " (reused)"),
                  flush=True)
            index.append({**lib.plan_fields(), "file": built.path.name,
                          "direction": lib.program.direction, "form": lib.program.form,
                          "reduction": lib.program.reduction,
                          "deterministic": lib.program.deterministic})
    index.sort(key=lambda e: e["name"])
    index_file.write_text(json.dumps({"arch": args.arch, "libraries": index}, indent=2) + "\n")
    print(f"wrote {index_file}: {len(index)} libraries (this run compiled {compiled_now}, "
          f"reused {len(libs) - compiled_now})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
