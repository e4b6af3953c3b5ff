"""GPU timing: CUDA-graph replay with L2 flushed (kernel time), eager wall time (host included),
and the device's copy bandwidth, all measured in the same run."""

from __future__ import annotations

import statistics
import time

import torch

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
    del graph
    return statistics.median(times)


def eager_time_ms(fn, reps: int = 50, batches: int = 9) -> float:
    """Wall time of one eager call of fn (host overhead included): the fastest of `batches` batches
    of reps calls, per call. Host noise (other processes, clock changes) only ever adds time, so the
    fastest batch is the steadiest figure; every implementation is measured the same way."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) * 1e3 / reps)
    return best


def copy_bandwidth_gbs() -> float:
    """An elementwise kernel over 1 GiB (bytes read plus written). Not copy_: a contiguous copy_ is
    a memcpy, which measured 2.7 TB/s on the H200 here, below what elementwise kernels move."""
    src = torch.empty(1 << 26, 4, dtype=torch.float32, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = graph_time_ms(lambda: torch.mul(src, 1.0, out=dst))
    return 2 * src.numel() * src.element_size() / ms / 1e6
