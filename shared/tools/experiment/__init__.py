"""`tsukimi-loadgen experiment mooncake`: the Mooncake paper's scheduling experiment reproduced on the sim backend;
`tsukimi-loadgen experiment long-context`: its long-context experiment (chunked pipeline parallelism).

Parses the command line and writes the outputs; the runs are `mooncake.py` and `long_context.py`, the figures
`results.py`, `report.py` and `long_context_report.py`.
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
import tempfile
import time
from pathlib import Path

from loadgen.trace import BUNDLED_TRACE, CONVERSATION_TRACE, TRACE_BLOCK_LEN, TraceError
from shared.sim.profiles import PROFILES
from shared.tools.experiment.long_context import LENGTHS, LongContextConfig, run_long_context
from shared.tools.experiment.long_context_report import write_long_context_report
from shared.tools.experiment.mooncake import (
    ALL_POLICIES,
    POLICIES,
    ExperimentConfig,
    ExperimentError,
    plan_runs,
    run_experiment,
)
from shared.tools.experiment.report import write_report
from shared.tools.experiment.results import compute, to_json
from shared.tools.experiment.studies import STUDIES

FULL = {"num_requests": 70, "time_scales": (4.0, 2.5, 1.5, 1.0), "policy_time_scale": 2.5, "policies": POLICIES}
QUICK = {"num_requests": 16, "time_scales": (4.0, 2.0), "policy_time_scale": 2.0, "policies": ("random", "conductor")}
# The virtual clock (nothing sleeps): the paper's 8P+8D against 16 colocated nodes, the whole trace, all five policies.
VIRTUAL = {"num_requests": None, "time_scales": (2.0, 1.0, 0.7, 0.5), "policy_time_scale": 1.0,
           "policies": ALL_POLICIES, "num_prefill": 8, "num_decode": 8, "num_cache_stores": 16, "studies": STUDIES}
VIRTUAL_QUICK = {"num_requests": 200, "time_scales": (2.0, 1.0), "policy_time_scale": 1.0,
                 "policies": ("random", "conductor"), "num_prefill": 2, "num_decode": 2, "num_cache_stores": 4}

DESCRIPTION = """\
Reproduce the Mooncake paper's scheduling experiment (FAST'25, conversation trace) on this machine with the sim
engine backend: no model runs; each prefill and decode step sleeps for what a roofline model of --profile predicts
(one instance = one 8-GPU node), while the gateway, NATS, the scheduler and the cache-store are the real services.

Runs, each a fresh `tsukimi up --engine sim` on loopback, replaying the trace's first requests time-scaled to a sweep of
loads: (a) the baseline, P+D colocated instances (chunked prefill, own prefix cache, least-loaded routing: the
vLLM-style deployment the paper compares with), (b) tsukimi with P prefill + D decode instances and the Conductor;
then tsukimi with each placement policy at one load. Full: 70 requests x 4 loads x 2 systems + 3 policies (about 18
minutes); --quick: 16 requests x 2 loads x 2 systems + random (about 4 minutes).

