"""The `cake-rmsnorm` command (also `python -m cake_rmsnorm`): plan, build, wheel, verify, explain,
doctor, matrix.

The build machinery is imported only by the commands that need it, so `plan` and `explain` run on
any machine with nothing but this package.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import List, Optional, Sequence

from . import __version__
from .errors import CakeError
from .registry import GENERIC_LABEL, Registry, load_registry

DEFAULT_ARCH = "sm_90a"


def _source_root(explicit: Optional[str]) -> Path:
    """The checkout holding CMakeLists.txt and csrc/ (building needs the sources)."""
    root = Path(explicit) if explicit else Path(__file__).resolve().parents[2]
    if not (root / "CMakeLists.txt").is_file() or not (root / "csrc").is_dir():
        raise CakeError(f"{root} is not a cake-rmsnorm source checkout (no CMakeLists.txt and "
                        f"csrc/); building needs one: pass --source DIR")
    return root


def _widths(reg: Registry, text: Optional[str]) -> Optional[List[int]]:
    if not text:
        return None
    try:
        widths = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise CakeError(f"--width {text!r}: expected comma-separated integers from "
                        f"{', '.join(map(str, reg.widths))}") from None
    bad = [w for w in widths if w not in reg.widths]
    if bad:
        raise CakeError(f"--width {bad}: not prebuilt widths; prebuilt: "
                        f"{', '.join(map(str, reg.widths))}")
    return widths


# ---- plan ------------------------------------------------------------------------------------
def cmd_plan(args, reg: Registry) -> int:
    archs = reg.parse_arch_list(args.arch)
    widths = _widths(reg, args.width)
    plans = []
    for arch in archs:
        libs = reg.libraries(arch.name, widths)
        plans.append({"arch": arch.name, "widths": list(widths or reg.widths),
                      "libraries": [lib.plan_fields() for lib in libs]})
    if args.json:
        print(json.dumps(plans, indent=2))
        return 0
    for plan in plans:
        generic = sum(lib["H"] == 0 for lib in plan["libraries"])
        print(f"{plan['arch']}: {len(plan['libraries'])} libraries over widths "
              f"{', '.join(map(str, plan['widths']))} and {generic} generic (any other H up to "
              f"{reg.max_hidden})")
        for lib in plan["libraries"]:
            flags = " oversized" if lib["oversized"] else ""
            print(f"  {lib['name']:<44} {lib['program']:<24} smem {lib['smem_bytes']}{flags}")
    total = sum(len(p["libraries"]) for p in plans)
    print("counts: " + ", ".join(f"{p['arch']} {len(p['libraries'])}" for p in plans)
          + f"; total {total}")
    return 0


# ---- explain ---------------------------------------------------------------------------------
def cmd_explain(args, reg: Registry) -> int:
    route = reg.route(args.arch, args.backend, args.direction, args.H, args.T,
                      args.weight_dtype, args.residual)
    window, program = route.window, route.program
    doc = {"arch": args.arch, "backend": args.backend, "direction": args.direction, "H": args.H,
           "T": args.T, "weight_dtype": args.weight_dtype, "residual": args.residual,
           "program": program.name, "form": program.form, "reduction": program.reduction,
           "library": route.library.name, "window": [window.first, window.last],
           "window_label": window.label or None}
    fallback = reg.fallback(route.library) if route.library.oversized else None
    if fallback is not None:
        doc["gated"] = {"smem_bytes": route.library.smem_bytes, "fallback": fallback.name}
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    print(f"{route.table.describe()}, T={args.T}:")
    print(f"  runs program {program.name} ({program.form}, {program.reduction} dw sums)")
    print(f"  from library {route.library.filename}")
    if window.label == GENERIC_LABEL:
        print(f"  because H={args.H} is not a prebuilt width ({', '.join(map(str, reg.widths))}): "
              f"every T of it runs the generic {args.direction} program, H given at run time (any "
              f"multiple of 8 up to {reg.max_hidden}), for both backends")
    else:
        label = f" (override {window.label})" if window.label else ""
        print(f"  because the table's window {window.describe()}{label} names it")
    print(f"  program: {program.about}")
    if fallback is not None:
        print(f"  gated: needs {route.library.smem_bytes} B of shared memory (oversized mode, CUDA "
              f"13.4+); where the runtime check says no, {fallback.filename} runs instead "
              f"(`cake-rmsnorm doctor` tells which)")
    return 0


# ---- build / wheel / verify ------------------------------------------------------------------
def _progress(line: str) -> None:
    print(line, flush=True)


def cmd_build(args, reg: Registry) -> int:
    from .build import toolchain
    from .build.orchestrate import build

    archs = reg.parse_arch_list(args.arch)
    toolchain.preflight(archs)
    summary = build(archs, _widths(reg, args.width), args.jobs, Path(args.build_dir),
                    _source_root(args.source), _progress)
    print(summary.text())
    return 0


def cmd_wheel(args, reg: Registry) -> int:
    from .build.wheel import write_wheels

    archs = reg.parse_arch_list(args.arch)
    paths = write_wheels(archs, Path(args.out), Path(args.build_dir), _source_root(args.source))
    for path in paths:
        print(f"{path}  {path.stat().st_size} bytes")
    return 0


def cmd_verify(args, reg: Registry) -> int:
    from .build.verify import verify_installed, verify_path

    problems = verify_installed() if args.target == "installed" else verify_path(Path(args.target))
    if problems:
        print(f"verify {args.target}: {len(problems)} problem(s)", file=sys.stderr)
        for problem in problems:
            print(f"  - {problem}", file=sys.stderr)
        return 1
    print(f"verify {args.target}: OK")
    return 0


def cmd_doctor(args, reg: Registry) -> int:
    from .doctor import doctor

    print(doctor(reg))
    return 0


# ---- matrix ----------------------------------------------------------------------------------
def cmd_matrix(args, reg: Registry) -> int:
    from .matrix import load_matrix

    cells = load_matrix(args.matrix, reg).select(args.select)
    if args.json:  # one line: CI writes it to $GITHUB_OUTPUT and reads it with fromJSON
        print(json.dumps({"include": [c.to_dict() for c in cells]}, separators=(",", ":")))
    elif args.print_build_identifiers:
        print("\n".join(c.identifier for c in cells))
    else:
        width = max(28, *(len(c.identifier) + 1 for c in cells))
        for c in cells:
            what, needs = ((c.arch, f"nvcc {c.toolkit.nvcc}") if c.kind == "provider"
                           else (c.kind, f"torch {c.torch}"))
            print(f"{c.identifier:<{width}} {what:<8} {c.platform.wheel_tag:<24} "
                  f"{needs}  runner {c.platform.runner}")
    return 0


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cake-rmsnorm", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"cake-rmsnorm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    arch_help = "arch, comma-separated archs, or all"

    p = sub.add_parser("plan", help="list every library each arch needs, without compiling")
    p.add_argument("--arch", default="all", help=arch_help)
    p.add_argument("--width", help="comma-separated widths (default: all prebuilt widths)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan)

    def add_tree(q):
        q.add_argument("--build-dir", default=os.environ.get("CAKE_RMSNORM_BUILD_DIR", "build"))
        q.add_argument("--source", help="source checkout (default: the one this package is in)")

    p = sub.add_parser("build", help="compile the libraries of the plan (CMake + Ninja + nvcc)")
    p.add_argument("--arch", default=DEFAULT_ARCH, help=arch_help + f" (default {DEFAULT_ARCH})")
    p.add_argument("--width", help="comma-separated widths (default: all prebuilt widths)")
    p.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1)
    add_tree(p)
    p.set_defaults(func=cmd_build)

    p = sub.add_parser("wheel", help="package built libraries into the shim and arch wheels")
    p.add_argument("--arch", default=DEFAULT_ARCH, help=arch_help + f" (default {DEFAULT_ARCH})")
    p.add_argument("--out", required=True, help="folder to write the wheels into")
    add_tree(p)
    p.set_defaults(func=cmd_wheel)

    p = sub.add_parser("verify", help="check a wheel folder, build tree, or the installed providers")
    p.add_argument("target", help="a folder of wheels, a build tree, or 'installed'")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("explain", help="which program and library run one point, and why")
    p.add_argument("--arch", required=True)
    p.add_argument("--backend", required=True, choices=["det", "fast"])
    p.add_argument("--direction", required=True, choices=["fwd", "bwd"])
    p.add_argument("--H", type=int, required=True)
    p.add_argument("--T", type=int, required=True)
    p.add_argument("--weight-dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--residual", action="store_true")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_explain)

    p = sub.add_parser("doctor", help="CUDA runtime, driver, devices, limits, installed wheels, and "
                                      "which gated programs this process would run")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("matrix", help="the CI build matrix (ci/matrix.toml): cells of arch, host "
                                      "platform and toolkit, and of the native eager step's torch "
                                      "release and host platform")
    p.add_argument("--print-build-identifiers", action="store_true",
                   help="one cell identifier a line, e.g. sm100a-manylinux_x86_64 or "
                        "native-torch2.11.0-manylinux_x86_64")
    p.add_argument("--select", action="append", metavar="GLOB",
                   help="identifier globs (space or comma separated, repeatable; default: all)")
    p.add_argument("--json", action="store_true", help="the cells as a CI job matrix {include: [...]}")
    p.add_argument("--matrix", help="matrix file (default: ci/matrix.toml of this checkout)")
    p.set_defaults(func=cmd_matrix)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = make_parser().parse_args(argv)
    try:
        return args.func(args, load_registry())
    except CakeError as exc:
        print(f"cake-rmsnorm {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"cake-rmsnorm {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
