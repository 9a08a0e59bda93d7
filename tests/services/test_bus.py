"""The bus against a real nats-server: typed publish/serve, request/reply, queue groups, bad payloads."""

from __future__ import annotations

import asyncio

import pytest

from shared.wire.bus import Bus, BusError, DropLog
from shared.wire.protocol import Ack, BlockHas, BlockHasReply, Cancel, Heartbeat, Message, Subjects


async def _bus(url: str, name: str) -> Bus:
    return await Bus.connect(url, name, Subjects("t"))


async def test_request_reply_is_typed(nats_url: str) -> None:
    server, client = await _bus(nats_url, "server"), await _bus(nats_url, "client")

    async def handler(msg: Message) -> Message:
        assert isinstance(msg, BlockHas)
        return BlockHasReply([h % 2 == 0 for h in msg.block_hashes])

    await server.serve("t.has", handler)
    reply = await client.request("t.has", BlockHas([2, 3]), BlockHasReply)
    assert reply.present == [True, False]
    with pytest.raises(BusError, match="expected ack"):
        await client.request("t.has", BlockHas([1]), Ack)
    with pytest.raises(BusError, match="no answer"):
        await client.request("t.nobody", BlockHas([1]), BlockHasReply, timeout_s=0.3)
    await server.drain()
    await client.drain()


async def test_a_responder_that_subscribes_a_moment_late_still_gets_the_request(nats_url: str) -> None:
    server, client = await _bus(nats_url, "server"), await _bus(nats_url, "client")

    async def handler(msg: Message) -> Message:
        return BlockHasReply([True for _ in msg.block_hashes])

    async def serve_soon(subject: str) -> None:
        await asyncio.sleep(0.03)
        await server.serve(subject, handler)

    late = asyncio.create_task(serve_soon("t.late"))
    reply = await client.request("t.late", BlockHas([7]), BlockHasReply)
    await late
    assert reply.present == [True]
    started = asyncio.get_running_loop().time()
    with pytest.raises(BusError, match="NoRespondersError"):
        await client.request("t.never", BlockHas([7]), BlockHasReply, timeout_s=5.0)
    assert asyncio.get_running_loop().time() - started < 2.0  # nobody listening fails long before the timeout
    missed = asyncio.create_task(serve_soon("t.late2"))
    with pytest.raises(BusError, match="NoRespondersError"):  # no grace: not waited for
        await client.request("t.late2", BlockHas([7]), BlockHasReply, responder_grace_s=0.0)
    await missed
    await server.drain()
    await client.drain()


async def test_a_failing_handler_answers_an_error_and_keeps_serving(nats_url: str) -> None:
    server, client = await _bus(nats_url, "server"), await _bus(nats_url, "client")

    async def handler(msg: Message) -> Message:
        if isinstance(msg, Cancel) and msg.request_id == "boom":
            raise RuntimeError("kaput")
        return Ack()

    await server.serve("t.x", handler)
    with pytest.raises(BusError, match="kaput"):
        await client.request("t.x", Cancel("boom"), Ack)
    await client.client.publish("t.x", b"not msgpack at all")
    assert (await client.request("t.x", Cancel("fine"), Ack)).ok
    await server.drain()
    await client.drain()


async def test_queue_group_delivers_each_message_once(nats_url: str) -> None:
    buses = [await _bus(nats_url, f"w{i}") for i in range(2)]
    sender = await _bus(nats_url, "sender")
    received: list[tuple[int, str]] = []

    def make_handler(worker: int):  # noqa: ANN202
        async def handler(msg: Message) -> None:
            assert isinstance(msg, Cancel)
            received.append((worker, msg.request_id))

        return handler

    for i, bus in enumerate(buses):
        await bus.serve("t.q", make_handler(i), queue="workers")
    for i in range(40):
        await sender.publish("t.q", Cancel(f"r{i}"))
    await sender.client.flush()
    for _ in range(50):
        if len(received) >= 40:
            break
        await asyncio.sleep(0.05)
    assert sorted(r for _, r in received) == sorted(f"r{i}" for i in range(40))
    for bus in [*buses, sender]:
        await bus.drain()


async def test_a_subject_refuses_other_kinds_and_messages_that_speak_for_another_sender(nats_url: str) -> None:
    server, client = await _bus(nats_url, "server"), await _bus(nats_url, "client")
    seen: list[Message] = []

    async def handler(msg: Message) -> Message:
        seen.append(msg)
        return Ack()

    await server.serve("t.only-cancels", handler, kinds=(Cancel,))
    with pytest.raises(BusError, match="block-has is not a message of this subject"):
        await client.request("t.only-cancels", BlockHas([1]), Ack)
    assert (await client.request("t.only-cancels", Cancel("r"), Ack)).ok
    subjects = client.subjects
    await server.serve(subjects.heartbeat_all, handler, kinds=(Heartbeat,), bind_sender=True)
    own = Heartbeat("decode-0", "decode", 1, 0.0)
    assert (await client.request(subjects.heartbeat("decode", "decode-0"), own, Ack)).ok
    for subject in (subjects.heartbeat("decode", "decode-1"), subjects.heartbeat("prefill", "decode-0")):
        with pytest.raises(BusError, match="speaks for decode/decode-0"):
            await client.request(subject, own, Ack)
    assert seen == [Cancel("r"), own]
    assert sum(server._drops.counts.values()) == 3
    await server.drain()
    await client.drain()


async def test_a_route_sends_each_kind_to_its_handler_and_refuses_the_rest(nats_url: str) -> None:
    server, client = await _bus(nats_url, "server"), await _bus(nats_url, "client")
    cancels: list[Cancel] = []

    async def on_cancel(msg: Cancel) -> Ack:
        cancels.append(msg)
        return Ack()

    async def on_has(msg: BlockHas) -> BlockHasReply:
        return BlockHasReply([h % 2 == 0 for h in msg.block_hashes])

    await server.route("t.mixed", {Cancel: on_cancel, BlockHas: on_has})
    assert (await client.request("t.mixed", BlockHas([1, 2]), BlockHasReply)).present == [False, True]
    assert (await client.request("t.mixed", Cancel("r"), Ack)).ok and cancels == [Cancel("r")]
    with pytest.raises(BusError, match="heartbeat is not a message of this subject"):
        await client.request("t.mixed", Heartbeat("d", "decode", 1, 0.0), Ack)
    await server.drain()
    await client.drain()


def test_refused_messages_are_logged_once_per_interval_with_a_count() -> None:
    now = [0.0]
    drops = DropLog(interval_s=5.0, clock=lambda: now[0])
    lines = []
    for step in range(100):
        now[0] = step * 0.1  # 10 s of a flood, 10 a second
        before = drops._logged.get("t.x")
        drops.note("t.x", "forged")
        if drops._logged.get("t.x") != before:
            lines.append(drops._logged["t.x"])
    assert [count for _, count in lines] == [1, 51]  # at 0 s and at 5 s, not 100 lines
    assert drops.counts["t.x"] == 100
