"""On a GPU: run every library that ci/program_libs.py built (index.json) directly, at small, ragged
and large T, against the FP64 reference (cake_rmsnorm.accuracy), and det's bits across two runs and
two grid caps. Prints one line per library (worst figures over its T) and writes a JSON report.

    python3 ci/check_programs.py --libs .carry/programs [--json report.json] [--large]

T is capped at each program's max_tokens (programs.toml): no route runs it past that.
Exit 1 if any library breaks the contract (rstd, y, dx tolerance; dw budget and relL2; det bits).
A dw worst above 0.5 of the budget is flagged (the tuner's rejection line) but is not a failure.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from library_calls import (EPS, BwdCall, FwdCall, bits, fp32_rstd, inputs, load_folder,  # noqa: E402
                           open_entry)

from cake_rmsnorm import accuracy  # noqa: E402
from cake_rmsnorm.registry import load_registry  # noqa: E402

TOKENS = {"forward": (1, 3, 1025, 65537), "column_task": (1, 3, 171, 256, 1025),
          "pair": (1, 3, 257, 1025, 65537), "single": (1, 3, 257, 1025, 65537)}
LARGE = (262145, 524288)  # with --large: single and pair forms at H <= 5120, FP32 weight, no residual


def run_bwd(lib, xn, dy, dh, w, rstd, sm, grid_cap=0):
    call = BwdCall(lib, xn, dy, dh, w, rstd, sm, grid_cap)
    call()
    torch.cuda.synchronize()
    return call.dx, call.dw


def check(entry, lib, sm, large) -> dict:
    H, wd, res, form = entry["H"], entry["weight_dtype"], entry["residual"], entry["form"]
    tokens = list(TOKENS[form])
    if large and form in ("single", "pair") and H <= 5120 and wd == "fp32" and not res:
        tokens += LARGE
    limit = load_registry().programs[entry["program"]].max_tokens  # routes never go past it
    tokens = [T for T in tokens if limit is None or T <= limit]
    worst = {"y_ratio": 0.0, "dx_ratio": 0.0, "dw_ratio": 0.0, "dw_rel": 0.0, "rstd_rel": 0.0}
    fails = []
    for T in tokens:
        x, r, dy, dh, w = inputs(H, T, wd, res)
        if form == "forward":
            call = FwdCall(lib, x, r, w)
            call()
            torch.cuda.synchronize()
            y, h, rstd = call.y, call.h, call.rstd
            xn = (x + r) if r is not None else x
            if h is not None and not torch.equal(bits(h), bits(xn)):
                fails.append(f"T {T}: residual_out != bf16(x + residual)")
            m = accuracy.measure(xn, w, None, None, {"y": y, "rstd": rstd}, EPS)
        else:
            xn = (x + r) if r is not None else x
            rstd = fp32_rstd(xn)
            dx, dw = run_bwd(lib, xn, dy, dh, w, rstd, sm)
            m = accuracy.measure(xn, w, dy, dh, {"rstd": rstd, "dx": dx, "dw": dw}, EPS)
            if entry["deterministic"]:
                for cap in (0, 7):
                    dx2, dw2 = run_bwd(lib, xn, dy, dh, w, rstd, sm, cap)
                    if not (torch.equal(bits(dx), bits(dx2)) and torch.equal(bits(dw), bits(dw2))):
                        fails.append(f"T {T}: det bits differ at grid_cap {cap}")
        fails += [f"T {T}: {f}" for f in m.failures()]
        for k, v in m.as_dict().items():
            if v is not None:
                worst[k] = max(worst[k], v)
        del x, r, dy, dh, w
    torch.cuda.empty_cache()
    return {"name": entry["name"], "tokens": tokens, **worst, "failures": fails}


def main(argv) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--libs", required=True)
    ap.add_argument("--json", default="")
    ap.add_argument("--large", action="store_true")
    args = ap.parse_args(argv)
    folder, index = load_folder(args.libs)
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    report, bad = [], 0
    for entry in index["libraries"]:
        lib = open_entry(folder, entry)
        row = check(entry, lib, sm, args.large)
        report.append(row)
        flag = "FAIL" if row["failures"] else ("WARN" if row["dw_ratio"] > 0.5 else "ok  ")
        bad += bool(row["failures"])
        print(f"{flag} {row['name']:<44} dw worst {row['dw_ratio']:.3f} relL2 {row['dw_rel']:.2e} "
              f"dx {row['dx_ratio']:.3f} y {row['y_ratio']:.3f} rstd {row['rstd_rel']:.1e}"
              + ("".join(f"\n     {f}" for f in row["failures"][:4])), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    print(f"PROGRAM CHECK: {len(report) - bad} of {len(report)} libraries pass"
          + ("" if not bad else f"; {bad} FAIL"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
