"""`tsukimi keys add|list|remove`: the gateway's API keys file (the format is `shared.wire.api_keys`). A new key
is printed once; the file keeps only its hash.
"""

from __future__ import annotations

import argparse
import secrets
import sys
from pathlib import Path

from shared.tools.cli.common import CliError, positive_int
from shared.wire.api_keys import (
    KEY_PREFIX,
    NAME,
    ApiKey,
    ApiKeys,
    ApiKeysError,
    hash_key,
    read_api_keys,
    write_api_keys,
)


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "keys", help="manage the gateway's API keys (TSUKIMI_API_KEYS_FILE)",
        description="Create, list and remove the gateway's API keys. The file keeps each key's name, SHA-256 hash and "
        "limits, never the key: `add` prints the new key once. Point TSUKIMI_API_KEYS_FILE at the file and clients "
        "send `Authorization: Bearer <key>` (OpenAI clients: api_key=<key>). The gateway reads the file when it "
        "starts: restart it after a change.",
    )
    actions = parser.add_subparsers(dest="keys_action", metavar="ACTION", required=True)
    add = actions.add_parser("add", help="create a key and print it (once)")
    add.add_argument("name", help="the key's name (1-64 letters, digits, '.', '_', '-'); the gateway's logs show it")
    add.add_argument("--file", required=True, type=Path, help="the key file (created if missing)")
    add.add_argument("--rpm", type=positive_int, help="requests per minute (default: unlimited)")
    add.add_argument("--tpm", type=positive_int,
                     help="tokens per minute: prompt plus max_tokens reserved, settled to the real use (default: "
                     "unlimited)")
    add.add_argument("--concurrency", type=positive_int, help="requests in flight at once (default: unlimited)")
    add.set_defaults(run=run_add)
    listing = actions.add_parser("list", help="print the keys' names and limits")
    listing.add_argument("--file", required=True, type=Path, help="the key file")
    listing.set_defaults(run=run_list)
    remove = actions.add_parser("remove", help="delete a key (restart the gateway to apply)")
    remove.add_argument("name", help="the key's name")
    remove.add_argument("--file", required=True, type=Path, help="the key file")
    remove.set_defaults(run=run_remove)


def run_add(args: argparse.Namespace) -> int:
    if not NAME.match(args.name):
        raise CliError(f"a key name is 1-64 letters, digits, '.', '_' or '-', got {args.name!r}")
    keys = _existing(args.file) if args.file.exists() else ApiKeys(())
    if any(k.name == args.name for k in keys.keys):
        raise CliError(f"{args.file} already has a key named {args.name!r} (tsukimi keys remove it first)")
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    entry = ApiKey(args.name, hash_key(key), args.rpm, args.tpm, args.concurrency)
    write_api_keys(args.file, ApiKeys((*keys.keys, entry)))
    print(key)
    print(f"added {args.name!r} to {args.file}; the key is shown only now", file=sys.stderr)
    return 0


def run_list(args: argparse.Namespace) -> int:
    keys = _existing(args.file)
    print(f"{'NAME':<24} {'RPM':>8} {'TPM':>10} {'CONCURRENT':>10}  SHA256")
    for k in keys.keys:
        limits = [str(v) if v else "-" for v in (k.requests_per_minute, k.tokens_per_minute, k.max_concurrent)]
        print(f"{k.name:<24} {limits[0]:>8} {limits[1]:>10} {limits[2]:>10}  {k.sha256[:12]}")
    return 0


def run_remove(args: argparse.Namespace) -> int:
    keys = _existing(args.file)
    kept = tuple(k for k in keys.keys if k.name != args.name)
    if len(kept) == len(keys.keys):
        raise CliError(f"{args.file} has no key named {args.name!r}")
    write_api_keys(args.file, ApiKeys(kept))
    print(f"removed {args.name!r} from {args.file}", file=sys.stderr)
    return 0


def _existing(path: Path) -> ApiKeys:
    try:
        return read_api_keys(path)
    except ApiKeysError as exc:
        raise CliError(str(exc)) from None
