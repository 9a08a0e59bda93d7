"""The Mooncake experiment's markdown report and figures: results beside the paper's, labelled as simulation."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from loadgen.metrics import Slo, Summary
from shared.tools.experiment.capacity import THRESHOLD
from shared.tools.experiment.mooncake import RunOutcome
from shared.tools.experiment.paper import CONVERSATION
from shared.tools.experiment.plan import BASELINE, TSUKIMI
from shared.tools.experiment.results import Results


def write_report(results: Results, folder: Path, command: str, took_s: float) -> Path:
    """report.md and its PNGs in `folder` (created); returns the report's path."""
    folder.mkdir(parents=True, exist_ok=True)
    figures = _figures(results, folder)
    lines = _intro(results, command, took_s) + _capacity_section(results, figures) + _policy_section(results, figures)
    lines += _studies_section(results, figures) + _runs_section(results) + _notes(results)
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
        f"- Trace: {_replayed(results)} of `{c.trace.name}`, arrival times multiplied by "
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
    paper = results.paper
    lines = ["## Effective request capacity", "",
             "The share of requests meeting both SLOs (rejected and failed count as missing them) at each load; the "
             "capacity is the load at which it falls to 90%, interpolated between the swept loads (`>=`: never fell; "
             "`<`: below 90% already at the lightest load).", "",
             "| TBT SLO | baseline (req/s) | tsukimi (req/s) | tsukimi / baseline | "
             f"paper (Mooncake / vLLM{', ' + paper.capacity_source if paper.capacity_source else ''}) |",
             "|---|---|---|---|---|"]
    for key in (f"{t:g}" for t in results.config.tbt_slos_ms):
        base, ours = results.capacities.get(BASELINE, {}).get(key), results.capacities.get(TSUKIMI, {}).get(key)
        ratio = results.ratios.get(key)
        paper_ratio = paper.capacity_ratio.get(key)
        lines.append(f"| {key} ms | {base or 'n/a'} | {ours or 'n/a'} | {ratio or 'n/a'} | "
                     f"{f'{paper_ratio:.2f}x' if paper_ratio else 'n/a'} |")
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
    paper = results.paper
    lines = ["## Average TTFT by placement policy", "",
             f"tsukimi at time scale {results.config.policy_time_scale:g}, one fresh system per policy.", "",
             "| policy | average TTFT (s) | cache hit rate | paper (s) |", "|---|---|---|---|"]
    for run in results.runs:
        if run.system == TSUKIMI and run.time_scale == results.config.policy_time_scale and not run.study:
            ttft, hit = results.avg_ttft_s.get(run.policy), results.cache_hit_rates.get(run.label)
            lines.append(f"| {run.policy} | {_num(ttft, '{:.2f}')} | {_num(hit, '{:.1%}')} | "
                         f"{_num(paper.avg_ttft_s.get(run.policy), '{:.2f}')} |")
    return lines + ["", *[f"![{n}]({f})" for n, f in figures.items() if n.startswith("ttft")], ""]


