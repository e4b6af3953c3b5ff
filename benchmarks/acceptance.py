"""Issue 4's speed goals (acceptance 4 and 5) checked over a benchmark run's bench.json: every
check printed with its figures, the failing ones marked FAIL; exit status 1 if any fails.

    python benchmarks/acceptance.py results/bench.json [more runs' bench.json ...] [--failures-only]

Given several runs (of one device), each is checked in turn, then every check that failed in any
of them is listed with its value in each run: a miss in every run is the code's, one that comes
and goes is the measurement's to explain first.

Ratios are a peer's time over ours, as in the benchmark's table (> 1: we are faster), except the
copy fractions (our effective GB/s over the device's copy bandwidth) and the eager step (our time
over the fastest peer's: <= the goal).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

from peers import OURS

COMPILE = "torch_compile"
DET, FAST = OURS


@dataclass(frozen=True)
class Goals:
    """Issue 4, acceptance 4 (sm_90a, FP32 weight) and 5."""
    large_min_hidden: int = 1536       # the large-T goals hold at H >= this
    large_min_tokens: int = 65536      # and T >= this
    fwd_vs_compile: float = 1.0        # forward, both backends: compile's time / ours >=
    fwd_of_copy: float = 0.93          # forward GB/s / copy GB/s >=
    fast_bwd_vs_compile: float = 1.10  # fast backward: compile's time / ours >=
    fast_bwd_of_copy: float = 0.88     # fast backward GB/s / copy GB/s >=
    det_bwd_vs_fast: float = 0.90      # fast's backward time / det's >=
    small_max_tokens: int = 4096       # at T <= this, both kernels:
    small_vs_compile: float = 1.0      # compile's time / ours >=
    eager_tokens: int = 128            # the eager step (host included) at this T:
    eager_vs_fastest_peer: float = 0.5  # our time / the fastest peer's <=


@dataclass(frozen=True)
class Check:
    what: str     # e.g. "H 4096 T 65536 cake_fast fwd vs torch_compile"
    value: float
    limit: float
    at_most: bool  # the value must be <= limit (else >=)
    detail: str    # the times behind the value

    @property
    def ok(self) -> bool:
        return self.value <= self.limit if self.at_most else self.value >= self.limit

    def line(self) -> str:
        sign = "<=" if self.at_most else ">="
        return (f"{'ok  ' if self.ok else 'FAIL'} {self.what}: {self.value:.3f} (goal {sign} "
                f"{self.limit:g}; {self.detail})")


def _us(ms: float) -> str:
    return f"{ms * 1e3:.2f} us"


def _spread(row: dict, key: str) -> str:
    """The replays' quartiles behind the median `key` (fwd_ms: fwd_q_ms) as " (a-b)" in us, with
    their interquartile mean (fwd_iqm_ms) as " (a-b, IQM c)", or "" where the run did not record
    them. The checks use the median; the IQM shows whether a gap of one event tick (32 ns) is
    more than the tick."""
    q = row.get(key.replace("_ms", "_q_ms"))
    if not q:
        return ""
    iqm = row.get(key.replace("_ms", "_iqm_ms"))
    mean = f", IQM {iqm * 1e3:.3f}" if iqm is not None else ""
    return f" ({q[0] * 1e3:.2f}-{q[1] * 1e3:.2f}{mean})"


def _vs(what: str, ours: dict, peer: dict, key: str, limit: float) -> Check:
    """peer's time over ours for `key` (a *_ms field), >= limit; the detail gives both medians and,
    where recorded, their replays' quartiles."""
    return Check(what, peer[key] / ours[key], limit, False,
                 f"{_us(ours[key])}{_spread(ours, key)} vs {_us(peer[key])}{_spread(peer, key)}")


