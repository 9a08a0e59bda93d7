"""The Conductor's admission on the virtual clock: windows of a Mooncake-format trace replayed against 1 prefill + 1
decode node (`python -m services.virtual`, the llama3-70b-8xa800 profile, prediction-based rejection, the default
TTFT SLO of 10 s), each window's 3 s steps of simultaneous arrivals spread evenly over the step
(`loadgen.trace.write_spread`, as tests/integration/test_virtual_fidelity.py does). Per window: requests served,
and served within the TTFT SLO; with --baseline-repo, the same windows replayed by another checkout's virtual clock
(an earlier commit, say) beside them.

Not a test. Usage (from the repository root):
    python benchmarks/ttft_prediction.py [--trace T] [--windows 0:120:2,400:120:2] [--baseline-repo PATH]
The five windows of docs/experiments/peers.md ("The Conductor's TTFT prediction", about 2 minutes a checkout):
    --windows 0:120:2,400:120:2,3000:120:2,6000:200:1.5,9000:200:1.5
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from loadgen.metrics import ttft_s
from loadgen.record import RequestRecord
from loadgen.trace import CONVERSATION_TRACE, read_trace, write_spread

REPO = Path(__file__).resolve().parents[1]
TTFT_SLO_S = 10.0  # TSUKIMI_SLO_TTFT_MS's default


def replay(repo: Path, trace: Path, num: int, time_scale: float, out: Path) -> tuple[int, int]:
    """(served, served within the TTFT SLO) of one window on `repo`'s virtual clock."""
    python = repo / ".venv" / "bin" / "python"
    subprocess.run([str(python if python.exists() else sys.executable), "-m", "services.virtual", "--trace",
                    str(trace), "--num-requests", str(num), "--time-scale", str(time_scale), "--prefill", "1",
                    "--decode", "1", "--env", "TSUKIMI_REJECTION=predicted", "--json", str(out), "--quiet"],
                   cwd=repo, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=1800)
    ttfts = [t for r in json.loads(out.read_text())["records"] if (t := ttft_s(RequestRecord(**r))) is not None]
    return len(ttfts), sum(t <= TTFT_SLO_S for t in ttfts)


def parse_windows(text: str, num_lines: int) -> list[tuple[int, int, float]]:
    """Raises ValueError: not first:count:time_scale[,...], or a window past the trace's end."""
    try:
        windows = [(int(a), int(b), float(c)) for a, b, c in (w.split(":") for w in text.split(","))]
    except ValueError:
        raise ValueError(f"--windows takes first:count:time_scale[,...], got {text!r}") from None
    for first, count, scale in windows:
        if first < 0 or count < 1 or scale <= 0 or first + count > num_lines:
            raise ValueError(f"window {first}:{count}:{scale:g} does not fit a trace of {num_lines} requests")
    return windows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, default=CONVERSATION_TRACE,
                        help="a Mooncake-format trace (default: the whole bundled conversation trace)")
    parser.add_argument("--windows", default="0:120:2,400:120:2",
                        help="first request:count:time scale, comma-separated (default %(default)s)")
    parser.add_argument("--baseline-repo", type=Path, help="another checkout (with its .venv) to replay beside this")
    args = parser.parse_args()
    entries = read_trace(args.trace)
    try:
        windows = parse_windows(args.windows, len(entries))
    except ValueError as exc:
        parser.error(str(exc))
    repos = [("this", REPO)] + ([("baseline", args.baseline_repo.resolve())] if args.baseline_repo else [])
    print("| window (first, count, scale) | " + " | ".join(f"{name}: served / within {TTFT_SLO_S:g} s"
                                                          for name, _ in repos) + " |")
    print("| --- |" + " --- |" * len(repos))
    totals = [[0, 0] for _ in repos]
    with tempfile.TemporaryDirectory() as tmp:
        for first, count, scale in windows:
            trace = write_spread(entries[first:first + count], Path(tmp) / f"window-{first}.jsonl")
            cells = []
            for k, (name, repo) in enumerate(repos):
                served, within = replay(repo, trace, count, scale, Path(tmp) / f"{name}-{first}.json")
                totals[k][0] += served
                totals[k][1] += within
                cells.append(f"{served} / {within}")
            print(f"| {first}, {count}, {scale:g}x | " + " | ".join(cells) + " |", flush=True)
    print("| all | " + " | ".join(f"{s} / {w}" for s, w in totals) + " |")


if __name__ == "__main__":
    main()
