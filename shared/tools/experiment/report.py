"""The Mooncake experiment's markdown report and figures: results beside the paper's, labelled as simulation."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from loadgen.metrics import Slo, Summary
from shared.tools.experiment.capacity import THRESHOLD
from shared.tools.experiment.mooncake import BASELINE, TSUKIMI, RunOutcome
from shared.tools.experiment.results import PAPER_AVG_TTFT_S, PAPER_CAPACITY_RATIO, Results


def write_report(results: Results, folder: Path, command: str, took_s: float) -> Path:
    """report.md and its PNGs in `folder` (created); returns the report's path."""
    folder.mkdir(parents=True, exist_ok=True)
    figures = _figures(results, folder)
    lines = _intro(results, command, took_s) + _capacity_section(results, figures) + _policy_section(results, figures)
    lines += _runs_section(results) + _notes(results)
    path = folder / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _intro(results: Results, command: str, took_s: float) -> list[str]:
    c = results.config
    if c.clock == "virtual":
        title, what = "# The Mooncake experiment, simulated on a virtual clock", (
            f"**Simulation on a virtual clock.** No model ran and nothing slept: every run was the whole cluster in "
            "one process (`python -m services.virtual`: the real scheduler, prefill, decode and cache-store service "
            "classes and the gateway's request sessions over an in-process NATS and a modelled network, 4 x 200 "
            f"Gbps per node), each engine step taking the time a roofline model of `{c.profile}` predicts "
            "(shared/sim/profiles.py, shared/sim/cost.py). What differs from a deployment: "
            "docs/experiments/virtual-clock.md. The paper measured (and partly simulated) real hardware; these "
            "figures show what the same scheduling does under a cost model.")
    elif c.engine == "sim":
        title, what = "# The Mooncake experiment, simulated", (
            f"**Simulation.** No model ran. Every engine step slept for the time a roofline model of `{c.profile}` "
            "predicts (shared/sim/profiles.py, shared/sim/cost.py); the gateway, NATS, the scheduler and the "
            "cache-store were the real services, and KV moved as sizes only. The paper measured real hardware; these "
            "figures show what the same scheduling does under a cost model, not what a cluster would measure.")
    else:
        title, what = "# The Mooncake experiment on the real model", (
            "**The real model on this machine's CPU** (SmolLM2-135M; every instance shares the same cores), with the "
            f"trace scaled down: input x{c.input_scale:g} (prefix sharing kept), output x{c.output_scale:g}. The "
            "shape of the comparison, not the paper's hardware.")
    return [
        title,
        "",
        what,
        "",
        f"- Trace: the first {c.num_requests} requests of `{c.trace.name}`, arrival times multiplied by "
        f"{', '.join(f'{s:g}' for s in c.time_scales)} (larger is lighter).",
        f"- tsukimi: {c.num_prefill} prefill + {c.num_decode} decode instances, the Conductor, "
        f"{c.num_cache_stores} cache-store shards; baseline: {c.num_prefill + c.num_decode} colocated instances "
        f"(chunked prefill, own prefix cache, {c.baseline_route} routing), the vLLM-style deployment the paper "
        "compares with. " + ("Each instance stands for one 8-GPU node. " if c.engine == "sim" else "")
        + "Early rejection off.",
        f"- SLOs: TTFT {c.ttft_slo_ms / 1000:g} s; TBT (mean of a request's slowest 10% token gaps) "
        f"{', '.join(f'{t:g}' for t in c.tbt_slos_ms)} ms.",
        f"- Reproduce: `{command}` ({took_s / 60:.1f} minutes here).",
        "",
    ]


def _capacity_section(results: Results, figures: dict[str, str]) -> list[str]:
    lines = ["## Effective request capacity", "",
             "The share of requests meeting both SLOs (rejected and failed count as missing them) at each load; the "
             "capacity is the load at which it falls to 90%, interpolated between the swept loads (`>=`: never fell; "
             "`<`: below 90% already at the lightest load).", "",
             "| TBT SLO | baseline (req/s) | tsukimi (req/s) | tsukimi / baseline | paper (Mooncake / vLLM) |",
             "|---|---|---|---|---|"]
    for key in (f"{t:g}" for t in results.config.tbt_slos_ms):
        base, ours = results.capacities.get(BASELINE, {}).get(key), results.capacities.get(TSUKIMI, {}).get(key)
        ratio = results.ratios.get(key)
        paper = PAPER_CAPACITY_RATIO.get(key)
        lines.append(f"| {key} ms | {base or 'n/a'} | {ours or 'n/a'} | {ratio or 'n/a'} | "
                     f"{f'{paper:.2f}x' if paper else 'n/a'} |")
    lines += ["", "Share meeting the SLOs at each load (%):", "",
              "| system | TBT SLO | " + " | ".join(f"{rate:.2f} req/s" for rate, _ in _first_points(results)) + " |",
              "|---|---|" + "---|" * len(_first_points(results))]
    for system in (BASELINE, TSUKIMI):
        for key, points in results.shares.get(system, {}).items():
            lines.append(f"| {system} | {key} ms | " + " | ".join(f"{100 * share:.0f}" for _, share in points) + " |")
    lines += ["", *[f"![{name}]({file})" for name, file in figures.items() if name.startswith("capacity")], ""]
    return lines


def _first_points(results: Results) -> list[tuple[float, float]]:
    for by_slo in results.shares.values():
        for points in by_slo.values():
            return points
    return []


