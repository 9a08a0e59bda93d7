"""A system under measurement: a fresh `tsukimi up` (with its own nats-server and passwords), a free loopback port and
a log folder (start, wait for GET /health, stop with SIGINT as Ctrl-C would), and the scheduler's placements read
back from its log. It sends no workload.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
# One torch thread per engine (several engines share the cores) and fast heartbeats; the caller's TSUKIMI_* win.
DEFAULT_ENV = {"TSUKIMI_CACHE_DRAM_MB": "256", "TSUKIMI_NUM_THREADS": "1", "TSUKIMI_HEARTBEAT_S": "0.3"}
STOP_WAIT_S = 20.0  # `tsukimi up` stops everything within 10 s of SIGINT


class StartError(RuntimeError):
    """The system did not come up; the message says why and where the logs are."""


@dataclass(frozen=True)
class SystemSpec:
    """What to start.

    Attributes:
        policy: placement policy (a colocated system: its routing).
        num_prefill, num_decode: the pools; ignored when `colocated` > 0.
        colocated: that many instances that prefill and decode (the vLLM-style baseline), no prefill pool.
        cpp_group: prefill instances per pipeline group (`tsukimi up --cpp-group`; 1: none).
        engine, profile: `real`, or `sim` with a profile of shared.sim.profiles.
        rejection, slo_ttft_ms, slo_tbt_ms: the scheduler's early rejection and SLOs (None: the defaults).
        env: more TSUKIMI_* settings; they win over `DEFAULT_ENV` and this shell's.
    """

    policy: str
    num_prefill: int = 2
    num_decode: int = 2
    num_cache_stores: int = 2
    colocated: int = 0
    cpp_group: int = 1
    engine: str = "real"
    profile: str | None = None
    rejection: str = "off"
    slo_ttft_ms: float | None = None
    slo_tbt_ms: float | None = None
    kv_cache_mb: int = 64
    startup_timeout_s: float = 300.0
    env: dict[str, str] = field(default_factory=dict)

    def command(self, port: int, log_dir: Path) -> list[str]:
        """The `tsukimi up` command line for this spec."""
        cmd = [
            sys.executable,
            "-m",
            "shared",
            "up",
            "--cache-stores",
            str(self.num_cache_stores),
            "--policy",
            self.policy,
            "--rejection",
            self.rejection,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-dir",
            str(log_dir),
            "--startup-timeout",
            str(self.startup_timeout_s),
        ]
        cmd += (
            ["--colocated", str(self.colocated)]
            if self.colocated
            else ["--prefill", str(self.num_prefill), "--decode", str(self.num_decode)]
        )
        if self.cpp_group > 1:
            cmd += ["--cpp-group", str(self.cpp_group)]
        if self.engine != "real":
            cmd += ["--engine", self.engine] + (["--profile", self.profile] if self.profile else [])
        for flag, value in (("--slo-ttft-ms", self.slo_ttft_ms), ("--slo-tbt-ms", self.slo_tbt_ms)):
            if value is not None:
                cmd += [flag, str(value)]
        return cmd


@dataclass
class RunningSystem:
    process: subprocess.Popen[bytes]
    base_url: str
    log_dir: Path
    up_log: Path  # `tsukimi up`'s own output


def start_system(spec: SystemSpec, log_dir: Path, say: Callable[[str], None]) -> RunningSystem:
    """Start `python -m shared up` for `spec`, and wait until /health answers 200.

    Raises:
        StartError: `tsukimi up` exited, or /health was not 200 in time (all is stopped then).
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    # A sim system takes its own defaults (shared.sim.profiles.SIM_ENV_DEFAULTS) where the spec sets nothing.
    defaults = {} if spec.engine == "sim" else {**DEFAULT_ENV, "TSUKIMI_KV_CACHE_MB": str(spec.kv_cache_mb)}
    env = {**defaults, **os.environ, **spec.env}
    up_log = log_dir / "bench-up.log"
    with open(up_log, "wb") as out:
        process = subprocess.Popen(
            spec.command(port, log_dir),
            cwd=REPO_ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    system = RunningSystem(process, f"http://127.0.0.1:{port}", log_dir, up_log)
    try:
        _wait_healthy(system, spec.startup_timeout_s, say)
    except BaseException:
        stop_system(system)
        raise
    return system


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_healthy(system: RunningSystem, timeout_s: float, say: Callable[[str], None]) -> None:
    started = time.monotonic()
    next_note = started + 30.0
    while time.monotonic() - started < timeout_s:
        if system.process.poll() is not None:
            raise StartError(f"tsukimi up exited with code {system.process.returncode}: {_tail(system.up_log)}")
        if "tsukimi is up" in system.up_log.read_text(errors="replace") and _health(system.base_url) == 200:
            return
        if time.monotonic() >= next_note:
            next_note += 30.0
            say(f"still starting ({time.monotonic() - started:.0f} s)")
        time.sleep(0.5)
    raise StartError(f"/health was not 200 after {timeout_s:.0f} s: {_tail(system.up_log)}")


def _health(base_url: str) -> int | None:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback only, never a proxy
    try:
        with opener.open(f"{base_url}/health", timeout=2.0) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def _tail(path: Path, num_lines: int = 6) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()[-num_lines:]
    except OSError:
        return "(no output)"
    return " | ".join(line.strip() for line in lines) or "(no output)"


def stop_system(system: RunningSystem) -> tuple[int | None, float]:
    """SIGINT to `tsukimi up` (SIGKILL after STOP_WAIT_S; it stops its NATS); returns (exit code or None, seconds)."""
    started = time.monotonic()
    code: int | None = system.process.poll()
    if code is None:
        system.process.send_signal(signal.SIGINT)
        try:
            code = system.process.wait(timeout=STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            system.process.kill()
            system.process.wait()
            code = None
    return code, time.monotonic() - started


def placement_counts(log_dir: Path, request_prefix: str = "", pattern: str = "scheduler*.log") -> dict[str, int]:
    """What the scheduler decided for the requests whose id starts with `request_prefix`, from its JSON log lines
    (`"event": "placed"` / `"rejected"`): placed, fetch_from_pool true/false, on_decode, reused blocks, and
    placements per prefill and decode instance. Empty when there is no scheduler log."""
    counts: Counter[str] = Counter()
    for path in sorted(log_dir.glob(pattern)):
        for line in path.read_text(errors="replace").splitlines():
            if '"event": "placed"' not in line and '"event": "rejected"' not in line:
                continue
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if str(event.get("request_id", "")).startswith(request_prefix):
                _count(event, counts)
    return dict(counts)


def _count(event: dict[str, object], counts: Counter[str]) -> None:
    if event["event"] == "rejected":
        counts["rejected"] += 1
        return
    counts["placed"] += 1
    counts["fetch_from_pool_true" if event.get("fetch_from_pool") else "fetch_from_pool_false"] += 1
    counts["on_decode_true"] += bool(event.get("on_decode"))
    reused = event.get("reused_blocks")
    counts["reused_blocks"] += reused if isinstance(reused, int) else 0
    counts[f"prefill:{event.get('prefill')}"] += 1
    counts[f"decode:{event.get('decode')}"] += 1
