"""GPU timing: CUDA-graph replay with L2 flushed (kernel time), eager wall time (host included),
and the device's copy bandwidth, all measured in the same run.

Implementations compared side by side are timed interleaved: each repetition replays (or calls)
every one of them in turn, in an order that rotates (reshuffled every cycle), so clock, power and
host-load drifts over the run land on all of them alike instead of on whichever ran at a bad moment;
their graphs are all captured before any is timed. (Timed one after another on the H200, identical
forward kernels differed by up to 12% at T 262144; interleaved, by at most 1.2%.)
"""

from __future__ import annotations

import ctypes
import gc
import random
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Dict, Hashable, Optional, Tuple

import torch

L2_FLUSH_BYTES = 256 << 20
# Up to this T a point's kernels take microseconds, and their graph replays vary by tenths of a
# microsecond: more replays there (median of 60, else 20).
SMALL_T = 16384


def replays_for(tokens: int) -> int:
    return 60 if tokens <= SMALL_T else 20


def eager_batches_for(tokens: int) -> Tuple[int, int]:
    """(calls a batch, batches) for eager_times_ms: an eager step at small T is a fraction of a
    millisecond, so more calls a batch and more batches there."""
    return (50, 15) if tokens <= SMALL_T else (5, 9)


def captures_for(tokens: int) -> int:
    """Graphs captured per implementation (graph_times_ms): a graph's own offset is tenths of a
    microsecond, which matters only where the kernels take a few microseconds."""
    return 3 if tokens <= SMALL_T else 1


class L2Flush:
    """Empties the L2 before a timed replay: cudaCtxResetPersistingL2Cache, then a 256 MB write.

    The write alone is not enough. Lines read under an L2 evict_last policy (our `_el` forwards,
    torch.compile's first read of x) outlive it, so whatever was timed next read x from the L2
    (ncu on the H200: torch.compile's H 256 T 4096 forward read 7.9 KB of its 2 MB after an `_el`
    forward), and with replays interleaved in a fixed order that gain fell on the same neighbour
    each time: programs timed alone read 0.5-2 us faster with the write only (H 1536 T 1024
    fwd_rows1_wa_el 5.28 against 6.13 us, H 256 T 16384 fwd_rows8_wa_t2_el 7.39 against 8.35).
    Resetting the persisting lines first returns them to normal priority, and the write evicts them.
    Plain-load programs also timed faster with the write only (H 2048 T 4096 fwd_rows2_wa 11.55
    against 12.99), so not all of the difference is evict_last lines: this is the colder figure.
    """

    def __init__(self, cudart=None, nbytes: int = L2_FLUSH_BYTES, device: str = "cuda") -> None:
        if cudart is None:
            from cake_rmsnorm.runtime.loader import ensure_cudart

            cudart = ensure_cudart()
        self._reset = cudart.cudaCtxResetPersistingL2Cache
        self._reset.restype = ctypes.c_int
        self._reset.argtypes = []
        self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def __call__(self) -> None:
        rc = self._reset()
        if rc:
            raise RuntimeError(f"cudaCtxResetPersistingL2Cache failed: CUDA error {rc}")
        self._buffer.zero_()


def _capture(fn) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def _rotations(keys, reps: int, seed: int = 0):
    """keys in turn, each repetition starting one further along: over len(keys) repetitions every
    key takes every place once. After each such cycle the keys are reshuffled (seeded), so a key is
    not always timed after the same neighbour: whatever one replay leaves behind for the next
    lands on a different one each cycle."""
    keys = list(keys)
    rng = random.Random(seed)
    for rep in range(reps):
        k = rep % len(keys)
        if rep and not k:
            rng.shuffle(keys)
        yield keys[k:] + keys[:k]


def _fitting(fns: Dict[Hashable, Callable], prepare: Callable,
             out_of_memory: Optional[dict]) -> Dict[Hashable, object]:
    """prepare(fn) for each fn; where out_of_memory is a dict, a fn that runs out of GPU memory is
    left out with the reason, as is one already listed there (it did not fit an earlier stage of
    the same point), else the error propagates."""
    prepared = {}
    for key, fn in fns.items():
        if out_of_memory is not None and key in out_of_memory:
            continue
        try:
            prepared[key] = prepare(fn)
        except torch.OutOfMemoryError as exc:
            if out_of_memory is None:
                raise
            out_of_memory[key] = str(exc).splitlines()[0]
            torch.cuda.empty_cache()
    return prepared


def quartiles(samples) -> Tuple[float, float]:
    """The first and third quartiles of `samples` (both the one sample where there is one)."""
    if len(samples) < 2:
        return samples[0], samples[0]
    q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return q1, q3


def interquartile_mean(samples) -> float:
    """The mean of the middle half of `samples` (sorted, a quarter cut from each end; all of them
    where fewer than 4). Why beside the median: CUDA events tick in 32 ns steps on the H100 and
    H200 (bench.json, T <= 4096, the H200's of 2026-12-06 and the H100's of 2026-12-07: in each,
    all 105 forward medians and the 420 quartiles of forward and step fall on a tick or a half
    or quarter of one between two, as the median and quartiles interpolate), so a median moves
    by half ticks, and at T 128 one tick is 0.8% of a forward; the mean of the middle half
    resolves less than a tick and still drops the outlying replays."""
    ordered = sorted(samples)
    cut = len(ordered) // 4
    middle = ordered[cut:len(ordered) - cut]
    return statistics.fmean(middle)