def _studies_section(results: Results, figures: dict[str, str]) -> list[str]:
    """The studies beyond the main sweep (studies.py), each beside the paper's figure where it has one."""
    st, lines, paper = results.studies, [], results.paper
    loosest = f"{max(results.config.tbt_slos_ms):g}"  # the tables count requests meeting the loosest TBT SLO
    if "effective_capacity_ratio_by_baseline" in st:
        keys = [f"{t:g}" for t in results.config.tbt_slos_ms]
        lines += ["## Capacity against each colocated baseline", "",
                  "tsukimi's capacity (main sweep) over each baseline's, by TBT SLO; `>=`/`<=`: a bound (a sweep never "
                  "reached 90% or never fell below it).", "",
                  "| baseline | " + " | ".join(f"TBT {k} ms" for k in keys) + " |", "|---|" + "---|" * len(keys)]
        for name, got in st["effective_capacity_ratio_by_baseline"].items():
            cells = [f"{_bound(got['bound'].get(k, '='))}{_num(got['ratio'].get(k), '{:.2f}x')}" for k in keys]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    if "hit_rate_by_capacity" in st:
        lines += ["## Cache hit rate against pool capacity", "",
                  "tsukimi at the policy comparison's load; the pool's capacity in tokens of bf16 KV over every shard.",
                  "", "| pool (tokens) | hit rate |", "|---|---|"]
        lines += [f"| {int(k):,} | {_num(v, '{:.1%}')} |" for k, v in st["hit_rate_by_capacity"].items()]
        g, loc = st.get("hit_rate_global"), st.get("hit_rate_local")
        ratio = f"{g / loc:.2f}x" if g and loc else "n/a"
        lines += ["", "Global pool against local caches (10 prefill + 6 decode nodes, outputs of one token): global "
                  f"{_num(g, '{:.1%}')} (a 30M-token pool), local {_num(loc, '{:.1%}')} (no pool; each prefill node's "
                  f"own 3M-token cache): **{ratio}** (paper: {_num(paper.hit_rate_global_over_local, '{:.2f}x')}).", "",
                  *[f"![{n}]({f})" for n, f in figures.items() if n.startswith("hit rate")], ""]
    if "pd_sweep" in st:
        lines += ["## P/D split of 16 nodes", "", "| split | average TTFT (s) | TBT p90 (ms) | completed | meeting "
                  f"TBT {loosest} ms |", "|---|---|---|---|---|"]
        for name, got in st["pd_sweep"].items():
            lines.append(f"| {name} | {_num(got['avg_ttft_s'], '{:.2f}')} | {_num(got['tbt_p90_ms'], '{:.0f}')} | "
                         f"{got['completed']} | {got['meeting_slos'][loosest]} |")
        lines += ["", "Paper (Fig. 15): the best split near 1:1.", ""]
    if "rejections" in st:
        lines += ["## Early rejection at twice the trace's rate", "",
                  "| rejection | rejected | completed | meeting the SLOs | paper's rejected (arXiv Table 3) |",
                  "|---|---|---|---|---|"]
        for mode, got in st["rejections"].items():
            lines.append(f"| {mode} | {got['rejected']} | {got['completed']} | {got['meeting_slos'][loosest]} | "
                         f"{paper.rejections.get(mode, 'n/a')} |")
        lines += ["", *[f"![{n}]({f})" for n, f in figures.items() if n.startswith("load")], ""]
    if "kv_codec" in st:
        kv = st["kv_codec"]
        lines += [f"## The pool and every transfer at {kv['codec']}'s bytes", "",
                  f"{kv['codec']} blocks are {kv['bytes_ratio']:.2f}x smaller than bf16 (from the codec's section "
                  f"sizes); a pool of {kv['pool_tokens_bf16']:,} bf16 tokens holds that many times more.", "",
                  "| | hit rate | " + " | ".join(f"capacity at TBT {k} ms" for k in kv["capacity_ratio"]) + " |",
                  "|---|---|" + "---|" * len(kv["capacity_ratio"])]
        for codec, caps in kv["capacity_req_s"].items():
            bounds = kv["capacity_bound"][codec]
            lines.append(f"| {codec} | {_num(kv['hit_rate'].get(codec), '{:.1%}')} | " + " | ".join(
                f"{_bound(bounds[k])}{caps[k]:.3f} req/s" for k in kv["capacity_ratio"]) + " |")
        lines += ["| ratio | | " + " | ".join(f"{_bound(kv['capacity_ratio_bound'][k])}{v:.2f}x"
                                            for k, v in kv["capacity_ratio"].items()) + " |",
                  "", "`>=`, `<`: the sweep never left, or never reached, 90% meeting the SLOs; `?`: both "
                  "systems censored alike, no ratio.", ""]
    return lines


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
    if results.config.clock == "virtual":
        paper = results.paper
        if paper is not CONVERSATION:
            scale = (f"- The paper reported only its effective request capacity on its {paper.trace} trace "
                     f"({paper.capacity_source}); the other tables have no paper figure beside them." if paper.trace
                     else "- The paper did not use this trace: no paper figure stands beside these, which compare "
                     "tsukimi with its colocated baseline only.")
        elif results.config.num_requests is None:
            scale = "- Scale: the paper's, the whole conversation trace."
        else:
            scale = ("- Scale: the paper replayed the whole conversation trace (12,031 requests over about an hour, "
                     f"37% of prompt blocks reusable with an unlimited cache); these runs replay {_replayed(results)}, "
                     "where fewer prefixes repeat, so caching has less to win.")
        return ["## How this differs from the paper", "", scale,
                "- Step times come from a roofline with assumed efficiencies (shared/sim/profiles.py), not measured "
                "kernels; transfers take their bytes' time on modelled 4 x 200 Gbps interfaces; the services' own CPU "
                "time is not simulated (docs/experiments/virtual-clock.md).",
                "- The colocated baselines are this engine (continuous batching, its own prefix cache in GPU memory, "
                "no pool) configured as vLLM is, not vLLM itself.", ""]
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
    if results.studies.get("load_over_time"):
        figures["load over time"] = _plot_load_over_time(results.studies["load_over_time"],
                                                         folder / "load_over_time.png")
    if results.studies.get("hit_rate_by_capacity"):
        figures["hit rate by pool capacity"] = _plot_hit_rate(results.studies["hit_rate_by_capacity"],
                                                              folder / "hit_rate_by_capacity.png")
    return figures


