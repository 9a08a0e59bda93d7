"""`tsukimi secrets`, `tsukimi nats config` and `tsukimi nats serve` (what compose's NATS container runs) for real:
the secrets file is private and complete, the configuration a nats-server accepts, and the served NATS admits the
roles' passwords and refuses everyone else."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from shared.tools.nats_server import find_nats_server, free_port, wait_for_port
from shared.wire.bus import Bus, BusError
from shared.wire.nats_auth import NatsCredentials, inbox_prefix
from shared.wire.protocol import Subjects
from shared.wire.secrets import ROLES, Secrets, parse_env_file, password_variable


def _tsukimi(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shared", *args], capture_output=True, text=True, env=env,
                          timeout=60)


def test_secrets_are_private_complete_and_not_replaced_by_accident(tmp_path: Path) -> None:
    path = tmp_path / ".env"
    done = _tsukimi("secrets", "-o", str(path))
    assert done.returncode == 0, done.stderr
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    secrets = Secrets.read(path)
    assert set(secrets.passwords) == set(ROLES) and secrets.block_key
    assert len(set(secrets.passwords.values()) | {secrets.block_key}) == len(ROLES) + 1  # all different
    assert secrets.block_key not in done.stderr + done.stdout
    again = _tsukimi("secrets", "-o", str(path))
    assert again.returncode == 2 and "--force" in again.stderr
    assert Secrets.read(path) == secrets


def test_secrets_go_to_standard_output_for_a_shell_to_redirect() -> None:
    done = _tsukimi("secrets", "-o", "-")
    assert done.returncode == 0, done.stderr
    secrets = Secrets.from_env(parse_env_file(done.stdout))
    assert set(secrets.passwords) == set(ROLES) and secrets.block_key


def test_the_written_configuration_is_one_nats_server_accepts(tmp_path: Path) -> None:
    secrets, conf = tmp_path / ".env", tmp_path / "nats.conf"
    assert _tsukimi("secrets", "-o", str(secrets)).returncode == 0
    assert _tsukimi("nats", "config", "--secrets", str(secrets), "-o", str(conf), "--port", "4333").returncode == 0
    checked = subprocess.run([str(find_nats_server()), "-c", str(conf), "-t"], capture_output=True, text=True)
    assert checked.returncode == 0 and "is valid" in checked.stdout + checked.stderr
    assert stat.S_IMODE(conf.stat().st_mode) == 0o600  # it holds the passwords
    assert "jetstream" not in conf.read_text().lower()


def test_nats_serve_admits_the_roles_and_refuses_everyone_else(tmp_path: Path) -> None:
    """As compose's NATS container: only the NATS passwords in the environment (no block key)."""
    secrets = Secrets.generate()
    env = {**os.environ, **{password_variable(r): p for r, p in secrets.passwords.items()}}
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "shared", "nats", "serve", "--host", "127.0.0.1", "--port",
                               str(port)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        assert wait_for_port("127.0.0.1", port, 10), "tsukimi nats serve did not listen within 10 s"
        asyncio.run(_connect_as_roles(f"nats://127.0.0.1:{port}", secrets))
    finally:
        server.terminate()
        server.wait(10)
    missing = _tsukimi("nats", "serve", "--host", "127.0.0.1", "--port", str(free_port()),
                       env={k: v for k, v in env.items() if k != password_variable("decode")})
    assert missing.returncode == 2 and "NATS_PASSWORD_DECODE is not set" in missing.stderr


async def _connect_as_roles(url: str, secrets: Secrets) -> None:
    for role in ROLES:
        bus = await Bus.connect(url, role, Subjects(), NatsCredentials(role, secrets.passwords[role],
                                                                       inbox_prefix(role)), connect_timeout_s=5)
        await bus.drain()
    with pytest.raises(BusError, match="refused"):
        await Bus.connect(url, "anonymous", Subjects(), connect_timeout_s=3)


def test_an_env_file_is_read_as_compose_reads_it() -> None:
    assert parse_env_file("# a comment\n\nA=1\nB = two \nnot a line\n") == {"A": "1", "B": "two"}
