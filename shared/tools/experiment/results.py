"""The Mooncake experiment's figures from its runs: per system and TBT SLO the share meeting the SLOs at each load and
the capacity; the capacity ratios; the average TTFT per policy; cache hit rates; and the paper's figures beside them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from loadgen.metrics import Summary, ttft_s
from shared.tools.experiment.capacity import Capacity, Ratio, capacity, capacity_ratio
from shared.tools.experiment.mooncake import ExperimentConfig, RunOutcome
from shared.tools.experiment.paper import PaperFigures, paper_figures
from shared.tools.experiment.plan import BASELINE, TSUKIMI
from shared.tools.experiment.studies import study_figures


@dataclass
class Results:
    """Everything the report and the JSON show."""

    config: ExperimentConfig
    runs: list[RunOutcome]
    shares: dict[str, dict[str, list[tuple[float, float]]]] = field(default_factory=dict)  # system -> slo -> points
    capacities: dict[str, dict[str, Capacity]] = field(default_factory=dict)  # system -> slo -> capacity
    ratios: dict[str, Ratio] = field(default_factory=dict)  # slo -> tsukimi / baseline
    avg_ttft_s: dict[str, float | None] = field(default_factory=dict)  # policy -> seconds
    cache_hit_rates: dict[str, float | None] = field(default_factory=dict)  # run label -> share
    studies: dict[str, Any] = field(default_factory=dict)  # the studies' JSON keys (studies.study_figures)
    paper: PaperFigures = field(init=False)  # the paper's figures for this trace

    def __post_init__(self) -> None:
        self.paper = paper_figures(self.config.trace)


def compute(config: ExperimentConfig, runs: list[RunOutcome]) -> Results:
    results = Results(config, runs)
    for slo in config.slos():
        key = f"{slo.tbt_ms:g}"
        for system in (BASELINE, TSUKIMI):
            sweep = [r for r in runs if r.system == system and _is_sweep_run(r, config) and r.error is None]
            points = [(r.rate, r.summary(slo).effective_capacity or 0.0) for r in sweep]
            results.shares.setdefault(system, {})[key] = sorted(points)
            if points:
                results.capacities.setdefault(system, {})[key] = capacity(points)
        if key in results.capacities.get(TSUKIMI, {}) and key in results.capacities.get(BASELINE, {}):
            results.ratios[key] = capacity_ratio(results.capacities[TSUKIMI][key], results.capacities[BASELINE][key])
    for run in runs:
        if run.system == TSUKIMI and run.time_scale == config.policy_time_scale and not run.study:
            results.avg_ttft_s[run.policy] = _mean_ttft_s(run)
        results.cache_hit_rates[run.label] = run.summary(config.slos()[0]).cache_hit_rate
    results.studies = study_figures(config, runs)
    return results


def _is_sweep_run(run: RunOutcome, config: ExperimentConfig) -> bool:
    return not run.study and run.policy == ("conductor" if run.system == TSUKIMI else config.baseline_route)


def _mean_ttft_s(run: RunOutcome) -> float | None:
    values = [t for r in run.records if r.error is None and (t := ttft_s(r)) is not None]
    return sum(values) / len(values) if values else None


def to_json(results: Results, wall_s: float | None = None) -> dict[str, Any]:
    """One object: `effective_capacity_ratio` (TBT SLO ms as a string -> tsukimi / baseline capacity) with its bounds,
    `avg_ttft_s_by_policy`, the capacities, the shares, every run's summaries, and the paper's figures; `clock`,
    `num_requests` (per run), `num_nodes` (each system's) and `wall_s` (the whole experiment)."""
    config = results.config
    return {
        "simulation": config.engine == "sim",
        "clock": config.clock,
        "num_requests": max((len(run.records) for run in results.runs), default=0),
        "num_nodes": config.num_prefill + config.num_decode,
        "wall_s": None if wall_s is None else round(wall_s, 1),
        "profile": config.profile if config.engine == "sim" else None,
        "effective_capacity_ratio": {k: r.value for k, r in results.ratios.items()},
        "effective_capacity_ratio_bound": {k: r.bound for k, r in results.ratios.items()},
        "avg_ttft_s_by_policy": results.avg_ttft_s,
        "capacity_req_s": {s: {k: {"rate": c.rate, "bound": c.bound} for k, c in caps.items()}
                           for s, caps in results.capacities.items()},
        "share_meeting_slos": {s: {k: [list(p) for p in pts] for k, pts in by_slo.items()}
                               for s, by_slo in results.shares.items()},
        "cache_hit_rate": results.cache_hit_rates,
        **results.studies,
        "paper": results.paper.json(),
        "config": {k: (str(v) if k in ("trace", "log_dir") else v) for k, v in vars(config).items()},
        "runs": [_run_json(run, results) for run in results.runs],
    }


def _run_json(run: RunOutcome, results: Results) -> dict[str, Any]:
    summaries: dict[str, Summary] = {f"{slo.tbt_ms:g}": run.summary(slo) for slo in results.config.slos()}
    return {"system": run.system, "policy": run.policy, "time_scale": run.time_scale, "rate": run.rate,
            "study": run.study, "variant": run.variant,
            "error": run.error, "wall_s": run.wall_s, "placements": run.placements,
            "summary_by_tbt_slo_ms": {k: s.to_dict() for k, s in summaries.items()}}
