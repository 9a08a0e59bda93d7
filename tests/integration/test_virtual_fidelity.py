"""The virtual clock against the real processes (issue 20's fidelity check, at small scale): the same trace window
replayed against `tsukimi up --engine sim` (every service a process, NATS, HTTP, steps that sleep) and against
`python -m services.virtual` (the same service classes in one process, nothing sleeping) gives per-request TTFT
p50/p90 within 10% (overloaded: TTFT's mean, p90 and distribution, see `KS_C_ALPHA_5`), per-request TBT p50/p90
within 10% (see `delivery_allowance`), the share meeting each SLO within 3 points, and, overloaded with
prediction-based early rejection, the number of rejections within 10%.

Both runs replay the window with each 3 s step's simultaneous arrivals spread evenly over the step
(`loadgen.trace.write_spread` says why): a property of the trace, not of either system."""

from __future__ import annotations

import bisect
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from loadgen.metrics import Slo, itls_s, percentile, summarize, tbt_s, ttft_s
from loadgen.record import RequestRecord
from loadgen.trace import BUNDLED_TRACE, read_trace, write_spread
from shared.tools.experiment.system import SystemSpec, start_system, stop_system

REPO = Path(__file__).resolve().parents[2]
PROFILE = "llama3-70b-8xa800"
# Overloaded, with prediction-based rejection, many predictions land within a few percent of the TTFT SLO, so the
# host's timing flips some decisions and the queue behind them: four wall-clock runs of the same code gave TTFT p50s
# of 7.46-8.10 s (virtual: 7.49 s), and three of them 30-32 rejections (virtual: 31). The median alone would test the
# host; there the check is the mean and p90 within 10% and a two-sample Kolmogorov-Smirnov test (distance 0.12-0.17
# measured in those three) at 5%.
KS_C_ALPHA_5 = 1.358
SLOS = [Slo(30_000, tbt) for tbt in (100.0, 200.0, 300.0)]  # the paper's


def spread_trace(num_requests: int, out: Path) -> Path:
    return write_spread(read_trace(BUNDLED_TRACE, max_requests=num_requests), out)


def wall_run(trace: Path, num: int, time_scale: float, rejection: str,
             tmp: Path) -> tuple[list[RequestRecord], list[float]]:
    spec = SystemSpec("conductor", num_prefill=1, num_decode=1, num_cache_stores=1, engine="sim", profile=PROFILE,
                      rejection=rejection, startup_timeout_s=120)
    system = start_system(spec, tmp / f"wall-{rejection}", print)
    out = tmp / f"wall-{rejection}.json"
    try:  # the client in a process of its own, as a real one: this one's heap (every test before) pauses its GC
        code = subprocess.run([sys.executable, "-m", "loadgen", "--url", system.base_url, "--trace", str(trace),
                               "--max-requests", str(num), "--time-scale", str(time_scale), "--json", str(out),
                               "--quiet"], cwd=REPO, timeout=600).returncode
    finally:
        stop_system(system)
    assert code == 0
    records = [RequestRecord(**r) for r in json.loads(out.read_text())["requests"]]
    return records, decode_tbts(sorted((tmp / f"wall-{rejection}").glob("decode-*.log")))


def virtual_run(trace: Path, num: int, time_scale: float, rejection: str,
                tmp: Path) -> tuple[list[RequestRecord], list[float]]:
    out, log_file = tmp / f"virtual-{rejection}.json", tmp / f"virtual-{rejection}.log"
    subprocess.run([sys.executable, "-m", "services.virtual", "--trace", str(trace), "--num-requests", str(num),
                    "--time-scale", str(time_scale), "--prefill", "1", "--decode", "1", "--profile", PROFILE,
                    "--env", f"TSUKIMI_REJECTION={rejection}", "--json", str(out), "--log-file", str(log_file),
                    "--quiet"], cwd=REPO, check=True, timeout=300)
    return [RequestRecord(**r) for r in json.loads(out.read_text())["records"]], decode_tbts([log_file])


def figures(records: list[RequestRecord]) -> dict[str, float]:
    ttft = ttfts(records)
    tbts = [tbt_s(itls_s(r)) for r in records if r.is_completed and len(r.chunk_times_s) > 1]
    return {"ttft_p50": percentile(ttft, 50), "ttft_p90": percentile(ttft, 90), **tbt_figures(tbts)}


