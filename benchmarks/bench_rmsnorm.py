"""Side-by-side RMSNorm timing on one GPU: cake-rmsnorm (det, fast) against torch eager,
torch.compile and Liger (where it imports), same inputs, same run.

- kernel time: median CUDA-graph replay with L2 flushed; forward alone, and forward + backward
  captured whole (the backward is their difference, so autograd runs on the capturing stream);
  at T <= 16384 each implementation captured 3 times and the replays pooled (timing.py).
  The forward is timed twice: recording autograd (`fwd_ms`: the forward a training step runs, the
  one the step's time contains; torch.compile's training kernel also stores rstd for its backward)
  and under no_grad (`fwd_nograd_ms`: torch.compile's inference kernel, which stores no rstd; ours
  runs the same kernel either way);
  every implementation on the same input tensors, their replays interleaved (timing.py);
- effective bandwidth: forward 4·T·H bytes, backward 6·T·H (bf16 x, y / x, dy, dx), and its ratio to
  the device's copy bandwidth measured in the same run;
- eager step: wall time of forward + backward without graphs (host overhead included);
- ratios: each peer's time over ours (> 1: we are faster).
Writes bench.json, bench.md and one PNG per width (time vs T, a line per implementation).

    python benchmarks/bench_rmsnorm.py --widths 2048,4096 --tokens 128,4096,65536 --out results
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from library_calls import EPS  # noqa: E402
from peers import OURS, available  # noqa: E402
from report import markdown, plots  # noqa: E402
from timing import (captures_for, copy_bandwidth_gbs, eager_batches_for,  # noqa: E402
                    eager_times_ms, graph_times_ms, replays_for)


def point_inputs(hidden, tokens):
    """x (bf16 randn, requires grad), w (FP32 1 + 0.1 randn, requires grad) and dy (bf16 randn) of
    a point, seeded by it: every implementation, and every tool that times them, on the same."""
    gen = torch.Generator(device="cuda").manual_seed(hidden + tokens)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16().requires_grad_()
    w = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=gen)).requires_grad_()
    dy = torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16()
    return x, w, dy


def measure_point(impls, hidden, tokens):
    """Every implementation at (hidden, tokens) on the same input tensors, timed interleaved:
    (a row per implementation, {implementation: error} for those that ran out of GPU memory)."""
    x, w, dy = point_inputs(hidden, tokens)
    fwds = {name: (lambda impl=impl: impl(x, w, EPS)) for name, impl in impls.items()}
    steps = {name: (lambda impl=impl: torch.autograd.grad(impl(x, w, EPS), (x, w), dy))
             for name, impl in impls.items()}
    reps, captures = replays_for(tokens), captures_for(tokens)
    unfit: dict = {}  # {implementation: error}: ran out of GPU memory here, left out of this point
    with torch.no_grad():
        nograd_ms = graph_times_ms(fwds, reps, out_of_memory=unfit, captures=captures)
    fwd_q: dict = {}  # {implementation: timing.Spread} of its replays
    step_q: dict = {}
    fwd_ms = graph_times_ms(fwds, reps, out_of_memory=unfit, spread=fwd_q, captures=captures)
    step_ms = graph_times_ms(steps, reps, out_of_memory=unfit, spread=step_q, captures=captures)
    calls, batches = eager_batches_for(tokens)
    eager_ms = eager_times_ms(steps, reps=calls, batches=batches, out_of_memory=unfit)
    elems = tokens * hidden
    rows = []
    for name in (n for n in impls if n not in unfit):
        bwd_ms = max(step_ms[name] - fwd_ms[name], 1e-6)
        rows.append({"impl": name, "H": hidden, "T": tokens, "fwd_ms": fwd_ms[name],
                     "fwd_nograd_ms": nograd_ms[name],
                     "fwd_q_ms": [fwd_q[name].q1, fwd_q[name].q3], "fwd_iqm_ms": fwd_q[name].iqm,
                     "step_q_ms": [step_q[name].q1, step_q[name].q3], "step_iqm_ms": step_q[name].iqm,
                     "bwd_ms": bwd_ms, "step_ms": step_ms[name], "eager_step_ms": eager_ms[name],
                     "fwd_gbs": 4 * elems / fwd_ms[name] / 1e6, "bwd_gbs": 6 * elems / bwd_ms / 1e6})
    return rows, unfit


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--widths", default="256,1536,2048,4096,5120,6144,8192")
    ap.add_argument("--tokens", default="128,1024,4096,16384,65536,262144")
    ap.add_argument("--impls", default="", help="comma list (default: all that import)")
    ap.add_argument("--out", default="bench-results")
    args = ap.parse_args(argv)
    impls, missing = available([n for n in args.impls.split(",") if n] or None)
    for name, why in missing.items():
        print(f"left out {name}: {why}", flush=True)
    copy_gbs = copy_bandwidth_gbs()
    print(f"copy bandwidth {copy_gbs:.0f} GB/s on {torch.cuda.get_device_name()}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_gbs": copy_gbs,
           "left_out": missing, "out_of_memory": [], "rows": []}
    ours = [n for n in OURS if n in impls]
    for hidden in map(int, args.widths.split(",")):
        for tokens in map(int, args.tokens.split(",")):
            rows, unfit = measure_point(impls, hidden, tokens)
            for name, why in unfit.items():
                doc["out_of_memory"].append({"impl": name, "H": hidden, "T": tokens, "error": why})
                print(f"H {hidden} T {tokens} {name}: left out, {why}", flush=True)
            for row in rows:
                doc["rows"].append(row)
                print(f"H {hidden} T {tokens} {row['impl']}: fwd {row['fwd_ms']:.4f} ms (no_grad "
                      f"{row['fwd_nograd_ms']:.4f}), bwd {row['bwd_ms']:.4f} ms, eager step "
                      f"{row['eager_step_ms']:.4f} ms", flush=True)
            torch.cuda.empty_cache()
        # after every width: a run cut short still leaves what it measured
        (out / "bench.json").write_text(json.dumps(doc, indent=1))
        (out / "bench.md").write_text(markdown(doc["rows"], copy_gbs, ours) + "\n")
    print((out / "bench.md").read_text())
    for path in plots(doc["rows"], out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
