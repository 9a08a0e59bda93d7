"""The `tsukimi-loadgen` command line: options, their checks (bad input exits 2), building the workload, running
it and reporting. The pieces it wires together live in trace.py, workload.py, runner.py, report.py, plots.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from loadgen.client import API_CHAT, ClientOptions, ServerError, normalize_base_url, resolve_model
from loadgen.metrics import Slo
from loadgen.options import build_parser
from loadgen.report import format_summary, write_json
from loadgen.runner import RunOptions, RunResult, run
from loadgen.trace import TraceError, TraceOptions, load_trace
from loadgen.workload import PlannedRequest, SyntheticSpec, as_text, synthetic_requests

_SYNTHETIC = (
    "num_requests",
    "rate",
    "burstiness",
    "input_len",
    "output_len",
    "range_ratio",
    "shared_prefix_len",
    "num_prefix_groups",
)
_TRACE_ONLY = ("time_scale", "input_scale", "output_scale", "start_s")


def main(argv: list[str] | None = None) -> int:
    """Run the command; returns the exit status (0 ok, 1 server unreachable or output not written).
    Bad arguments exit 2 through argparse (`tsukimi-loadgen experiment ...` is `shared.tools.loadgen_command`'s)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        base_url = normalize_base_url(args.url)
        extra_body = _parse_extra_body(args.extra_body)
        _check_conflicts(args)
        requests = plan_workload(args)
    except (ValueError, TraceError) as exc:
        parser.error(str(exc))
    try:
        return asyncio.run(_run(args, base_url, extra_body, requests))
    except KeyboardInterrupt:
        print("tsukimi-loadgen: interrupted", file=sys.stderr)
        return 130


def plan_workload(args: argparse.Namespace) -> list[PlannedRequest]:
    """The requests the options describe (text prompts for --api chat). Raises ValueError, TraceError."""
    if args.trace is not None:
        options = TraceOptions(
            max_requests=args.max_requests,
            time_scale=_or(args.time_scale, 1.0),
            input_scale=_or(args.input_scale, 1.0),
            output_scale=_or(args.output_scale, 1.0),
            start_s=_or(args.start_s, 0.0),
            seed=args.seed,
            min_token_id=args.min_token_id,
            vocab_size=args.vocab_size,
        )
        requests = load_trace(args.trace, options)
    else:
        defaults = SyntheticSpec()
        fields = {name: _or(getattr(args, name), getattr(defaults, name)) for name in _SYNTHETIC}
        spec = SyntheticSpec(**fields, seed=args.seed, min_token_id=args.min_token_id, vocab_size=args.vocab_size)
        requests = synthetic_requests(spec)[: args.max_requests]
    return as_text(requests) if args.api == API_CHAT else requests


async def _run(
    args: argparse.Namespace, base_url: str, extra_body: dict[str, Any], requests: list[PlannedRequest]
) -> int:
    try:
        model = await resolve_model(base_url, args.model, args.api_key)
    except ServerError as exc:
        print(f"tsukimi-loadgen: {exc}", file=sys.stderr)
        return 1
    client = ClientOptions(base_url, model, args.api, args.request_timeout_s, not args.no_ignore_eos, extra_body,
                           args.api_key)
    slo = Slo(args.slo_ttft_ms, args.slo_tbt_ms)
    options = RunOptions(client, args.concurrency, args.max_requests, args.duration_s, slo, not args.quiet,
                         honor_retry_after=not args.ignore_retry_after)
    result = await run(requests, options)
    print(format_summary(result.summary, _header(args, base_url, model, len(requests))))
    return _write_outputs(args, options, result)


def _write_outputs(args: argparse.Namespace, options: RunOptions, result: RunResult) -> int:
    try:
        if args.json is not None:
            config = {"args": vars(args), "run": asdict(options)}
            path = write_json(args.json, config, result.summary, result.records)
            print(f"wrote {path}", file=sys.stderr)
        if args.plot is not None:
            from loadgen.plots import plot_latency_cdfs  # matplotlib only when asked for

            path = plot_latency_cdfs(result.records, Path(args.plot) / "latency_cdf.png", options.slo)
            print(f"wrote {path}", file=sys.stderr)
    except OSError as exc:
        print(f"tsukimi-loadgen: cannot write the output: {exc}", file=sys.stderr)
        return 1
    return 0


def _header(args: argparse.Namespace, base_url: str, model: str, num_planned: int) -> list[str]:
    if args.trace is not None:
        workload = f"trace {args.trace} (time x{_or(args.time_scale, 1.0):g}, input x{_or(args.input_scale, 1.0):g})"
    else:
        workload = f"synthetic ({_or(args.input_len, 1024)} in, {_or(args.output_len, 128)} out)"
    if args.concurrency:
        mode = f"closed loop, {args.concurrency} in flight"
    elif args.trace is None:
        mode = f"rate {_or(args.rate, math.inf):g} req/s, burstiness {_or(args.burstiness, 1.0):g}"
    else:
        mode = "open loop"
    return [f"Server: {base_url} ({args.api}, model {model})", f"Workload: {workload}, {num_planned} planned, {mode}"]


def _check_conflicts(args: argparse.Namespace) -> None:
    given = [
        name for name in (_SYNTHETIC if args.trace is not None else _TRACE_ONLY) if getattr(args, name) is not None
    ]
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        kind = "synthetic-workload" if args.trace is not None else "trace"
        raise ValueError(f"{flags}: {kind} options {'do not go with' if args.trace else 'need'} --trace")
    if args.concurrency is not None and (args.rate is not None or args.burstiness is not None):
        raise ValueError("--concurrency runs a closed loop: it does not go with --rate or --burstiness")
    if args.num_prefix_groups is not None and not args.shared_prefix_len:
        raise ValueError("--num-prefix-groups needs --shared-prefix-len")
    if not 0 <= args.min_token_id < args.vocab_size:
        raise ValueError("need 0 <= --min-token-id < --vocab-size")


def _parse_extra_body(text: str | None) -> dict[str, Any]:
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--extra-body is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError("--extra-body must be a JSON object")
    return value


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value
