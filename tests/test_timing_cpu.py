"""The benchmark's L2 flush (no GPU): persisting lines are reset before every 256 MB write, and a
failed reset stops the timing instead of leaving evict_last lines to favour the next replay."""

import statistics
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import timing  # noqa: E402


class _FakeCudart:
    def __init__(self, rc: int = 0) -> None:
        self.events = []

        def reset():
            self.events.append("reset")
            return rc

        self.cudaCtxResetPersistingL2Cache = reset


def test_flush_resets_persisting_lines_then_overwrites():
    cudart = _FakeCudart()
    flush = timing.L2Flush(cudart, nbytes=64, device="cpu")
    for _ in range(2):
        flush._buffer.fill_(7)
        flush()
        assert int(flush._buffer.count_nonzero()) == 0
    assert cudart.events == ["reset", "reset"]


def test_flush_raises_when_the_reset_fails():
    flush = timing.L2Flush(_FakeCudart(rc=1), nbytes=64, device="cpu")
    flush._buffer.fill_(7)
    with pytest.raises(RuntimeError, match=r"cudaCtxResetPersistingL2Cache failed: CUDA error 1"):
        flush()
    assert int(flush._buffer.count_nonzero()) == 64  # nothing timed on a half-flushed cache


def test_interleaved_orders_balance_places_and_vary_neighbours():
    keys = ["a", "b", "c", "d", "e"]
    orders = list(timing._rotations(keys, 4 * len(keys)))
    assert all(sorted(order) == keys for order in orders)
    for cycle in range(4):  # every key in every place once per cycle of len(keys) repetitions
        block = orders[cycle * len(keys):(cycle + 1) * len(keys)]
        for place in range(len(keys)):
            assert sorted(order[place] for order in block) == keys
    before = {key: {order[i - 1] for order in orders for i in range(1, len(order)) if order[i] == key}
              for key in keys}
    assert all(len(neighbours) > 1 for neighbours in before.values()), before


def _oom(*_args):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB.\nmore detail")


def test_an_implementation_that_does_not_fit_is_left_out_with_its_reason(monkeypatch):
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    prepared = []
    fns = {"fits": lambda: "a", "too_big": _oom, "fits_too": lambda: "b"}
    unfit: dict = {}
    got = timing._fitting(fns, lambda fn: prepared.append(fn()) or fn, unfit)
    assert list(got) == ["fits", "fits_too"] and prepared == ["a", "b"]
    assert unfit == {"too_big": "CUDA out of memory. Tried to allocate 8.00 GiB."}
    # a later stage of the same point skips what did not fit before, without preparing it again
    prepared.clear()
    got = timing._fitting({"fits": lambda: "c", "too_big": lambda: pytest.fail("prepared")},
                          lambda fn: prepared.append(fn()) or fn, unfit)
    assert list(got) == ["fits"] and prepared == ["c"]


def test_out_of_memory_propagates_unless_asked_to_leave_out():
    with pytest.raises(torch.OutOfMemoryError):
        timing._fitting({"too_big": _oom}, lambda fn: fn(), None)


def test_quartiles_bracket_the_median_and_show_a_scatter():
    steady = [4.2, 4.3, 4.25, 4.3, 4.2, 4.25, 4.3]
    split = [4.2, 4.8, 4.2, 4.8, 4.2, 4.8, 4.8]  # two modes: the median alone hides it
    assert timing.quartiles(steady) == pytest.approx((4.225, 4.3))
    q1, q3 = timing.quartiles(split)
    assert (q1, q3) == pytest.approx((4.2, 4.8))
    assert timing.quartiles([5.0]) == (5.0, 5.0)


