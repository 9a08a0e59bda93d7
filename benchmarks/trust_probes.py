"""Repeats issue 17's probes against a fresh `tsukimi up` (1 prefill, 1 decode, around a nats-server this script
runs with the deployment's secrets, so that it can act as any role) and prints what each shows now.

Not a test: the suite holds each behaviour as a test of its own; this is the attacker's and the demanding user's
view, end to end, for the record. About two minutes on 2 cores. Traffic to 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from shared.tools.nats_server import EmbeddedNatsServer, free_port
from shared.wire.block_integrity import BlockSigner
from shared.wire.bus import Bus, BusError
from shared.wire.cache_client import CacheClient, split_block
from shared.wire.nats_auth import ExtraUser, NatsCredentials, inbox_prefix
from shared.wire.payload import checksum
from shared.wire.protocol import (
    Ack,
    Cancel,
    HandoffStart,
    Heartbeat,
    KvChunk,
    SamplingParams,
    StreamEvent,
    Subjects,
    SubmitReply,
    SubmitRequest,
)
from shared.wire.secrets import Secrets, write_private

MODEL = "SmolLM2-135M-Instruct"
S = Subjects()


class Probe:
    """The system under probe and a way to speak to it as each role."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.secrets = tmp, Secrets.generate()
        self.watcher = ExtraUser("probe", "probe-password-0123456789")  # sees every subject
        self.nats = EmbeddedNatsServer(auth=self.secrets, extra_users=(self.watcher,))
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.nats.start()
        secrets_file = self.tmp / "secrets.env"
        write_private(secrets_file, self.secrets.env_text())
        env = {k: v for k, v in os.environ.items() if not k.startswith("TSUKIMI_")}
        env |= {"TSUKIMI_NUM_THREADS": "1", "TSUKIMI_HEARTBEAT_S": "0.3", "TSUKIMI_KV_CACHE_MB": "64"}
        cmd = [sys.executable, "-m", "shared", "up", "--port", str(self.port), "--nats-url", self.nats.url,
               "--nats-secrets", str(secrets_file), "--log-dir", str(self.tmp / "logs")]
        self.out = self.tmp / "up.out"
        self.process = subprocess.Popen(cmd, stdout=open(self.out, "wb"), stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 300
        while "tsukimi is up" not in self.out.read_text():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"tsukimi up did not come up: {self.out.read_text()[-2000:]}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            self.process.wait(30)
        self.nats.stop()

    def credentials(self, role: str) -> NatsCredentials:
        return NatsCredentials(role, self.secrets.passwords[role], inbox_prefix(role))

    async def bus(self, role: str | None) -> Bus:
        credentials = self.credentials(role) if role else NatsCredentials()
        return await Bus.connect(self.nats.url, f"probe-{role}", S, credentials, connect_timeout_s=3)

    async def watching_bus(self) -> Bus:
        credentials = NatsCredentials(self.watcher.name, self.watcher.password)
        return await Bus.connect(self.nats.url, "probe-watcher", S, credentials, connect_timeout_s=3)

    def pid_of(self, instance_id: str) -> int:
        """The pid of one of this system's processes (found by its environment: this run's NATS URL and the id)."""
        wanted = {f"TSUKIMI_NATS_URL={self.nats.url}".encode(), f"TSUKIMI_INSTANCE_ID={instance_id}".encode()}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and wanted <= set(_environ(entry)):
                return int(entry.name)
        raise SystemExit(f"no process of this system is {instance_id}")

    def http(self, path: str, body: Any = None, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str],
                                                                                              bytes]:
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data,
                                         headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return response.status, dict(response.headers), response.read()
        except urllib.error.HTTPError as exc:
            return exc.code, dict(exc.headers), exc.read()

    def logs(self, needle: str) -> int:
        return sum(path.read_text(errors="replace").count(needle) for path in (self.tmp / "logs").glob("*.log"))


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 12, "temperature": 0,
            **extra}


async def refused(attempt: Callable[[], Awaitable[Any]]) -> str:
    try:
        await attempt()
    except BusError as exc:
        return f"refused ({str(exc)[:80]})"
    return "ACCEPTED"


async def probe_nats(p: Probe) -> list[str]:
    lines = [f"1. no credentials: {await refused(lambda: p.bus(None))}"]
    gateway, watcher = await p.bus("gateway"), await p.watching_bus()
    seen: list[str] = []
    forged: list[str] = []

    async def on_any(msg: Any) -> None:
        seen.append(msg.subject)

    async def on_forged(msg: Any) -> None:
        forged.append(msg.subject)

    for subject in (S.stream("victim-1"), S.heartbeat("decode", "fake-decode")):
        await watcher.client.subscribe(subject, cb=on_forged)
    await watcher.client.flush()
    await gateway.client.subscribe(">", cb=on_any)
    await gateway.client.publish(S.stream("victim-1"), b"forged")
    await gateway.client.publish(S.heartbeat("decode", "fake-decode"), b"forged")
    await gateway.client.flush()
    await asyncio.sleep(1.0)
    lines.append(f"1. gateway password, subscribe '>': {len(seen)} messages seen; publish a stream event and a decode "
                 f"heartbeat: {len(forged)} of 2 reached a subscriber")
    forged_by = await p.bus("cache-store")
    fake = Heartbeat("fake-decode", "decode", 1, time.time(), kv_blocks_total=1000)
    await forged_by.publish(S.heartbeat("decode", "fake-decode"), fake)
    await forged_by.client.flush()
    await asyncio.sleep(1.0)
    status, _, body = p.http("/health")
    lines.append(f"1. fake decode instance announced with the cache-store's password: /health {status} {body.decode()}")
    for bus in (gateway, watcher, forged_by):
        await bus.drain()
    return lines


