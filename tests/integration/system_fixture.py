"""The whole system for integration tests: `tsukimi up` as a real child process (2 prefill, 2 decode, a cache-store,
the scheduler and the gateway) around a nats-server the test also connects to, so it can watch the subjects. The
server admits each role with its own password (`--nats-secrets`) and the test as a watcher allowed everything."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.tools.nats_server import EmbeddedNatsServer, free_port
from shared.wire.nats_auth import ExtraUser, NatsCredentials
from shared.wire.secrets import Secrets, write_private

STARTUP_S = 300.0  # five model loads on two busy cores
WATCHER = ExtraUser("itest-watcher", "itest-watcher-password-0123456789")


@dataclass
class System:
    process: subprocess.Popen[bytes]
    nats: EmbeddedNatsServer
    port: int
    log_dir: Path
    stdout_path: Path

    @property
    def watcher(self) -> NatsCredentials:
        """Credentials that may publish and subscribe anywhere (a test watching, or forging, messages)."""
        return NatsCredentials(WATCHER.name, WATCHER.password)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def post(self, path: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], Any]:
        """POST JSON (or raw bytes); returns status, headers, parsed JSON body."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        request = urllib.request.Request(
            self.base_url + path, data=data, method="POST",
            headers={"Content-Type": "application/json", **(headers or {})},
        )
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return response.status, dict(response.headers), json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, dict(exc.headers), json.loads(exc.read())

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.base_url + path, timeout=10) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def service_pids(self) -> dict[str, int]:
        """Every live process started for this system: TSUKIMI_INSTANCE_ID -> pid (found through /proc)."""
        found = {}
        marker = f"TSUKIMI_NATS_URL={self.nats.url}".encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                environ = (entry / "environ").read_bytes().split(b"\0")
                state = (entry / "stat").read_text().split()[2]
            except OSError:
                continue
            if marker in environ and state != "Z":
                ids = [e for e in environ if e.startswith(b"TSUKIMI_INSTANCE_ID=")]
                found[ids[0].split(b"=", 1)[1].decode() if ids else f"pid-{entry.name}"] = int(entry.name)
        return found


def start_system(tmp: Path, env_overrides: dict[str, str] | None = None, args: list[str] | None = None) -> System:
    secrets = Secrets.generate()
    nats = EmbeddedNatsServer(auth=secrets, extra_users=(WATCHER,)).start()
    port = free_port()
    log_dir, stdout_path = tmp / "logs", tmp / "up.out"
    secrets_file = tmp / "nats-secrets.env"
    write_private(secrets_file, secrets.env_text())
    env = {k: v for k, v in os.environ.items() if not k.startswith("TSUKIMI_")}
    env |= {"TSUKIMI_DTYPE": "fp32",  # the dtype the oracle tests check; `tsukimi up` would pick bf16 on AMX CPUs
            "TSUKIMI_KV_CACHE_MB": "64", "TSUKIMI_CACHE_DRAM_MB": "256", "TSUKIMI_NUM_THREADS": "1",
            "TSUKIMI_HEARTBEAT_S": "0.3", "TSUKIMI_KV_COMPRESS": "on",  # exercise the LZ4 path end to end
            # these tests are about function, not overload: on a busy 2-core CI machine the Conductor once predicted
            # a 100 s first token, and once a 1.4 s gap between tokens on a decode instance that also prefills, and
            # turned the request away (429) under the defaults (test_faults sets its own)
            "TSUKIMI_SLO_TTFT_MS": "600000", "TSUKIMI_SLO_TBT_MS": "600000"}
    env |= env_overrides or {}
    cmd = [sys.executable, "-m", "shared", "up", "--prefill", "2", "--decode", "2", "--port", str(port),
           "--nats-url", nats.url, "--nats-secrets", str(secrets_file), "--log-dir", str(log_dir), *(args or [])]
    with open(stdout_path, "wb") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    system = System(process, nats, port, log_dir, stdout_path)
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"tsukimi up exited with {process.returncode}: {stdout_path.read_text()}")
        if "tsukimi is up" in stdout_path.read_text() and system.get("/health")[0] == 200:
            return system
        time.sleep(0.5)
    stop_system(system)
    raise RuntimeError(f"tsukimi up was not healthy after {STARTUP_S} s: {stdout_path.read_text()}")


def stop_system(system: System) -> tuple[int | None, float]:
    """SIGINT, as Ctrl-C would; returns (exit code, seconds it took)."""
    started = time.monotonic()
    system.process.send_signal(signal.SIGINT)
    try:
        code: int | None = system.process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        system.process.kill()
        code = None
    took = time.monotonic() - started
    system.nats.stop()
    return code, took
