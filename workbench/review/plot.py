"""The speedup-vs-batch plot of a result file (matplotlib, Agg backend, PNG bytes)."""

from __future__ import annotations

import io

from workbench.results import RunResult


def speedup_vs_batch_png(result: RunResult, batch_axis: str = "T") -> bytes:
    """Speedup (the result's ``speedup``: baseline / candidate) per perf configuration against the decode batch.

    One marker per configuration with its bootstrap confidence interval as an error bar; a dashed
    line at 1.0x (no change). Configurations are grouped by their non-batch axes (one series each).

    Args:
        result: the result file.
        batch_axis: the axis that is the decode batch (the task scope's ``batch_axis``).

    Returns:
        A PNG image (bytes); a "no perf data" image when the result has no perf rows.
    """
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure  # no pyplot: no global state across requests

    fig = Figure(figsize=(6.4, 3.6), dpi=100)
    ax = fig.add_subplot()
    series: dict[str, list] = {}
    for p in result.perf:
        key = ", ".join(f"{k}={v}" for k, v in p.axes.items() if k != batch_axis) or "all"
        series.setdefault(key, []).append(p)
    for key, rows in series.items():
        rows.sort(key=lambda p: p.axes.get(batch_axis, 0))
        xs = [p.axes.get(batch_axis, 0) for p in rows]
        ys = [p.speedup for p in rows]
        lo = [max(0.0, p.speedup - p.speedup_ci[0]) for p in rows]
        hi = [max(0.0, p.speedup_ci[1] - p.speedup) for p in rows]
        ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=key)
    ax.axhline(1.0, linestyle="--", color="grey", linewidth=1)
    if result.perf:
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=7, loc="best")
    else:
        ax.text(0.5, 0.5, "no perf data in this result", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel(f"decode batch {batch_axis} (tokens)")
    ax.set_ylabel("speedup (x, baseline / candidate)")
    ax.set_title(f"{result.task_id}: speedup vs batch")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()