async def probe_tokens(p: Probe) -> list[str]:
    gateway = await p.bus("gateway")
    events: list[StreamEvent] = []

    async def on(msg: Any) -> None:
        events.append(msg)

    await gateway.serve(S.stream("probe-bad-tokens"), on)
    submit = SubmitRequest("probe-bad-tokens", [1, 2, 60_000], [], SamplingParams(max_tokens=4), time.time())
    reply = await gateway.request(S.submit, submit, SubmitReply, timeout_s=10)
    await asyncio.sleep(2.0)
    after = p.http("/v1/chat/completions", chat("What is the capital of France?"))
    await gateway.drain()
    failure = next((e for e in events if e.error_type), None)
    return [f"2. SubmitRequest with token 60000: accepted={reply.accepted}, its stream: "
            f"{failure.error_type if failure else 'nothing'} '{failure.error[:70] if failure else ''}'; a normal "
            f"chat after it: {after[0]}; engine step failures logged: {p.logs('engine step failed')}"]


def probe_request_ids(p: Probe) -> list[str]:
    first = p.http("/v1/chat/completions", chat("Hi"), {"X-Request-Id": "reused"})
    second = p.http("/v1/chat/completions", chat("Hi"), {"X-Request-Id": "reused"})
    ids = [json.loads(r[2])["id"] for r in (first, second)]
    return [f"3. X-Request-Id reused: {first[0]}, {second[0]} (ids {ids[0]}, {ids[1]})"]


async def probe_cache(p: Probe) -> list[str]:
    prefill = await p.bus("prefill")
    signer = BlockSigner(p.secrets.block_key.encode())
    client = CacheClient(prefill, 1, signer=signer)
    assert await client.put_block(0xA1, b"albatross" * 5000)
    for part in split_block(0xA1, b"albatross" * 5000, 16 << 10, signer):  # sniffed, relabelled, put again
        await prefill.request(S.cache_put(0), dataclasses.replace(part, block_hash=0xB2), Ack)
    got = await client.get_block(0xB2)
    await prefill.drain()
    return [f"4. another block's parts put under a new hash: the store holds it, the reader gets "
            f"{'the wrong bytes' if got else 'a miss (tag mismatch)'}"]


def probe_http(p: Probe) -> list[str]:
    lines = []
    # the port of the system under probe: were the refusal gone, the port check after it would stop the run before
    # anything listens on every interface
    exposed = subprocess.run([sys.executable, "-m", "shared", "up", "--host", "0.0.0.0", "--port", str(p.port)],
                             capture_output=True, text=True, timeout=60)
    lines.append(f"5. tsukimi up --host 0.0.0.0 without keys: exit {exposed.returncode}: {exposed.stderr.strip()[:90]}")
    banner = p.out.read_text().splitlines()[0]
    lines.append(f"5. banner: {banner[11:120]}")
    for name, body in [("tools", chat("Hi", tools=[{"type": "function", "function": {"name": "f"}}])),
                       ("temperature 100", chat("Hi", temperature=100)),
                       ("lone surrogate", b'{"model": "x", "messages": [{"role": "user", "content": "\\ud800"}]}'),
                       ("nested 50k", b"[" * 50_000 + b"]" * 50_000)]:
        status, _, raw = p.http("/v1/chat/completions", body)
        lines.append(f"8. {name}: {status} {raw[:90].decode(errors='replace')}")
    for path in ("/openapi.json", f"/v1/models/{MODEL}"):
        lines.append(f"8. GET {path}: {p.http(path)[0]}")
    with socket.create_connection(("127.0.0.1", p.port)) as sock:
        sock.sendall(b"GARBAGE\r\n\r\n")
        body = sock.recv(600).split(b"\r\n\r\n", 1)[-1]
        lines.append(f"8. a malformed request line: {body[:90].decode(errors='replace')}")
    return lines


def probe_slow_clients(p: Probe, read_timeout_s: float = 30.0) -> list[str]:
    """300 connections that never finish a request (idle, half a header line, headers and half a body)."""
    sockets = []
    for i in range(300):
        sock = socket.create_connection(("127.0.0.1", p.port))
        if i % 3 == 1:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-")
        elif i % 3 == 2:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        sockets.append(sock)
    time.sleep(read_timeout_s + 6)
    still_open = sum(not _is_closed(sock) for sock in sockets)
    for sock in sockets:
        sock.close()
    answer = p.http("/health")[0]
    return [f"8. 300 idle or half-sent connections, {read_timeout_s + 6:.0f} s later: {still_open} still open; "
            f"/health after {answer}"]