def _policy_section(results: Results, figures: dict[str, str]) -> list[str]:
    lines = ["## Average TTFT by placement policy", "",
             f"tsukimi at time scale {results.config.policy_time_scale:g}, one fresh system per policy.", "",
             "| policy | average TTFT (s) | cache hit rate | paper (s) |", "|---|---|---|---|"]
    for run in results.runs:
        if run.system == TSUKIMI and run.time_scale == results.config.policy_time_scale:
            ttft, hit = results.avg_ttft_s.get(run.policy), results.cache_hit_rates.get(run.label)
            lines.append(f"| {run.policy} | {_num(ttft, '{:.2f}')} | {_num(hit, '{:.1%}')} | "
                         f"{_num(PAPER_AVG_TTFT_S.get(run.policy), '{:.2f}')} |")
    return lines + ["", *[f"![{n}]({f})" for n, f in figures.items() if n.startswith("ttft")], ""]


def _runs_section(results: Results) -> list[str]:
    slo = results.config.slos()[0]
    lines = ["## Every run", "", f"Latencies of completed requests; SLO share at TBT {slo.tbt_ms:g} ms.", "",
             "| run | sent | completed | failed | TTFT mean (s) | TTFT p90 (s) | TBT p50 (ms) | TBT p90 (ms) | "
             "share meeting SLOs | cache hit | wall (s) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in results.runs:
        s = run.summary(slo)
        lines.append(
            f"| {run.label}{' (' + run.error + ')' if run.error else ''} | {s.num_sent} | {s.num_completed} | "
            f"{s.num_failed} | {_num(_s(s.ttft.mean_ms), '{:.2f}')} | {_num(_s(s.ttft.p90_ms), '{:.2f}')} | "
            f"{_num(s.tbt.median_ms, '{:.0f}')} | {_num(s.tbt.p90_ms, '{:.0f}')} | "
            f"{_num(s.effective_capacity, '{:.0%}')} | {_num(s.cache_hit_rate, '{:.1%}')} | {run.wall_s:.0f} |")
    return lines + [""]


def _notes(results: Results) -> list[str]:
    if results.config.engine != "sim":
        return ["## How this differs from the paper", "",
                "- A 135M-parameter model on 2 shared CPU cores: every instance competes for the same cores, so a "
                "disaggregated pool does not get hardware of its own as the paper's nodes did; prefill and decode "
                "interfere through the CPU even when they run in different processes.",
                "- The trace is scaled down (shorter prompts and answers) and its first requests share few prefixes.",
                ""]
    return ["## How this differs from the paper", "",
            "- Scale: the paper replayed the whole conversation trace (about an hour, 37% of prompt blocks reusable "
            "with an unlimited cache) on 16 nodes; this replays its first requests on a handful of simulated nodes, "
            "where far fewer prefixes repeat, so cache-aware placement has less to win.",
            "- Step times come from a roofline with assumed efficiencies, not from measured kernels; transfers between "
            "nodes (KV to decode, prefixes from the store) take what NATS takes on loopback for size-only messages, "
            "not RDMA time.",
            "- The host: every service shares 2 CPU cores, so the measured TBT includes this machine's own delays "
            "(a few ms a token) on top of the simulated step.", ""]


def _figures(results: Results, folder: Path) -> dict[str, str]:
    from loadgen.plots import plot_slo_attainment

    figures = {}
    for slo in results.config.slos():
        series = {name: _series(results.runs, name, results.config.baseline_route, slo)
                  for name in (BASELINE, TSUKIMI)}
        file = f"capacity_tbt{slo.tbt_ms:g}ms.png"
        kind = "simulation" if results.config.engine == "sim" else "real model, CPU"
        title = f"SLOs: TTFT {(slo.ttft_ms or 0) / 1000:g} s, TBT {slo.tbt_ms:g} ms ({kind})"
        plot_slo_attainment(series, folder / file, title=title, threshold=THRESHOLD)
        figures[f"capacity at TBT {slo.tbt_ms:g} ms"] = file
    figures["ttft by policy"] = _plot_ttft_by_policy(results, folder / "ttft_by_policy.png")
    return figures


def _series(runs: Sequence[RunOutcome], system: str, route: str, slo: Slo) -> list[tuple[float, Summary]]:
    policy = "conductor" if system == TSUKIMI else route
    chosen = [r for r in runs if r.system == system and r.policy == policy and r.error is None]
    return sorted(((r.rate, r.summary(slo)) for r in chosen), key=lambda p: p[0])


def _plot_ttft_by_policy(results: Results, path: Path) -> str:
    from matplotlib.figure import Figure

    policies = [p for p in results.avg_ttft_s if results.avg_ttft_s[p] is not None]
    fig = Figure(figsize=(6, 3.5), layout="constrained")
    ax = fig.subplots()
    xs = range(len(policies))
    label = "tsukimi (simulated)" if results.config.engine == "sim" else "tsukimi (real model, CPU)"
    ax.bar([x - 0.2 for x in xs], [results.avg_ttft_s[p] or 0.0 for p in policies], 0.4, label=label)
    ax.bar([x + 0.2 for x in xs], [PAPER_AVG_TTFT_S.get(p, 0.0) for p in policies], 0.4, label="paper")
    ax.set_xticks(list(xs), policies)
    ax.set(ylabel="average TTFT (s)", title="Average TTFT by placement policy")
    ax.legend()
    fig.savefig(path, dpi=120)
    return path.name


def _s(ms: float | None) -> float | None:
    return None if ms is None else ms / 1000


def _num(value: float | None, fmt: str) -> str:
    return "n/a" if value is None else fmt.format(value)


