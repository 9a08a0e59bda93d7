"""`tsukimi up` announces itself only once the gateway's /health counts every instance it started: a pipeline
group's later stages (or a second decode instance) that are still loading would otherwise miss the first requests.
The probe talks to a real HTTP server on loopback."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from shared.tools.cli.up_session import _HealthProbe
from shared.tools.topology import Topology


class _Gateway(BaseHTTPRequestHandler):
    answer: tuple[int, bytes] = (200, b"{}")

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        status, body = type(self).answer
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (http.server's name)
        pass


@pytest.fixture
def gateway() -> Iterator[tuple[str, type[_Gateway]]]:
    handler = type("Handler", (_Gateway,), {})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/health", handler
    server.shutdown()
    server.server_close()


def _answer(status: int, **counts: object) -> tuple[int, bytes]:
    return status, json.dumps({"status": "ok" if status == 200 else "unavailable", **counts}).encode()


def test_health_waits_for_every_started_instance(gateway: tuple[str, type[_Gateway]]) -> None:
    url, handler = gateway
    probe = _HealthProbe(url, Topology(prefill=2, decode=1, cpp_group=2).live_counts())
    handler.answer = _answer(200, scheduler=1, prefill=1, decode=1)
    assert not probe.is_ok()
    assert probe.status == "200, waiting for 1 prefill"
    handler.answer = _answer(200, scheduler=1, prefill=2, decode=1)
    assert probe.is_ok()


def test_health_unavailable_or_unreadable_is_not_ok(gateway: tuple[str, type[_Gateway]]) -> None:
    url, handler = gateway
    probe = _HealthProbe(url, {"scheduler": 1})
    handler.answer = _answer(503, scheduler=0)
    assert not probe.is_ok() and probe.status == "503"
    handler.answer = (200, b"not json")
    assert not probe.is_ok()


def test_a_colocated_topology_expects_no_prefill() -> None:
    assert Topology(prefill=0, decode=3, colocated=True).live_counts() == {"scheduler": 1, "decode": 3}
    assert Topology(prefill=2, decode=1).live_counts() == {"scheduler": 1, "decode": 1, "prefill": 2}
