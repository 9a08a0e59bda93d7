"""`tsukimi eval kv`: a KV codec's quality against fp16 KV on a text (perplexity, KL, top-1 agreement, compression).

Owns the `eval` command and its `kv` subcommand: arguments and output. Which calibration file a codec uses is
`shared.kvcompress.bundled`'s (as for the engine), the measurement `shared.tools.eval.kv`'s.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from shared.kvcompress.bundled import resolve_calibration
from shared.kvcompress.calibration import KvCalibrationError, load_calibration
from shared.kvcompress.names import CODEC_NAMES, needs_calibration
from shared.model.checkpoint import load_checkpoint
from shared.tools.cli.common import CliError, add_eval_args, emit_eval_result, log, positive_int
from shared.tools.eval.kv import evaluate_codec
from shared.tools.eval.text_spans import CALIBRATION_FRACTION, read_tokens


def register(kinds: argparse._SubParsersAction) -> None:
    """Add `kv` to the `eval` command's subcommands."""
    parser = kinds.add_parser(
        "kv", help="a KV codec's perplexity, KL and top-1 agreement against fp16 KV",
        description="Run the model (fp32, CPU) over --windows windows of --ctx tokens of FILE, once with the KV "
        "codec and once with fp16 KV, and report both perplexities, their relative difference, the mean KL "
        "divergence KL(fp16 || codec) per predicted token, the share of positions whose top-1 token agrees, and "
        "the codec's bits per element and compression against fp16. As in the engine, a token sees the full KV "
        "blocks before its own block through the codec and its own block in full precision. Only the text after "
        f"its first {CALIBRATION_FRACTION:.0%} is evaluated: that first part is what `tsukimi calibrate kv` "
        "calibrates on.",
    )
    parser.add_argument("--codec", required=True, choices=CODEC_NAMES, help="the KV codec to evaluate")
    parser.add_argument(
        "--kv-calib", default=None, metavar="PATH",
        help="calibration file for kvquant-* codecs (default: the one bundled for the default model, if any)",
    )
    parser.add_argument("--text", required=True, metavar="FILE", help="a UTF-8 text file")
    parser.add_argument("--windows", type=positive_int, default=8, help="windows evaluated (default: 8)")
    parser.add_argument("--ctx", type=positive_int, default=1024, help="tokens per window (default: 1024)")
    parser.add_argument("--block-size", type=positive_int, default=64, help="tokens per KV block (default: 64)")
    add_eval_args(parser)
    parser.set_defaults(run=run)


def _calibration_path(args: argparse.Namespace) -> Path | None:
    """--codec's calibration file: --kv-calib, else the one bundled for the default model (`bundled`); CliError if
    the codec needs one and there is none, or --kv-calib is given to a codec that takes none."""
    if args.model is not None and args.kv_calib is None and needs_calibration(args.codec):
        raise CliError(
            f"KV codec {args.codec} needs a calibration of this model (the bundled ones are for the default model): "
            "make one with `tsukimi calibrate kv --model ...` and pass --kv-calib PATH"
        )
    try:
        return resolve_calibration(args.codec, args.kv_calib)
    except KvCalibrationError as exc:
        raise CliError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    if args.ctx < args.block_size:
        raise CliError(f"--ctx {args.ctx} is below the block size {args.block_size}: a window needs a full block")
    calibration_path = _calibration_path(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    log("loading the model...")
    try:
        calibration = None if calibration_path is None else load_calibration(calibration_path)
        checkpoint = load_checkpoint(args.model)
        tokens = read_tokens(args.text, checkpoint.tokenizer)
        result = evaluate_codec(
            checkpoint, args.codec, calibration, tokens, args.ctx, args.windows, args.block_size,
            progress=lambda index, count: log(f"window {index}/{count}"),
        )
    except (FileNotFoundError, ValueError) as exc:  # TextSpanError and KvCalibrationError are ValueErrors
        raise CliError(str(exc)) from None
    result["kv_calib"] = None if calibration_path is None else str(calibration_path)
    return emit_eval_result(result, args, start, args.ctx, _print_table)


def _print_table(result: dict[str, Any]) -> None:
    windows = f"{result['num_windows']} window{'s' if result['num_windows'] != 1 else ''}"
    print(f"{windows} x {result['ctx']} tokens of {result['text']} ({result['num_predictions']} predictions), "
          f"{result['block_size']}-token blocks, {result['elapsed_s']} s")
    header = ("codec", "ppl", "ppl fp16", "rel ppl", "KL", "top-1", "bits/elem", "compression")
    cells = (
        result["codec"], f"{result['ppl']:.4f}", f"{result['ppl_fp16']:.4f}",
        f"{100 * result['rel_ppl_increase']:+.3f}%", f"{result['kl']:.5f}", f"{100 * result['top1_agreement']:.2f}%",
        f"{result['bits_per_element']:.3f}", f"{result['compression']:.2f}x",
    )
    print("  ".join(f"{h:>12}" for h in header))
    print("  ".join(f"{c:>12}" for c in cells))