def checks(doc: dict, goals: Goals = Goals()) -> Iterator[Check]:
    copy = doc["copy_gbs"]
    rows: Dict[Tuple[str, int, int], dict] = {(r["impl"], r["H"], r["T"]): r for r in doc["rows"]}
    for hidden, tokens in sorted({(h, t) for _, h, t in rows}):
        comp, det, fast = (rows.get((name, hidden, tokens)) for name in (COMPILE, DET, FAST))
        at = f"H {hidden} T {tokens}"
        if comp and det and fast:
            if hidden >= goals.large_min_hidden and tokens >= goals.large_min_tokens:
                for ours in (det, fast):
                    yield _vs(f"{at} {ours['impl']} fwd vs {COMPILE}", ours, comp, "fwd_ms",
                              goals.fwd_vs_compile)
                    yield Check(f"{at} {ours['impl']} fwd of copy", ours["fwd_gbs"] / copy,
                                goals.fwd_of_copy, False, f"{ours['fwd_gbs']:.0f} of {copy:.0f} GB/s")
                yield _vs(f"{at} {FAST} bwd vs {COMPILE}", fast, comp, "bwd_ms", goals.fast_bwd_vs_compile)
                yield Check(f"{at} {FAST} bwd of copy", fast["bwd_gbs"] / copy, goals.fast_bwd_of_copy,
                            False, f"{fast['bwd_gbs']:.0f} of {copy:.0f} GB/s")
                yield _vs(f"{at} {DET} bwd vs {FAST}", det, fast, "bwd_ms", goals.det_bwd_vs_fast)
            if tokens <= goals.small_max_tokens:
                for ours in (det, fast):
                    for key in ("fwd_ms", "bwd_ms"):
                        yield _vs(f"{at} {ours['impl']} {key[:3]} vs {COMPILE}", ours, comp, key,
                                  goals.small_vs_compile)
        peers = [r for (name, h, t), r in rows.items() if h == hidden and t == tokens and name not in OURS]
        if tokens == goals.eager_tokens and peers:
            best = min(peers, key=lambda r: r["eager_step_ms"])
            for ours in (r for r in (det, fast) if r):
                yield Check(f"{at} {ours['impl']} eager step vs fastest peer",
                            ours["eager_step_ms"] / best["eager_step_ms"], goals.eager_vs_fastest_peer,
                            True, f"{_us(ours['eager_step_ms'])} vs {best['impl']} "
                                  f"{_us(best['eager_step_ms'])}")


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"bench_json {str(path)!r}: not a readable bench.json ({e})") from None


def across_runs(runs: List[List[Check]]) -> List[str]:
    """For several runs' checks: a line for each check that failed in any run, with its value in
    every run (k of n), the ones that failed in every run first; then the counts."""
    by_what: Dict[str, List[Check]] = {}
    for results in runs:
        for check in results:
            by_what.setdefault(check.what, []).append(check)
    n = len(runs)
    misses = []  # (runs failed, line)
    for what, seen in by_what.items():
        failed = sum(not c.ok for c in seen)
        if failed:
            sign = "<=" if seen[0].at_most else ">="
            values = ", ".join(f"{c.value:.3f}" for c in seen)
            misses.append((failed, f"FAIL in {failed} of {n} runs: {what}: {values} (goal {sign} "
                                   f"{seen[0].limit:g})"))
    misses.sort(key=lambda m: -m[0])  # stable: each group keeps the checks' order
    always = sum(failed == n for failed, _ in misses)
    return [line for _, line in misses] + [
        f"across {n} runs: {len(by_what) - len(misses)} of {len(by_what)} checks pass in every run, "
        f"{always} fail in every run, {len(misses) - always} in some"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench_json", nargs="+", help="bench.json of benchmarks/bench_rmsnorm.py; "
                                                  "several: runs of one device, also compared")
    ap.add_argument("--failures-only", action="store_true", help="print the failing checks only")
    args = ap.parse_args(argv)
    docs = [_read(Path(f)) for f in args.bench_json]
    devices = sorted({d.get("device", "?") for d in docs})
    if len(devices) > 1:
        raise SystemExit(f"bench_json: runs of different devices ({', '.join(devices)}); compare "
                         f"runs of one device")
    runs: List[List[Check]] = []
    for path, doc in zip(args.bench_json, docs):
        results = list(checks(doc))
        runs.append(results)
        which = f"{path}: " if len(docs) > 1 else ""
        print(f"{which}{doc.get('device', '?')}: copy {doc['copy_gbs']:.0f} GB/s")
        for check in results:
            if not (args.failures_only and check.ok):
                print(check.line())
        failed = sum(not c.ok for c in results)
        print(f"{len(results) - failed} of {len(results)} checks pass, {failed} fail")
    if len(runs) > 1:
        print("\n".join(across_runs(runs)))
    return 1 if any(not c.ok for results in runs for c in results) else 0


if __name__ == "__main__":
    sys.exit(main())
