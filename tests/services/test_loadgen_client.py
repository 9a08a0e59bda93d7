"""The load generator against a scripted OpenAI-style server on a loopback port: what each request records
(streams, usage, 429, 500, errors mid-stream, timeouts), the runner's loops and limits, and the command line."""

from __future__ import annotations

import asyncio
import io
import json
import socket
import sys
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from loadgen.cli import main
from loadgen.client import API_CHAT, ClientOptions, ServerError, fetch_model_ids, normalize_base_url, send_request
from loadgen.metrics import Slo
from loadgen.record import RequestRecord
from loadgen.runner import RunOptions, run
from loadgen.workload import PlannedRequest
from shared.tools.loadgen_command import main as loadgen_command

MODEL = "fake-model"


class FakeOpenAI:
    """Streams `max_tokens` chunks ("t0", "t1", ...). The body's `fake` field picks a behaviour: ok, reject (429
    with an OpenAI error), boom (500, plain text), error-mid-stream, no-done, hang (until the server stops),
    no-usage, gate (hold the first token until `gate_count` requests are in flight or all `gate_total` started)."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.authorizations: list[str | None] = []
        self.num_in_flight = 0
        self.max_in_flight = 0
        self.num_started = 0
        self.released = asyncio.Event()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_post("/v1/chat/completions", self.complete)
        return app

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.authorizations.append(request.headers.get("Authorization"))
        mode = body.get("fake", "ok")
        if mode == "reject":
            error = {"message": "the cluster is busy", "type": "rate_limit_error", "param": None, "code": "x"}
            headers = {"Retry-After": str(body["retry_after"])} if "retry_after" in body else {}
            return web.json_response({"error": error}, status=429, headers=headers)
        if mode == "boom":
            return web.Response(status=500, text="internal blow-up")
        self.num_started += 1
        self.num_in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.num_in_flight)
        try:
            return await self._stream(request, body, mode)
        finally:
            self.num_in_flight -= 1

    async def _stream(self, request: web.Request, body: dict[str, Any], mode: str) -> web.StreamResponse:
        is_chat = "messages" in body
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if mode == "hang":
            await self.released.wait()
            return response
        if mode == "gate":
            await self._gate(body["gate_count"], body["gate_total"])
        if is_chat:
            await response.write(_sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}))
        for i in range(body["max_tokens"]):
            if i == 1 and mode == "error-mid-stream":
                await response.write(_sse({"error": {"message": "decode instance lost", "type": "server_error"}}))
                return response
            text = f"t{i}"
            choice = {"index": 0, "delta": {"content": text}} if is_chat else {"index": 0, "text": text}
            await response.write(_sse({"choices": [choice], "usage": None}))
            await response.write(_sse({"choices": [{"index": 0, "text": ""}]}))  # empty: no token
            await asyncio.sleep(body.get("pause_s", 0.0))
        if mode != "no-usage" and body.get("stream_options", {}).get("include_usage"):
            usage = {"prompt_tokens": 1000, "completion_tokens": body["max_tokens"], "total_tokens": 0,
                     "prompt_tokens_details": {"cached_tokens": 250}}
            await response.write(_sse({"choices": [], "usage": usage}))
        if mode != "no-done":
            await response.write(b"data: [DONE]\n\n")
        return response

    async def _gate(self, gate_count: int, gate_total: int) -> None:
        for _ in range(500):  # a correct runner opens the gate at once; a broken one fails, it does not hang
            if self.num_in_flight >= gate_count or self.num_started >= gate_total:
                return
            await asyncio.sleep(0.01)


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


class ServerThread:
    """The fake server on its own event loop in a thread, so both async tests and `main()` (asyncio.run) use it."""

    def __init__(self) -> None:
        self.fake: FakeOpenAI
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def start(self) -> ServerThread:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=10)
        return self

    async def _start(self) -> None:
        self.fake = FakeOpenAI()
        self._runner = web.AppRunner(self.fake.app())
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        async def _stop() -> None:
            self.fake.released.set()
            await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(_stop(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)


@pytest.fixture
def server() -> Iterator[ServerThread]:
    thread = ServerThread().start()
    yield thread
    thread.stop()


@pytest.fixture
def closed_port_url() -> str:
    with socket.socket() as sock:  # a port nothing listens on once the socket is closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def _planned(request_id: int = 0, output_len: int = 3, prompt: list[int] | str | None = None) -> PlannedRequest:
    return PlannedRequest(request_id, 0.0, prompt if prompt is not None else [1001, 1002, 1003, 1004], output_len)


async def _send(url: str, planned: PlannedRequest, **options: Any) -> RequestRecord:
    client = ClientOptions(url, MODEL, **options)
    async with aiohttp.ClientSession() as session:
        return await send_request(session, planned, client, t0=0.0, arrival_s=planned.arrival_s)


async def test_a_streamed_completion_records_chunks_and_usage(server: ServerThread) -> None:
    extra = {"pause_s": 0.02, "top_k": 5}
    record = await _send(server.url, _planned(output_len=4), extra_body=extra)
    assert record.status == 200 and record.error is None and record.is_completed
    assert len(record.chunk_times_s) == 4  # the empty-text chunks are not tokens
    assert record.send_s is not None and record.done_s is not None
    assert record.send_s < record.chunk_times_s[0] < record.chunk_times_s[-1] <= record.done_s
    assert (record.num_prompt_tokens, record.num_output_tokens, record.num_cached_tokens) == (1000, 4, 250)
    [body] = server.fake.bodies
    assert body == {
        "model": MODEL, "prompt": [1001, 1002, 1003, 1004], "max_tokens": 4, "temperature": 0.0, "stream": True,
        "stream_options": {"include_usage": True}, "ignore_eos": True, "pause_s": 0.02, "top_k": 5,
    }


async def test_without_usage_the_chunks_and_prompt_are_counted(server: ServerThread) -> None:
    record = await _send(server.url, _planned(output_len=3), ignore_eos=False, extra_body={"fake": "no-usage"})
    assert record.is_completed
    assert (record.num_prompt_tokens, record.num_output_tokens, record.num_cached_tokens) == (4, 3, None)
    assert "ignore_eos" not in server.fake.bodies[0]


async def test_chat_sends_text_and_skips_the_role_chunk(server: ServerThread) -> None:
    record = await _send(server.url, _planned(output_len=2, prompt="ba ko ti"), api=API_CHAT)
    assert record.is_completed and len(record.chunk_times_s) == 2
    body = server.fake.bodies[0]
    assert body["messages"] == [{"role": "user", "content": "ba ko ti"}] and "prompt" not in body


async def test_an_api_key_goes_as_a_bearer_token_and_none_without_one(server: ServerThread) -> None:
    assert (await _send(server.url, _planned(), api_key="tsk-secret")).is_completed
    assert (await _send(server.url, _planned())).is_completed
    assert server.fake.authorizations == ["Bearer tsk-secret", None]
    assert "tsk-secret" not in repr(ClientOptions(server.url, MODEL, api_key="tsk-secret"))


async def test_a_429_is_a_rejection_with_the_openai_message(server: ServerThread) -> None:
    record = await _send(server.url, _planned(), extra_body={"fake": "reject"})
    assert record.status == 429 and record.is_rejected and not record.is_failed and not record.is_completed
    assert record.error == "HTTP 429: the cluster is busy"


async def test_a_closed_loop_waits_out_retry_after_unless_told_not_to(server: ServerThread) -> None:
    client = ClientOptions(server.url, MODEL, extra_body={"fake": "reject", "retry_after": 1})
    planned = [_planned(i, output_len=2) for i in range(3)]
    started = time.perf_counter()
    polite = await run(planned, RunOptions(client, concurrency=1, show_progress=False))
    assert [r.retry_after_s for r in polite.records] == [1.0, 1.0, 1.0]
    sends = sorted(r.send_s or 0.0 for r in polite.records)
    assert all(later - earlier >= 0.99 for earlier, later in zip(sends, sends[1:], strict=False))
    assert time.perf_counter() - started < 2.9  # two waits, none after the last refusal
    eager = await run(planned, RunOptions(client, concurrency=1, show_progress=False, honor_retry_after=False))
    assert max(r.done_s or 0.0 for r in eager.records) < 0.9
    bounded = await run(planned, RunOptions(client, concurrency=1, duration_s=0.5, show_progress=False))
    assert len(bounded.records) == 1  # the wait ran into the duration: nothing more was sent


@pytest.mark.parametrize(
    ("fake", "status", "error"),
    [
        ("boom", 500, "HTTP 500: internal blow-up"),
        ("error-mid-stream", 200, "error in stream: decode instance lost"),
        ("no-done", 200, "the stream ended without [DONE]"),
    ],
)
async def test_failures_are_recorded_not_raised(server: ServerThread, fake: str, status: int, error: str) -> None:
    record = await _send(server.url, _planned(), extra_body={"fake": fake})
    assert (record.status, record.error) == (status, error)
    assert record.is_failed and not record.is_rejected and record.done_s is not None


async def test_a_request_past_its_timeout_fails(server: ServerThread) -> None:
    record = await _send(server.url, _planned(), request_timeout_s=0.2, extra_body={"fake": "hang"})
    assert record.error == "timed out after 0.2 s" and record.is_failed


async def test_an_unreachable_server_is_a_failed_record(closed_port_url: str) -> None:
    record = await _send(closed_port_url, _planned())
    assert record.status is None and record.is_failed
    assert record.error is not None and record.error.startswith("connection failed")


async def test_model_ids_and_unreachable_servers(server: ServerThread, closed_port_url: str) -> None:
    async with aiohttp.ClientSession() as session:
        assert await fetch_model_ids(session, server.url) == [MODEL]
        with pytest.raises(ServerError, match="cannot reach"):
            await fetch_model_ids(session, closed_port_url)


@pytest.mark.parametrize(
    ("url", "base"),
    [
        ("http://127.0.0.1:8000", "http://127.0.0.1:8000"),
        ("http://127.0.0.1:8000/v1/", "http://127.0.0.1:8000"),
        ("https://host/prefix/v1", "https://host/prefix"),
    ],
)
def test_base_urls_are_normalized(url: str, base: str) -> None:
    assert normalize_base_url(url) == base


@pytest.mark.parametrize("url", ["ftp://127.0.0.1", "127.0.0.1:8000", "http://", "http://h/?q=1"])
def test_other_urls_are_refused(url: str) -> None:
    with pytest.raises(ValueError):
        normalize_base_url(url)


async def test_fixed_concurrency_keeps_exactly_n_in_flight(server: ServerThread) -> None:
    num_requests, concurrency = 10, 3
    extra = {"fake": "gate", "gate_count": concurrency, "gate_total": num_requests, "pause_s": 0.01}
    options = RunOptions(ClientOptions(server.url, MODEL, extra_body=extra), concurrency=concurrency,
                         show_progress=False)
    result = await run([_planned(i, output_len=2) for i in range(num_requests)], options)
    assert server.fake.max_in_flight == concurrency
    assert [r.request_id for r in result.records] == list(range(num_requests))
    assert result.summary.num_completed == num_requests


async def test_open_loop_sends_in_arrival_order_within_the_limits(server: ServerThread) -> None:
    arrivals = [0.1, 0.0, 0.05, 0.15, 100.0]
    planned = [PlannedRequest(i, a, [1000 + i], 2) for i, a in enumerate(arrivals)]
    client = ClientOptions(server.url, MODEL)
    result = await run(planned, RunOptions(client, duration_s=5.0, show_progress=False))
    assert [r.request_id for r in result.records] == [0, 1, 2, 3]  # the one due at 100 s is past the duration
    sends = sorted(result.records, key=lambda r: r.send_s or 0.0)
    assert [r.request_id for r in sends] == [1, 2, 0, 3]
    assert [r.arrival_s for r in result.records] == arrivals[:4]
    capped = await run(planned, RunOptions(client, max_requests=2, show_progress=False))
    assert [r.request_id for r in capped.records] == [1, 2]  # the first two to arrive


async def test_the_summary_counts_rejections_apart(server: ServerThread) -> None:
    planned = [_planned(i, output_len=2) for i in range(3)]
    client = ClientOptions(server.url, MODEL, extra_body={"fake": "reject"})
    stream = io.StringIO()
    result = await run(planned, RunOptions(client, slo=Slo(ttft_ms=1000)), progress_stream=stream)
    summary = result.summary
    assert (summary.num_sent, summary.num_completed, summary.num_rejected, summary.num_failed) == (3, 0, 3, 0)
    assert summary.effective_capacity == 0.0 and summary.ttft_attainment == 0.0
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue() and "rejected 3" in lines[-1] and "3/3" in lines[-1]


def test_the_command_runs_and_writes_json_and_plots(
    server: ServerThread, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run.json"
    argv = ["--url", server.url + "/v1", "--num-requests", "4", "--input-len", "8", "--output-len", "3",
            "--rate", "inf", "--slo-ttft-ms", "5000", "--slo-tbt-ms", "5000", "--quiet", "--json", str(out),
            "--plot", str(tmp_path / "plots")]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "SLOs: TTFT <= 5000 ms, TBT <= 5000 ms" in table and f"model {MODEL}" in table
    document = json.loads(out.read_text())
    assert document["summary"]["num_completed"] == 4 and len(document["requests"]) == 4
    assert document["config"]["args"]["rate"] == "inf"
    assert all(len(body["prompt"]) == 8 and body["model"] == MODEL for body in server.fake.bodies)
    assert (tmp_path / "plots" / "latency_cdf.png").stat().st_size > 0


def test_an_unreachable_server_exits_1(closed_port_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--url", closed_port_url, "--num-requests", "1", "--quiet"]) == 1
    assert "cannot reach the server" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--trace", "/nonexistent/trace.jsonl"], "cannot read trace"),
        (["--rate", "fast"], "not a number"),
        (["--num-requests", "2.5"], "not an integer"),
        (["--burstiness", "0"], "positive"),
        (["--range-ratio", "1"], "[0, 1)"),
        (["--trace", "t.jsonl", "--rate", "3"], "--rate: synthetic-workload options do not go with --trace"),
        (["--time-scale", "0.5"], "--time-scale: trace options need --trace"),
        (["--concurrency", "4", "--rate", "2"], "does not go with --rate"),
        (["--url", "ftp://127.0.0.1:8000"], "not an http(s) URL"),
        (["--extra-body", "{oops"], "--extra-body is not valid JSON"),
        (["--extra-body", "[1]"], "must be a JSON object"),
        (["--api", "grpc"], "invalid choice"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as excinfo:
        main(argv)
    assert excinfo.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_experiment_is_dispatched_lazily(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[str]] = []
    module = types.ModuleType("shared.tools.experiment")
    module.main = lambda argv: calls.append(argv) or 0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "shared.tools.experiment", module)
    assert loadgen_command(["experiment", "--rates", "1,2"]) == 0
    assert calls == [["--rates", "1,2"]]
