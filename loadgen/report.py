"""Reporting a run: the summary table on stdout and the JSON file (config, summary, every request's record).
Plots are in plots.py.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from loadgen.metrics import LatencyStats, Summary
from loadgen.record import RequestRecord

_WIDTH = 64
_LABEL_WIDTH = 40


def format_summary(summary: Summary, header_lines: Sequence[str] = ()) -> str:
    """The summary as an aligned table with units; `header_lines` (workload, URL) go above the SLOs."""
    lines = [" tsukimi-loadgen ".center(_WIDTH, "="), *header_lines, f"SLOs: {summary.slo.describe()}", "-" * _WIDTH]
    lines += [_row(label, value) for label, value in _counts(summary)]
    lines += [_row(label, value) for label, value in _rates(summary)]
    lines.append(" latency (ms) ".center(_WIDTH, "-"))
    lines.append(f"{'':<6}{'mean':>11}{'median':>11}{'p90':>11}{'p99':>11}{'n':>8}")
    stats = (("TTFT", summary.ttft), ("TPOT", summary.tpot), ("ITL", summary.itl), ("E2E", summary.e2e))
    for name, stat in (*stats, ("TBT", summary.tbt)):
        lines.append(_latency_row(name, stat))
    if summary.errors:
        lines.append(" most common errors ".center(_WIDTH, "-"))
        lines += [f"{count:>6} x {message[: _WIDTH - 9]}" for message, count in summary.errors.items()]
    lines.append("=" * _WIDTH)
    return "\n".join(lines)


def run_document(config: Mapping[str, Any], summary: Summary, records: Sequence[RequestRecord]) -> dict[str, Any]:
    """The JSON document of a run: {"config", "summary", "requests"}; non-finite numbers become strings."""
    document = {"config": dict(config), "summary": summary.to_dict(), "requests": [r.to_dict() for r in records]}
    return _finite(document)


def write_json(path: str | Path, config: Mapping[str, Any], summary: Summary, records: Sequence[RequestRecord]) -> Path:
    """Write `run_document` to `path` (parent folders are created). Raises OSError."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(run_document(config, summary, records), indent=1, allow_nan=False) + "\n")
    return path


def _counts(summary: Summary) -> list[tuple[str, str]]:
    return [
        ("Requests sent", f"{summary.num_sent}"),
        ("  completed", f"{summary.num_completed}"),
        ("  rejected (HTTP 429)", f"{summary.num_rejected}"),
        ("  failed", f"{summary.num_failed}"),
        ("  meeting every SLO", f"{summary.num_meeting_slo}"),
        ("Duration (s)", f"{summary.duration_s:.2f}"),
        ("Prompt / output tokens (completed)", f"{summary.num_prompt_tokens} / {summary.num_output_tokens}"),
    ]


def _rates(summary: Summary) -> list[tuple[str, str]]:
    return [
        ("Request throughput (req/s)", f"{summary.request_throughput:.3f}"),
        ("Output token throughput (tok/s)", f"{summary.output_token_throughput:.1f}"),
        ("Goodput (req/s meeting SLOs)", f"{summary.goodput:.3f}"),
        ("Effective capacity (% of sent)", _percent(summary.effective_capacity)),
        ("TTFT SLO attainment (% of sent)", _percent(summary.ttft_attainment)),
        ("TBT SLO attainment (% of sent)", _percent(summary.tbt_attainment)),
        ("Cache hit rate (% of prompt tokens)", _percent(summary.cache_hit_rate)),
    ]


def _row(label: str, value: str) -> str:
    return f"{label + ':':<{_LABEL_WIDTH}}{value:>{_WIDTH - _LABEL_WIDTH}}"


def _latency_row(name: str, stat: LatencyStats) -> str:
    values = (stat.mean_ms, stat.median_ms, stat.p90_ms, stat.p99_ms)
    cells = "".join(f"{'-' if v is None else f'{v:.2f}':>11}" for v in values)
    return f"{name:<6}{cells}{stat.count:>8}"


def _percent(share: float | None) -> str:
    return "-" if share is None else f"{share * 100:.1f}"


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value
