"""The load generator end to end against the sim backend, all real processes on loopback: `tsukimi-loadgen` replays
the bundled trace against `tsukimi up --engine sim`, and `tsukimi-loadgen experiment mooncake` writes its report and
JSON from a tiny sweep."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadgen.cli import main as loadgen_main
from loadgen.trace import BUNDLED_TRACE
from shared.tools.experiment import main as experiment_main
from shared.tools.experiment.studies import POOL_TOKENS
from shared.tools.experiment.system import RunningSystem, SystemSpec, start_system, stop_system

NUM_REQUESTS = 6
OUTPUT_SCALE = 0.05  # trace answers of ~350 tokens become ~18: a few seconds of simulated decoding


@pytest.fixture(scope="module")
def sim_system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningSystem]:
    spec = SystemSpec("conductor", num_prefill=1, num_decode=1, num_cache_stores=1, engine="sim",
                      profile="llama2-70b-8xa800", startup_timeout_s=120)
    system = start_system(spec, tmp_path_factory.mktemp("sim-logs"), print)
    yield system
    stop_system(system)


def test_trace_replay_against_the_sim_system(sim_system: RunningSystem, tmp_path: Path) -> None:
    out, plots = tmp_path / "run.json", tmp_path / "plots"
    code = loadgen_main([
        "--url", sim_system.base_url, "--trace", str(BUNDLED_TRACE), "--max-requests", str(NUM_REQUESTS),
        "--time-scale", "0.5", "--output-scale", str(OUTPUT_SCALE), "--slo-ttft-ms", "30000", "--slo-tbt-ms", "300",
        "--json", str(out), "--plot", str(plots), "--quiet",
    ])
    assert code == 0
    result = json.loads(out.read_text())
    summary, records = result["summary"], result["requests"]
    assert summary["num_sent"] == summary["num_completed"] == NUM_REQUESTS, summary["errors"]
    trace = [json.loads(line) for line in BUNDLED_TRACE.read_text().splitlines()[:NUM_REQUESTS]]
    for record in records:  # the sim never stops early: every answer is as long as the trace says, scaled
        line = trace[record["request_id"]]
        assert record["num_output_tokens"] == max(1, round(line["output_length"] * OUTPUT_SCALE))
        assert record["num_prompt_tokens"] == line["input_length"]
        assert len(record["chunk_times_s"]) == record["num_output_tokens"]
        assert record["send_s"] < record["chunk_times_s"][0] <= record["chunk_times_s"][-1] <= record["done_s"]
    assert summary["ttft"]["count"] == NUM_REQUESTS and summary["tbt"]["count"] > 0
    assert summary["ttft"]["mean_ms"] < summary["e2e"]["mean_ms"]
    assert sorted(p.name for p in plots.iterdir()) and all(p.stat().st_size > 0 for p in plots.iterdir())


def test_an_experiment_without_a_load_to_sweep_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The trace's first ten requests all arrive at time 0: replaying four of them offers no measurable load."""
    code = experiment_main(["mooncake", "--num-requests", "4", "--report", str(tmp_path / "report")])
    assert code == 2 and "all arrive at the same time" in capsys.readouterr().err
    assert not (tmp_path / "report").exists()


def test_the_mooncake_experiment_writes_its_report_and_json(tmp_path: Path) -> None:
    out, report = tmp_path / "result.json", tmp_path / "report"
    code = experiment_main([
        "mooncake", "--quick", "--num-requests", "12", "--time-scales", "1", "--prefill", "1", "--decode", "1",
        "--input-scale", "0.1", "--output-scale", "0.05", "--json", str(out), "--report", str(report),
        "--log-dir", str(tmp_path / "logs"),
    ])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["simulation"] is True
    assert set(result["effective_capacity_ratio"]) == {"100", "200", "300"}
    assert all(isinstance(v, float) and v > 0 for v in result["effective_capacity_ratio"].values())
    assert set(result["effective_capacity_ratio_bound"].values()) <= {"=", ">=", "<=", "?"}
    assert set(result["avg_ttft_s_by_policy"]) == {"random", "conductor"}
    assert all(v > 0 for v in result["avg_ttft_s_by_policy"].values())
    assert [(r["system"], r["policy"]) for r in result["runs"]] == [
        ("baseline", "least_loaded"), ("tsukimi", "conductor"), ("tsukimi", "random")]
    assert all(r["summary_by_tbt_slo_ms"]["100"]["num_completed"] == 12 for r in result["runs"])
    assert all(r["rate"] == pytest.approx(12 / 3.0) for r in result["runs"])  # 12 arrivals over the trace's first 3 s
    text = (report / "report.md").read_text()
    assert "Simulation." in text and "| 100 ms |" in text and "paper" in text
    assert all((report / f"capacity_tbt{t}ms.png").stat().st_size > 0 for t in (100, 200, 300))


