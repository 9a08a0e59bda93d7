"""The in-process NATS of a virtual cluster (`services.virtual.nats`) under the real `Bus`: wildcards, one member of
a queue group per message, a subscription's messages handled one at a time in order even when a handler waits,
request/reply and no responders; and the network model (`services.virtual.network`): each message lands after its
bytes' time on both interfaces and the latency, first come first served, and a size-only payload counts the bytes
it stands for."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import cast

import pytest
from nats.aio.client import Client

from services.virtual import clock
from services.virtual.nats import VirtualNats, VirtualNatsClient, wire_bytes
from services.virtual.network import Network, NetworkSpec
from shared.wire.bus import Bus, BusError
from shared.wire.protocol import Ack, Cancel, KvChunk, Subjects, encode

GB = 1e9


@pytest.fixture(autouse=True)
def installed() -> Iterator[None]:
    clock.install()
    yield
    clock.uninstall()


def buses(network: Network, *nodes: str) -> list[Bus]:
    server = VirtualNats(network)
    return [Bus(cast(Client, server.connect(f"c{i}", node)), Subjects("t")) for i, node in enumerate(nodes)]


def test_wildcards_queue_groups_and_in_order_delivery_across_nodes() -> None:
    network = Network(NetworkSpec(bandwidth=1 * GB, latency_s=0.001))

    async def main() -> tuple[list[tuple[str, str, float]], list[str]]:
        sender, a, b = buses(network, "n0", "n1", "n2")
        got: list[tuple[str, str, float]] = []
        grouped: list[str] = []

        async def slow(msg: Cancel) -> None:  # waits, yet the next message waits its turn
            await asyncio.sleep(0.5)
            got.append(("slow", msg.request_id, asyncio.get_running_loop().time()))

        async def fast(msg: Cancel) -> None:
            got.append(("star", msg.request_id, asyncio.get_running_loop().time()))

        await a.route("t.x.*", {Cancel: slow})
        await b.route("t.>", {Cancel: fast})
        for bus in (a, b):
            await bus.route("t.q", {Cancel: lambda m, bus=bus: _append(grouped, bus)}, queue="g")
        for i in range(3):
            await sender.publish("t.x.1", Cancel(f"r{i}", "test"))
        for _ in range(4):
            await sender.publish("t.q", Cancel("q", "test"))
        await asyncio.sleep(5)
        return got, grouped

    got, grouped = clock.run_virtual(main)
    assert [rid for name, rid, _ in got if name == "star"] == ["r0", "r1", "r2", "q", "q", "q", "q"]  # `>`: all
    slow_ones = [(rid, t) for name, rid, t in got if name == "slow"]
    assert [rid for rid, _ in slow_ones] == ["r0", "r1", "r2"]  # in order, one at a time
    assert slow_ones[1][1] - slow_ones[0][1] == pytest.approx(0.5, abs=1e-3)
    assert sorted(grouped) == ["c1", "c1", "c2", "c2"]  # each message to one member of the group, in turn


async def _append(into: list[str], bus: Bus) -> None:
    into.append(cast(VirtualNatsClient, bus.client).name)


def test_request_reply_and_no_responders() -> None:
    async def main() -> tuple[Ack, str]:
        client, server = buses(Network(NetworkSpec()), "n0", "n1")

        async def answer(msg: Cancel) -> Ack:
            return Ack(ok=True, error=msg.request_id)

        await server.route("t.ask", {Cancel: answer})
        reply = await client.request("t.ask", Cancel("hello", "test"), Ack)
        try:
            await client.request("t.nobody", Cancel("x", "test"), Ack, responder_grace_s=0.0)
        except BusError as exc:
            return reply, str(exc)
        return reply, ""

    reply, refused = clock.run_virtual(main)
    assert reply.ok and reply.error == "hello"
    assert "NoRespondersError" in refused


def test_a_message_lands_after_its_bytes_time_on_both_interfaces_and_the_latency() -> None:
    network = Network(NetworkSpec(bandwidth=1 * GB, latency_s=0.001))
    assert network.arrival("a", "b", 10**9, 0.0) == pytest.approx(1.001)  # a second of bytes, then the latency
    assert network.arrival("c", "b", 10**9, 0.0) == pytest.approx(2.001)  # b's interface was busy receiving
    assert network.arrival("a", "d", 10**6, 0.5) == pytest.approx(1.002)  # a's was busy sending until 1.0
    assert network.arrival("a", "a", 10**9, 3.0) == 3.0  # within a node: no interface
    assert network.bytes_moved == 2 * 10**9 + 10**6


def test_a_size_only_payload_counts_the_bytes_it_stands_for() -> None:
    chunk = KvChunk("r1", 0, 1, 0, 1, 0, 16, "bf16", "size-only", 1 << 30, 0, b"")
    data = encode(chunk)
    assert wire_bytes(data) == len(data) + (1 << 30)
    plain = encode(Cancel("r1", "x"))
    assert wire_bytes(plain) == len(plain)
