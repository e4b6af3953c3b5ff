"""The dw accuracy sweep on one GPU: for us (det, fast: the program each point routes to) and the peers
(torch eager, torch.compile, Liger where it imports), per (width, T, implementation, weight dtype,
residual, seed): worst = max |dw - ref| / (1e-4 + 1e-4 |ref|), and dw relL2, against the FP64 sum
computed in row chunks (T 524288 fits); for ours also rstd relL2 and y/dx error over tolerance
(cake_rmsnorm.accuracy), and the eager FP32 reduction's dw relL2 of the same inputs.
Inputs: bf16 randn x and dy (and residual), weight 1 + 0.1 randn.

    python benchmarks/accuracy_sweep.py --widths 4096 --tokens 1,1025,65536 --out results
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from library_calls import EPS, inputs  # noqa: E402
from peers import OURS, available  # noqa: E402

from cake_rmsnorm import accuracy, ops  # noqa: E402,F401  (ops registers torch.ops.cake_rmsnorm)
from cake_rmsnorm.registry import load_registry  # noqa: E402
from cake_rmsnorm.runtime import device  # noqa: E402

PEER_MAX_ELEMENTS = 1 << 31  # the peers' FP32 temporaries: keep them inside GPU memory


def run_ours(backend, x, r, dy, w):
    x = x.detach().requires_grad_()
    w = w.detach().requires_grad_()
    if r is None:
        y, rstd = torch.ops.cake_rmsnorm.fwd(x, w, EPS, backend)
        torch.autograd.backward([y], [dy])
    else:
        y, h, rstd = torch.ops.cake_rmsnorm.fwd_residual(x, r, w, EPS, backend)
        torch.autograd.backward([y], [dy])  # dh = 0: the dw budget is the point here
    return dict(y=y.detach(), rstd=rstd.detach(), dx=x.grad, dw=w.grad)


def run_peer(impl, x, r, dy, w):
    xn = (x + r) if r is not None else x
    xn = xn.detach().requires_grad_()
    w = w.detach().requires_grad_()
    torch.autograd.backward([impl(xn, w, EPS)], [dy])
    return w.grad


def sweep_point(impls, arch, hidden, tokens, wname, residual, seed):
    x, r, dy, _, w = inputs(hidden, tokens, wname, residual, seed)  # no residual gradient here
    xn = (x + r) if r is not None else x
    rstd64 = accuracy.reference_rstd(xn, EPS)
    ref_exact = accuracy.reference_dw(xn, dy, rstd64)
    eager = accuracy.dw_errors(accuracy.eager_fp32_dw(xn, dy, rstd64.float()), ref_exact)
    base = dict(H=hidden, T=tokens, weight=wname, residual=residual, seed=seed, eager_fp32_rel=eager[1])
    out = []
    for name, impl in impls.items():
        if name in OURS:
            backend = name.split("_")[1]
            route = load_registry().route(arch, backend, "bwd", hidden, tokens, wname, residual)
            got = run_ours(backend, x, r, dy, w)
            m = accuracy.measure(xn, w, dy, None, got, EPS)
            out.append(dict(base, impl=name, program=route.program.name, form=route.program.form,
                            worst=m.dw_ratio, rel=m.dw_rel, rstd_rel=m.rstd_rel,
                            y_ratio=m.y_ratio, dx_ratio=m.dx_ratio, failures=m.failures()))
        elif tokens * hidden <= PEER_MAX_ELEMENTS:
            worst, rel, _ = accuracy.dw_errors(run_peer(impl, x, r, dy, w), ref_exact)
            out.append(dict(base, impl=name, worst=worst, rel=rel))
        torch.cuda.empty_cache()
    return out


def summary(rows) -> str:
    lines = ["| H | T | weight | impl | program | worst/budget (max over cases) | dw relL2 (max) "
             "| eager FP32 relL2 |", "|---|---|---|---|---|---|---|---|"]
    keys = sorted({(r["H"], r["T"], r["weight"], r["impl"]) for r in rows})
    for hidden, tokens, wname, impl in keys:
        sel = [r for r in rows if (r["H"], r["T"], r["weight"], r["impl"]) == (hidden, tokens, wname, impl)]
        lines.append(f"| {hidden} | {tokens} | {wname} | {impl} | {sel[0].get('program', '')} | "
                     f"{max(r['worst'] for r in sel):.3f} | {max(r['rel'] for r in sel):.2e} | "
                     f"{max(r['eager_fp32_rel'] for r in sel):.2e} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--widths", default="256,1536,2048,4096,5120,6144,8192")
    ap.add_argument("--tokens", default="1,3,64,127,256,1025,4096,16384,65536,131073,262145,524288")
    ap.add_argument("--weights", default="fp32,bf16")
    ap.add_argument("--residual", default="0,1")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--impls", default="")
    ap.add_argument("--out", default="accuracy-results")
    args = ap.parse_args(argv)
    impls, missing = available([n for n in args.impls.split(",") if n] or None)
    for name, why in missing.items():
        print(f"left out {name}: {why}", flush=True)
    arch = device.device_info(torch.cuda.current_device()).arch.name
    rows = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for hidden in map(int, args.widths.split(",")):
        for tokens in map(int, args.tokens.split(",")):
            for wname in args.weights.split(","):
                for residual in (bool(int(v)) for v in args.residual.split(",")):
                    for seed in map(int, args.seeds.split(",")):
                        rows += sweep_point(impls, arch, hidden, tokens, wname, residual, seed)
            worst = {r["impl"]: r["worst"] for r in rows if r["H"] == hidden and r["T"] == tokens}
            print(f"H {hidden} T {tokens}: " + ", ".join(f"{k} {v:.3f}" for k, v in worst.items()),
                  flush=True)
        # after each width, so a run cut short still leaves what it measured
        (out / "accuracy.json").write_text(json.dumps({"arch": arch, "left_out": missing, "rows": rows}))
    (out / "accuracy.json").write_text(json.dumps({"arch": arch, "left_out": missing, "rows": rows}))
    table = summary(rows)
    (out / "accuracy.md").write_text(table + "\n")
    bad = [r for r in rows if r.get("failures")]
    print(f"ours: {sum(1 for r in rows if r['impl'] in OURS)} cases, {len(bad)} outside the contract")
    for r in bad[:20]:
        print(f"  {r['impl']} H {r['H']} T {r['T']} {r['weight']} res={r['residual']}: {r['failures']}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