def test_the_mooncake_experiment_on_the_virtual_clock(tmp_path: Path) -> None:
    """Every run is one `python -m services.virtual` process, two at a time: the same report and JSON, with the
    clock, the request and node counts and the wall time, and all five placement policies to choose from."""
    out, report = tmp_path / "result.json", tmp_path / "report"
    code = experiment_main([
        "mooncake", "--clock", "virtual", "--quick", "--num-requests", "24", "--time-scales", "2,1",
        "--prefill", "1", "--decode", "1", "--policies", "round_robin,conductor", "--json", str(out),
        "--report", str(report), "--log-dir", str(tmp_path / "logs"),
    ])
    assert code == 0
    result = json.loads(out.read_text())
    assert (result["clock"], result["num_requests"], result["num_nodes"]) == ("virtual", 24, 2)
    assert result["wall_s"] > 0
    assert [(r["system"], r["policy"], r["time_scale"]) for r in result["runs"]] == [
        ("baseline", "least_loaded", 2.0), ("tsukimi", "conductor", 2.0), ("baseline", "least_loaded", 1.0),
        ("tsukimi", "conductor", 1.0), ("tsukimi", "round_robin", 1.0)]
    for run in result["runs"]:
        assert run["error"] is None and run["summary_by_tbt_slo_ms"]["100"]["num_completed"] == 24
        assert run["placements"]["placed"] == 24  # from the scheduler's log lines of the run's one process
    baseline = [r for r in result["runs"] if r["system"] == "baseline"][0]
    prefilled_on = {k: v for k, v in baseline["placements"].items() if k.startswith("prefill:")}
    assert sum(prefilled_on.values()) == 24  # colocated: two instances, each prefilling its own requests
    assert set(prefilled_on) == {"prefill:decode-0", "prefill:decode-1"}
    assert set(result["avg_ttft_s_by_policy"]) == {"round_robin", "conductor"}
    text = (report / "report.md").read_text()
    assert "virtual clock" in text and "| 100 ms |" in text


def test_the_virtual_clock_s_studies_write_their_figures(tmp_path: Path) -> None:
    """The studies beyond the main sweep, small: each one's runs come back without errors and its JSON keys and
    report section are there (their figures at scale are in docs/experiments/)."""
    out, report = tmp_path / "result.json", tmp_path / "report"
    code = experiment_main([
        "mooncake", "--clock", "virtual", "--quick", "--num-requests", "24", "--time-scales", "2,1",
        "--prefill", "1", "--decode", "1", "--policies", "conductor", "--studies", "rejection,pool,kv_codec",
        "--json", str(out), "--report", str(report), "--log-dir", str(tmp_path / "logs"),
    ])
    assert code == 0
    result = json.loads(out.read_text())
    assert all(run["error"] is None for run in result["runs"])
    assert set(result["rejections"]) == set(result["load_over_time"]) == {"off", "current", "predicted"}
    assert result["rejections"]["off"]["rejected"] == 0 and result["load_over_time"]["off"]["t_s"]
    assert set(result["hit_rate_by_capacity"]) == {str(tokens) for tokens in POOL_TOKENS}
    assert result["hit_rate_global"] is not None and result["hit_rate_local"] is not None
    assert result["kv_codec"]["bytes_ratio"] > 4 and set(result["kv_codec"]["hit_rate"]) == {"none", "kvquant-3"}
    text = (report / "report.md").read_text()
    assert "Early rejection at twice" in text and "Global pool against local caches" in text
    assert (report / "load_over_time.png").is_file() and (report / "hit_rate_by_capacity.png").is_file()
