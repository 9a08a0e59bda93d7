"""`tsukimi eval fastgen`: FastGen's adaptive KV eviction against the full cache on a text's continuations, with
StreamingLLM and H2O at the same memory, and optionally both the full cache and FastGen over a KV codec.

Owns the `fastgen` subcommand of `eval` (the `eval` command itself is `eval_kv`'s): arguments and output. The
measurement is `shared.tools.eval.fastgen`'s.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from shared.fastgen.policies import PAPER_WIDER_LOCAL, TSUKIMI_WIDER_LOCAL, FastGenSettings, parse_shares
from shared.model.checkpoint import load_checkpoint
from shared.tools.cli.common import CliError, add_eval_args, emit_eval_result, log, positive_int
from shared.tools.eval.fastgen import WindowSpec, evaluate_fastgen
from shared.tools.eval.fastgen_codecs import DEFAULT_BLOCK_SIZE, LANE_CODECS, build_kv_serving
from shared.tools.eval.text_spans import CALIBRATION_FRACTION, read_tokens


def register(kinds: argparse._SubParsersAction) -> None:
    """Add `fastgen` to the `eval` command's subcommands."""
    policies = ", ".join(FastGenSettings().labels())
    paper = ", ".join(FastGenSettings(wider_local=PAPER_WIDER_LOCAL, frequent_alone=True).labels())
    parser = kinds.add_parser(
        "fastgen", help="FastGen's adaptive KV eviction against the full cache, StreamingLLM and H2O",
        description="Run the model (fp32, CPU) over --windows windows of FILE: each a prompt of --prompt-len tokens "
        "(full attention; FastGen profiles it), then the next --gen-len tokens fed one at a time as if generated. "
        "Per layer and KV head FastGen keeps, for the whole continuation, the cheapest policy whose kept keys "
        "recover at least --threshold of the prompt's attention mass (the minimum over the head's query heads of "
        f"the mean over the profiled rows); policies, cheapest first: {policies} (the FastGen paper's, with "
        f"--wider-local none --frequent-alone: {paper}). Reports the continuation "
        "perplexity with the full cache and with FastGen, their relative difference, KL(full || FastGen) per "
        "prediction, top-1 agreement, the fraction of KV kept (each decode step's kept (token, head, layer) "
        "entries over all, averaged over the steps) and the policies chosen; and the same figures for "
        "StreamingLLM (4 sinks plus the newest) and H2O (half heavy hitters, half newest) given FastGen's kept "
        f"fraction per window and layer, spread evenly over heads. With --kv-codec, the same figures (against the "
        "uncoded full cache) for the full cache and FastGen as the engine serves them over the codec in "
        "--kv-block-size blocks: the full cache reads every block before the step's own decoded (as `tsukimi eval "
        "kv`); FastGen reads kvquant records (one an entry, keys coded before RoPE, written from the pool's "
        "values: the prompt's full blocks are coded twice) but for the newest W positions, kept whole in a ring; "
        "the first token is kept whole (fp16) in both. Also the record size and coded FastGen's KV bytes over the full "
        "cache's fp16 bytes (its records plus the ring, counted as fp16). "
        f"Only the text after its first {CALIBRATION_FRACTION:.0%} is read, as for `tsukimi eval kv`.",
    )
    parser.add_argument("--text", required=True, metavar="FILE", help="a UTF-8 text file")
    parser.add_argument(
        "--threshold", type=float, default=0.95, metavar="T",
        help="attention mass a head's kept keys must recover, in (0, 1] (default: 0.95)",
    )
    parser.add_argument("--prompt-len", type=positive_int, default=512, help="prompt tokens (default: 512)")
    parser.add_argument("--gen-len", type=positive_int, default=256, help="continuation tokens (default: 256)")
    parser.add_argument("--windows", type=positive_int, default=4, help="windows evaluated (default: 4)")
    parser.add_argument(
        "--r-local", type=float, default=0.3, help="local window, a share of the length, in [0, 1] (default: 0.3)"
    )
    parser.add_argument(
        "--r-frequent", type=float, default=0.3,
        help="heavy-hitter budget, a share of the length, in [0, 1] (default: 0.3)",
    )
    parser.add_argument(
        "--wider-local", type=_shares, default=TSUKIMI_WIDER_LOCAL, metavar="LIST",
        help="wider windows, increasing shares above --r-local, each a policy (with the heavy hitters) tried before "
        "the full cache; none for the paper's ladder (default: " + ",".join(map(str, TSUKIMI_WIDER_LOCAL)) + ")",
    )
    parser.add_argument(
        "--frequent-alone", action="store_true",
        help="make heavy hitters without the local window a policy, as the paper does (default: not)",
    )
    parser.add_argument(
        "--profile-rows", type=positive_int, default=None, metavar="W",
        help="profile on the prompt's last W query rows (default: every row); costs heads x W x prompt-len "
        "float64 per layer",
    )
    parser.add_argument(
        "--kv-codec", default=None, choices=LANE_CODECS,
        help="also decode the full cache and FastGen as the engine serves them over this codec (default: none)",
    )
    parser.add_argument(
        "--kv-block-size", type=positive_int, default=None, metavar="W",
        help=f"tokens per KV block with --kv-codec, and FastGen's exact ring of the newest tokens (default: "
        f"{DEFAULT_BLOCK_SIZE}, the engine's)",
    )
    parser.add_argument(
        "--kv-calib", default=None, metavar="PATH",
        help="the --kv-codec's calibration from `tsukimi calibrate kv` (default: the one shipped for SmolLM2)",
    )
    add_eval_args(parser)
    parser.set_defaults(run=run)


