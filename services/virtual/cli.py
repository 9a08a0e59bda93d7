"""The command line of `python -m services.virtual`: which cluster, which trace, and where the outcome goes (one JSON
object: every request's record as the client saw it, the network's traffic, the pools' load over time, the wall and
virtual seconds; the
scheduler's placements are in the log file). `tsukimi-loadgen experiment mooncake --clock virtual` runs it once per
run of an experiment.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from loadgen.record import RequestRecord
from loadgen.trace import TraceError, read_trace
from services.virtual import clock
from services.virtual.cluster import ClusterSpec, VirtualCluster
from services.virtual.load import LoadSampler
from services.virtual.network import GBIT, NetworkSpec
from services.virtual.progress import VirtualProgress
from services.virtual.replay import Replay, ReplayOptions
from shared.config import ConfigError
from shared.sim.profiles import PROFILES
from shared.wire.log import configure_logging

DESCRIPTION = """\
Replay a Mooncake-format trace (JSON lines: timestamp ms, input_length, output_length, hash_ids) against a whole
cluster simulated in this one process: the real scheduler, prefill, decode and cache-store services and the gateway's
request sessions, over an in-process NATS whose messages land when a modelled network says, on the sim engine
backend, with a clock that jumps from event to event instead of waiting. Nothing sleeps: an hour of trace takes
minutes. What differs from a real deployment is listed in services/virtual/*.py and docs/experiments/virtual-clock.md.
"""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m services.virtual", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", type=Path, required=True, help="the Mooncake-format trace (JSONL)")
    p.add_argument("--num-requests", type=int, metavar="N", help="replay the first N requests (default: all)")
    p.add_argument("--start-s", type=float, default=0.0, metavar="S", help="skip the trace's first S seconds")
    p.add_argument("--time-scale", type=float, default=1.0, metavar="X",
                   help="arrival times multiplied by X (0.5: twice the trace's rate)")
    pools = p.add_argument_group("the cluster (one instance = one node)")
    pools.add_argument("--prefill", type=int, default=1, metavar="P", help="prefill instances (default 1)")
    pools.add_argument("--decode", type=int, default=1, metavar="D", help="decode instances (default 1)")
    pools.add_argument("--colocated", type=int, default=0, metavar="N",
                       help="instead: N colocated instances that prefill their own requests (the baseline; routed "
                            "least_loaded unless --env TSUKIMI_POLICY=... says otherwise)")
    pools.add_argument("--cpp-group", type=int, default=1, metavar="G",
                       help="prefill instances per pipeline group (chunked pipeline parallelism for prompts of at "
                            "least TSUKIMI_CPP_MIN_TOKENS; default 1: none)")
    pools.add_argument("--cache-stores", type=int, metavar="K",
                       help="cache-store shards, one on each of the first K nodes (default: one per prefill node; "
                            "colocated: one per node)")
    pools.add_argument("--profile", choices=sorted(PROFILES), default="llama3-70b-8xa800",
                       help="the model and GPUs each node stands for (default llama3-70b-8xa800)")
    pools.add_argument("--bandwidth-gbps", type=float, default=NetworkSpec().bandwidth / GBIT, metavar="G",
                       help="each node's network interface, Gbit/s each way (default 800: 4 x 200 Gbps RDMA)")
    pools.add_argument("--latency-us", type=float, default=NetworkSpec().latency_s * 1e6, metavar="US",
                       help="one-way network latency in microseconds (default 5)")
    pools.add_argument("--env", action="append", default=[], metavar="TSUKIMI_X=VALUE",
                       help="a setting for every instance (policy, SLOs, rejection, capacities); repeatable")
    p.add_argument("--max-output-tokens", type=int, metavar="N",
                   help="cap every request's output at N tokens (1: prefill alone, as Mooncake's cache study)")
    out = p.add_argument_group("output")
    out.add_argument("--json", type=Path, metavar="OUT", help="write the outcome here (default: a summary only)")
    out.add_argument("--log-file", type=Path, metavar="F", help="every service's log lines (JSON), info and up")
    out.add_argument("--load-every-s", type=float, default=10.0, metavar="S",
                     help="sample the pools' load (the scheduler's view) every S virtual seconds (default 10)")
    out.add_argument("--seed", type=int, default=0,
                     help="seeds the trace blocks' tokens and the random policies (default 0)")
    out.add_argument("--quiet", action="store_true", help="no progress line")
    out.add_argument("--progress-file", type=Path, metavar="F",
                     help="keep the progress figures in F as JSON, rewritten every second (for a caller's own bar)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    env = {}
    for item in args.env:
        name, sep, value = item.partition("=")
        if not sep or not name.startswith("TSUKIMI_"):
            p.error(f"--env takes TSUKIMI_NAME=VALUE, got {item!r}")
        env[name] = value
    if min(args.prefill, args.decode) < 1 and not args.colocated:
        p.error("--prefill and --decode must be at least 1 (or give --colocated N)")
    if args.cpp_group < 1 or (args.cpp_group > 1 and (args.colocated or args.prefill % args.cpp_group)):
        p.error(f"--cpp-group must divide --prefill into groups, got {args.cpp_group} for {args.prefill} prefill "
                "instances" + (" (a colocated cluster has no prefill pool)" if args.colocated else ""))
    if args.colocated < 0 or (args.cache_stores is not None and args.cache_stores < 1):
        p.error("--colocated must be at least 0 and --cache-stores at least 1")
    if args.num_requests is not None and args.num_requests < 1:
        p.error("--num-requests must be at least 1")
    if (args.max_output_tokens is not None and args.max_output_tokens < 1) or not args.load_every_s > 0:
        p.error("--max-output-tokens must be at least 1 and --load-every-s positive")
    if not (args.time_scale > 0 and args.bandwidth_gbps > 0 and args.latency_us >= 0):
        p.error("--time-scale and --bandwidth-gbps must be positive, --latency-us at least 0")
    try:
        entries = read_trace(args.trace, args.num_requests, args.start_s)
    except TraceError as exc:
        print(f"python -m services.virtual: {exc}", file=sys.stderr)
        return 2
    if not entries:
        p.error(f"no requests in {args.trace} from {args.start_s} s on")
    if args.colocated:  # as `tsukimi up --colocated`: the conductor needs a prefill pool
        env.setdefault("TSUKIMI_POLICY", "least_loaded")
    env.setdefault("TSUKIMI_POLICY_SEED", str(args.seed))  # a random policy's run repeats too
    engines = args.colocated or args.prefill + args.decode
    spec = ClusterSpec(
        prefill=0 if args.colocated else args.prefill, decode=args.colocated or args.decode,
        cache_stores=args.cache_stores or (args.colocated or args.prefill), colocated=bool(args.colocated),
        cpp_group=args.cpp_group, profile=args.profile, env=env,
        network=NetworkSpec(args.bandwidth_gbps * GBIT, args.latency_us * 1e-6),
    )
    log_stream = None
    if args.log_file:
        args.log_file.parent.mkdir(parents=True, exist_ok=True)
        log_stream = open(args.log_file, "a", encoding="utf-8")  # noqa: SIM115 -- as long as the process
    configure_logging("virtual", "virtual", "info" if args.log_file else "warning", "json", log_stream)
    progress = VirtualProgress(len(entries), (entries[-1].timestamp_ms - entries[0].timestamp_ms) / 1000
                               * args.time_scale, enabled=not args.quiet, progress_file=args.progress_file)
    try:
        outcome = clock.run_virtual(lambda: _run(spec, entries, args, progress))
    except ConfigError as exc:
        print(f"python -m services.virtual: {exc}", file=sys.stderr)
        return 2
    finally:
        progress.close()
    outcome |= {"num_nodes": engines, "wall_s": round(progress.wall_s(), 2)}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(outcome, separators=(",", ":")))
    done = Counter("completed" if r["error"] is None else ("rejected" if r["status"] == 429 else "failed")
                   for r in outcome["records"])
    print(f"{len(entries)} requests on {engines} nodes: {dict(done)}; {outcome['virtual_s']:.0f} s simulated in "
          f"{outcome['wall_s']:.0f} s", file=sys.stderr)
    return 0


async def _run(spec: ClusterSpec, entries: list[Any], args: argparse.Namespace,
               progress: VirtualProgress) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    cluster = VirtualCluster(spec, loop)  # type: ignore[arg-type]
    await cluster.start()
    replay = Replay(cluster, ReplayOptions(args.time_scale, args.seed, max_output_tokens=args.max_output_tokens),
                    on_done=progress.done)
    sampler = LoadSampler(cluster.scheduler().instances, args.load_every_s, spec.colocated)
    progress.start(replay)
    sampler.start()
    try:
        records = await replay.run(entries)
    finally:
        await sampler.stop()
        await cluster.stop()
    return {
        "clock": "virtual",
        "num_requests": len(records),
        "virtual_s": round(loop.time() - replay.start_s, 3),
        "records": [_compact(r) for r in records],
        "network": {"bytes": cluster.network.bytes_moved, "messages": cluster.network.num_messages},
        "load_over_time": sampler.series(replay.start_s),
    }


def _compact(record: RequestRecord) -> dict[str, Any]:
    out = record.to_dict()
    out["chunk_times_s"] = [round(t, 5) for t in record.chunk_times_s]
    return out
