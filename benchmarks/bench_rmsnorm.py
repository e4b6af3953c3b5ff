"""Side-by-side RMSNorm timing on the GPU: cake-rmsnorm (det, fast) against torch eager and
torch.compile, same inputs, same run.

Kernel time is the median CUDA-graph replay time with L2 flushed before each replay (the backward's
is the training step's minus the forward's, both captured whole); effective
bandwidth counts forward 4·T·H bytes and backward 6·T·H bytes (bf16 x, y / x, dy, dx), and is
reported against the device's measured copy bandwidth. Writes JSON and a markdown table.

    python benchmarks/bench_rmsnorm.py --widths 4096,8192 --tokens 4096,65536 --out results
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

import cake_rmsnorm

L2_FLUSH_BYTES = 256 << 20


def graph_time_ms(fn, reps: int = 20) -> float:
    """Median time of one call of fn, replayed as a CUDA graph after an L2 flush."""
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth_gbs() -> float:
    """An elementwise copy kernel over 1 GiB (bytes read plus written). Not copy_: a contiguous
    copy_ is a memcpy, which measured 2.7 TB/s on the H200 here, below what our own kernels move."""
    src = torch.empty(1 << 26, 4, dtype=torch.float32, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = graph_time_ms(lambda: torch.mul(src, 1.0, out=dst))
    return 2 * src.numel() * src.element_size() / ms / 1e6


def eager_rmsnorm(x, w, eps):
    var = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(var + eps) * w.float()).to(x.dtype)


def implementations():
    compiled = torch.compile(eager_rmsnorm, fullgraph=True)
    return {
        "cake_det": lambda x, w, eps: cake_rmsnorm.rms_norm(x, w, eps, backend="det"),
        "cake_fast": lambda x, w, eps: cake_rmsnorm.rms_norm(x, w, eps, backend="fast"),
        "torch_eager": eager_rmsnorm,
        "torch_compile": compiled,
    }


def measure(name, impl, hidden, tokens, eps=1e-6):
    """Forward alone, and the training step (forward + backward) captured as one graph: the
    backward's time is their difference, so autograd runs on the capturing stream."""
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (1 + 0.1 * torch.randn(hidden, device="cuda")).requires_grad_()
    dy = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        fwd_ms = graph_time_ms(lambda: impl(x, w, eps))

    def step():
        torch.autograd.grad(impl(x, w, eps), (x, w), dy)
    step_ms = graph_time_ms(step)
    bwd_ms = max(step_ms - fwd_ms, 1e-6)
    nbytes = tokens * hidden * 2
    return {"impl": name, "H": hidden, "T": tokens, "fwd_ms": fwd_ms, "bwd_ms": bwd_ms,
            "step_ms": step_ms, "fwd_gbs": 2 * nbytes / fwd_ms / 1e6,
            "bwd_gbs": 3 * nbytes / bwd_ms / 1e6}


def markdown(rows, copy_gbs) -> str:
    lines = [f"copy bandwidth: {copy_gbs:.0f} GB/s", "",
             "| H | T | impl | fwd ms | fwd GB/s | fwd/copy | bwd ms | bwd GB/s | bwd/copy "
             "| bwd vs torch.compile |", "|" + "---|" * 10]
    for row in rows:
        peer = next((r for r in rows if r["impl"] == "torch_compile" and r["H"] == row["H"]
                     and r["T"] == row["T"]), None)
        ratio = f"{peer['bwd_ms'] / row['bwd_ms']:.2f}x" if peer else "-"
        lines.append(f"| {row['H']} | {row['T']} | {row['impl']} | {row['fwd_ms']:.4f} | "
                     f"{row['fwd_gbs']:.0f} | {row['fwd_gbs'] / copy_gbs:.2f} | {row['bwd_ms']:.4f} "
                     f"| {row['bwd_gbs']:.0f} | {row['bwd_gbs'] / copy_gbs:.2f} | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", default="4096,8192")
    parser.add_argument("--tokens", default="4096,65536")
    parser.add_argument("--out", default="bench-results")
    args = parser.parse_args()
    copy_gbs = copy_bandwidth_gbs()
    rows = []
    for hidden in map(int, args.widths.split(",")):
        for tokens in map(int, args.tokens.split(",")):
            for name, impl in implementations().items():
                rows.append(measure(name, impl, hidden, tokens))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps({"copy_gbs": copy_gbs, "rows": rows}, indent=2))
    table = markdown(rows, copy_gbs)
    (out / "bench.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