Reported: the share of requests meeting TTFT <= 30 s and TBT <= 100/200/300 ms at each load (TBT: the mean of a
request's slowest 10% token gaps), the effective request capacity (the load at which that share falls to 90%) of each
system and their ratio, the average TTFT per policy, cache hit rates; beside the paper's +498%/+157%/+59% and
3.07/3.58/5.27/19.65 s. Everything is labelled as simulation.

--clock virtual: every run is instead the whole cluster in one process on a virtual clock (python -m
services.virtual: the same service classes, an in-process NATS, a modelled network, nothing sleeping), --parallel at
a time, at the paper's scale: 8 prefill + 8 decode against 16 colocated nodes, the whole conversation trace (12,031
requests; about 10 minutes a run, two at a time on two cores), all five policies (--quick: 2P+2D, 200 requests),
then the studies (--studies): the capacity against three more colocated baselines (plain, prefix caching alone,
chunked prefill alone), the hit rate against the pool's size and a global pool against local caches, the P/D split
of 16 nodes from 5P11D to 11P5D, rejection off / on current load / predicted at twice the trace's rate with the
pools' load over time, and the pool and every transfer at kvquant-3's bytes.
"""

LONG_CONTEXT_DESCRIPTION = """\
Reproduce Mooncake's long-context experiment (arXiv 2407.00079 v1, section 8.1.1, Fig. 12) on the virtual clock
(python -m services.virtual: the whole cluster in one process, the sim engine backend, nothing sleeping): prompts of
16k, 32k, 64k and 128k tokens, 512 out, half of each prompt a shared prefix, Poisson arrivals. For each length, the
highest request rate at which P90 TTFT <= 10x and P90 TBT <= 5x the values of one request alone on one node, for
tsukimi 3P+1D with its prefill instances one pipeline group (chunked pipeline parallelism), the same without it, and
4 colocated instances (the vLLM-style baseline); beside the paper's +50% to +525%. About 40 minutes on two cores.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tsukimi-loadgen experiment", description="Reproducible experiments.")
    experiments = parser.add_subparsers(dest="experiment", required=True, metavar="EXPERIMENT")
    mooncake = experiments.add_parser("mooncake", help="the Mooncake paper's scheduling experiment, simulated",
                                      description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_options(mooncake)
    long_context = experiments.add_parser(
        "long-context", help="Mooncake's long-context experiment (Fig. 12): chunked pipeline parallelism, simulated",
        description=LONG_CONTEXT_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_long_context_options(long_context)
    args = parser.parse_args(argv)
    argv = argv if argv is not None else sys.argv[2:]
    if args.experiment == "long-context":
        return _run_long_context(args, long_context, argv)
    config = _config(args, parser)
    return _run(config, args, argv)


def _add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", type=Path,
                        help="Mooncake JSONL trace, .jsonl or .jsonl.gz (default: the conversation trace, bundled: "
                             "its first 1,000 requests; --clock virtual: all 12,031)")
    parser.add_argument("--quick", action="store_true", help="fewer requests and loads: under 5 minutes")
    parser.add_argument("--json", type=Path, metavar="OUT", help="write every figure as one JSON object")
    parser.add_argument("--report", type=Path, metavar="DIR", default=Path("mooncake-report"),
                        help="folder for report.md and its PNGs (default: ./mooncake-report)")
    parser.add_argument("--profile", choices=sorted(PROFILES), default="llama3-70b-8xa800",
                        help="model and GPUs each simulated instance stands for (default: llama3-70b-8xa800)")
    parser.add_argument("--clock", choices=("wall", "virtual"), default="wall",
                        help="wall: every run real processes in real time (default); virtual: every run the whole "
                             "cluster in one process on a virtual clock (python -m services.virtual), the paper's "
                             "scale: 8P+8D against 16 colocated, the whole trace (quick: 2P+2D, 200 requests)")
    parser.add_argument("--parallel", type=int, default=2, metavar="N",
                        help="virtual clock: runs at once, one core each (default 2)")
    parser.add_argument("--prefill", type=int, metavar="P", help="tsukimi's prefill instances (default 2; virtual 8)")
    parser.add_argument("--decode", type=int, metavar="D", help="tsukimi's decode instances (default 2; virtual 8)")
    parser.add_argument("--num-requests", type=int, metavar="N",
                        help="the trace's first N requests in each run (default 70, quick 16; virtual: all, quick 200)")
    parser.add_argument("--time-scales", metavar="X,Y,...",
                        help="loads of the sweep: arrival times multiplied by each (default: 4,2.5,1.5,1; quick 4,2)")
    parser.add_argument("--policies", metavar="A,B,...",
                        help=f"placement policies compared at one load (default: {','.join(POLICIES)}; quick: "
                             "random,conductor)")
    parser.add_argument("--studies", metavar="A,B,...",
                        help=f"virtual clock: the studies after the main sweep, of {','.join(STUDIES)}, or none "
                             "(default: all; quick: none)")
    parser.add_argument("--log-dir", type=Path, metavar="DIR", help="every process's log (default: a temp folder)")
    real = parser.add_argument_group("the real model instead (SmolLM2 on this machine's CPU; scale the trace down)")
    real.add_argument("--engine", choices=("sim", "real"), default="sim", help="default: sim")
    real.add_argument("--input-scale", type=float, default=1.0, metavar="X",
                      help="each 512-token trace block becomes round(512 X) tokens; input lengths scale alike")
    real.add_argument("--output-scale", type=float, default=1.0, metavar="X", help="output lengths times X")
    real.add_argument("--ttft-slo-ms", type=float, default=30_000.0, metavar="MS", help="default: 30000 (the paper's)")
    real.add_argument("--tbt-slos-ms", default="100,200,300", metavar="A,B,C",
                      help="TBT SLOs, each reported apart (default: 100,200,300, the paper's)")


def _add_long_context_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)), metavar="A,B,...",
                        help="prompt lengths in tokens (default: 16384,32768,65536,130560: the paper's 16k-128k, "
                             "128k less the 512 out)")
    parser.add_argument("--num-requests", type=int, default=300, metavar="N", help="requests a run (default 300)")
    parser.add_argument("--steps", type=int, default=3, metavar="K",
                        help="geometric bisections of the rate after it is bracketed (default 3: within 9%%)")
    parser.add_argument("--parallel", type=int, default=2, metavar="N", help="runs at once, one core each (default 2)")
    parser.add_argument("--profile", choices=sorted(PROFILES), default="llama3-70b-8xa800",
                        help="model and GPUs each simulated node stands for (default: llama3-70b-8xa800)")
    parser.add_argument("--report", type=Path, metavar="DIR", default=Path("long-context-report"),
                        help="folder for report.md, its PNG and result.json (default: ./long-context-report)")
    parser.add_argument("--log-dir", type=Path, metavar="DIR",
                        help="the traces and every run's log (default: a temp folder)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the arrivals and the prefixes (default 0)")


