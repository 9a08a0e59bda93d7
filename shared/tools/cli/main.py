"""Entry point of the `tsukimi` command: parses the sub-command and maps user mistakes to exit code 2."""

from __future__ import annotations

import argparse
import importlib
import sys
from types import ModuleType

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


# Each command's module, imported only when its command runs (or every one, for the overview): `tsukimi up` need not
# import torch, which the engine's commands do.
COMMAND_MODULES = {"generate": "generate", "chat": "chat", "bench": "bench_engine", "eval": "eval_kv eval_fastgen",
                   "calibrate": "calibrate", "up": "up", "compose": "compose", "secrets": "secrets", "nats": "nats",
                   "keys": "keys"}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or of `command` alone (its options and help are the same)."""
    parser = argparse.ArgumentParser(
        prog="tsukimi", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in [command] if command in COMMAND_MODULES else COMMAND_MODULES:
        if name == "eval":
            evaluate = commands.add_parser("eval", help="quality evaluations (tsukimi eval kv --help, eval fastgen "
                                                        "--help)")
            kinds = evaluate.add_subparsers(dest="eval", metavar="WHAT", required=True)
            _module("eval_kv").register(kinds)
            _module("eval_fastgen").register(kinds)
        else:
            _module(COMMAND_MODULES[name]).register(commands)
    return parser


def _module(name: str) -> ModuleType:
    return importlib.import_module(f"shared.tools.cli.{name}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv[0] if argv else None)
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except CliError as exc:
        parser.exit(2, f"tsukimi: error: {exc}\n")
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
