"""Build the oversized-check test libraries for sm_90a, H 4096, FP32 weight, no residual, into a
git-ignored folder (default .carry/oversized) that travels to the GPU machine:

    python ci/oversized_libs.py [--out .carry/oversized]

- det_pair_c64_h4096_fp32            the registry's det_pair_c64 (the fallback whose bits are the bar)
- test_staged<N>_h4096_fp32          the staged reduce (cake::BwdPairStaged) at stage_bytes N:
    N = 4096     2 staged chunks per warp (many stages: the staging loop itself is exercised)
    N = 200704   194 chunks per warp, under the 232448 B opt-in (an H200 runs it)
    N = 271360   the sm_107a size, above the opt-in: built with CAKE_OVERSIZED (sets oversized mode)
These are scratch programs, not in the registry: `cake-rmsnorm plan` never lists them. Same
generated source, nvcc flags (nvcc_step.py) and shared-memory checks as a planned build.
Writes index.json (what ci/oversized_check.py loads, by path).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))

from cake_rmsnorm.build.one import compile_one  # noqa: E402
from cake_rmsnorm.registry import Library, LibraryKey, load_registry  # noqa: E402

ARCH = "sm_90a"
KEY = LibraryKey(hidden=4096, weight_dtype="fp32", residual=False)
STAGES = (4096, 200704, 271360)


def staged_library(stage_bytes: int, arch: str = ARCH, key: LibraryKey = KEY) -> Library:
    """A scratch copy of det_pair_c64_staged at another staging size (outside the registry)."""
    reg = load_registry()
    base = reg.programs["det_pair_c64_staged"]
    program = dataclasses.replace(
        base, name=f"test_staged{stage_bytes}",
        params=tuple((k, stage_bytes if k == "stage_bytes" else v) for k, v in base.params),
        smem_fixed=stage_bytes, smem_per_h=0, oversized=stage_bytes > reg.smem_optin_bytes,
        about=f"test copy of det_pair_c64_staged at stage_bytes {stage_bytes}")
    return Library(arch, program, key, reg.smem_optin_bytes)


def libraries():
    reg = load_registry()
    yield Library(ARCH, reg.programs["det_pair_c64"], KEY, reg.smem_optin_bytes)
    for stage in STAGES:
        yield staged_library(stage)


def main(argv) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / ".carry" / "oversized"))
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    index = []
    for lib in libraries():
        built = compile_one(lib, out)
        print(f"built {built.path.name}: {lib.smem_bytes} B, oversized {lib.oversized}, "
              f"registers {built.record['registers']}")
        index.append({**lib.plan_fields(), "file": built.path.name,
                      "stage_bytes": dict(lib.program.params).get("stage_bytes", 0)})
    (out / "index.json").write_text(json.dumps({"arch": ARCH, "libraries": index}, indent=2) + "\n")
    print(f"wrote {out / 'index.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
