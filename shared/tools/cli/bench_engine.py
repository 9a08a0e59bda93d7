"""`tsukimi bench engine`: tsukimi's engine against Hugging Face transformers, same model, dtype and shapes.

Prints prefill and decode tokens/s for both, their ratios, and this machine's decode roofline.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass

import torch

from shared.engine.engine import LLMEngine
from shared.env_vars import PREFILL_BATCHED_TOKENS
from shared.model.checkpoint import load_checkpoint
from shared.model.config import LlamaConfig
from shared.tools.bench.hf_baseline import random_prompts
from shared.tools.bench.hf_process import TransformersProcess
from shared.tools.bench.roofline import (
    decode_roofline,
    measure_matmul_peak,
    measure_memory_bandwidth,
    measure_weight_streaming,
    weight_streaming_bound_s,
)
from shared.tools.cli.common import CliError, add_engine_args, engine_config_from_args, positive_int
from shared.wire.protocol import SamplingParams


@dataclass(frozen=True)
class EngineResult:
    prefill_tok_s: float
    decode_tok_s: float
    decode_step_s: float


@dataclass(frozen=True)
class BenchRow:
    batch_size: int
    dtype: str
    tsukimi_prefill_tok_s: float
    transformers_prefill_tok_s: float | None  # None with --skip-transformers, as are the ratios
    tsukimi_decode_tok_s: float
    transformers_decode_tok_s: float | None
    prefill_ratio: float | None
    decode_ratio: float | None
    roofline_decode_tok_s: float
    tsukimi_decode_step_ms: float
    weight_streaming_bound_ms: float
    weight_kv_bound_ms: float  # the weight-streaming bound plus the step's KV reads at the measured bandwidth
    step_to_bound_ratio: float  # step / weight_kv_bound


def _batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError("batch sizes must be positive integers")
    return sizes


def register(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser("bench", help="benchmarks (see: tsukimi bench engine --help)")
    kinds = bench.add_subparsers(dest="bench", metavar="WHAT", required=True)
    parser = kinds.add_parser(
        "engine", help="engine throughput against transformers",
        description="Measure tsukimi's engine and Hugging Face transformers `generate` in the same run with the "
        "same model, dtype and random prompts: prefill tokens/s (tsukimi in steps of --max-batched-tokens, as it "
        "serves; transformers the whole batch in one pass, its only way) and decode tokens/s "
        "(decode only: for transformers, a run of gen-len+1 tokens minus a run of 1). Also prints this machine's "
        "roofline for one decode step (weights and KV over measured memory bandwidth, FLOPs over measured "
        "matmul peak), the weight-streaming bound (weights over the rate a decode-shaped matmul streams them) and "
        "that bound plus the step's KV reads at the measured bandwidth, which the step is compared with. "
        "transformers runs in a separate process, its runs interleaved with tsukimi's.",
    )
    parser.add_argument("--batch-sizes", type=_batch_sizes, default=[1, 8, 32], help="default: 1,8,32")
    parser.add_argument("--prompt-len", type=positive_int, default=128, help="tokens per prompt (default: 128)")
    parser.add_argument("--gen-len", type=positive_int, default=32, help="decode tokens measured (default: 32)")
    parser.add_argument("--repeats", type=positive_int, default=3, help="runs per figure; median (default: 3)")
    parser.add_argument(
        "--max-batched-tokens", type=positive_int, default=PREFILL_BATCHED_TOKENS,
        help="tsukimi's tokens per step, the prefill chunk (default: %(default)s, as a prefill instance runs)",
    )
    parser.add_argument("--skip-transformers", action="store_true", help="measure tsukimi only")
    parser.add_argument("--json", action="store_true", help="print one JSON object with `results`")
    add_engine_args(parser)
    parser.set_defaults(run=run)


def measure_tsukimi(engine: LLMEngine, prompts: list[list[int]], gen_len: int) -> EngineResult:
    """Prefill alone (the prompts with one token each, as transformers' prefill is measured), then the prompts again
    with gen_len + 1 tokens, decode timed over the steps that run the whole batch (chunked prefill lets the first
    prompts decode while the last are still prefilling, and lets them finish first); prefix caching must be off."""

    def submit(max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"bench-{time.monotonic_ns()}-{i}", prompt, params)

    submit(1)
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    prefill_s = time.perf_counter() - start
    submit(gen_len + 1)
    started: set[str] = set()
    while len(started) < len(prompts):
        started.update(out.request_id for out in engine.step())
    full_steps: list[float] = []  # every sequence decoding
    while engine.has_unfinished():
        step_start = time.perf_counter()
        outputs = engine.step()
        if len(outputs) == len(prompts):
            full_steps.append(time.perf_counter() - step_start)
    if not full_steps:
        raise CliError(f"no decode step ran the whole batch of {len(prompts)}: raise --gen-len")
    step_s = sum(full_steps) / len(full_steps)
    return EngineResult(
        prefill_tok_s=sum(len(p) for p in prompts) / prefill_s, decode_tok_s=len(prompts) / step_s,
        decode_step_s=step_s,
    )


def _rounded(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def _log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class _Setup:
    engine: LLMEngine
    transformers: TransformersProcess | None
    model_config: LlamaConfig
    dtype: torch.dtype
    bandwidth: float
    peak_flops: float


def _bench_rows(setup: _Setup, args: argparse.Namespace) -> list[BenchRow]:
    return [_bench_row(setup, batch_size, args) for batch_size in args.batch_sizes]


def _bench_row(setup: _Setup, batch_size: int, args: argparse.Namespace) -> BenchRow:
    """Both engines at one batch size, their runs interleaved so that both sample the same machine noise."""
    prompts = random_prompts(batch_size, args.prompt_len, setup.model_config.vocab_size, seed=batch_size)
    measure_tsukimi(setup.engine, prompts[:1], 2)  # warm-up
    ours, theirs = [], []
    for repeat in range(args.repeats):
        _log(f"batch {batch_size}, run {repeat + 1}/{args.repeats}: tsukimi...")
        ours.append(measure_tsukimi(setup.engine, prompts, args.gen_len))
        if setup.transformers is not None:
            _log(f"batch {batch_size}, run {repeat + 1}/{args.repeats}: transformers...")
            theirs.append(setup.transformers.measure(batch_size, args.prompt_len, args.gen_len, seed=batch_size))
    theirs_prefill = _median([r.prefill_tok_s for r in theirs]) if theirs else None
    theirs_decode = _median([r.decode_tok_s for r in theirs]) if theirs else None
    roof = decode_roofline(
        setup.model_config, batch_size, args.prompt_len + args.gen_len / 2, setup.dtype, setup.bandwidth,
        setup.peak_flops,
    )
    streaming = measure_weight_streaming(setup.model_config, batch_size, setup.dtype)
    bound_s = weight_streaming_bound_s(setup.model_config, batch_size, setup.dtype, streaming)
    weight_kv_bound_s = bound_s + roof.kv_bytes / setup.bandwidth
    prefill, decode = _median([r.prefill_tok_s for r in ours]), _median([r.decode_tok_s for r in ours])
    return BenchRow(
        batch_size=batch_size, dtype=args.dtype,
        tsukimi_prefill_tok_s=round(prefill, 1), transformers_prefill_tok_s=_rounded(theirs_prefill, 1),
        tsukimi_decode_tok_s=round(decode, 1), transformers_decode_tok_s=_rounded(theirs_decode, 1),
        prefill_ratio=_rounded(theirs_prefill and prefill / theirs_prefill, 2),
        decode_ratio=_rounded(theirs_decode and decode / theirs_decode, 2),
        roofline_decode_tok_s=round(roof.tok_s, 1),
        tsukimi_decode_step_ms=round(1000 * _median([r.decode_step_s for r in ours]), 2),
        weight_streaming_bound_ms=round(1000 * bound_s, 2),
        weight_kv_bound_ms=round(1000 * weight_kv_bound_s, 2),
        step_to_bound_ratio=round(_median([r.decode_step_s for r in ours]) / weight_kv_bound_s, 2),
    )


def run(args: argparse.Namespace) -> int:
    config = engine_config_from_args(
        args, enable_prefix_caching=False, max_num_seqs=max(args.batch_sizes),
        max_num_batched_tokens=args.max_batched_tokens,
    )
    _log("loading the model...")
    try:
        checkpoint = load_checkpoint(args.model)
        engine = LLMEngine(checkpoint, config)
    except (FileNotFoundError, ValueError) as exc:
        raise CliError(str(exc)) from None
    model_config, dtype = checkpoint.config, config.torch_dtype
    _log("measuring memory bandwidth and matmul peak...")
    bandwidth, peak = measure_memory_bandwidth(), measure_matmul_peak(dtype)
    if checkpoint.is_dummy and not args.skip_transformers:
        _log("random weights (dummy:...): transformers has no model to load, so only tsukimi is measured")
    if args.skip_transformers or checkpoint.is_dummy:
        rows = _bench_rows(_Setup(engine, None, model_config, dtype, bandwidth, peak), args)
    else:
        _log("loading transformers' model in a separate process...")
        with TransformersProcess(checkpoint.path, dtype, args.threads) as transformers:
            rows = _bench_rows(_Setup(engine, transformers, model_config, dtype, bandwidth, peak), args)
    machine = {"memory_bandwidth_gb_s": round(bandwidth / 1e9, 2), "matmul_peak_gflop_s": round(peak / 1e9, 1)}
    if args.json:
        print(json.dumps({"machine": machine, "prompt_len": args.prompt_len, "gen_len": args.gen_len,
                          "results": [asdict(r) for r in rows]}, indent=2))
    else:
        _print_table(rows, machine, args)
    return 0


def _print_table(rows: list[BenchRow], machine: dict[str, float], args: argparse.Namespace) -> None:
    print(f"prompt {args.prompt_len} tokens, decode {args.gen_len} tokens, {args.dtype}, median of {args.repeats}; "
          f"memory {machine['memory_bandwidth_gb_s']} GB/s, matmul peak {machine['matmul_peak_gflop_s']} GFLOP/s")
    header = ("batch", "prefill tok/s", "hf prefill", "ratio", "decode tok/s", "hf decode", "ratio",
              "roofline tok/s", "step ms", "weight bound ms", "+KV bound ms", "step/bound")
    print("  ".join(f"{h:>14}" for h in header))
    for r in rows:
        cells = (r.batch_size, r.tsukimi_prefill_tok_s, r.transformers_prefill_tok_s, r.prefill_ratio,
                 r.tsukimi_decode_tok_s, r.transformers_decode_tok_s, r.decode_ratio, r.roofline_decode_tok_s,
                 r.tsukimi_decode_step_ms, r.weight_streaming_bound_ms, r.weight_kv_bound_ms, r.step_to_bound_ratio)
        print("  ".join(f"{'-' if c is None else c:>14}" for c in cells))
