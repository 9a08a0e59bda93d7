"""Entry point of the `tsukimi` command: parses the sub-command and maps user mistakes to exit code 2."""

from __future__ import annotations

import argparse
import sys

from shared.tools.cli import (
    bench_engine,
    calibrate,
    chat,
    compose,
    eval_fastgen,
    eval_kv,
    generate,
    keys,
    nats,
    secrets,
    up,
)
from shared.tools.cli.common import CliError

DESCRIPTION = """\
tsukimi: a KVCache-centric LLM serving system (Mooncake's architecture, in Python).

Commands:
  generate   complete one prompt with the local engine and print it (or --json)
  chat       talk to the model in the terminal
  bench      measure the engine against Hugging Face transformers on this machine
  eval       measure quality: a KV codec against fp16 KV (eval kv), FastGen's eviction against the full cache
             (eval fastgen)
  calibrate  learn a KVQuant calibration (Fisher-weighted codebooks, key ranges) from text
  up         run the whole system locally: nats-server plus every service, OpenAI-compatible API
  compose    print docker-compose.yml for the same topology
  secrets    a deployment's secrets: a NATS password per role and the cache block key (.env for compose)
  nats       the NATS server's configuration that limits each role to its own subjects
  keys       create, list and remove the gateway's API keys (TSUKIMI_API_KEYS_FILE)
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tsukimi", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    generate.register(commands)
    chat.register(commands)
    bench_engine.register(commands)
    evaluate = commands.add_parser("eval", help="quality evaluations (tsukimi eval kv --help, eval fastgen --help)")
    kinds = evaluate.add_subparsers(dest="eval", metavar="WHAT", required=True)
    eval_kv.register(kinds)
    eval_fastgen.register(kinds)
    calibrate.register(commands)
    up.register(commands)
    compose.register(commands)
    secrets.register(commands)
    nats.register(commands)
    keys.register(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except CliError as exc:
        parser.exit(2, f"tsukimi: error: {exc}\n")
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