def _series(runs: Sequence[RunOutcome], system: str, route: str, slo: Slo) -> list[tuple[float, Summary]]:
    policy = "conductor" if system == TSUKIMI else route
    chosen = [r for r in runs if r.system == system and r.policy == policy and r.error is None and not r.study]
    return sorted(((r.rate, r.summary(slo)) for r in chosen), key=lambda p: p[0])


def _plot_ttft_by_policy(results: Results, path: Path) -> str:
    from matplotlib.figure import Figure

    policies = [p for p in results.avg_ttft_s if results.avg_ttft_s[p] is not None]
    fig = Figure(figsize=(6, 3.5), layout="constrained")
    ax = fig.subplots()
    xs = range(len(policies))
    label = "tsukimi (simulated)" if results.config.engine == "sim" else "tsukimi (real model, CPU)"
    ax.bar([x - 0.2 for x in xs], [results.avg_ttft_s[p] or 0.0 for p in policies], 0.4, label=label)
    paper = results.paper.avg_ttft_s
    if paper:
        ax.bar([x + 0.2 for x in xs], [paper.get(p, 0.0) for p in policies], 0.4, label="paper")
    ax.set_xticks(list(xs), policies)
    ax.set(ylabel="average TTFT (s)", title="Average TTFT by placement policy")
    ax.legend()
    fig.savefig(path, dpi=120)
    return path.name


def _plot_load_over_time(series_by_mode: dict[str, dict[str, list[float]]], path: Path) -> str:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True)
    for mode, series in series_by_mode.items():
        if series.get("t_s"):
            top.plot(series["t_s"], series["prefill_queued_tokens"], label=f"rejection {mode}", lw=1)
            bottom.plot(series["t_s"], series["decode_kv_share"], label=f"rejection {mode}", lw=1)
    top.set(ylabel="prefill queue (tokens/node)", title="Load over time, as the scheduler sees it (simulated)")
    bottom.set(ylabel="decode KV in use (share)", xlabel="time (s)")
    top.legend(fontsize=8)
    fig.savefig(path, dpi=120)
    return path.name


def _plot_hit_rate(by_capacity: dict[str, float | None], path: Path) -> str:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 3.5), layout="constrained")
    ax = fig.subplots()
    points = sorted((int(k), v) for k, v in by_capacity.items() if v is not None)
    ax.plot([p for p, _ in points], [100 * v for _, v in points], marker="o")
    ax.set(xscale="log", xlabel="pool capacity (tokens)", ylabel="cache hit rate (%)",
           title="Hit rate against pool capacity (simulated)")
    fig.savefig(path, dpi=120)
    return path.name


def _replayed(results: Results) -> str:
    """'all N requests' or 'the first N requests' of the trace, N as replayed."""
    num = max((len(run.records) for run in results.runs), default=0)
    return f"all {num:,} requests" if results.config.num_requests is None else f"the first {num:,} requests"


def _bound(bound: str) -> str:
    return "" if bound == "=" else f"{bound} "


def _s(ms: float | None) -> float | None:
    return None if ms is None else ms / 1000


def _num(value: float | None, fmt: str) -> str:
    return "n/a" if value is None else fmt.format(value)


