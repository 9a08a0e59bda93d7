"""`tsukimi secrets`: a new deployment's secrets in a private file (docker compose reads it as `.env`), and
`LocalSecrets`, the private files through which `tsukimi up` hands them to its own processes.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from shared.tools.cli.common import CliError
from shared.wire.nats_auth import server_config
from shared.wire.protocol import Subjects
from shared.wire.secrets import ROLES, Secrets, write_private

DESCRIPTION = """\
Write a new set of secrets (readable by its owner only): a NATS password for every role (gateway, scheduler,
prefill, decode, cache-store), each limited to its own subjects by the NATS server (README, Security), and the key
prefill instances sign the cache-store's KV blocks with. docker compose reads the file as .env:

  tsukimi secrets -o .env && docker compose up -d --build

For an existing nats-server, `tsukimi nats config --secrets FILE` writes its configuration, and `tsukimi up
--nats-url URL --nats-secrets FILE` runs the services against it. Replacing the file (--force) changes every
password: restart every service and the NATS server with it.
"""


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser("secrets", help="make a deployment's NATS passwords and block key (.env)",
                                 description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", "-o", metavar="FILE", type=Path, required=True,
                        help="the file to write ('-': standard output, for a shell to redirect)")
    parser.add_argument("--force", action="store_true", help="replace an existing file")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if str(args.output) == "-":
        sys.stdout.write(Secrets.generate().env_text())
        return 0
    if args.output.exists() and not args.force:
        raise CliError(f"{args.output} exists; --force replaces it (every service then needs the new secrets)")
    try:
        write_private(args.output, Secrets.generate().env_text())
    except OSError as exc:
        raise CliError(f"cannot write {args.output}: {exc.strerror}") from None
    print(f"wrote NATS passwords for {', '.join(ROLES)} and the cache block key to {args.output} (mode 0600)",
          file=sys.stderr)
    return 0


@dataclass
class LocalSecrets:
    """`tsukimi up`'s private folder (mode 0700, removed by `close`): each role's NATS password and the block key in
    files of their own, and the embedded server's configuration. A process gets paths, never a secret.

    Args:
        secrets: the secrets.
        folder: where the files go.
    """

    secrets: Secrets
    folder: Path

    @classmethod
    def create(cls, secrets: Secrets) -> LocalSecrets:
        """Write the files into a new private temporary folder."""
        local = cls(secrets, Path(tempfile.mkdtemp(prefix="tsukimi-secrets-")))
        for role in ROLES:
            write_private(local.password_file(role), secrets.passwords[role] + "\n")
        write_private(local.block_key_file, secrets.block_key + "\n")
        return local

    def password_file(self, role: str) -> Path:
        return self.folder / f"{role}.password"

    @property
    def block_key_file(self) -> Path:
        return self.folder / "cache-block.key"

    def server_config_file(self, port: int, subjects: Subjects) -> Path:
        """Write the embedded server's configuration (loopback only) and return its path."""
        path = self.folder / "nats.conf"
        write_private(path, server_config("127.0.0.1", port, self.secrets, subjects))
        return path

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