def _is_closed(sock: socket.socket) -> bool:
    """The server closed it (whatever it answered first, a 408 say)."""
    sock.settimeout(0.5)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return False
    except OSError:
        return True
    return True


async def probe_silence(p: Probe) -> list[str]:
    gateway = await p.bus("gateway")
    started = time.monotonic()
    loop = asyncio.get_running_loop()

    def stream_chat() -> str:
        status, _, raw = p.http("/v1/chat/completions", chat("Write a long story.", max_tokens=400, ignore_eos=True,
                                                             stream=True), {"X-Request-Id": "victim"})
        return f"{status} {raw[-160:].decode(errors='replace')!r}"

    reading = loop.run_in_executor(None, stream_chat)
    await asyncio.sleep(4.0)
    request_id = ""
    while not request_id and time.monotonic() < started + 30:
        ids = [r for line in (p.tmp / "logs" / "gateway-0.log").read_text().splitlines() if '"victim' in line
               for r in [json.loads(line).get("request_id", "")] if r.startswith("victim-")]
        request_id = ids[-1] if ids else ""
        await asyncio.sleep(0.2)
    await gateway.publish(S.cancel, Cancel(request_id or "victim", "forged"))
    answer = await reading
    await gateway.drain()
    return [f"6. a cancel the client did not send, 4 s in: its stream ended {time.monotonic() - started - 4:.1f} s "
            f"later with {answer[-120:]}"]


def probe_unsolicited_kv(p: Probe) -> list[str]:
    decode_pid = p.pid_of("decode-0")

    def rss_mb() -> float:
        fields = (Path("/proc") / str(decode_pid) / "status").read_text()
        return int(fields.split("VmRSS:")[1].split()[0]) / 1024

    async def flood() -> None:
        prefill = await p.bus("prefill")
        payload = os.urandom(510 << 10)
        for i in range(600):
            start = HandoffStart(f"stranger-{i}", [1], SamplingParams(max_tokens=1), "prefill-0", 2)
            chunk = KvChunk(f"stranger-{i}", 0, 2, 0, 1, 0, 1, "fp32", "raw", len(payload), checksum(payload), payload,
                            "fp32", 16)
            await prefill.publish(S.decode_handoff("decode-0"), start)
            await prefill.publish(S.decode_handoff("decode-0"), chunk)
            if i % 20 == 0:
                await prefill.client.flush()
        await prefill.drain()

    before = rss_mb()
    asyncio.run(flood())
    time.sleep(3)
    return [f"6. 600 unannounced 510 KiB KV chunks to decode-0: RSS {before:.0f} -> {rss_mb():.0f} MB; /health "
            f"{p.http('/health')[0]}"]


def probe_nats_restart(p: Probe) -> list[str]:
    """The NATS server goes away for 3 s under a streaming request."""
    started = time.monotonic()
    result: list[str] = []

    def stream_chat() -> None:
        status, _, raw = p.http("/v1/chat/completions", chat("Write a long story.", max_tokens=300, ignore_eos=True,
                                                             stream=True))
        tail = raw[-150:].decode(errors="replace")
        result.append(f"{status} after {time.monotonic() - started:.1f} s, ends {tail!r}")

    reader = threading.Thread(target=stream_chat)
    reader.start()
    time.sleep(3.0)
    p.nats.stop()
    time.sleep(3.0)
    p.nats.start()
    reader.join(120)
    time.sleep(3.0)
    after = p.http("/v1/chat/completions", chat("What is the capital of France?"))[0]
    return [f"6. NATS down 3 s mid-stream: the stream {result[0] if result else 'still open after 120 s'}; a chat "
            f"after: {after}"]


def probe_health_without_scheduler(p: Probe) -> list[str]:
    pid = p.pid_of("scheduler-0")
    os.kill(pid, signal.SIGSTOP)  # alive but silent, as a hung scheduler
    try:
        time.sleep(4.0)
        status, headers, body = p.http("/health")
    finally:
        os.kill(pid, signal.SIGCONT)
    return [f"8. /health while the scheduler is silent: {status}, Retry-After {headers.get('Retry-After')}, "
            f"{body.decode()[:100]}"]


def _environ(process: Path) -> list[bytes]:
    try:
        return (process / "environ").read_bytes().split(b"\0")
    except OSError:
        return []


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="tsukimi-probes-") as folder:
        probe = Probe(Path(folder))
        probe.start()
        probes: list[Callable[[], list[str]]] = [
            lambda: asyncio.run(probe_nats(probe)), lambda: asyncio.run(probe_tokens(probe)),
            lambda: probe_request_ids(probe), lambda: asyncio.run(probe_cache(probe)), lambda: probe_http(probe),
            lambda: probe_slow_clients(probe),
            lambda: asyncio.run(probe_silence(probe)), lambda: probe_unsolicited_kv(probe),
            lambda: probe_health_without_scheduler(probe), lambda: probe_nats_restart(probe),
        ]
        try:
            for run_probe in probes:
                print("\n".join(run_probe()), flush=True)
        finally:
            probe.stop()


if __name__ == "__main__":
    main()