@dataclass(frozen=True)
class Spread:
    """How a median's replays scatter: first and third quartiles and the interquartile mean."""
    q1: float
    q3: float
    iqm: float

    @classmethod
    def of(cls, samples) -> "Spread":
        return cls(*quartiles(samples), interquartile_mean(samples))


def graph_times_ms(fns: Dict[Hashable, Callable], reps: int = 20,
                   out_of_memory: Optional[dict] = None, spread: Optional[dict] = None,
                   captures: int = 1, per_graph: Optional[dict] = None) -> Dict[Hashable, float]:
    """Median time of one call of each fn, replayed as a CUDA graph after an L2 flush, interleaved.
    out_of_memory: see _fitting (the fns that did not fit are missing from the result). spread: a
    dict to receive each fn's Spread (quartiles and interquartile mean), to tell a steady gap
    between two medians from replays that scatter across it. captures: each fn captured that
    many times (each graph with outputs of its own; _captured), every graph replayed `reps`
    times, a fn's replays pooled; per_graph: a dict to receive each graph's own Spread, keyed
    (fn's key, capture), as benchmarks/graph_offsets.py reads them. Why: a graph keeps its own
    offset. On the H200 captures of one implementation differed steadily by up to 0.4 us at
    T <= 4096 (interquartile means of 120 replays, the same in two trials: torch.compile's H 2048
    T 128 forward 5.45, 5.04, 5.03 us; our routed H 256 T 4096 forward 5.33 to 5.52 over six
    graphs), as much as the gaps measured."""
    flush = L2Flush()
    graphs = _captured(fns, captures, out_of_memory)
    slots = [(key, i) for key, captured in graphs.items() for i in range(len(captured))]
    samples = _replayed(slots, reps, lambda key, i: _replay_ms(flush, graphs[key][i]))
    del graphs
    pooled: Dict[Hashable, list] = {key: [] for key, _ in slots}
    for (key, _), t in samples.items():
        pooled[key].extend(t)
    if per_graph is not None:
        per_graph.update({slot: Spread.of(t) for slot, t in samples.items()})
    if spread is not None:
        spread.update({key: Spread.of(t) for key, t in pooled.items()})
    return {key: statistics.median(t) for key, t in pooled.items()}


def _captured(fns: Dict[Hashable, Callable], captures: int,
              out_of_memory: Optional[dict]) -> Dict[Hashable, list]:
    """{key: its graphs}: every fn captured `captures` times, in rounds (each fn once a round,
    A0 B0 A1 B1 ...), so no implementation's graphs all come first. A fn that runs out of GPU
    memory in any round is left out (_fitting)."""
    graphs: Dict[Hashable, list] = {}
    for _ in range(captures):
        for key, graph in _fitting(fns, _capture, out_of_memory).items():
            graphs.setdefault(key, []).append(graph)
    return {key: g for key, g in graphs.items() if out_of_memory is None or key not in out_of_memory}


def _replay_ms(flush: L2Flush, graph: torch.cuda.CUDAGraph) -> float:
    flush()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _replayed(slots, reps: int, measure: Callable) -> Dict[Hashable, list]:
    """{slot: samples}: every (key, capture) slot measured `reps` times, interleaved
    (_rotations)."""
    samples: Dict[Hashable, list] = {slot: [] for slot in slots}
    for order in _rotations(slots, reps):
        for key, i in order:
            samples[(key, i)].append(measure(key, i))
    return samples


def graph_time_ms(fn, reps: int = 20) -> float:
    """Median time of one call of fn, replayed as a CUDA graph after an L2 flush."""
    return graph_times_ms({0: fn}, reps)[0]


def _warm(fn, calls: int = 5) -> Callable:
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return fn


def eager_times_ms(fns: Dict[Hashable, Callable], reps: int = 50, batches: int = 9,
                   out_of_memory: Optional[dict] = None) -> Dict[Hashable, float]:
    """Wall time of one eager call of each fn (host overhead included): the fastest of `batches`
    batches of reps calls, per call, the implementations' batches interleaved. Host noise (other
    processes, clock changes) only ever adds time, so the fastest batch is the steadiest figure.
    The garbage collector is off while a batch runs (as in timeit): a collection would land on
    whichever implementation happened to be running. out_of_memory: see _fitting."""
    fns = _fitting(fns, _warm, out_of_memory)
    best = {key: float("inf") for key in fns}
    collecting = gc.isenabled()
    # Collections run between batches only. (Not gc.collect() before each: a full collection with
    # torch loaded took 0.1 s on the CPU here, 75 of them a small-T point, and the H100 benchmark
    # with them ran past 420 s.)
    try:
        for order in _rotations(fns, batches):
            for key in order:
                fn = fns[key]
                gc.disable()
                t0 = time.perf_counter()
                for _ in range(reps):
                    fn()
                torch.cuda.synchronize()
                best[key] = min(best[key], (time.perf_counter() - t0) * 1e3 / reps)
                if collecting:
                    gc.enable()
    finally:
        if collecting:
            gc.enable()
    return best


def copy_bandwidth_gbs() -> float:
    """An elementwise kernel over 1 GiB (bytes read plus written). Not copy_: a contiguous copy_ is
    a memcpy, which measured 2.7 TB/s on the H200 here, below what elementwise kernels move."""
    src = torch.empty(1 << 26, 4, dtype=torch.float32, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = graph_time_ms(lambda: torch.mul(src, 1.0, out=dst))
    return 2 * src.numel() * src.element_size() / ms / 1e6
