"""NATS authorization against a real nats-server: no credentials, wrong ones, and each role's credentials refused
on every subject that is another role's; the table below is the specification, written apart from the code."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from nats.aio.msg import Msg

from shared.tools.nats_server import EmbeddedNatsServer
from shared.wire.bus import Bus, BusError
from shared.wire.nats_auth import ExtraUser, NatsCredentials, ServerTls, inbox_prefix
from shared.wire.protocol import Cancel, Message, Subjects, encode
from shared.wire.secrets import ROLES, Secrets

SUBJECTS = Subjects("t")
ADMIN = ExtraUser("watcher", "watcher-password-0123456789")

# subject -> (roles that may publish on it, roles that may subscribe to it)
TABLE: dict[str, tuple[set[str], set[str]]] = {
    "t.sched.submit": ({"gateway"}, {"scheduler"}),
    "t.cancel": ({"gateway", "scheduler"}, {"scheduler", "prefill", "decode"}),
    "t.stream.r1": ({"prefill", "decode"}, {"gateway"}),
    "t.sched.failed": ({"scheduler"}, {"gateway"}),
    "t.prefill.p0.run": ({"scheduler"}, {"prefill"}),
    "t.prefill.p1.stage": ({"prefill"}, {"prefill"}),
    "t.decode.d0.run": ({"scheduler"}, {"decode"}),
    "t.decode.d0.handoff": ({"prefill"}, {"decode"}),
    "t.cache.0.put": ({"prefill"}, {"cache-store"}),
    "t.cache.1.get": ({"prefill"}, {"cache-store"}),
    "t.cache.0.has": ({"prefill"}, {"cache-store"}),
    "t.kv.events.prefill.p0": ({"prefill"}, {"scheduler"}),
    "t.kv.events.cache-store.c0": ({"cache-store"}, {"scheduler"}),
    "t.snapshot.prefill.p0": ({"scheduler"}, {"prefill"}),
    "t.snapshot.cache-store.c0": ({"scheduler"}, {"cache-store"}),
    "_INBOX_gateway.abc.1": (set(), {"gateway"}),  # replies only through allow_responses, never a free publish
    "_INBOX_prefill.abc.1": (set(), {"prefill"}),
    "$JS.API.INFO": (set(), set()),
    "t.anything.else": (set(), set()),
}
for _role in ROLES:  # every role but the gateway beats, on its own subjects only; the gateway and the scheduler listen
    TABLE[f"t.sched.heartbeat.{_role}.x0"] = ({_role} - {"gateway"}, {"gateway", "scheduler"})


@pytest.fixture(scope="module")
def server() -> AsyncIterator[EmbeddedNatsServer]:
    with EmbeddedNatsServer(auth=Secrets.generate(), subjects=SUBJECTS, extra_users=(ADMIN,)) as nats:
        yield nats


async def _bus(server: EmbeddedNatsServer, credentials: NatsCredentials) -> Bus:
    return await Bus.connect(server.url, credentials.user or "anonymous", SUBJECTS, credentials, connect_timeout_s=3)


def _admin() -> NatsCredentials:
    return NatsCredentials(ADMIN.name, ADMIN.password)


async def test_no_credentials_and_wrong_ones_are_refused(server: EmbeddedNatsServer) -> None:
    with pytest.raises(BusError, match="refused no credentials"):
        await _bus(server, NatsCredentials())
    wrong = NatsCredentials("decode", "not-the-decode-password-at-all")
    with pytest.raises(BusError, match="refused user 'decode'"):
        await _bus(server, wrong)
    other_role = NatsCredentials("decode", server.credentials("prefill").password)
    with pytest.raises(BusError, match="refused"):
        await _bus(server, other_role)


async def _collect(bus: Bus, subject: str, into: list[tuple[str, bytes]]) -> None:
    async def on_msg(msg: Msg) -> None:
        into.append((msg.subject, msg.data))

    await bus.client.subscribe(subject, cb=on_msg)


async def _until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"not within {timeout_s} s")


async def test_each_role_publishes_only_on_its_own_subjects(server: EmbeddedNatsServer) -> None:
    admin = await _bus(server, _admin())
    seen: list[tuple[str, bytes]] = []
    await _collect(admin, ">", seen)
    await admin.client.flush()
    buses = {role: await _bus(server, server.credentials(role)) for role in ROLES}
    for role, bus in buses.items():
        for subject in TABLE:
            await bus.client.publish(subject, encode(Cancel(f"{role}|{subject}")))
        await bus.client.flush()  # the server has what this role published: it reaches the watcher before the barrier
    await admin.client.publish("t.barrier", b"")
    await _until(lambda: ("t.barrier", b"") in seen)
    for subject, (publishers, _) in TABLE.items():
        for role in ROLES:
            got = any(s == subject and f"{role}|{subject}".encode() in d for s, d in seen)
            assert got == (role in publishers), (role, "publish", subject)
    for bus in [*buses.values(), admin]:
        await bus.drain()


async def test_each_role_receives_only_its_own_subjects(server: EmbeddedNatsServer) -> None:
    buses = {role: await _bus(server, server.credentials(role)) for role in ROLES}
    received: dict[str, list[tuple[str, bytes]]] = {role: [] for role in ROLES}
    for role, bus in buses.items():
        for subject in TABLE:
            await _collect(bus, subject, received[role])
        await bus.client.flush()
    for role, bus in buses.items():  # each role's own reply subjects: a barrier it may receive
        await _collect(bus, f"{inbox_prefix(role)}.barrier", received[role])
        await bus.client.flush()
    admin = await _bus(server, _admin())
    for subject in TABLE:
        await admin.client.publish(subject, encode(Cancel("from-admin")))
    for role in ROLES:  # after everything else, from the same connection: each role gets it last
        await admin.client.publish(f"{inbox_prefix(role)}.barrier", b"")
    await admin.client.flush()
    await _until(lambda: all(any(s.endswith(".barrier") for s, _ in received[role]) for role in ROLES))
    for subject, (_, subscribers) in TABLE.items():
        for role in ROLES:
            got = any(s == subject for s, _ in received[role])
            assert got == (role in subscribers), (role, "subscribe", subject)
    for role in ROLES:  # nobody but the watcher may listen to everything
        assert not any(s == "t.anything.else" for s, _ in received[role])
    for bus in [*buses.values(), admin]:
        await bus.drain()


async def test_requests_are_answered_across_roles_through_private_inboxes(server: EmbeddedNatsServer) -> None:
    """The gateway asks the scheduler on `sched.submit`; the answer comes back on the gateway's own inbox, which the
    scheduler may answer (allow_responses) but the prefill role cannot read."""
    gateway, scheduler = await _bus(server, server.credentials("gateway")), await _bus(
        server, server.credentials("scheduler"))
    spy = await _bus(server, server.credentials("prefill"))
    spied: list[tuple[str, bytes]] = []
    await _collect(spy, "_INBOX_gateway.>", spied)

    async def answer(msg: Message) -> Message:
        return Cancel("answered")

    await scheduler.serve("t.sched.submit", answer)
    reply = await gateway.request("t.sched.submit", Cancel("q"), Cancel)
    await spy.client.flush()
    assert reply.request_id == "answered" and not spied
    for bus in (gateway, scheduler, spy):
        await bus.drain()


def _certificates(folder: Path) -> ServerTls:
    """A throw-away CA and a server certificate for 127.0.0.1 signed by it (openssl, as an operator would)."""
    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
            "-subj", "/CN=tsukimi test CA")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj",
            "/CN=127.0.0.1")
    (folder / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out",
            "server.pem", "-days", "1", "-extfile", "san.ext")
    return ServerTls(folder / "server.pem", folder / "server.key", folder / "ca.pem")


async def test_tls_to_nats_with_the_operators_ca(tmp_path: Path) -> None:
    tls = _certificates(tmp_path)
    with EmbeddedNatsServer(auth=Secrets.generate(), subjects=SUBJECTS, tls=tls) as server:
        credentials = server.credentials("decode")
        assert credentials.tls_ca_file == str(tls.ca_file)
        bus = await _bus(server, credentials)
        assert bus.client.is_connected
        await bus.drain()
        without_ca = dataclasses.replace(credentials, tls_ca_file="")  # plain text to a TLS-only server
        with pytest.raises(BusError):
            await _bus(server, without_ca)
        (tmp_path / "other").mkdir()
        other_ca = _certificates(tmp_path / "other")  # a CA that did not sign the server's certificate
        with pytest.raises(BusError, match="certificate verify failed"):
            await _bus(server, dataclasses.replace(credentials, tls_ca_file=str(other_ca.ca_file)))
