"""`tsukimi nats`: the NATS side of tsukimi's security. `config` writes the server configuration an existing
nats-server needs, `serve` runs nats-server from the environment's passwords (the compose file's NATS container).
The passwords themselves come from `tsukimi secrets`.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from shared.tools.cli.common import CliError
from shared.tools.nats_server import NatsServerError, find_nats_server
from shared.wire.nats_auth import ServerTls, server_config
from shared.wire.protocol import Subjects
from shared.wire.secrets import Secrets, SecretsError, write_private

DESCRIPTION = """\
NATS carries every prompt, answer and KV block, so tsukimi's NATS admits only its own roles, each with its own
password and limited to its own subjects (README, Security): the gateway cannot publish KV or heartbeats, only
prefill may put blocks, only prefill and decode may publish on a request's stream, and nobody reads another role's
replies. `tsukimi up` makes fresh passwords every run; containers and existing servers take them from a secrets file.

  tsukimi secrets -o .env                           one password per role (docker compose reads .env)
  tsukimi nats config --secrets .env -o nats.conf   the server configuration for an existing nats-server
  tsukimi nats serve                                run nats-server with the passwords of the environment
"""


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser("nats", help="the NATS server's configuration for tsukimi (config, serve)",
                                 description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    config = verbs.add_parser("config", help="write the server configuration for an existing nats-server",
                              description="The nats-server configuration (include it, or run nats-server -c FILE): "
                                          "one user per role with its permissions, no anonymous access, no "
                                          "JetStream. It holds the passwords: readable by its owner only.")
    config.add_argument("--secrets", metavar="FILE", type=Path, required=True, help="from `tsukimi secrets`")
    config.add_argument("--output", "-o", metavar="FILE", type=Path, required=True, help="the file to write")
    _add_server_args(config)
    config.set_defaults(run=_run_config)
    serve = verbs.add_parser("serve", help="run nats-server with the passwords of the environment",
                             description="Run nats-server (in the foreground, as this process) for tsukimi, with the "
                                         "passwords in NATS_PASSWORD_<ROLE> variables (docker compose passes them "
                                         "from .env). The configuration lives in a private temporary folder.")
    _add_server_args(serve)
    serve.set_defaults(run=_run_serve)


def _add_server_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="0.0.0.0", help="listen address (default: 0.0.0.0)")
    parser.add_argument("--port", type=int, default=4222, help="client port (default: 4222)")
    parser.add_argument("--prefix", default="tsukimi", help="the deployment's TSUKIMI_SUBJECT_PREFIX")
    parser.add_argument("--tls-cert", type=Path, metavar="FILE", help="serve TLS with this certificate")
    parser.add_argument("--tls-key", type=Path, metavar="FILE", help="the certificate's key")
    parser.add_argument("--tls-ca", type=Path, metavar="FILE", help="the CA that client certificates must chain to")
    parser.add_argument("--tls-verify", action="store_true", help="require client certificates (needs --tls-ca)")


def _config_text(args: argparse.Namespace, secrets: Secrets) -> str:
    tls = None
    if args.tls_cert or args.tls_key:
        if not (args.tls_cert and args.tls_key):
            raise CliError("--tls-cert and --tls-key go together")
        tls = ServerTls(args.tls_cert.resolve(), args.tls_key.resolve(), args.tls_ca and args.tls_ca.resolve(),
                        args.tls_verify)
    if args.tls_verify and not (tls and args.tls_ca):
        raise CliError("--tls-verify needs --tls-cert, --tls-key and --tls-ca")
    if not 0 < args.port < 65536:
        raise CliError(f"--port must be in 1..65535, got {args.port}")
    return server_config(args.host, args.port, secrets, Subjects(args.prefix), tls)


def _run_config(args: argparse.Namespace) -> int:
    try:
        secrets = Secrets.read(args.secrets, with_block_key=False)
    except SecretsError as exc:
        raise CliError(str(exc)) from None
    _write(args.output, _config_text(args, secrets))
    return 0


def _run_serve(args: argparse.Namespace) -> int:
    try:
        secrets = Secrets.from_env(os.environ, with_block_key=False)  # the server needs only the passwords
        binary = str(find_nats_server())
    except (SecretsError, NatsServerError) as exc:
        raise CliError(str(exc)) from None
    folder = Path(tempfile.mkdtemp(prefix="tsukimi-nats-"))
    config = folder / "nats.conf"
    write_private(config, _config_text(args, secrets))
    os.execv(binary, [binary, "-c", str(config)])  # nats-server takes this process (PID 1 in a container: signals)


def _write(path: Path, text: str) -> None:
    try:
        write_private(path, text)
    except OSError as exc:
        raise CliError(f"cannot write {path}: {exc.strerror}") from None
