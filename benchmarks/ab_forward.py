"""A/B of two builds of the same forward programs on the GPU: for every program that both library
folders (ci/program_libs.py's) hold at one key, y and rstd bits compared (a kernel change that
claims the same bits must give them) and kernel times taken interleaved with torch.compile's
training forward, in the same run (timing.py: CUDA-graph replay, L2 flushed).

    python3 benchmarks/ab_forward.py OLD_DIR NEW_DIR [--H 256] [--tokens 1025,4096] [--reps 240]
                                     [--trials 2] [--json ab.json]

Why: the tuner times one folder's candidates against each other; a change to a program's code
needs its old and new builds side by side, with the peer it is meant to catch, in one process
(between processes the same kernel moved by 10% at H 256, T 4096: README). Ragged T (not a
multiple of a block's rows) checks the last block's path. Exit 1 if any program's bits differ.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from library_calls import EPS, FwdCall, inputs, load_folder, open_entry, read_index  # noqa: E402
from peers import FACTORIES  # noqa: E402
from timing import graph_times_ms  # noqa: E402

from cake_rmsnorm.accuracy import same_bits  # noqa: E402

SIDES = ("old", "new")


def paired_programs(index_old: dict, index_new: dict, hidden: int, weight_dtype: str = "fp32",
                    residual: bool = False) -> Tuple[Dict[str, Tuple[dict, dict]], List[str]]:
    """({program: (old entry, new entry)} for the forward programs both indexes hold at the key,
    sorted, [programs only one of them holds there])."""
    def at_key(index):
        return {e["program"]: e for e in index["libraries"]
                if e["direction"] == "fwd" and e["H"] == hidden and e["weight_dtype"] == weight_dtype
                and bool(e["residual"]) == residual}
    old, new = at_key(index_old), at_key(index_new)
    both = {p: (old[p], new[p]) for p in sorted(old.keys() & new.keys())}
    return both, sorted(old.keys() ^ new.keys())


def same_outputs(a: FwdCall, b: FwdCall) -> bool:
    return same_bits(a.y, b.y) and same_bits(a.rstd, b.rstd)


def measure(folders, pairs, hidden: int, tokens: int, reps: int, trials: int, compiled) -> dict:
    """Bits and times at one T: {"T", "bits": {program: same?}, "trials": [{label: us}]}."""
    x, _, _, _, w = inputs(hidden, tokens, "fp32", False)
    calls, bits = {}, {}
    for program, entries in pairs.items():
        done = []
        for side, folder, entry in zip(SIDES, folders, entries):
            call = FwdCall(open_entry(folder, entry), x, None, w)
            call()
            done.append(call)
            calls[f"{side}/{program}"] = call
        torch.cuda.synchronize()
        bits[program] = same_outputs(*done)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    calls["torch_compile"] = lambda: compiled(xg, wg, EPS)
    runs = [{k: v * 1e3 for k, v in graph_times_ms(calls, reps).items()} for _ in range(trials)]
    return {"T": tokens, "bits": bits, "trials": runs}


def report(point: dict) -> List[str]:
    lines = [f"T {point['T']}: bits " + ", ".join(
        f"{p} {'same' if ok else 'DIFFER'}" for p, ok in point["bits"].items())]
    for i, run in enumerate(point["trials"]):
        order = sorted(run.items(), key=lambda kv: kv[1])
        lines.append(f"T {point['T']} trial {i}: " + "; ".join(f"{k} {v:.2f}" for k, v in order))
    labels = point["trials"][0].keys()
    medians = {k: statistics.median(run[k] for run in point["trials"]) for k in labels}
    peer = medians["torch_compile"]
    lines.append(f"T {point['T']} median us (torch.compile / ours): " + "; ".join(
        f"{k} {v:.2f} ({peer / v:.3f})" for k, v in sorted(medians.items(), key=lambda kv: kv[1])
        if k != "torch_compile") + f"; torch_compile {peer:.2f}")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--H", type=int, default=256)
    ap.add_argument("--tokens", default="1025,1024,4095,4096,16384")
    ap.add_argument("--reps", type=int, default=240)
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    pairs, unpaired = paired_programs(read_index(Path(args.old)), read_index(Path(args.new)), args.H)
    if not pairs:
        raise SystemExit(f"no forward program at H {args.H} (FP32 weight, no residual) in both "
                         f"{args.old} and {args.new}")
    if unpaired:
        print(f"in one folder only, not compared: {', '.join(unpaired)}")
    folders = [load_folder(f)[0] for f in (args.old, args.new)]
    compiled = FACTORIES["torch_compile"]()
    points = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        points.append(measure(folders, pairs, args.H, tokens, args.reps, args.trials, compiled))
        print("\n".join(report(points[-1])), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"H": args.H, "points": points}, indent=1) + "\n")
    differ = sorted({p for pt in points for p, ok in pt["bits"].items() if not ok})
    if differ:
        print(f"bits differ between the builds: {', '.join(differ)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
