"""Figures of runs (PNG, drawn off-screen on matplotlib's Agg canvas, no pyplot state): latency CDFs of one run,
and SLO attainment against load for several series of runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from loadgen.metrics import Slo, Summary, e2e_s, itls_s, tbt_s, ttft_s
from loadgen.record import RequestRecord

LoadPoint = tuple[float | str, Summary]  # (load: a number such as req/s, or a label; the run's summary)


def plot_latency_cdfs(records: Sequence[RequestRecord], path: str | Path, slo: Slo | None = None) -> Path:
    """One PNG with the CDFs of TTFT, TBT, E2E and ITL (ms) of the completed requests; SLOs as dashed lines."""
    slo = slo or Slo()
    completed = [r for r in records if r.is_completed]
    panels: list[tuple[str, list[float], float | None]] = [
        ("TTFT", [v * 1e3 for r in completed if (v := ttft_s(r)) is not None], slo.ttft_ms),
        ("TBT", [tbt_s(g) * 1e3 for r in completed if (g := itls_s(r))], slo.tbt_ms),
        ("E2E latency", [v * 1e3 for r in completed if (v := e2e_s(r)) is not None], None),
        ("ITL", [gap * 1e3 for r in completed for gap in itls_s(r)], None),
    ]
    fig = Figure(figsize=(10, 7), layout="constrained")
    for ax, (name, values_ms, slo_ms) in zip(fig.subplots(2, 2).flat, panels, strict=True):
        _cdf(ax, name, values_ms, slo_ms)
    fig.suptitle(f"Latency CDFs ({len(completed)} completed requests)")
    return _save(fig, path)


def plot_slo_attainment(
    series: Mapping[str, Sequence[LoadPoint]],
    path: str | Path,
    x_label: str = "load (requests/s)",
    title: str | None = None,
    threshold: float | None = None,
) -> Path:
    """Effective request capacity and TTFT/TBT SLO attainment (% of sent requests) against load, one line per
    series (e.g. name -> [(rate, summary), ...]). Loads are numbers or labels (labels are spaced evenly in order
    of first appearance). The TTFT/TBT panels appear when some summary has that SLO; `threshold` (a share, e.g.
    0.9) draws a dashed line where a system counts as serving its load."""
    metrics = [("effective capacity", lambda s: s.effective_capacity)]
    points = [p for pts in series.values() for p in pts]
    if any(s.slo.ttft_ms is not None for _, s in points):
        metrics.append(("TTFT SLO attainment", lambda s: s.ttft_attainment))
    if any(s.slo.tbt_ms is not None for _, s in points):
        metrics.append(("TBT SLO attainment", lambda s: s.tbt_attainment))
    positions = _positions([x for x, _ in points])
    fig = Figure(figsize=(5 * len(metrics), 4), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(metrics)))
    for ax, (name, value) in zip(axes, metrics, strict=True):
        for label, pts in series.items():
            shown = [(positions[x], v * 100) for x, s in pts if (v := value(s)) is not None]
            ax.plot([p for p, _ in shown], [v for _, v in shown], marker="o", label=label)
        _load_axis(ax, positions, x_label)
        if threshold is not None:
            ax.axhline(100 * threshold, color="gray", linestyle="--", linewidth=1)
        ax.set(title=name, ylabel="% of sent requests", ylim=(-2, 102))
        ax.grid(alpha=0.3)
    axes[0].legend()
    if title:
        fig.suptitle(title)
    return _save(fig, path)


def _cdf(ax: Axes, name: str, values_ms: list[float], slo_ms: float | None) -> None:
    ax.set(title=name, xlabel="ms", ylabel="share of requests" if name != "ITL" else "share of gaps", ylim=(0, 1.02))
    ax.grid(alpha=0.3)
    if values_ms:
        xs = np.sort(values_ms)
        ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post")
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    if slo_ms is not None:
        ax.axvline(slo_ms, color="red", linestyle="--", label=f"SLO {slo_ms:g} ms")
        ax.legend(loc="lower right")


def _positions(xs: Sequence[float | str]) -> dict[float | str, float]:
    """Numbers stand for themselves; with any label, every load gets its rank of first appearance."""
    if all(isinstance(x, int | float) for x in xs):
        return {x: float(x) for x in xs}
    return {x: float(i) for i, x in enumerate(dict.fromkeys(xs))}


def _load_axis(ax: Axes, positions: Mapping[float | str, float], x_label: str) -> None:
    ax.set_xlabel(x_label)
    if any(isinstance(x, str) for x in positions):
        ax.set_xticks(list(positions.values()), [str(x) for x in positions])


def _save(fig: Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path
