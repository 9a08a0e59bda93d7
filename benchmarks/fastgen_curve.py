"""FastGen's quality curve from `tsukimi eval fastgen --json` results: the README's table and an SVG plot of the
continuation perplexity increase against the share of KV freed, for our ladder and the paper's, with StreamingLLM and
H2O at each run's memory.

Reads `T<T>.json` (our ladder) and `paper-T<T>.json` (`--wider-local none --frequent-alone`) from `--dir`, writes
`curve.svg` there and prints the table (markdown). Not a test; no model runs here. Run from the repository root:
`python benchmarks/fastgen_curve.py` (the JSONs come from the commands in the README's FastGen section).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shared.fastgen.policies import FastGenSettings

WIDTH, HEIGHT, MARGIN = 640, 400, 56
SERIES = (  # (name, which results, where the figures are, colour)
    ("FastGen, our ladder", "ours", None, "#1f77b4"),
    ("FastGen, the paper's ladder", "paper", None, "#9467bd"),
    ("H2O at our ladder's memory", "ours", "h2o", "#ff7f0e"),
    ("StreamingLLM at our ladder's memory", "ours", "streaming_llm", "#2ca02c"),
)


def load(directory: Path) -> dict[str, list[dict[str, Any]]]:
    """{"ours": [...], "paper": [...]}, each sorted by threshold."""
    runs: dict[str, list[dict[str, Any]]] = {"ours": [], "paper": []}
    for path in sorted(directory.glob("*T*.json")):
        name = path.stem
        kind = "paper" if name.startswith("paper-T") else "ours" if name.startswith("T") else None
        if kind is None or "-" in name.removeprefix("paper-"):  # T0.95-kvquant-4, T0.95-rows128: other studies
            continue
        runs[kind].append(json.loads(path.read_text()))
    for results in runs.values():
        results.sort(key=lambda r: r["threshold"])
    return runs


def figures(result: dict[str, Any], baseline: str | None) -> tuple[float, float]:
    """(KV freed %, perplexity increase %) of the run, or of a baseline in it."""
    source = result if baseline is None else result["baselines"][baseline]
    return 100 * (1 - source["kv_kept_fraction"]), 100 * source["rel_ppl_increase"]


def table(runs: dict[str, list[dict[str, Any]]]) -> str:
    rows = [
        "| ladder | T | KV freed | FastGen ppl / KL / top-1 | StreamingLLM ppl / KL | H2O ppl / KL "
        "| KV heads by policy |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for kind, results in runs.items():
        for r in results:
            sl, h2o = r["baselines"]["streaming_llm"], r["baselines"]["h2o"]
            order = _settings(r).labels()
            counts = ", ".join(f"{_short(label)} {n}" for label, n in sorted(r["policy_histogram"].items(),
                                                                           key=lambda item: order.index(item[0])))
            rows.append(
                f"| {kind} | {r['threshold']} | {100 * (1 - r['kv_kept_fraction']):.1f}% | "
                f"{100 * r['rel_ppl_increase']:+.2f}% / {r['kl']:.4f} / {100 * r['top1_agreement']:.1f}% | "
                f"{100 * sl['rel_ppl_increase']:+.2f}% / {sl['kl']:.4f} | "
                f"{100 * h2o['rel_ppl_increase']:+.2f}% / {h2o['kl']:.4f} | {counts} |"
            )
    return "\n".join(rows)


def _short(label: str) -> str:
    """special+punct+frequent+local@0.5 -> hh+w0.5 (hh: heavy hitters, w: the window; punct and special implied)."""
    return (label.replace("special+punct+frequent+local", "hh+w").replace("special+punct+frequent", "hh")
            .replace("special+punct", "punct").replace("@", ""))


def _settings(result: dict[str, Any]) -> FastGenSettings:
    """The ladder a result was measured with."""
    return FastGenSettings(r_local=result["r_local"], r_frequent=result["r_frequent"],
                           wider_local=tuple(result["wider_local"]), frequent_alone=result["frequent_alone"])


def svg(runs: dict[str, list[dict[str, Any]]]) -> str:
    points = {name: [figures(r, baseline) for r in runs[kind]] for name, kind, baseline, _ in SERIES}
    x_max = max(50.0, *(x for series in points.values() for x, _ in series)) * 1.05
    y_max = max(3.0, *(y for series in points.values() for _, y in series)) * 1.1
    y_min = min(0.0, *(y for series in points.values() for _, y in series))

    def at(x: float, y: float) -> tuple[float, float]:
        return (MARGIN + x / x_max * (WIDTH - 2 * MARGIN),
                HEIGHT - MARGIN - (y - y_min) / (y_max - y_min) * (HEIGHT - 2 * MARGIN))

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif" '
             f'font-size="11"><rect width="100%" height="100%" fill="white"/>']
    (x0, y0), (x1, y1) = at(35, 2), at(x_max, max(y_min, 0))
    parts.append(f'<rect x="{x0:.1f}" y="{y0:.1f}" width="{x1 - x0:.1f}" height="{y1 - y0:.1f}" fill="#e8f5e9"/>')
    parts.append(f'<text x="{x0 + 4:.1f}" y="{y0 + 14:.1f}" fill="#2e7d32">target: at least 35% freed, '
                 f'at most +2%</text>')
    parts += _axes(at, x_max, y_min, y_max)
    for index, (name, kind, _, colour) in enumerate(SERIES):
        series = points[name]
        corners = [at(x, y) for x, y in series]
        path = " ".join(f"{'M' if i == 0 else 'L'}{cx:.1f},{cy:.1f}" for i, (cx, cy) in enumerate(corners))
        parts.append(f'<path d="{path}" fill="none" stroke="{colour}" stroke-width="2"/>')
        for (x, y), result in zip(series, runs[kind], strict=True):
            cx, cy = at(x, y)
            parts.append(f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="3.5" fill="{colour}"/>')
            if name.startswith("FastGen"):
                parts.append(f'<text x="{cx + 5:.1f}" y="{cy - 5:.1f}" fill="{colour}">T={result["threshold"]}</text>')
        ly = MARGIN + 16 * index
        parts.append(f'<line x1="{MARGIN + 10}" y1="{ly}" x2="{MARGIN + 30}" y2="{ly}" stroke="{colour}" '
                     f'stroke-width="2"/><text x="{MARGIN + 36}" y="{ly + 4}">{name}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _axes(at: Callable[[float, float], tuple[float, float]], x_max: float, y_min: float, y_max: float) -> list[str]:
    (left, bottom), (right, top) = at(0, y_min), at(x_max, y_max)
    out = [f'<line x1="{left}" y1="{bottom}" x2="{right}" y2="{bottom}" stroke="black"/>',
           f'<line x1="{left}" y1="{bottom}" x2="{left}" y2="{top}" stroke="black"/>',
           f'<text x="{(left + right) / 2 - 40:.1f}" y="{HEIGHT - 16}">KV freed (%)</text>',
           f'<text x="14" y="{(top + bottom) / 2:.1f}" transform="rotate(-90 14 {(top + bottom) / 2:.1f})">'
           f'continuation perplexity increase (%)</text>']
    for x_tick in range(0, int(x_max) + 1, 10):
        x, y = at(x_tick, y_min)
        out.append(f'<text x="{x - 6:.1f}" y="{y + 16:.1f}">{x_tick}</text>')
    step = 0.5 if y_max - y_min <= 4 else 1.0
    tick = math.ceil(y_min / step) * step
    while tick <= y_max:
        x, y = at(0, tick)
        out.append(f'<text x="{x - 30:.1f}" y="{y + 4:.1f}">{tick:+.1f}</text>'
                   f'<line x1="{x:.1f}" y1="{y:.1f}" x2="{WIDTH - MARGIN}" y2="{y:.1f}" stroke="#eeeeee"/>')
        tick += step
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=Path("docs/experiments/fastgen"),
                        help="where the eval JSONs are and curve.svg goes (default: docs/experiments/fastgen)")
    args = parser.parse_args()
    runs = load(args.dir)
    if not runs["ours"]:
        parser.exit(2, f"fastgen_curve: error: no T*.json in {args.dir}\n")
    (args.dir / "curve.svg").write_text(svg(runs))
    print(table(runs))
    print(f"\nwrote {args.dir / 'curve.svg'}")


if __name__ == "__main__":
    main()
