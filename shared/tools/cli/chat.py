"""`tsukimi chat`: an interactive conversation with the local engine in the terminal (what `make up` starts)."""

from __future__ import annotations

import argparse
import sys

from shared.engine.engine import LLMEngine
from shared.tools.cli.common import add_engine_args
from shared.tools.cli.generate import add_sampling_args, load_engine, sampling_params_from_args
from shared.wire.protocol import SamplingParams

HELP = "Type a message and press Enter. /reset starts over, /exit (or Ctrl-D) quits."


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "chat", help="talk to the model in the terminal",
        description="An interactive chat with the local engine. The whole conversation is re-sent each turn; "
        "the prefix cache makes earlier turns free to recompute. " + HELP,
    )
    parser.add_argument("--system", default=None, help="a system prompt (default: the model's own)")
    add_sampling_args(parser, temperature=0.7)
    add_engine_args(parser)
    parser.set_defaults(run=run, max_tokens=512)


def run(args: argparse.Namespace) -> int:
    params = sampling_params_from_args(args)
    print("tsukimi chat: loading the model...", file=sys.stderr, flush=True)
    engine = load_engine(args)
    print(f"ready ({engine.config.torch_device}, {args.dtype}). {HELP}", file=sys.stderr, flush=True)
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    turn = 0
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            print()
            return 0
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            messages = list(system)
            continue
        if not line:
            continue
        messages.append({"role": "user", "content": line})
        turn += 1
        reply = _answer(engine, messages, params, f"chat-{turn}")
        messages.append({"role": "assistant", "content": reply})


def _answer(engine: LLMEngine, messages: list[dict[str, str]], params: SamplingParams, request_id: str) -> str:
    """Stream one reply; Ctrl-C stops this reply (keeping what was said) without leaving the chat."""
    prompt_ids = engine.tokenizer.encode_chat(messages)
    try:
        engine.add_request(request_id, prompt_ids, params)
    except ValueError as exc:
        print(f"[{exc}; /reset to start over]", file=sys.stderr)
        return ""
    print("model> ", end="", flush=True)
    pieces = []
    done = False
    try:
        while not done:
            for out in engine.step():
                print(out.new_text, end="", flush=True)
                pieces.append(out.new_text)
                done = out.finished
    except KeyboardInterrupt:
        engine.abort(request_id)
        print(" [interrupted]", end="")
    print()
    return "".join(pieces)
