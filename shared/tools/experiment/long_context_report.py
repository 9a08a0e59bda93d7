"""The long-context experiment's report (`long_context.py`'s results): report.md with the table beside the paper's
range, and a bar chart of each system's sustained rate at each prompt length."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shared.tools.experiment.long_context import COLOCATED, CPP, NO_CPP


def write_long_context_report(results: dict[str, Any], folder: Path, command: str) -> Path:
    """report.md and capacity_by_length.png in `folder` (made if missing); returns the report's path."""
    folder.mkdir(parents=True, exist_ok=True)
    figure = _plot(results, folder / "capacity_by_length.png")
    low, high = results["paper_gain_range"]
    lines = [
        "# Long-context requests: chunked pipeline parallelism (Mooncake arXiv 2407.00079 v1, Fig. 12)",
        "",
        f"SIMULATION on the virtual clock ({results['profile']} per node; `python -m services.virtual`): prompts of "
        f"each length with {results['output_tokens']} tokens out, the first half of each prompt one of "
        f"{results['num_prefixes']} shared prefixes, Poisson arrivals, {results['num_requests']} requests a run, "
        "prediction-based rejection off. For each system and length, the highest rate (requests/s) at which the P90 "
        f"TTFT stays within {results['limits']['ttft_factor']:g}x and the P90 TBT (Mooncake's: a request's slowest "
        f"10% of token gaps) within {results['limits']['tbt_factor']:g}x their values for one request alone on one "
        f"node; found by doubling, then {results['steps']} geometric bisections. The paper: Mooncake [3P+1D] "
        f"sustains {low:.2f}x to {high:.2f}x the rate of vLLM [4M] across the four lengths (+50% to +525%; it "
        "gives no figure per length in its text).",
        "",
        f"Reproduce: `{command}`",
        "",
        f"| prompt tokens | alone: TTFT / TBT | {CPP.name} | {NO_CPP.name} | {COLOCATED.name} | CPP / colocated "
        "| no CPP / colocated | CPP / no CPP |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for length, entry in results["lengths"].items():
        systems = entry["systems"]
        cells = [_rate(systems.get(name)) for name in (CPP.name, NO_CPP.name, COLOCATED.name)]
        ratios = [_ratio(systems, CPP.name, COLOCATED.name), _ratio(systems, NO_CPP.name, COLOCATED.name),
                  _ratio(systems, CPP.name, NO_CPP.name)]
        lines.append(f"| {int(length):,} | {entry['single_ttft_s']:.2f} s / {entry['single_tbt_s'] * 1000:.1f} ms | "
                     + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    lines += ["", "A rate marked >= met the limits at every rate tried; < met them at none. Every point measured:", ""]
    for length, entry in results["lengths"].items():
        for name, system in entry["systems"].items():
            points = ", ".join(f"{p['rate']:.3f} ({p['p90_ttft_s']:.1f} s, {p['p90_tbt_s'] * 1000:.0f} ms"
                               f"{'' if p['meets'] else ', beyond'})" for p in system["points"])
            lines.append(f"- {int(length):,} tokens, {name}: {points}")
    lines += ["", f"![sustained rate by prompt length]({figure})", ""]
    path = folder / "report.md"
    path.write_text("\n".join(lines))
    return path


def _rate(system: dict[str, Any] | None) -> str:
    if system is None:
        return "-"
    bound = "" if system["bound"] == "=" else f"{system['bound']} "
    return f"{bound}{system['capacity_rps']:.3f}"


def _ratio(systems: dict[str, Any], ours: str, theirs: str) -> str:
    if ours not in systems or theirs not in systems:
        return "-"
    a, b = systems[ours], systems[theirs]
    bounds = {a["bound"], b["bound"]}
    mark = "" if bounds == {"="} else "~"  # a bound on either side: the ratio is a bound too
    return f"{mark}{a['capacity_rps'] / b['capacity_rps']:.2f}x"


def _plot(results: dict[str, Any], path: Path) -> str:
    from matplotlib.figure import Figure

    lengths = list(results["lengths"])
    names = (CPP.name, NO_CPP.name, COLOCATED.name)
    fig = Figure(figsize=(7, 3.8), layout="constrained")
    ax = fig.subplots()
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        rates = [results["lengths"][k]["systems"].get(name, {}).get("capacity_rps", 0.0) for k in lengths]
        ax.bar([x + (i - 1) * width for x in range(len(lengths))], rates, width, label=name)
    ax.set_xticks(range(len(lengths)), [f"{round(int(k) / 1024)}k" for k in lengths])
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("requests/s within the limits")
    ax.set_title("P90 TTFT <= 10x, P90 TBT <= 5x one request alone (simulation)")
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)
    return path.name
