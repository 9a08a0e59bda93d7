"""One `tsukimi up` run once it is planned: NATS and the services under their supervisors, the wait for /health, the
announcement, and stopping in order on a signal. What to run and the checks before are `shared.tools.cli.up`.
"""

from __future__ import annotations

import http.client
import json
import shlex
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from shared.tools.nats_server import wait_for_port
from shared.tools.supervisor import Supervisor
from shared.tools.topology import Topology

NATS_START_S = 10.0


@dataclass
class Session:
    """One `tsukimi up` run: NATS (`infra`, stopped last) and the services, polled from the main thread."""

    topology: Topology
    model_name: str
    startup_timeout_s: float
    stop: threading.Event
    infra: Supervisor
    services: Supervisor
    nats_port: int | None  # the embedded server's, else None
    needs_key: bool = False  # the gateway takes API keys: the example says how to send one

    def serve(self) -> int:
        """Start NATS, then the services; wait for health, announce, keep them running until `stop` is set.

        Returns 0 after a stop signal, 1 when NATS or the gateway did not come up in time.
        """
        try:
            self.infra.start()
            if self.nats_port is not None and not self.wait_for(self.nats_listens, NATS_START_S):
                return self.gave_up(f"nats-server did not listen on port {self.nats_port} within {NATS_START_S:.0f} s")
            self.services.start()
        except OSError as exc:
            return self.gave_up(f"cannot start a process: {exc}")
        base_url = f"http://{_connect_host(self.topology.host)}:{self.topology.port}"
        health = _HealthProbe(f"{base_url}/health", self.topology.live_counts())
        if not self.wait_for(health.is_ok, self.startup_timeout_s):
            return self.gave_up(f"GET {health.url} -> {health.status} after {self.startup_timeout_s:.0f} s")
        announce(base_url, self.model_name, self.services.log_dir, self.needs_key)
        while not self.stop.wait(0.2):
            self.poll()
        return 0

    def nats_listens(self) -> bool:
        return self.nats_port is not None and wait_for_port("127.0.0.1", self.nats_port, 0.2)

    def poll(self) -> None:
        self.infra.poll()
        self.services.poll()

    def wait_for(self, ready: Callable[[], bool], timeout_s: float) -> bool:
        """Poll the children and `ready()` until it is true (True), or a stop or the timeout (False)."""
        deadline = time.monotonic() + timeout_s
        while not self.stop.is_set() and time.monotonic() < deadline:
            self.poll()
            if ready():
                return True
            self.stop.wait(0.25)
        return False

    def gave_up(self, reason: str) -> int:
        if self.stop.is_set():
            return 0
        say(f"gave up: {reason}; the logs are in {self.services.log_dir}")
        return 1


class _HealthProbe:
    """GET the gateway's /health (never through a proxy) until it answers 200 counting at least `expected` live
    instances of each role (every instance started, so that the first request already sees the whole cluster);
    remembers the last answer and says every 10 s that it is still waiting."""

    def __init__(self, url: str, expected: dict[str, int]) -> None:
        self.url = url
        self.expected = expected
        self.status = "no answer yet"
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        self._started = time.monotonic()
        self._next_note = self._started + 10.0

    def is_ok(self) -> bool:
        try:
            with self._opener.open(self.url, timeout=1.0) as response:
                self.status = str(response.status)
                counts = json.loads(response.read() or b"{}")
            missing = [f"{count - counts.get(role, 0)} {role}" for role, count in self.expected.items()
                       if isinstance(counts, dict) and counts.get(role, 0) < count]
            if self.status == "200" and missing:
                self.status = f"200, waiting for {', '.join(missing)}"
        except urllib.error.HTTPError as exc:
            self.status = str(exc.code)
        except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError) as exc:
            reason = getattr(exc, "reason", exc)
            self.status = getattr(reason, "strerror", None) or str(reason)
        if self.status == "200":
            return True
        if time.monotonic() >= self._next_note:
            self._next_note += 10.0
            say(f"still starting ({time.monotonic() - self._started:.0f} s): GET {self.url} -> {self.status}")
        return False


def announce(base_url: str, model_name: str, log_dir: Path, needs_key: bool = False) -> None:
    body = json.dumps({"model": model_name, "messages": [{"role": "user", "content": "Say hello."}]})
    print(f"tsukimi is up: {base_url}/v1  (OpenAI-compatible; Ctrl-C to stop)", flush=True)
    key = " -H 'Authorization: Bearer <your API key>'" if needs_key else ""
    print(f"  try: curl -s {base_url}/v1/chat/completions -H 'Content-Type: application/json'{key} "
          f"-d {shlex.quote(body)}")
    print(f"  logs: {log_dir}", flush=True)


def _connect_host(host: str) -> str:
    """Where to reach a server listening on `host` from this machine."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


@contextmanager
def stop_on_signals() -> Iterator[threading.Event]:
    """SIGINT, SIGTERM and SIGHUP set the event (the loop stops children in order) instead of raising."""
    stop = threading.Event()
    signals = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]
    previous = {sig: signal.signal(sig, lambda _signum, _frame: stop.set()) for sig in signals}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def say(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)