def test_interquartile_mean_resolves_less_than_a_tick_and_drops_outliers():
    tick = 0.032  # a CUDA event's step on the H100 and H200
    # replays on whole ticks: the same median, but b's middle half sits 0.4 tick later
    a = [t * tick for t in (129, 129, 130, 130, 130, 130, 130, 131, 131)]
    b = [t * tick for t in (129, 129, 130, 130, 130, 131, 131, 131, 131)]
    assert statistics.median(a) == statistics.median(b)
    assert timing.interquartile_mean(b) - timing.interquartile_mean(a) == pytest.approx(0.4 * tick)
    assert timing.interquartile_mean([4.0, 4.1, 4.2, 40.0]) == pytest.approx(4.15)  # 40 is cut
    assert timing.interquartile_mean([4.0, 5.0]) == pytest.approx(4.5)  # under 4: all of them
    spread = timing.Spread.of([4.2, 4.3, 4.25, 4.3, 4.2, 4.25, 4.3])
    assert (spread.q1, spread.q3) == pytest.approx((4.225, 4.3))
    assert spread.iqm == pytest.approx(4.26)  # 4.2, 4.25, 4.25, 4.3, 4.3


def _fake_graphs(monkeypatch, offsets):
    """graph_times_ms without a GPU: capturing fns[key] takes the next of offsets[key] (a graph's
    steady time of its own), replaying a graph returns it; (fns, capture order, replays)."""
    captured, replayed = [], []
    left = {key: iter(times) for key, times in offsets.items()}

    def capture(key):
        captured.append(key)
        return next(left[key])

    monkeypatch.setattr(timing, "L2Flush", lambda: None)
    monkeypatch.setattr(timing, "_capture", lambda fn: fn())
    monkeypatch.setattr(timing, "_replay_ms", lambda _flush, graph: replayed.append(graph) or graph)
    return {key: (lambda key=key: capture(key)) for key in offsets}, captured, replayed


def test_captures_are_each_replayed_and_pooled_per_implementation(monkeypatch):
    # two implementations, three captures each, every capture with a steady offset of its own
    fns, captured, replayed = _fake_graphs(monkeypatch, {"a": [5.0, 5.4, 5.1], "b": [5.2, 5.2, 5.2]})
    spread, per_graph = {}, {}
    medians = timing.graph_times_ms(fns, reps=4, spread=spread, captures=3, per_graph=per_graph)
    assert captured == ["a", "b"] * 3  # in rounds: neither implementation's graphs all come first
    assert sorted(replayed) == sorted([5.0, 5.4, 5.1] * 4 + [5.2] * 12)  # every graph reps times
    # one capture alone would have put "a" ahead (5.0) or behind (5.4); pooled, its median is 5.1
    assert medians == {"a": 5.1, "b": 5.2}
    assert spread["a"].iqm == pytest.approx(statistics.fmean([5.0, 5.1, 5.1, 5.1, 5.1, 5.4]))
    assert {slot: s.iqm for slot, s in per_graph.items()} == {
        ("a", 0): 5.0, ("a", 1): 5.4, ("a", 2): 5.1, ("b", 0): 5.2, ("b", 1): 5.2, ("b", 2): 5.2}


def test_an_implementation_out_of_memory_in_a_later_round_is_left_out(monkeypatch):
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    fns, captured, replayed = _fake_graphs(monkeypatch, {"a": [5.0, 5.1], "b": [6.0]})
    fns["b"] = (lambda first=fns["b"]: first() if "b" not in captured else _oom())
    unfit: dict = {}
    medians = timing.graph_times_ms(fns, reps=2, out_of_memory=unfit, captures=2)
    assert captured == ["a", "b", "a"]
    assert list(medians) == ["a"] and list(unfit) == ["b"]
    assert 6.0 not in replayed  # its first round's graph is not timed either


def test_eager_batches_run_with_the_collector_off_and_restore_it(monkeypatch):
    import gc
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    states = []
    fns = {"a": lambda: states.append(gc.isenabled()), "b": lambda: states.append(gc.isenabled())}
    assert gc.isenabled()
    best = timing.eager_times_ms(fns, reps=3, batches=2)
    assert set(best) == {"a", "b"} and all(v >= 0 for v in best.values())
    assert len(states) == 5 * 2 + 2 * 2 * 3  # _warm's calls (collector on), then the batches
    assert states[:10] == [True] * 10 and not any(states[10:])
    assert gc.isenabled()
