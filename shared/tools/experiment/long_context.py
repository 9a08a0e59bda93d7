"""Mooncake's long-context experiment (arXiv 2407.00079 v1, section 8.1.1, Fig. 12) on the virtual clock: prompts of
16k, 32k, 64k and 128k tokens with 512 out and half of each prompt a prefix seen before, Poisson arrivals; for each
length and system, the highest request rate at which the P90 TTFT stays within 10x and the P90 TBT within 5x their
single-request values. The paper: Mooncake [3P+1D] sustains +50% to +525% the rate of vLLM [4M].

Systems: tsukimi 3P+1D with its three prefill instances one pipeline group (chunked pipeline parallelism), the same
without it (each prompt on one prefill instance), and 4 colocated instances (chunked prefill beside decoding, their
own prefix caches, least-loaded routing: the vLLM-style baseline of every sim experiment here). The single-request
values are one request alone on one colocated instance (the plain deployment every system is held to), and every
system is held to the same limits.

The rate search and the trace are pure functions; `run_long_context` runs `python -m services.virtual` processes.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadgen.metrics import itls_s, percentile, tbt_s, ttft_s
from loadgen.record import RequestRecord
from loadgen.trace import TRACE_BLOCK_LEN
from shared.tools.experiment.virtual import VirtualOutcome, VirtualRun, run_virtual_runs

# The paper's 16k/32k/64k/128k: 128k less the 512 output tokens, so that a request fits the profile's 131,072
# positions.
LENGTHS = (16_384, 32_768, 65_536, 130_560)
OUTPUT_TOKENS = 512
REUSE = 0.5  # the share of each prompt that is a prefix seen before
NUM_PREFIXES = 4  # the shared prefixes, each first computed by one request, then reused by the others
TTFT_FACTOR, TBT_FACTOR = 10.0, 5.0  # the limits: P90 TTFT <= 10x and P90 TBT <= 5x the single-request values
# The gateway's silence timeout in a run (its default, TSUKIMI_REQUEST_TIMEOUT_S, is 300 s): 4x the P90 TTFT limit, so
# a prompt that queues longer than the limit is a slow request, not a lost one (128k's limit is 302 s).
DEFAULT_SILENCE_S = 300.0
SILENCE_FACTOR = 4.0
PAPER_GAIN = (1.50, 6.25)  # Mooncake [3P+1D] / vLLM [4M] across the four lengths: +50% to +525% (arXiv v1, Fig. 12)


@dataclass(frozen=True)
class System:
    """One deployment of 4 nodes: `prefill` + `decode` instances (a pipeline group of `cpp_group`), or `colocated`."""

    name: str
    prefill: int = 0
    decode: int = 0
    colocated: int = 0
    cpp_group: int = 1


CPP = System("tsukimi 3P+1D, CPP", prefill=3, decode=1, cpp_group=3)
NO_CPP = System("tsukimi 3P+1D", prefill=3, decode=1)
COLOCATED = System("4 colocated", colocated=4)
SYSTEMS = (CPP, NO_CPP, COLOCATED)
SINGLE = System("1 colocated", colocated=1)  # where the single-request values are measured


def unit_rate_trace(input_tokens: int, num_requests: int, seed: int = 0, reuse: float = REUSE,
                    num_prefixes: int = NUM_PREFIXES, output_tokens: int = OUTPUT_TOKENS) -> list[dict[str, Any]]:
    """Mooncake-format trace lines at 1 request/s on average (Poisson: exponential gaps, the first at 0), so that
    `--time-scale 1/r` replays them at r requests/s with the same draws. Each prompt's first `reuse` of its
    512-token blocks is one of `num_prefixes` shared prefixes (chosen at random), the rest its own."""
    if not (input_tokens > 0 and num_requests > 0 and 0 <= reuse < 1 and num_prefixes > 0):
        raise ValueError("a trace needs input tokens, requests, a reuse share in [0, 1) and at least one prefix")
    rng = random.Random(seed)
    num_blocks = math.ceil(input_tokens / TRACE_BLOCK_LEN)
    num_shared = int(num_blocks * reuse)
    next_own = num_prefixes * num_shared  # hash ids past every shared prefix's
    lines, at_s = [], 0.0
    for i in range(num_requests):
        if i:
            at_s += rng.expovariate(1.0)
        prefix = rng.randrange(num_prefixes) * num_shared
        own = num_blocks - num_shared
        hash_ids = list(range(prefix, prefix + num_shared)) + list(range(next_own, next_own + own))
        next_own += own
        lines.append({"timestamp": round(at_s * 1000.0, 3), "input_length": input_tokens,
                      "output_length": output_tokens, "hash_ids": hash_ids})
    return lines


@dataclass(frozen=True)
class Point:
    """One run at `rate` requests/s: its P90 TTFT and TBT (seconds), requests that did not complete, and whether it
    met the limits."""

    rate: float
    p90_ttft_s: float
    p90_tbt_s: float
    num_failed: int
    meets: bool
    wall_s: float = 0.0


@dataclass(frozen=True)
class Limits:
    """The single-request values and the limits they set."""

    ttft_s: float
    tbt_s: float

    @property
    def max_ttft_s(self) -> float:
        return TTFT_FACTOR * self.ttft_s

    @property
    def max_tbt_s(self) -> float:
        return TBT_FACTOR * self.tbt_s


def point(rate: float, records: list[RequestRecord], limits: Limits, wall_s: float = 0.0) -> Point:
    """A run's figures at `rate`: P90 over the requests of TTFT and of Mooncake's TBT (a request's slowest 10% of
    gaps); a request that did not complete fails the limits."""
    ttfts = [t for t in map(ttft_s, records) if t is not None]
    tbts = [tbt_s(itls_s(r)) for r in records if r.is_completed]
    failed = sum(not r.is_completed for r in records)
    if not ttfts:
        return Point(rate, math.inf, math.inf, failed, False, wall_s)
    p90_ttft, p90_tbt = percentile(ttfts, 90), percentile(tbts, 90)
    meets = failed == 0 and p90_ttft <= limits.max_ttft_s and p90_tbt <= limits.max_tbt_s
    return Point(rate, p90_ttft, p90_tbt, failed, meets, wall_s)


def search_rate(measure: Callable[[float], Point], start: float, steps: int) -> list[Point]:
    """The points measured while finding the highest rate that meets the limits: from `start`, doubling while it
    meets them (halving while it does not) until a bracket, then `steps` geometric bisections of it. Assumes a
    rate that meets the limits is met by every lower one. Every point, in the order measured."""
    points = [measure(start)]
    grow = points[0].meets
    for _ in range(12):  # bracket within 2^12 of the start
        if points[-1].meets != grow:
            break
        points.append(measure(points[-1].rate * (2.0 if grow else 0.5)))
    else:
        return points  # never bracketed: every rate tried met the limits, or none did
    low, high = sorted((points[-1].rate, points[-2].rate))
    for _ in range(steps):
        middle = math.sqrt(low * high)
        points.append(measure(middle))
        low, high = (middle, high) if points[-1].meets else (low, middle)
    return points


def capacity(points: list[Point]) -> tuple[float, str]:
    """The highest rate measured that met the limits with every lower rate measured meeting them too, and "=" when a
    higher rate failed; (the highest rate that met them, ">=") when none failed; (the lowest rate, "<") when none
    met them."""
    ordered = sorted(points, key=lambda p: p.rate)
    if not ordered[0].meets:
        return ordered[0].rate, "<"
    best = ordered[0].rate
    for p in ordered[1:]:
        if not p.meets:
            return best, "="
        best = p.rate
    return best, ">="


@dataclass(frozen=True)
class LongContextConfig:
    """The experiment: `lengths` of prompt, `num_requests` per run, `steps` bisections, `parallel` runs at once."""

    out_dir: Path
    lengths: tuple[int, ...] = LENGTHS
    systems: tuple[System, ...] = SYSTEMS
    num_requests: int = 40
    steps: int = 4
    parallel: int = 2
    profile: str = "llama3-70b-8xa800"
    seed: int = 0


@dataclass
class Search:
    """One system at one length: its points and capacity."""

    system: System
    length: int
    points: list[Point] = field(default_factory=list)

    @property
    def capacity(self) -> tuple[float, str]:
        return capacity(self.points)


def run_long_context(config: LongContextConfig, say: Callable[[str], None]) -> dict[str, Any]:
    """Every length: the single-request values, then each system's rate search (`parallel` searches at once, each
    run one `python -m services.virtual` process). Returns the results as JSON-ready data.

    Raises:
        RuntimeError: a run that failed (its log is named).
    """
    config.out_dir.mkdir(parents=True, exist_ok=True)
    limits: dict[int, Limits] = {}
    for length in config.lengths:
        trace = config.out_dir / f"trace-{length}.jsonl"
        lines = unit_rate_trace(length, config.num_requests, config.seed)
        trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
        records, _ = _run(config, SINGLE, trace, 1, 1.0, f"single-{length}")
        first = records[0]
        limits[length] = Limits(ttft_s(first) or math.inf, tbt_s(itls_s(first)))
        say(f"{length} tokens alone on one node: TTFT {limits[length].ttft_s:.2f} s, TBT "
            f"{limits[length].tbt_s * 1000:.1f} ms; limits P90 TTFT <= {limits[length].max_ttft_s:.1f} s, "
            f"P90 TBT <= {limits[length].max_tbt_s * 1000:.0f} ms")
    searches = [Search(system, length) for length in config.lengths for system in config.systems]

    def one(search: Search) -> Search:
        trace = config.out_dir / f"trace-{search.length}.jsonl"
        nodes = search.system.prefill or search.system.colocated  # nodes that prefill: where prompts queue
        start = nodes / limits[search.length].ttft_s  # what those nodes prefill in a second, one prompt each

        def measure(rate: float) -> Point:
            name = f"{_slug(search.system.name)}-{search.length}-{rate:.4f}"
            silence_s = max(DEFAULT_SILENCE_S, SILENCE_FACTOR * limits[search.length].max_ttft_s)
            records, wall_s = _run(config, search.system, trace, config.num_requests, 1.0 / rate, name, silence_s)
            p = point(rate, records, limits[search.length], wall_s)
            say(f"{search.system.name}, {search.length} tokens, {rate:.3f} req/s: P90 TTFT {p.p90_ttft_s:.2f} s, "
                f"P90 TBT {p.p90_tbt_s * 1000:.0f} ms{f', {p.num_failed} failed' if p.num_failed else ''} -> "
                f"{'within' if p.meets else 'beyond'} the limits ({wall_s:.0f} s)")
            return p

        search.points = search_rate(measure, start, config.steps)
        return search

    with ThreadPoolExecutor(max(1, config.parallel)) as pool:
        done = list(pool.map(one, searches))
    return _results(config, limits, done)


def _run(config: LongContextConfig, system: System, trace: Path, num_requests: int, time_scale: float,
         name: str, silence_s: float = DEFAULT_SILENCE_S) -> tuple[list[RequestRecord], float]:
    """One virtual run; the gateway gives a request up after `silence_s` without an event (a prompt queued at
    prefill has none until its first token)."""
    env = {"TSUKIMI_REJECTION": "off", "TSUKIMI_REQUEST_TIMEOUT_S": f"{silence_s:g}"}
    run = VirtualRun(
        trace=trace, num_requests=num_requests, time_scale=time_scale, profile=config.profile,
        prefill=system.prefill, decode=system.decode, cache_stores=system.prefill or system.colocated,
        colocated=system.colocated, env=env, log_dir=config.out_dir / "runs" / name, cpp_group=system.cpp_group,
    )
    (outcome,) = run_virtual_runs([run], 1, lambda index, outcome: None)
    _check(outcome, run)
    return outcome.records, outcome.wall_s


def _check(outcome: VirtualOutcome, run: VirtualRun) -> None:
    if outcome.error is not None:
        raise RuntimeError(outcome.error)
    if not outcome.records:
        raise RuntimeError(f"no requests replayed: see {run.log_dir}")


def _results(config: LongContextConfig, limits: dict[int, Limits], searches: list[Search]) -> dict[str, Any]:
    by_length: dict[str, Any] = {}
    for length in config.lengths:
        rows = {s.system.name: s for s in searches if s.length == length}
        baseline = rows.get(COLOCATED.name)
        entry: dict[str, Any] = {
            "single_ttft_s": round(limits[length].ttft_s, 4), "single_tbt_s": round(limits[length].tbt_s, 5),
            "max_p90_ttft_s": round(limits[length].max_ttft_s, 4), "max_p90_tbt_s": round(limits[length].max_tbt_s, 5),
            "systems": {},
        }
        for name, search in rows.items():
            rate, bound = search.capacity
            ratio = None
            if baseline is not None and name != COLOCATED.name:
                ratio = round(rate / baseline.capacity[0], 3)
            entry["systems"][name] = {
                "capacity_rps": round(rate, 5), "bound": bound, "over_colocated": ratio,
                "points": [vars(p) | {"rate": round(p.rate, 5)} for p in sorted(search.points, key=lambda p: p.rate)],
            }
        by_length[str(length)] = entry
    return {"experiment": "long-context (arXiv 2407.00079 v1, Fig. 12)", "clock": "virtual", "profile": config.profile,
            "num_requests": config.num_requests, "output_tokens": OUTPUT_TOKENS, "reuse": REUSE,
            "num_prefixes": NUM_PREFIXES, "steps": config.steps, "seed": config.seed,
            "limits": {"ttft_factor": TTFT_FACTOR, "tbt_factor": TBT_FACTOR}, "paper_gain_range": list(PAPER_GAIN),
            "lengths": by_length}


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-").replace("--", "-")
