"""The decode service on a real nats-server and the real model, fed hand-off streams as prefill sends them: a whole
stream decodes, its first token streamed by decode; a corrupt chunk fails its request at once, a chunk lost on the way
at the stream's end, a stream that stops after the deadline; a FastGen profile travels in the stream, a corrupt one
fails its request; a cancel shrinks the batch; the others keep being served."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable, Sequence

import pytest
import torch

from services.decode.service import DecodeService
from shared.config import load_settings
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.kv.paged.store import prompt_layer_of
from shared.engine.kv.store import BlockFormat
from shared.wire.bus import Bus
from shared.wire.handoff.profile import PromptProfile, profile_parts
from shared.wire.handoff.prompt import chunk_prompt_layer, num_prompt_chunks
from shared.wire.protocol import (
    Cancel,
    ErrorType,
    FastGenProfilePart,
    HandoffEnd,
    HandoffStart,
    Heartbeat,
    KvChunk,
    Message,
    PrefillTask,
    SamplingParams,
    StreamEvent,
    Subjects,
    decode,
)

pytestmark = pytest.mark.slow
PREFIX = "dkv"
NUM_PROMPT = 40


@pytest.fixture
async def service(nats_url: str, checkpoint) -> AsyncIterator[DecodeService]:
    settings = load_settings("decode", {
        "TSUKIMI_NATS_URL": nats_url, "TSUKIMI_SUBJECT_PREFIX": PREFIX, "TSUKIMI_INSTANCE_ID": "d0",
        "TSUKIMI_KV_DEADLINE_S": "1", "TSUKIMI_HEARTBEAT_S": "0.2", "TSUKIMI_WARMUP": "off",
    })
    engine = LLMEngine(checkpoint, EngineConfig(device="cpu", kv_cache_bytes=32 << 20, block_size=16))
    bus = await Bus.connect(nats_url, "decode", Subjects(PREFIX))
    svc = DecodeService(settings, bus, engine)
    await svc.start()
    yield svc
    await svc.stop()
    await bus.drain()


class Client:
    """Plays prefill (sends KV and tasks) and gateway (collects stream events)."""

    def __init__(self, bus: Bus, checkpoint, block_format: BlockFormat) -> None:  # noqa: ANN001
        self.bus, self.cfg, self.block_format = bus, checkpoint.config, block_format
        self.events: dict[str, list[StreamEvent]] = {}

    async def listen(self, request_id: str) -> None:
        async def on(msg) -> None:  # noqa: ANN001
            self.events.setdefault(request_id, []).append(decode(msg.data))

        await self.bus.client.subscribe(self.bus.subjects.stream(request_id), cb=on)

    def chunks(self, request_id: str) -> list[KvChunk]:
        cfg, fmt = self.cfg, self.block_format
        total = num_prompt_chunks(cfg.num_layers, NUM_PROMPT, fmt, 4096)
        out: list[KvChunk] = []
        for layer in range(cfg.num_layers):
            kv = prompt_layer_of(torch.randn(2, cfg.num_kv_heads, NUM_PROMPT, cfg.head_dim) * 0.1, fmt.block_size)
            out += chunk_prompt_layer(request_id, layer, kv.blocks, kv.tail, kv.num_tokens, fmt, len(out), total, 4096)
        return out

    async def send(
        self, request_id: str, chunks: list[KvChunk], max_tokens: int = 4, profile: Sequence[FastGenProfilePart] = (),
        num_profile_parts: int | None = None, num_kv_chunks: int | None = None, end: bool = True,
    ) -> None:
        """A hand-off stream: its start (announcing `num_kv_chunks`, default all), the chunks, the profile parts, then
        (if `end`) its end (announcing `num_profile_parts`, default all)."""
        await self.listen(request_id)
        start = HandoffStart(request_id, list(range(100, 100 + NUM_PROMPT)),
                             SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), "p0",
                             len(chunks) if num_kv_chunks is None else num_kv_chunks)
        parts = len(profile) if num_profile_parts is None else num_profile_parts
        stream = [start, *chunks, *profile] + ([HandoffEnd(request_id, 7, "seven", 0, parts)] if end else [])
        await self.publish(*stream)

    async def publish(self, *messages: Message) -> None:
        for message in messages:
            await self.bus.publish(self.bus.subjects.decode_handoff("d0"), message)

    def profile(self, request_id: str) -> list[FastGenProfilePart]:
        cfg = self.cfg
        policies = torch.full((cfg.num_layers, cfg.num_kv_heads), 4)
        return profile_parts(request_id, PromptProfile(policies, torch.rand(*policies.shape, NUM_PROMPT)), 2048)

    async def wait_done(self, request_id: str, timeout_s: float = 30.0) -> list[StreamEvent]:
        for _ in range(int(timeout_s / 0.05)):
            events = self.events.get(request_id, [])
            if events and (events[-1].finish_reason or events[-1].error_type):
                return events
            await asyncio.sleep(0.05)
        raise AssertionError(f"{request_id}: no end after {timeout_s} s: {self.events.get(request_id)}")


@pytest.fixture
async def client(nats_url: str, checkpoint, service: DecodeService) -> AsyncIterator[Client]:
    bus = await Bus.connect(nats_url, "client", Subjects(PREFIX))
    yield Client(bus, checkpoint, service.engine.block_format)
    await bus.drain()


async def test_good_corrupt_lost_and_stalled_streams(service: DecodeService, client: Client) -> None:
    good = client.chunks("good")
    assert len(good) > 30  # several chunks per layer
    corrupt = client.chunks("corrupt")
    corrupt[5] = dataclasses.replace(corrupt[5], data=bytes([corrupt[5].data[0] ^ 1]) + corrupt[5].data[1:])
    lost = client.chunks("lost")
    await client.send("corrupt", corrupt)
    await client.send("lost", lost[:17] + lost[18:], num_kv_chunks=len(lost))
    await client.send("stalled", client.chunks("stalled")[:9], num_kv_chunks=len(lost), end=False)
    await client.send("good", good)
    done = await client.wait_done("good")
    assert [e.index for e in done] == [0, 1, 2, 3] and done[-1].finish_reason == "length"
    assert done[0].token_ids == [7] and done[0].text == "seven"  # the first token, as prefill sampled it
    (failure,) = await client.wait_done("corrupt")
    assert failure.error_type == ErrorType.KV_TRANSFER and "checksum" in failure.error and "5" in failure.error
    (missing,) = await client.wait_done("lost")  # at the stream's end, not after the deadline
    assert missing.error_type == ErrorType.KV_TRANSFER and "1 of" in missing.error and "(17)" in missing.error
    (stalled,) = await client.wait_done("stalled", timeout_s=5)
    assert stalled.error_type == ErrorType.KV_TRANSFER and "stalled" in stalled.error and "missing" in stalled.error
    # Still serving after the failures.
    await client.send("after", client.chunks("after"))
    assert (await client.wait_done("after"))[-1].finish_reason == "length"
    assert len(service.receiver) == 0 and not service._assembling


async def test_a_profile_travels_in_the_stream_and_a_corrupt_or_short_one_fails(
    service: DecodeService, client: Client
) -> None:
    profile = client.profile("profiled")
    assert len(profile) > 1
    await client.send("short", client.chunks("short"), profile=client.profile("short")[:-1],
                      num_profile_parts=len(profile))  # a part lost on the way
    await client.send("profiled", client.chunks("profiled"), profile=profile)
    assert (await client.wait_done("profiled"))[-1].finish_reason == "length"
    bad = client.profile("bad")
    bad[1] = dataclasses.replace(bad[1], data=bad[1].data[:-1] + bytes([bad[1].data[-1] ^ 1]))
    await client.send("bad", client.chunks("bad"), profile=bad)
    (failure,) = await client.wait_done("bad")
    assert failure.error_type == ErrorType.KV_TRANSFER and "checksum" in failure.error
    (short,) = await client.wait_done("short")
    assert short.error_type == ErrorType.KV_TRANSFER and "profile parts arrived" in short.error
    assert len(service.receiver) == 0


async def test_cancel_shrinks_the_batch(service: DecodeService, client: Client) -> None:
    await client.send("long", client.chunks("long"), max_tokens=2000)
    for _ in range(200):
        if service.load().num_running == 1 and client.events.get("long"):
            break
        await asyncio.sleep(0.05)
    assert service.load().num_running == 1
    await client.bus.publish(client.bus.subjects.cancel, Cancel("long"))
    for _ in range(100):
        if service.load().num_running == 0:
            break
        await asyncio.sleep(0.05)
    assert service.load().num_running == 0 and not service.engine.has_unfinished()


async def test_a_prompt_sent_to_decode_is_prefilled_there(service: DecodeService, client: Client, checkpoint) -> None:
    """Conditional disaggregation: the whole request runs on the decode instance, streamed from token 0."""
    prompt = checkpoint.tokenizer.encode("The capital of France is")
    beats: list[Heartbeat] = []

    async def on_beat(msg) -> None:  # noqa: ANN001
        beats.append(decode(msg.data))

    await client.bus.client.subscribe(client.bus.subjects.heartbeat_all, cb=on_beat)
    await client.listen("here")
    task = PrefillTask("here", prompt, [], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), "d0", 0.0)
    await client.bus.publish(client.bus.subjects.decode_run("d0"), task)
    events = await client.wait_done("here")
    assert [e.index for e in events] == [0, 1, 2] and events[-1].finish_reason == "length"
    assert events[0].num_prompt_tokens == len(prompt)
    await asyncio.sleep(0.5)  # a heartbeat or two
    samples = [s for beat in beats for s in beat.samples]
    assert samples and all(len(s) == 3 and s[0] >= 1 and s[2] > 0 for s in samples)  # decode step timings
    # its prompt ran in a step of its own (nothing else decoded there): a sample for the prefill cost model
    prompt_steps = [s for beat in beats for s in beat.prefill_samples]
    assert [s[0] for s in prompt_steps] == [len(prompt)] and prompt_steps[0][2] > 0
    assert all(beat.block_bytes > 0 for beat in beats)


async def test_a_cancel_it_did_not_send_reaches_the_client(service: DecodeService, client: Client) -> None:
    """A broadcast cancel (the scheduler's, after an instance died, say) ends the request with an error event: the
    client is told, not left to time out. A stream that prefill closes early (finished there) gets nothing from
    decode, and its late chunks do not reopen it."""
    await client.send("cut", client.chunks("cut"), max_tokens=200)
    for _ in range(100):
        if service.load().num_running == 1:
            break
        await asyncio.sleep(0.05)
    await client.bus.publish(client.bus.subjects.cancel, Cancel("cut", "prefill-0 stopped responding"))
    events = await client.wait_done("cut")
    assert events[-1].error_type == ErrorType.UNAVAILABLE and "prefill-0 stopped responding" in events[-1].error
    chunks = client.chunks("done-at-prefill")
    await client.send("done-at-prefill", chunks[:5], num_kv_chunks=len(chunks), end=False)
    await _until(lambda: "done-at-prefill" in service.receiver)
    await client.publish(Cancel("done-at-prefill", "finished at prefill"), *chunks[5:])
    await _until(lambda: "done-at-prefill" not in service.receiver and service.receiver.is_closed("done-at-prefill"))
    await service.bus.client.flush()  # what decode published for it is at the server, before our barrier below
    barrier = StreamEvent("done-at-prefill", 0, [], "barrier")
    await client.bus.publish(client.bus.subjects.stream("done-at-prefill"), barrier)
    await _until(lambda: bool(client.events.get("done-at-prefill")))  # the barrier: decode sent nothing before it
    assert len(client.events["done-at-prefill"]) == 1 and "done-at-prefill" not in service.receiver


async def test_parts_of_a_stream_that_never_started_fail_at_once(service: DecodeService, client: Client) -> None:
    """A chunk, a profile part or an end with no start before it (the start was lost): the request fails at once,
    and the rest of that stream is ignored."""
    for request_id, message in (("ghost-kv", client.chunks("ghost-kv")[0]), ("ghost-profile",
                                client.profile("ghost-profile")[0]), ("ghost-end", HandoffEnd("ghost-end", 7, "", 0))):
        await client.listen(request_id)
        await client.publish(message)
        (failure,) = await client.wait_done(request_id)
        assert failure.error_type == ErrorType.KV_TRANSFER and "the start was lost?" in failure.error
    await client.publish(*client.chunks("ghost-kv")[1:3])
    await client.send("marker", client.chunks("marker"))
    assert (await client.wait_done("marker"))[-1].finish_reason == "length"
    assert len(client.events["ghost-kv"]) == 1 and len(service.receiver) == 0


async def _until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"not within {timeout_s} s")



async def test_a_finished_request_is_held_until_its_last_event_is_out(nats_url: str, checkpoint) -> None:  # noqa: ANN001
    """A long step (a whole prompt, on a colocated instance) may end a request on the engine thread well before its
    last event reaches the loop: the heartbeats meanwhile must still list it, or the gateway declares it lost."""
    settings = load_settings("decode", {
        "TSUKIMI_NATS_URL": nats_url, "TSUKIMI_SUBJECT_PREFIX": PREFIX, "TSUKIMI_INSTANCE_ID": "d0",
        "TSUKIMI_HEARTBEAT_S": "0.2", "TSUKIMI_WARMUP": "off",
    })
    engine = LLMEngine(checkpoint, EngineConfig(device="cpu", kv_cache_bytes=32 << 20, block_size=16))
    bus = await Bus.connect(nats_url, "decode", Subjects(PREFIX))
    service = DecodeService(settings, bus, engine)
    held_at_delivery: dict[str, bool] = {}
    deliver = service._deliver

    async def watched(ticks: list) -> None:  # noqa: ANN001 -- the service's _Tick
        listed = set(service.load().request_ids)
        outputs = [o for tick in ticks for o in tick.results]
        held_at_delivery.update({o.request_id: o.request_id in listed for o in outputs if getattr(o, "finished", 0)})
        await deliver(ticks)

    service._deliver = watched  # type: ignore[method-assign]
    await service.start()
    client_bus = await Bus.connect(nats_url, "client", Subjects(PREFIX))
    client = Client(client_bus, checkpoint, engine.block_format)
    try:
        await client.send("held", client.chunks("held"), max_tokens=3)
        assert (await client.wait_done("held"))[-1].finish_reason == "length"
        assert held_at_delivery == {"held": True}
        assert "held" not in service.load().request_ids
    finally:
        await service.stop()
        await client_bus.drain()
        await bus.drain()