def _run_long_context(args: argparse.Namespace, parser: argparse.ArgumentParser, argv: list[str]) -> int:
    try:
        lengths = tuple(int(x) for x in args.lengths.split(","))
    except ValueError:
        parser.error(f"--lengths must be whole numbers separated by commas, got {args.lengths!r}")
    if min(lengths) < TRACE_BLOCK_LEN or args.num_requests < 10 or args.steps < 0 or args.parallel < 1:
        parser.error(f"lengths must be at least {TRACE_BLOCK_LEN}, --num-requests at least 10, --steps at least 0 "
                     "and --parallel at least 1")
    signal.signal(signal.SIGTERM, _interrupt)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="tsukimi-long-context-"))
    config = LongContextConfig(log_dir, lengths, num_requests=args.num_requests, steps=args.steps,
                               parallel=args.parallel, profile=args.profile, seed=args.seed)
    started = time.monotonic()
    say(f"SIMULATION ({args.profile}) on the virtual clock: {len(lengths)} lengths x {len(config.systems)} systems; "
        f"logs in {log_dir}")
    try:
        results = run_long_context(config, say)
    except RuntimeError as exc:
        print(f"tsukimi-loadgen experiment: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    results["wall_s"] = round(time.monotonic() - started, 1)
    report = write_long_context_report(results, args.report, "tsukimi-loadgen experiment " + shlex.join(argv))
    (args.report / "result.json").write_text(json.dumps(results, indent=1))
    say(f"report: {report}")
    return 0


def _config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> ExperimentConfig:
    if args.clock == "virtual":
        preset = dict(VIRTUAL_QUICK if args.quick else VIRTUAL)
        if args.engine != "sim":
            parser.error("--clock virtual runs the sim engine backend only")
    else:
        preset = dict(QUICK if args.quick else FULL)
    for name in ("prefill", "decode"):
        if getattr(args, name) is not None:
            preset[f"num_{name}"] = getattr(args, name)
    preset.setdefault("num_prefill", 2)
    preset.setdefault("num_decode", 2)
    num_requests = preset["num_requests"] if args.num_requests is None else args.num_requests
    trace = args.trace or (CONVERSATION_TRACE if args.clock == "virtual" else BUNDLED_TRACE)
    scales: tuple[float, ...] = preset["time_scales"]  # type: ignore[assignment]
    if args.time_scales:
        scales = _numbers(args.time_scales, "--time-scales", parser)
        preset["policy_time_scale"] = scales[len(scales) // 2]
    tbt_slos = _numbers(args.tbt_slos_ms, "--tbt-slos-ms", parser)
    pools = (int(preset["num_prefill"]), int(preset["num_decode"]))  # type: ignore[call-overload]
    if min(scales) <= 0 or (num_requests is not None and num_requests < 2) or min(pools) < 1:  # type: ignore[operator]
        parser.error("time scales must be positive, --num-requests at least 2, --prefill and --decode at least 1")
    if min(args.input_scale, args.output_scale, args.ttft_slo_ms, *tbt_slos) <= 0:
        parser.error("scales and SLOs must be positive")
    preset |= {"num_requests": num_requests, "time_scales": scales}
    if args.policies:
        policies = tuple(args.policies.split(","))
        unknown = sorted(set(policies) - set(ALL_POLICIES))
        if unknown:
            parser.error(f"unknown policies {', '.join(unknown)}; choose from {', '.join(ALL_POLICIES)}")
        preset["policies"] = policies
    if args.studies:
        if args.clock != "virtual":
            parser.error("--studies needs --clock virtual (they replay the trace dozens of times)")
        studies = () if args.studies == "none" else tuple(args.studies.split(","))
        unknown = sorted(set(studies) - set(STUDIES))
        if unknown:
            parser.error(f"unknown studies {', '.join(unknown)}; choose from {', '.join(STUDIES)} or none")
        preset["studies"] = studies
    if not trace.is_file():
        parser.error(f"no trace at {trace}")
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="tsukimi-mooncake-"))
    return ExperimentConfig(trace=trace, log_dir=log_dir, profile=args.profile, clock=args.clock,
                            parallel=max(1, args.parallel), engine=args.engine, input_scale=args.input_scale,
                            output_scale=args.output_scale, ttft_slo_ms=args.ttft_slo_ms, tbt_slos_ms=tbt_slos,
                            **preset)  # type: ignore[arg-type]