def decode_tbts(logs: list[Path]) -> list[float]:
    """Each request's TBT as its decode instance published its tokens (the `decoded` log lines), in seconds."""
    tbts = []
    for path in logs:
        for line in path.read_text().splitlines():
            if '"decoded"' in line and (tbt_ms := json.loads(line).get("tbt_ms")) is not None:
                tbts.append(tbt_ms / 1000.0)
    return tbts


def tbt_figures(tbts: list[float]) -> dict[str, float]:
    return {"tbt_p50": percentile(tbts, 50), "tbt_p90": percentile(tbts, 90)}


def delivery_allowance(client: dict[str, float], at_decode: dict[str, float], name: str) -> float:
    """What the real processes' own host added to a TBT figure between decode and the client (NATS, the gateway,
    HTTP and the client's process, on two shared cores), which the virtual clock, with no CPU time, does not model.
    It grows with whatever else runs on the machine (two busy processes beside the run put the client's TBT
    19-21% above the virtual clock's, CI once 38%), so the client's figures may differ by 10% plus it, and the
    figures at decode are held to 10% alone."""
    return max(0.0, client[name] - at_decode[name])


def ks_distance(a: list[float], b: list[float]) -> float:
    """The largest gap between the two samples' empirical distribution functions."""
    a, b = sorted(a), sorted(b)
    return max(abs(bisect.bisect_right(a, x) / len(a) - bisect.bisect_right(b, x) / len(b)) for x in a + b)


def ttfts(records: list[RequestRecord]) -> list[float]:
    return [t for r in records if (t := ttft_s(r)) is not None]


def shares(records: list[RequestRecord]) -> list[float]:
    return [summarize(records, slo).num_meeting_slo / len(records) for slo in SLOS]


@pytest.mark.parametrize(("num", "time_scale", "rejection"), [(40, 6.0, "off"), (120, 2.0, "predicted")],
                         ids=["moderate-load", "overloaded-with-early-rejection"])
def test_the_virtual_clock_agrees_with_the_real_processes(num: int, time_scale: float, rejection: str,
                                                          tmp_path: Path) -> None:
    trace = spread_trace(num, tmp_path / "spread.jsonl")
    wall, wall_at_decode = wall_run(trace, num, time_scale, rejection, tmp_path)
    virtual, virtual_at_decode = virtual_run(trace, num, time_scale, rejection, tmp_path)
    assert len(wall) == len(virtual) == num
    assert sum(r.is_failed for r in wall) == sum(r.is_failed for r in virtual) == 0
    for records, at_decode in ((wall, wall_at_decode), (virtual, virtual_at_decode)):  # one TBT a decoded request
        assert len(at_decode) == sum(r.is_completed and len(r.chunk_times_s) > 1 for r in records)
    got, want = figures(virtual), figures(wall)
    got_at_decode, want_at_decode = tbt_figures(virtual_at_decode), tbt_figures(wall_at_decode)
    print(f"wall {want}\nvirtual {got}\nat decode: wall {want_at_decode} virtual {got_at_decode}\n"
          f"shares {shares(wall)} {shares(virtual)}")
    if rejection == "off":
        for name in ("ttft_p50", "ttft_p90"):
            assert got[name] == pytest.approx(want[name], rel=0.10), name
    else:  # see KS_C_ALPHA_5
        wall_ttfts, virtual_ttfts = ttfts(wall), ttfts(virtual)
        assert np.mean(virtual_ttfts) == pytest.approx(np.mean(wall_ttfts), rel=0.10)
        assert got["ttft_p90"] == pytest.approx(want["ttft_p90"], rel=0.10)
        critical = KS_C_ALPHA_5 * math.sqrt(1 / len(wall_ttfts) + 1 / len(virtual_ttfts))
        assert ks_distance(wall_ttfts, virtual_ttfts) < critical
    for name in ("tbt_p50", "tbt_p90"):
        assert got_at_decode[name] == pytest.approx(want_at_decode[name], rel=0.10), f"{name} at decode"
        allowance = delivery_allowance(want, want_at_decode, name)
        assert abs(got[name] - want[name]) <= 0.10 * want[name] + allowance, name
    for wall_share, virtual_share in zip(shares(wall), shares(virtual), strict=True):
        assert virtual_share == pytest.approx(wall_share, abs=0.03)
    num_rejected = sum(r.is_rejected for r in wall), sum(r.is_rejected for r in virtual)
    if rejection == "off":
        assert num_rejected == (0, 0)
    else:
        assert num_rejected[0] > 0 and num_rejected[1] == pytest.approx(num_rejected[0], rel=0.10, abs=1)
