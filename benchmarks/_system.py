"""The system under a benchmark: a fresh `tsukimi up` with its own embedded nats-server, a free loopback port and a
log folder (start, wait for GET /health, stop with SIGINT as Ctrl-C would), one streamed chat request timed by the
client, and the scheduler's placements read back from its log. No workload here, and nothing from tests/.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from shared.nats_server import EmbeddedNatsServer, NatsServerError, free_port

REPO_ROOT = Path(__file__).resolve().parents[1]
# As the integration tests run the system: one torch thread per engine (4 engines share the cores), fast heartbeats.
# The caller's TSUKIMI_* variables win over these.
DEFAULT_ENV = {"TSUKIMI_CACHE_DRAM_MB": "256", "TSUKIMI_NUM_THREADS": "1", "TSUKIMI_HEARTBEAT_S": "0.3"}
STOP_WAIT_S = 20.0  # `tsukimi up` stops everything within 10 s of SIGINT


class StartError(RuntimeError):
    """The system did not come up; the message says why and where the logs are."""


@dataclass(frozen=True)
class SystemSpec:
    """What to start: the topology, the policy, an engine's KV pool and how long to wait for health."""

    policy: str
    num_prefill: int = 2
    num_decode: int = 2
    num_cache_stores: int = 2
    kv_cache_mb: int = 64
    startup_timeout_s: float = 300.0


@dataclass
class RunningSystem:
    process: subprocess.Popen[bytes]
    nats: EmbeddedNatsServer
    base_url: str
    log_dir: Path
    up_log: Path  # `tsukimi up`'s own output


def start_system(spec: SystemSpec, log_dir: Path, say: Callable[[str], None]) -> RunningSystem:
    """Start NATS and `python -m shared up` with early rejection off, and wait until /health answers 200.

    Raises:
        StartError: NATS did not start, `tsukimi up` exited, or /health was not 200 in time (all is stopped then).
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        nats = EmbeddedNatsServer(log_path=log_dir / "bench-nats.log").start()
    except NatsServerError as exc:
        raise StartError(str(exc)) from None
    port = free_port()
    cmd = [sys.executable, "-m", "shared", "up", "--prefill", str(spec.num_prefill), "--decode", str(spec.num_decode),
           "--cache-stores", str(spec.num_cache_stores), "--policy", spec.policy, "--rejection", "off",
           "--host", "127.0.0.1", "--port", str(port), "--nats-url", nats.url, "--log-dir", str(log_dir),
           "--startup-timeout", str(spec.startup_timeout_s)]
    env = {**DEFAULT_ENV, **os.environ, "TSUKIMI_KV_CACHE_MB": str(spec.kv_cache_mb)}
    up_log = log_dir / "bench-up.log"
    with open(up_log, "wb") as out:
        process = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                   stderr=subprocess.STDOUT)
    system = RunningSystem(process, nats, f"http://127.0.0.1:{port}", log_dir, up_log)
    try:
        _wait_healthy(system, spec.startup_timeout_s, say)
    except BaseException:
        stop_system(system)
        raise
    return system


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
    """SIGINT to `tsukimi up` (SIGKILL after STOP_WAIT_S), then NATS; returns (exit code or None, seconds)."""
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
    system.nats.stop()
    return code, time.monotonic() - started


def placement_counts(log_dir: Path, request_prefix: str) -> dict[str, int]:
    """What the scheduler decided for the requests whose id starts with `request_prefix`, from its JSON log lines
    (`"event": "placed"` / `"rejected"`): placed, fetch_from_pool true/false, on_decode, reused blocks, and
    placements per prefill and decode instance. Empty when there is no scheduler log."""
    counts: Counter[str] = Counter()
    for path in sorted(log_dir.glob("scheduler*.log")):
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


# ---- one request, timed by the client -------------------------------------------------------------------------


@dataclass
class Outcome:
    """What one request got; seconds from sending it."""

    index: int
    doc: int
    status: str = "unsent"  # ok, rejected (429), error, unsent
    http_status: int | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    detail: str = ""


def chat_body(model: str, content: str, max_tokens: int) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}


async def send(session: aiohttp.ClientSession, url: str, body: dict[str, Any], request_id: str,
               outcome: Outcome, timeout_s: float) -> Outcome:
    """POST one streamed chat completion and fill `outcome`; never raises (a failure is status "error")."""
    start = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(url, json=body, headers={"X-Request-Id": request_id}) as response:
                outcome.http_status = response.status
                if response.status == 429:
                    outcome.status = "rejected"
                    outcome.detail = f"Retry-After {response.headers.get('Retry-After')}: {await response.text()}"
                elif response.status != 200:
                    outcome.status, outcome.detail = "error", (await response.text())[:300]
                else:
                    await read_stream(response, outcome, start)
    except TimeoutError:
        outcome.status, outcome.detail = "error", f"no answer within {timeout_s:.0f} s"
    except (aiohttp.ClientError, ValueError) as exc:
        outcome.status, outcome.detail = "error", f"{type(exc).__name__}: {exc}"
    return outcome


async def read_stream(response: aiohttp.ClientResponse, outcome: Outcome, start: float) -> None:
    """Server-sent events: TTFT at the first chunk with content (else the finishing one), usage from the last."""
    usage = None
    async for raw in response.content:
        line = raw.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        event = json.loads(line[6:])
        if "error" in event:
            outcome.status, outcome.detail = "error", str(event["error"])[:300]
            return
        for choice in event.get("choices", []):
            has_text = bool(choice.get("delta", {}).get("content")) or choice.get("finish_reason")
            if has_text and outcome.ttft_s is None:
                outcome.ttft_s = time.perf_counter() - start
        usage = event.get("usage") or usage
    outcome.e2e_s = time.perf_counter() - start
    if usage is None:
        outcome.status, outcome.detail = "error", "the stream ended without usage"
        return
    outcome.status = "ok"
    outcome.prompt_tokens, outcome.completion_tokens = usage["prompt_tokens"], usage["completion_tokens"]
    outcome.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