def _numbers(text: str, flag: str, parser: argparse.ArgumentParser) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        parser.error(f"{flag} must be numbers separated by commas, got {text!r}")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM as Ctrl-C: the running system is stopped on the way out


def _run(config: ExperimentConfig, args: argparse.Namespace, argv: list[str]) -> int:
    signal.signal(signal.SIGTERM, _interrupt)
    started = time.monotonic()
    what = f"SIMULATION ({config.profile})" if config.engine == "sim" else "the real model on this machine"
    say(f"{what}: {len(plan_runs(config))} runs; logs in {config.log_dir}")
    try:
        runs = run_experiment(config, say)
    except (TraceError, ExperimentError) as exc:
        print(f"tsukimi-loadgen experiment: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        say("interrupted; the system of the run in progress was stopped")
        return 130
    results = compute(config, runs)
    command = "tsukimi-loadgen experiment " + shlex.join(argv)
    report = write_report(results, args.report, command, time.monotonic() - started)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(to_json(results, time.monotonic() - started), indent=2, default=str))
    say(f"report: {report}" + (f"; json: {args.json}" if args.json else ""))
    for key, ratio in results.ratios.items():
        say(f"effective capacity at TBT {key} ms: tsukimi / baseline = {ratio}")
    say("average TTFT by policy: " + ", ".join(f"{p} {t:.2f} s" for p, t in results.avg_ttft_s.items() if t))
    return 0 if all(run.error is None for run in runs) else 1


def say(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


