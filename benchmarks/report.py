"""The benchmark's markdown table and plots (from bench.json rows)."""

from __future__ import annotations

from pathlib import Path
from typing import List


def _peer(rows, row, impl):
    return next((r for r in rows if r["impl"] == impl and r["H"] == row["H"] and r["T"] == row["T"]),
                None)


# (column label, row key) of the peer-over-ours ratio columns
RATIOS = (("fwd", "fwd_ms"), ("fwd no_grad", "fwd_nograd_ms"), ("bwd", "bwd_ms"),
          ("step", "eager_step_ms"))


def markdown(rows, copy_gbs: float, ours: List[str]) -> str:
    peers = sorted({r["impl"] for r in rows} - set(ours))
    head = ["H", "T", "impl", "fwd ms", "fwd/copy", "fwd no_grad ms", "bwd ms", "bwd/copy",
            "eager step ms"]
    head += [f"{label} {p}/ours" for label, _ in RATIOS for p in peers]
    lines = [f"copy bandwidth: {copy_gbs:.0f} GB/s; ratios are the peer's time over ours (> 1: "
             f"ours is faster); fwd moves 4·T·H bytes, bwd 6·T·H; fwd records autograd (a "
             f"training step's forward), fwd no_grad does not; bwd is the step less fwd", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row["H"], row["T"], row["impl"], f"{row['fwd_ms']:.4f}",
                 f"{row['fwd_gbs'] / copy_gbs:.2f}", f"{row['fwd_nograd_ms']:.4f}",
                 f"{row['bwd_ms']:.4f}",
                 f"{row['bwd_gbs'] / copy_gbs:.2f}", f"{row['eager_step_ms']:.4f}"]
        for _, key in RATIOS:
            for p in peers:
                other = _peer(rows, row, p)
                cells.append(f"{other[key] / row[key]:.2f}" if other and row["impl"] in ours else "")
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def plots(rows, out: Path) -> List[Path]:
    """One PNG per width: forward and backward kernel time vs T, a line per implementation."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        print(f"no plots: {exc}")
        return []
    paths = []
    for hidden in sorted({r["H"] for r in rows}):
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for ax, key, title in ((axes[0], "fwd_ms", "forward"), (axes[1], "bwd_ms", "backward")):
            for impl in sorted({r["impl"] for r in rows}):
                pts = sorted((r["T"], r[key]) for r in rows if r["H"] == hidden and r["impl"] == impl)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("T (tokens)")
            ax.set_ylabel("kernel time, ms (graph replay, L2 flushed)")
            ax.set_title(f"RMSNorm {title}, H {hidden}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / f"bench_h{hidden}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)
    return paths
