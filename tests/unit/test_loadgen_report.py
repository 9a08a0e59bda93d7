"""The load generator's outputs: the summary table, the JSON document, and the figures."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from loadgen.metrics import Slo, summarize
from loadgen.plots import plot_latency_cdfs, plot_slo_attainment
from loadgen.record import RequestRecord
from loadgen.report import format_summary, write_json


def _records() -> list[RequestRecord]:
    ok = RequestRecord(0, 0.0, 8, 3, 0.0, [0.5, 0.625, 0.75], 0.75, 200, None, 8, 3, 4)
    rejected = RequestRecord(1, 0.0, 8, 3, 0.25, [], 0.5, 429, "HTTP 429: busy")
    return [ok, rejected]


def test_the_table_shows_slos_counts_and_latencies() -> None:
    table = format_summary(summarize(_records(), Slo(ttft_ms=600, tbt_ms=100)), ["Server: http://x"])
    lines = table.splitlines()
    assert "Server: http://x" in lines and "SLOs: TTFT <= 600 ms, TBT <= 100 ms" in lines
    assert any(line.startswith("  rejected (HTTP 429):") and line.endswith(" 1") for line in lines)
    assert any(line.startswith("Effective capacity (% of sent):") and line.endswith(" 0.0") for line in lines)
    ttft = next(line for line in lines if line.startswith("TTFT  "))
    assert ttft.split() == ["TTFT", "500.00", "500.00", "500.00", "500.00", "1"]
    assert len({len(line) for line in lines if ":" in line and line.startswith(("Requests", "Duration"))}) == 1
    assert "1 x HTTP 429: busy" in table


def test_the_json_document_holds_config_summary_and_records(tmp_path: Path) -> None:
    path = write_json(tmp_path / "out" / "run.json", {"rate": math.inf}, summarize(_records()), _records())
    document = json.loads(path.read_text())
    assert document["config"] == {"rate": "inf"}
    assert document["summary"]["num_rejected"] == 1 and document["summary"]["ttft"]["count"] == 1
    assert document["requests"][0]["chunk_times_s"] == [0.5, 0.625, 0.75]
    assert document["requests"][1]["error"] == "HTTP 429: busy"


@pytest.mark.parametrize("loads", [[1.0, 2.0, 4.0], ["low", "mid", "high"]])
def test_slo_attainment_is_drawn_for_numeric_and_labelled_loads(tmp_path: Path, loads: list[float | str]) -> None:
    summary = summarize(_records(), Slo(ttft_ms=600, tbt_ms=100))
    series = {"tsukimi": [(x, summary) for x in loads], "baseline": [(loads[0], summarize([]))]}
    path = plot_slo_attainment(series, tmp_path / "attainment.png", title="test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_latency_cdfs_are_drawn_even_without_data(tmp_path: Path) -> None:
    assert plot_latency_cdfs(_records(), tmp_path / "a.png", Slo(ttft_ms=600)).stat().st_size > 0
    assert plot_latency_cdfs([], tmp_path / "b.png").stat().st_size > 0
