"""The Mooncake experiment: replay the trace's first requests, time-scaled to a sweep of loads, against (a) a colocated
baseline of P+D instances and (b) tsukimi with P prefill + D decode and the Conductor, then tsukimi under each
placement policy at one load. Every run is a fresh `tsukimi up` on loopback, on the sim backend (or the real model,
with the trace scaled down).

It runs and collects; the capacity arithmetic is `capacity.py`, the JSON and markdown are `report.py`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from loadgen.client import ClientOptions, ServerError, resolve_model
from loadgen.metrics import Slo, Summary, summarize
from loadgen.record import RequestRecord
from loadgen.runner import RunOptions, run
from loadgen.trace import TraceOptions, load_trace, read_trace
from loadgen.workload import PlannedRequest
from shared.config import POLICIES as SCHEDULER_POLICIES
from shared.tools.experiment.plan import BASELINE, TSUKIMI, PlannedRun
from shared.tools.experiment.progress import RunsProgress
from shared.tools.experiment.studies import plan_studies
from shared.tools.experiment.system import StartError, SystemSpec, placement_counts, start_system, stop_system
from shared.tools.experiment.virtual import VirtualOutcome, VirtualRun, run_virtual_runs


class ExperimentError(ValueError):
    """The experiment cannot be run as configured; the message says why."""
POLICIES = ("random", "least_loaded", "local_cache_aware", "conductor")
ALL_POLICIES = SCHEDULER_POLICIES  # every policy the scheduler has (the virtual clock compares them all)


@dataclass(frozen=True)
class ExperimentConfig:
    """What to run.

    Attributes:
        num_prefill, num_decode: tsukimi's pools; the baseline has num_prefill + num_decode colocated instances.
        num_requests: the trace's first requests replayed in every run.
        time_scales: the loads of the sweep (arrival times multiplied by each; larger is lighter).
        policy_time_scale: the load at which the policies are compared (one of `time_scales`).
        baseline_route: how the colocated baseline routes (least_loaded or round_robin).
        engine: "sim" (`profile` stands for each instance) or "real" (the default model on this machine's CPU).
        input_scale, output_scale: shrink the trace's lengths, keeping its prefix sharing (for the real model).
        kv_cache_mb: each real engine's KV pool (the sim's comes from its profile's GPU memory).
        clock: "wall" (every run a fresh `tsukimi up` on loopback) or "virtual" (every run one `python -m
            services.virtual` process: the whole cluster on a virtual clock, `parallel` runs at once).
        studies: on the virtual clock, the studies (studies.STUDIES) run after the main sweep.
    """

    trace: Path
    log_dir: Path
    profile: str = "llama3-70b-8xa800"
    engine: str = "sim"
    input_scale: float = 1.0
    output_scale: float = 1.0
    kv_cache_mb: int = 512
    num_prefill: int = 2
    num_decode: int = 2
    num_cache_stores: int = 2
    num_requests: int | None = 50  # None: every request of the trace
    time_scales: tuple[float, ...] = (6.0, 4.0, 2.5)
    policy_time_scale: float = 4.0
    policies: tuple[str, ...] = POLICIES
    baseline_route: str = "least_loaded"
    ttft_slo_ms: float = 30_000.0
    tbt_slos_ms: tuple[float, ...] = (100.0, 200.0, 300.0)
    request_timeout_s: float = 180.0
    seed: int = 0
    clock: str = "wall"  # "wall": real processes in real time; "virtual": services.virtual, nothing sleeps
    parallel: int = 1  # virtual runs at once (each is one process on one core)
    studies: tuple[str, ...] = ()  # virtual clock: the studies beyond the main sweep (studies.STUDIES)

    def slos(self) -> list[Slo]:
        return [Slo(self.ttft_slo_ms, tbt) for tbt in self.tbt_slos_ms]


@dataclass
class RunOutcome:
    """One run: which system, at which load, and what each request got."""

    system: str  # TSUKIMI or BASELINE
    policy: str
    time_scale: float
    rate: float  # offered requests/s
    records: list[RequestRecord] = field(default_factory=list)
    placements: dict[str, int] = field(default_factory=dict)
    error: str | None = None
    wall_s: float = 0.0
    study: str = ""  # see PlannedRun
    variant: str = ""
    load_over_time: dict[str, list[float]] = field(default_factory=dict)  # virtual clock: the pools' load

    _summaries: dict[tuple[Slo, int, int], Summary] = field(default_factory=dict, init=False, repr=False, compare=False)

    def summary(self, slo: Slo) -> Summary:
        """`summarize(records, slo)`, once per SLO: the report, the JSON and the studies all ask (each run's TBTs are
        a sort per request); recomputed if `records` is replaced or grows."""
        key = (slo, id(self.records), len(self.records))
        if key not in self._summaries:
            self._summaries[key] = summarize(self.records, slo)
        return self._summaries[key]

    @property
    def label(self) -> str:
        study = f" [{self.study}: {self.variant}]" if self.study else ""
        return f"{self.system} ({self.policy}) at {self.rate:.2f} req/s{study}"


def plan_runs(config: ExperimentConfig) -> list[PlannedRun]:
    """The sweep for both systems, then each other policy at `policy_time_scale` (conductor's run is shared), then
    on the virtual clock the runs of `config.studies` (studies.py)."""
    runs = []
    for scale in config.time_scales:
        runs += [PlannedRun(BASELINE, config.baseline_route, scale), PlannedRun(TSUKIMI, "conductor", scale)]
    runs += [PlannedRun(TSUKIMI, p, config.policy_time_scale) for p in config.policies if p != "conductor"]
    return runs + (plan_studies(config) if config.clock == "virtual" else [])


def offered_rate(requests: list[PlannedRequest]) -> float:
    """Requests per second of the replay: the count over the span of the arrivals."""
    span = max(r.arrival_s for r in requests) - min(r.arrival_s for r in requests)
    return len(requests) / span if span > 0 else float("inf")


def run_experiment(config: ExperimentConfig, say: Callable[[str], None]) -> list[RunOutcome]:
    """Every planned run in turn; a run whose system does not come up is recorded with its error, and the rest go on.

    Raises:
        TraceError: the trace cannot be read.
        ExperimentError: the replayed requests all arrive at once, so there is no load to sweep.
    """
    runs = plan_runs(config)
    if config.clock == "virtual":
        return _run_virtual(config, runs, say)
    base = load_trace(config.trace, TraceOptions(
        config.num_requests, 1.0, config.input_scale, config.output_scale, seed=config.seed))
    workloads = {scale: [dataclasses.replace(r, arrival_s=r.arrival_s * scale) for r in base]
                 for scale in sorted(set(config.time_scales))}
    if any(offered_rate(requests) == float("inf") for requests in workloads.values()):
        raise ExperimentError(f"the trace's first {config.num_requests} requests all arrive at the same time (the "
                              "trace counts time in 3 s steps): replay more of them (--num-requests)")
    outcomes = []
    for index, planned in enumerate(runs, 1):
        requests = workloads[planned.time_scale]
        outcome = RunOutcome(planned.system, planned.policy, planned.time_scale, offered_rate(requests))
        say(f"[{index}/{len(runs)}] {outcome.label}: {len(requests)} requests")
        _run_one(config, outcome, requests, config.log_dir / f"run-{index:02d}-{planned.system}-{planned.policy}",
                 say)
        outcomes.append(outcome)
    return outcomes


def _run_virtual(config: ExperimentConfig, runs: list[PlannedRun], say: Callable[[str], None]) -> list[RunOutcome]:
    """Every planned run as a `python -m services.virtual` process, `config.parallel` at a time."""
    entries = read_trace(config.trace, config.num_requests)
    span_s = (entries[-1].timestamp_ms - entries[0].timestamp_ms) / 1000.0 if entries else 0.0
    if span_s <= 0:
        raise ExperimentError(f"the trace's first {len(entries)} requests all arrive at the same time (the trace "
                              "counts time in 3 s steps): replay more of them (--num-requests)")
    env = {"TSUKIMI_REJECTION": "off", "TSUKIMI_SLO_TTFT_MS": f"{config.ttft_slo_ms:g}",
           "TSUKIMI_SLO_TBT_MS": f"{max(config.tbt_slos_ms):g}"}
    planned = [_virtual_run(config, run, env, config.log_dir / f"run-{i:02d}-{_run_name(run)}")
               for i, run in enumerate(runs, 1)]
    outcomes = [RunOutcome(run.system, run.policy, run.time_scale, len(entries) / (span_s * run.time_scale),
                           study=run.study, variant=run.variant) for run in runs]
    say(f"{len(runs)} runs of {len(entries)} requests, {config.parallel} at a time")
    progress = RunsProgress([run.progress_path for run in planned], len(entries), say)
    say = progress.say

    def done(index: int, got: VirtualOutcome) -> None:
        outcome = outcomes[index]
        outcome.records, outcome.placements, outcome.error, outcome.wall_s = (
            got.records, got.placements, got.error, got.wall_s)
        outcome.load_over_time = got.load_over_time
        first = outcome.summary(config.slos()[0])
        say(f"[{index + 1}/{len(runs)}] {outcome.label}: " + (outcome.error or (
            f"{got.virtual_s:.0f} s simulated in {got.wall_s:.0f} s; {first.num_completed} completed, "
            f"{first.num_rejected} rejected, {first.num_failed} failed; TTFT mean {_ms(first.ttft.mean_ms)}, "
            f"TBT p90 {_ms(first.tbt.p90_ms)}")))

    progress.start()
    try:
        run_virtual_runs(planned, config.parallel, done, progress)
    finally:
        progress.stop()
    return outcomes


def _virtual_run(config: ExperimentConfig, run: PlannedRun, env: dict[str, str], log_dir: Path) -> VirtualRun:
    prefill, decode = run.pools or (config.num_prefill, config.num_decode)
    colocated = run.system == BASELINE
    return VirtualRun(
        config.trace, config.num_requests, run.time_scale, config.profile, prefill, decode,
        prefill + decode if colocated else config.num_cache_stores, prefill + decode if colocated else 0,
        env | {"TSUKIMI_POLICY": run.policy} | dict(run.env), log_dir, run.max_output_tokens,
    )


def _run_name(run: PlannedRun) -> str:
    return f"{run.system}-{run.policy}" + (f"-{run.study}-{run.variant}" if run.study else "")


def _spec(config: ExperimentConfig, outcome: RunOutcome) -> SystemSpec:
    profile = config.profile if config.engine == "sim" else None
    common = dict(policy=outcome.policy, num_cache_stores=config.num_cache_stores, engine=config.engine,
                  profile=profile, rejection="off", slo_ttft_ms=config.ttft_slo_ms, slo_tbt_ms=max(config.tbt_slos_ms),
                  kv_cache_mb=config.kv_cache_mb)
    if outcome.system == BASELINE:
        return SystemSpec(colocated=config.num_prefill + config.num_decode, **common)  # type: ignore[arg-type]
    return SystemSpec(num_prefill=config.num_prefill, num_decode=config.num_decode, **common)  # type: ignore[arg-type]


def _run_one(config: ExperimentConfig, outcome: RunOutcome, requests: list[PlannedRequest], log_dir: Path,
             say: Callable[[str], None]) -> None:
    started = time.monotonic()
    try:
        system = start_system(_spec(config, outcome), log_dir, say)
    except StartError as exc:
        outcome.error = f"did not come up: {exc}"
        say(f"  {outcome.error}")
        return
    try:
        outcome.records = asyncio.run(_replay(system.base_url, requests, config))
    except ServerError as exc:
        outcome.error = f"the run broke off: {exc}"
        say(f"  {outcome.error}")
    finally:
        code, took = stop_system(system)
        outcome.wall_s = time.monotonic() - started
    outcome.placements = placement_counts(log_dir)
    first = outcome.summary(config.slos()[0])
    say(f"  done in {outcome.wall_s:.0f} s (stop {took:.1f} s, exit {code}): {first.num_completed} completed, "
        f"{first.num_failed} failed; TTFT mean {_ms(first.ttft.mean_ms)}, TBT p90 {_ms(first.tbt.p90_ms)}")


async def _replay(base_url: str, requests: list[PlannedRequest], config: ExperimentConfig) -> list[RequestRecord]:
    model = await resolve_model(base_url, None)
    options = RunOptions(ClientOptions(base_url, model, request_timeout_s=config.request_timeout_s),
                         show_progress=sys.stderr.isatty())
    result = await run(requests, options)
    return result.records


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f} ms"
