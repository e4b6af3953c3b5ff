"""The benchmark's L2 flush (no GPU): persisting lines are reset before every 256 MB write, and a
failed reset stops the timing instead of leaving evict_last lines to favour the next replay."""

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