def _shares(text: str) -> tuple[float, ...]:
    try:
        return parse_shares(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _settings(args: argparse.Namespace) -> tuple[FastGenSettings, WindowSpec]:
    try:
        settings = FastGenSettings(args.threshold, args.r_local, args.r_frequent, args.profile_rows,
                                   args.wider_local, args.frequent_alone)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if args.profile_rows is not None and args.profile_rows > args.prompt_len:
        raise CliError(f"--profile-rows {args.profile_rows} exceeds --prompt-len {args.prompt_len}")
    for option, value in (("--kv-calib", args.kv_calib), ("--kv-block-size", args.kv_block_size)):
        if value is not None and args.kv_codec is None:
            raise CliError(f"{option} needs --kv-codec")
    return settings, WindowSpec(args.prompt_len, args.gen_len, args.windows)


def run(args: argparse.Namespace) -> int:
    settings, spec = _settings(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    log("loading the model...")
    try:
        checkpoint = load_checkpoint(args.model)
        codec = None if args.kv_codec is None else build_kv_serving(
            args.kv_codec, checkpoint.config, args.kv_calib, args.kv_block_size or DEFAULT_BLOCK_SIZE
        )
        tokens = read_tokens(args.text, checkpoint.tokenizer)
        result = evaluate_fastgen(
            checkpoint, tokens, settings, spec, progress=lambda index, count: log(f"window {index}/{count}"),
            codec=codec,
        )
    except (FileNotFoundError, ValueError) as exc:  # TextSpanError is a ValueError
        raise CliError(str(exc)) from None
    return emit_eval_result(result, args, start, spec.window_len, _print_table)


def _print_table(result: dict[str, Any]) -> None:
    windows = f"{result['num_windows']} window{'s' if result['num_windows'] != 1 else ''}"
    print(f"{windows} x ({result['prompt_len']} prompt + {result['gen_len']} continuation) tokens of "
          f"{result['text']} ({result['num_predictions']} predictions), T={result['threshold']}, "
          f"r_l={result['r_local']}, r_f={result['r_frequent']}, wider windows {result['wider_local'] or 'none'}"
          f"{', heavy hitters alone' if result['frequent_alone'] else ''}, {result['profile_rows']} profiled rows, "
          f"{result['elapsed_s']} s (prefill {result['prefill_s']} s, of which profiling {result['profile_s']} s)")
    rows = {"full": {"ppl": result["ppl_full"], "rel_ppl_increase": 0.0, "kl": 0.0, "top1_agreement": 1.0,
                     "kv_kept_fraction": 1.0},
            "fastgen": result, **result["baselines"]}
    if "codec" in result:
        rows |= {f"{name}+{result['codec']['name']}": result["codec"][name] for name in ("full", "fastgen")}
    width = max(14, *(len(name) for name in rows))
    header = ("method", "ppl", "rel ppl", "KL", "top-1", "KV kept")
    print("  ".join(f"{h:>{width}}" for h in header))
    for name, figures in rows.items():
        cells = (
            name, f"{figures['ppl']:.4f}", f"{100 * figures['rel_ppl_increase']:+.3f}%", f"{figures['kl']:.5f}",
            f"{100 * figures['top1_agreement']:.2f}%", f"{100 * figures['kv_kept_fraction']:.2f}%",
        )
        print("  ".join(f"{c:>{width}}" for c in cells))
    histogram = ", ".join(f"{label} {count}" for label, count in result["policy_histogram"].items())
    print(f"policies (layer x KV head x window): {histogram}")
    if "codec" in result:
        codec = result["codec"]
        print(f"{codec['name']} in {codec['block_size']}-token blocks; FastGen's lanes: {codec['entry_bytes']} bytes "
              f"an entry against {codec['fp16_entry_bytes']} in fp16, plus the newest {codec['block_size']} whole: "
              f"{100 * codec['kv_bytes_fraction']:.2f}% of the full cache's fp16 bytes")
