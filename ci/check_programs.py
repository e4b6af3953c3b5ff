"""On a GPU: run every library that ci/program_libs.py built (index.json) directly, at small, ragged
and large T, against the FP64 reference (cake_rmsnorm.accuracy), det's bits across runs and grid
caps, and det's bits across program forms. Prints one line per library (worst figures over its T)
and one per form comparison, and writes a JSON report.

    python3 ci/check_programs.py --libs .carry/programs [--json report.json] [--large]

T is capped at each program's max_tokens (programs.toml): no route runs it past that.
Det libraries: dx and dw bits identical across two runs and at grid_cap 7 and about half the SMs
(sm // 2) against the library's own grid (grid_cap 0).
Program forms: deterministic backward programs of the same `reduction` but different form (pair,
pair_staged counting as pair, single and column_task; membership read from the registry) give identical dx
and dw bits for the same inputs, at every (H, weight dtype, residual) that has libraries of both in
the index, at T in FORM_TOKENS that both programs' max_tokens allow. Forward programs of one key
(rows-per-block grids and the ring) give identical y, h and rstd bits, at T in FWD_FORM_TOKENS.
A library whose shared memory this device cannot grant (above the opt-in limit, and the capability
check refuses it or its launch raises LaunchError) is reported as skipped, not failed; a LaunchError
of a library within the opt-in limit is a failure.
Exit 1 if any library breaks the contract (rstd, y, dx tolerance; dw budget and relL2; det bits) or
any form comparison differs. A dw worst above 0.5 of the budget is flagged (the tuner's rejection
line) but is not a failure.
JSON report: {"sm_count", "grid_caps", "libraries": [one row per library],
"form_comparisons": [one row per comparison]}.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from library_calls import (EPS, BwdCall, FwdCall, fp32_rstd, inputs, load_folder,  # noqa: E402
                           open_entry)

from cake_rmsnorm import accuracy  # noqa: E402
from cake_rmsnorm.accuracy import bits, same_bits  # noqa: E402
from cake_rmsnorm.errors import LaunchError  # noqa: E402
from cake_rmsnorm.registry import load_registry  # noqa: E402

TOKENS = {"forward": (1, 3, 1025, 65537), "column_task": (1, 3, 171, 256, 1025),
          "pair": (1, 3, 257, 1025, 65537), "single": (1, 3, 257, 1025, 65537)}
LARGE = (262145, 524288)  # with --large: single and pair forms at H <= 5120, FP32 weight, no residual
FORM_TOKENS = (1, 3, 64, 65, 127, 256, 1025, 4097)  # ragged around the 64-row chunk


def grid_caps(sm: int) -> tuple:
    """The caps det's bits are compared at against cap 0: a small one and about half the SMs."""
    return tuple(dict.fromkeys((0, 7, max(1, sm // 2))))


def run_bwd(lib, xn, dy, dh, w, rstd, sm, grid_cap=0):
    call = BwdCall(lib, xn, dy, dh, w, rstd, sm, grid_cap)
    call()
    torch.cuda.synchronize()
    return call.dx, call.dw


_optin = []


def optin_bytes() -> int:
    """This device's opt-in shared-memory limit per block (the registry's if it cannot be asked)."""
    if not _optin:
        try:
            from cake_rmsnorm.runtime import capability
            _optin.append(capability.probe(torch.cuda.current_device()).optin_bytes)
        except Exception:  # cannot ask: the limit every table is checked against
            _optin.append(load_registry().smem_optin_bytes)
    return _optin[0]


def needs_grant(entry) -> bool:
    """Above the opt-in limit: only CUDA 13.4's oversized mode can grant it, and may not."""
    return int(entry.get("smem_bytes") or 0) > optin_bytes()


def smem_refusal(entry) -> str:
    """Why this device cannot grant the library's shared memory ("" if it can, or cannot tell)."""
    if not needs_grant(entry):
        return ""
    nbytes = int(entry["smem_bytes"])
    try:
        from cake_rmsnorm.runtime import capability
        ok, why = capability.probe(torch.cuda.current_device()).fits(nbytes)
    except Exception:  # cannot ask: launch it and see
        return ""
    return "" if ok else f"{nbytes} B of shared memory not granted here: {why}"


def launch_refusal(entry, exc: LaunchError) -> str:
    """A LaunchError of a library above the opt-in limit: a skip; else "" (a failure: a library
    within the opt-in must get its shared memory)."""
    if needs_grant(entry):
        return f"LaunchError (above the {optin_bytes()} B opt-in, not granted): {exc}"
    return ""


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
                for cap in grid_caps(sm):  # 0: a second run at the library's own grid
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


# ---- det bits across program forms --------------------------------------------------------------
def _form(program) -> str:
    """The form a program's bits are compared by: pair_staged counts as pair."""
    return "pair" if program.form.startswith("pair") else program.form


def form_families(entries, reg) -> dict:
    """{(H, weight dtype, residual, reduction): [entries]} of the deterministic backward libraries
    in the index, where the registry's programs of that reduction give at least two forms there.
    Members sorted pair form first, then by name."""
    groups = {}
    for e in entries:
        p = reg.programs.get(e["program"])
        if p is None or p.direction != "bwd" or not p.deterministic:
            continue
        groups.setdefault((e["H"], e["weight_dtype"], e["residual"], p.reduction), []).append(e)
    out = {}
    for key in sorted(groups):
        members = sorted(groups[key], key=lambda e: (_form(reg.programs[e["program"]]) != "pair",
                                                     _form(reg.programs[e["program"]]), e["name"]))
        if len({_form(reg.programs[e["program"]]) for e in members}) >= 2:
            out[key] = members
    return out


def _diff(name, a, b) -> str:
    ne = (bits(a) != bits(b)).reshape(-1)
    n = int(ne.sum())
    if not n:
        return ""
    i = int(ne.nonzero()[0])
    av, bv = a.reshape(-1)[i].item(), b.reshape(-1)[i].item()
    return f"{name}: {n} of {ne.numel()} differ (first [{i}]: {av:.9g} vs {bv:.9g})"


def compare_forms(entries, libs, sm) -> list:
    """Run every cross-form pair of each family on the same inputs; one row per comparison."""
    reg = load_registry()
    rows = []
    for (H, wd, res, reduction), members in form_families(entries, reg).items():
        prog = {e["name"]: reg.programs[e["program"]] for e in members}
        pairs = [(a, b) for i, a in enumerate(members) for b in members[i + 1:]
                 if _form(prog[a["name"]]) != _form(prog[b["name"]])]
        skip = {e["name"]: smem_refusal(e) for e in members}
        key = f"H {H} {wd}{' +res' if res else ''} {reduction}"
        for T in FORM_TOKENS:
            pairs_t = [(a, b) for a, b in pairs
                       if all(prog[e["name"]].max_tokens is None or T <= prog[e["name"]].max_tokens
                              for e in (a, b))]
            if not pairs_t:
                continue
            x, r, dy, dh, w = inputs(H, T, wd, res, seed=1)
            xn = (x + r) if r is not None else x
            rstd = fp32_rstd(xn)
            outs, errors = {}, {}
            for e in {e["name"]: e for ab in pairs_t for e in ab}.values():
                if skip[e["name"]]:
                    continue
                try:
                    outs[e["name"]] = run_bwd(libs[e["name"]], xn, dy, dh, w, rstd, sm)
                except LaunchError as exc:
                    why = launch_refusal(e, exc)
                    if why:
                        skip[e["name"]] = why
                    else:
                        errors[e["name"]] = f"LaunchError: {exc}"
            for a, b in pairs_t:
                na, nb = a["name"], b["name"]
                row = {"H": H, "weight_dtype": wd, "residual": res, "reduction": reduction, "T": T,
                       "programs": [a["program"], b["program"]], "libraries": [na, nb],
                       "forms": [prog[na].form, prog[nb].form], "identical": None,
                       "skipped": "", "failures": []}
                if skip[na] or skip[nb]:
                    row["skipped"] = "; ".join(f"{n}: {skip[n]}" for n in (na, nb) if skip[n])
                elif na in errors or nb in errors:
                    row["failures"] = [f"{n}: {errors[n]}" for n in (na, nb) if n in errors]
                else:
                    (dxa, dwa), (dxb, dwb) = outs[na], outs[nb]
                    row["identical"] = same_bits(dxa, dxb) and same_bits(dwa, dwb)
                    if not row["identical"]:
                        row["failures"] = [d for d in (_diff("dx", dxa, dxb), _diff("dw", dwa, dwb))
                                           if d] or ["shapes or dtypes differ"]
                rows.append(row)
                verdict = ("skip" if row["skipped"] else "FAIL" if row["failures"] else "ok  ")
                same = {True: "yes", False: "NO", None: "-"}[row["identical"]]
                print(f"{verdict} forms {key:<24} T {T:<5} {a['program']} ({prog[na].form}) vs "
                      f"{b['program']} ({prog[nb].form}): identical {same}"
                      + (f"  [{row['skipped']}]" if row["skipped"] else "")
                      + "".join(f"\n     {f}" for f in row["failures"]), flush=True)
            del x, r, dy, dh, w, xn, rstd, outs
        torch.cuda.empty_cache()
    return rows


FWD_FORM_TOKENS = (1, 3, 1025, 65537)


def compare_forward_programs(entries, libs) -> list:
    """Every forward program of a key (H, weight dtype, residual) against the first: y, h and rstd
    must be bit-identical (they share one row layout and row math). One row per comparison."""
    groups = {}
    for e in entries:
        if e["direction"] == "fwd":
            groups.setdefault((e["H"], e["weight_dtype"], e["residual"]), []).append(e)
    rows = []
    for (H, wd, res), members in sorted(groups.items()):
        members = sorted(members, key=lambda e: e["name"])
        for T in FWD_FORM_TOKENS:
            x, r, _, _, w = inputs(H, T, wd, res, seed=2)
            outs = {}
            for e in members:
                call = FwdCall(libs[e["name"]], x, r, w)
                call()
                torch.cuda.synchronize()
                outs[e["name"]] = call
            first = members[0]["name"]
            for e in members[1:]:
                a, b = outs[first], outs[e["name"]]
                fails = [d for d in (_diff("y", a.y, b.y), _diff("rstd", a.rstd, b.rstd),
                                     _diff("h", a.h, b.h) if res else "") if d]
                rows.append({"H": H, "weight_dtype": wd, "residual": res, "T": T, "direction": "fwd",
                             "programs": [members[0]["program"], e["program"]],
                             "identical": not fails, "skipped": "", "failures": fails})
                print(f"{'FAIL' if fails else 'ok  '} fwd forms H {H} {wd}{' +res' if res else ''} T {T}: "
                      f"{members[0]['program']} vs {e['program']}: identical {'NO' if fails else 'yes'}"
                      + "".join(f"\n     {f}" for f in fails), flush=True)
            del x, r, w, outs
    return rows


def main(argv) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--libs", required=True)
    ap.add_argument("--json", default="")
    ap.add_argument("--large", action="store_true")
    args = ap.parse_args(argv)
    folder, index = load_folder(args.libs)
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{sm} SMs; det grid caps compared: {', '.join(map(str, grid_caps(sm)))}", flush=True)
    report, bad, skipped, libs = [], 0, 0, {}
    reg = load_registry()
    runtime_h = [e for e in index["libraries"] if reg.programs[e["program"]].runtime_h]
    fixed_h = [e for e in index["libraries"] if e not in runtime_h]
    for entry in runtime_h:  # their calls take H: tests/gpu/test_generic_gpu.py checks them
        skipped += 1
        report.append({"name": entry["name"], "skipped": "run-time H (tests/gpu/test_generic_gpu.py)",
                       "failures": []})
        print(f"skip {entry['name']:<44} run-time H: tests/gpu/test_generic_gpu.py checks it", flush=True)
    for entry in fixed_h:
        lib = libs[entry["name"]] = open_entry(folder, entry)
        why = smem_refusal(entry)
        if not why:
            try:
                row = check(entry, lib, sm, args.large)
            except LaunchError as exc:
                why = launch_refusal(entry, exc)
                if not why:
                    row = {"name": entry["name"], "failures": [f"LaunchError: {exc}"]}
        if why:
            skipped += 1
            report.append({"name": entry["name"], "skipped": why, "failures": []})
            print(f"skip {entry['name']:<44} {why}", flush=True)
            continue
        report.append(row)
        flag = "FAIL" if row["failures"] else ("WARN" if row.get("dw_ratio", 0) > 0.5 else "ok  ")
        bad += bool(row["failures"])
        figures = ("" if "dw_ratio" not in row else
                   f" dw worst {row['dw_ratio']:.3f} relL2 {row['dw_rel']:.2e} "
                   f"dx {row['dx_ratio']:.3f} y {row['y_ratio']:.3f} rstd {row['rstd_rel']:.1e}")
        print(f"{flag} {row['name']:<44}{figures}"
              + ("".join(f"\n     {f}" for f in row["failures"][:4])), flush=True)
    forms = compare_forms(fixed_h, libs, sm) + compare_forward_programs(fixed_h, libs)
    forms_bad = sum(bool(r["failures"]) for r in forms)
    forms_skipped = sum(bool(r["skipped"]) for r in forms)
    if args.json:
        Path(args.json).write_text(json.dumps({"sm_count": sm, "grid_caps": list(grid_caps(sm)),
                                               "libraries": report, "form_comparisons": forms},
                                              indent=1))
    print(f"PROGRAM CHECK: {len(report) - bad - skipped} of {len(report)} libraries pass"
          + (f"; {skipped} skipped" if skipped else "") + ("" if not bad else f"; {bad} FAIL"))
    print(f"FORM CHECK: {len(forms) - forms_bad - forms_skipped} of {len(forms)} comparisons "
          f"identical" + (f"; {forms_skipped} skipped" if forms_skipped else "")
          + ("" if not forms_bad else f"; {forms_bad} FAIL"))
    return 1 if bad or forms_bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
