"""`tsukimi generate`: one prompt through the local engine, streamed to the terminal or reported as JSON."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass

from shared.engine.engine import LLMEngine
from shared.tools.cli.common import CliError, add_engine_args, engine_config_from_args, positive_int
from shared.wire.protocol import SamplingParams


def add_sampling_args(parser: argparse.ArgumentParser, temperature: float) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=positive_int, default=128, help="most tokens to generate (default: 128)")
    group.add_argument(
        "--temperature", type=float, default=temperature, help=f"0 is greedy (default: {temperature})"
    )
    group.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0, off)")
    group.add_argument("--top-k", type=int, default=0, help="keep the k likeliest tokens (default: 0, off)")
    group.add_argument("--seed", type=int, default=None, help="same seed, same output")
    group.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    try:
        return SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            seed=args.seed, stop=list(args.stop),
        )
    except ValueError as exc:
        raise CliError(str(exc)) from None


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "generate", help="complete one prompt",
        description="Complete PROMPT with the local engine. Text streams to stdout as it is generated; with "
        "--json one object is printed at the end instead (text, prompt_tokens, completion_tokens, "
        "finish_reason, ttft_s, decode_tok_s).",
    )
    parser.add_argument("prompt", metavar="PROMPT", help="the text to complete (use - to read stdin)")
    parser.add_argument("--chat", action="store_true", help="wrap PROMPT as a user message in the chat template")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    add_sampling_args(parser, temperature=0.0)
    add_engine_args(parser)
    parser.set_defaults(run=run)


@dataclass
class Timings:
    start: float
    first_token: float | None = None
    end: float | None = None


def load_engine(args: argparse.Namespace) -> LLMEngine:
    """The engine for `--model` etc.; a missing or unreadable model is a user error (exit 2)."""
    config = engine_config_from_args(args)
    try:
        return LLMEngine.from_path(args.model, config)
    except (FileNotFoundError, ValueError) as exc:
        raise CliError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt:
        raise CliError("the prompt is empty")
    params = sampling_params_from_args(args)
    engine = load_engine(args)
    tokenizer = engine.tokenizer
    prompt_ids = tokenizer.encode_chat([{"role": "user", "content": prompt}]) if args.chat else tokenizer.encode(prompt)
    try:
        engine.add_request("generate", prompt_ids, params)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    timings = Timings(time.perf_counter())
    pieces: list[str] = []
    finish_reason, completion_tokens = None, 0
    while finish_reason is None:
        for out in engine.step():
            timings.first_token = timings.first_token or time.perf_counter()
            pieces.append(out.new_text)
            completion_tokens = out.num_output_tokens
            finish_reason = out.finish_reason
            if not args.json:
                print(out.new_text, end="", flush=True)
    timings.end = time.perf_counter()
    if args.json:
        print(json.dumps(_report("".join(pieces), len(prompt_ids), completion_tokens, finish_reason.value, timings)))
    else:
        print()
    return 0


def _report(text: str, prompt_tokens: int, completion_tokens: int, reason: str, t: Timings) -> dict[str, object]:
    assert t.first_token is not None and t.end is not None
    decode_s = t.end - t.first_token
    return {
        "text": text,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "finish_reason": reason,
        "ttft_s": round(t.first_token - t.start, 4),
        "decode_tok_s": round((completion_tokens - 1) / decode_s, 2) if completion_tokens > 1 and decode_s else None,
    }
