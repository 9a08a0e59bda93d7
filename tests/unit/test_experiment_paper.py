"""The paper's figures stand beside ours only for the trace they were reported on."""

from __future__ import annotations

from pathlib import Path

from loadgen.record import RequestRecord
from shared.tools.experiment.mooncake import ExperimentConfig, RunOutcome
from shared.tools.experiment.paper import CONVERSATION, NONE, SYNTHETIC, paper_figures
from shared.tools.experiment.report import write_report
from shared.tools.experiment.results import compute, to_json


def test_each_published_trace_gets_its_own_figures() -> None:
    assert paper_figures(Path("loadgen/data/conversation_trace.jsonl.gz")) is CONVERSATION
    assert paper_figures(Path("/tmp/conversation_trace_head.jsonl")) is CONVERSATION
    assert paper_figures(Path("/data/synthetic_trace.jsonl")) is SYNTHETIC
    assert paper_figures(Path("/data/toolagent_trace.jsonl")) is NONE
    assert SYNTHETIC.capacity_ratio == {"100": 1.62, "200": 1.40, "300": 1.28} and not SYNTHETIC.avg_ttft_s


def record(ttft_s: float) -> RequestRecord:
    r = RequestRecord(0, 0.0, 100, 3)
    r.send_s = 0.0
    r.status, r.chunk_times_s, r.done_s = 200, [ttft_s, ttft_s + 0.02, ttft_s + 0.04], ttft_s + 0.04
    return r


def report_for(tmp_path: Path, trace_name: str) -> tuple[str, dict]:
    config = ExperimentConfig(trace=tmp_path / trace_name, log_dir=tmp_path, time_scales=(1.0,),
                              policy_time_scale=1.0, policies=("conductor",), clock="virtual")
    runs = [RunOutcome("baseline", "least_loaded", 1.0, 1.0, [record(1.0)]),
            RunOutcome("tsukimi", "conductor", 1.0, 1.0, [record(2.0)])]
    results = compute(config, runs)
    text = write_report(results, tmp_path / trace_name.split(".")[0], "cmd", 60.0).read_text()
    return text, to_json(results)


def test_a_trace_the_paper_did_not_use_has_no_paper_figures(tmp_path: Path) -> None:
    text, out = report_for(tmp_path, "agent_trace.jsonl")
    assert "5.98x" not in text and "3.07" not in text and "The paper did not use this trace" in text
    assert out["paper"]["trace"] is None and out["paper"]["effective_capacity_ratio"] == {}


def test_the_synthetic_trace_stands_beside_fig_7_only(tmp_path: Path) -> None:
    text, out = report_for(tmp_path, "synthetic_trace.jsonl")
    assert "1.62x" in text and "Fig. 7" in text and "5.98x" not in text and "3.07" not in text
    assert out["paper"]["trace"] == "synthetic"
    conversation, _ = report_for(tmp_path, "conversation_trace.jsonl.gz")
    assert "5.98x" in conversation and "3.07" in conversation and "Fig. 1" in conversation
