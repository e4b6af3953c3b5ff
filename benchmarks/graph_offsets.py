"""Is a small-T forward gap the kernels' or the graphs'? Each implementation's training forward is
captured several times, the captures in rounds across implementations (A0 B0 A1 B1 ...), and
every graph replayed interleaved (timing.graph_times_ms: CUDA-graph replay, L2 flushed); each
graph's replays are read apart (its per_graph), not only pooled.

    python3 benchmarks/graph_offsets.py [--H 256] [--tokens 128,1024,4096] [--captures 8]
                                        [--reps 60] [--impls cake_fast,torch_compile] [--json F]

Why: a graph keeps an offset of its own, steady over its replays (timing.graph_times_ms: up to
0.4 us between captures of one implementation on the H200), and the benchmark captures an
implementation's graphs and pools them. If every graph of ours sits above every graph of the
peer's, the gap is the kernel's; if the graphs' offsets overlap, the benchmark's median gap of a
tick or two (32 ns) says little.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_rmsnorm import point_inputs  # noqa: E402
from library_calls import EPS  # noqa: E402
from peers import available  # noqa: E402
from timing import graph_times_ms  # noqa: E402


def measure(impls, hidden: int, tokens: int, captures: int, reps: int) -> dict:
    """{impl: [Spread of each of its graphs' replays, in ms]} at one (H, T), on the benchmark's
    inputs and its training forward (x and w require grad)."""
    x, w, _ = point_inputs(hidden, tokens)
    fwds = {name: (lambda impl=impl: impl(x, w, EPS)) for name, impl in impls.items()}
    per_graph: dict = {}
    graph_times_ms(fwds, reps, captures=captures, per_graph=per_graph)
    return {name: [per_graph[(name, i)] for i in range(captures)] for name in impls}


def report(hidden: int, tokens: int, per_graph: dict) -> list:
    lines = []
    for name, spreads in per_graph.items():
        iqms = sorted(s.iqm * 1e3 for s in spreads)  # us
        lines.append(f"H {hidden} T {tokens} {name}: graphs' IQM {iqms[0]:.3f}-{iqms[-1]:.3f} us, "
                     f"median of them {statistics.median(iqms):.3f} ("
                     + " ".join(f"{v:.3f}" for v in iqms) + ")")
    if len(per_graph) == 2:
        (a, sa), (b, sb) = per_graph.items()
        ia, ib = [s.iqm for s in sa], [s.iqm for s in sb]
        above = sum(u > v for u in ia for v in ib)
        lines.append(f"H {hidden} T {tokens}: {a} above {b} in {above} of {len(ia) * len(ib)} "
                     f"graph pairs; median IQM ratio {b}/{a} "
                     f"{statistics.median(ib) / statistics.median(ia):.4f}")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--H", type=int, default=256)
    ap.add_argument("--tokens", default="128,1024,4096")
    ap.add_argument("--captures", type=int, default=8)
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--impls", default="cake_fast,torch_compile")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    impls, missing = available(args.impls.split(","))
    if missing:
        raise SystemExit("cannot run: " + "; ".join(f"{k}: {v}" for k, v in missing.items()))
    print(f"{torch.cuda.get_device_name()}: {args.captures} graphs each, {args.reps} replays a graph",
          flush=True)
    points = []
    for tokens in map(int, args.tokens.split(",")):
        per_graph = measure(impls, args.H, tokens, args.captures, args.reps)
        print("\n".join(report(args.H, tokens, per_graph)), flush=True)
        points.append({"H": args.H, "T": tokens, "graphs_ms": {
            name: [vars(s) for s in spreads] for name, spreads in per_graph.items()}})
    if args.json:
        Path(args.json).write_text(json.dumps(points, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
