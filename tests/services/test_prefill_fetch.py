"""The prefill service on a real nats-server and the real model, against a scripted cache-store shard: a stored prefix
is loaded layer by layer and reused; `fetch_from_pool=False` is honoured; a block that goes bad mid-fetch is
recomputed (same answer, every KV chunk sent once); heartbeat figures, KV events and snapshots describe the cache."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import pytest
import pytest_asyncio
import torch

from services.prefill.service import PrefillService
from shared.config import load_settings
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.kv.paged.store import tensor_of
from shared.engine.kv.store import PromptKv
from shared.wire.block_hash import block_hashes
from shared.wire.bus import Bus
from shared.wire.cache_client import CacheClient
from shared.wire.handoff.prompt import KvAssembly, assemble_prompt
from shared.wire.heartbeat import new_epoch
from shared.wire.kv_events import KvEventLog
from shared.wire.protocol import (
    Ack,
    BlockGet,
    BlockHas,
    BlockHasReply,
    BlockPart,
    BlockPut,
    HandoffEnd,
    HandoffStart,
    KvChunk,
    KvEvent,
    Message,
    PrefillTask,
    Role,
    SamplingParams,
    Snapshot,
    SnapshotRequest,
    StreamEvent,
    Subjects,
    attention_work,
)
from shared.wire.protocol.messages import STORED

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]
PREFIX = "pft"
BLOCK = 16
TEXTS = {  # cut to 2 full blocks plus a tail, so every prompt has stored blocks to load
    "x": "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the steps as his father "
         "had taught him, and lit the great lamp that warned ships away from the rocks below the cliffs.",
    "w": "A recipe for bread: flour, water, salt and yeast, kneaded for ten minutes and left to rise overnight in "
         "a warm kitchen, then shaped into loaves, proofed again, and baked until the crust sings when tapped.",
    "y": "In the mountains the snow falls early, and the villagers gather wood all summer so that the long winter "
         "finds every shed full, every chimney swept, and every family ready for months of quiet evenings.",
    "z": "Our train left the coast at noon and followed the river inland past orchards, mills and sleepy stations "
         "where nobody got on or off, until the valley narrowed and the first tunnels swallowed the afternoon light.",
}


class FakeStore:
    """One cache-store shard as the wire sees it (put, get, has), scripted: `tamper(get, part)` may spoil a reply."""

    def __init__(self) -> None:
        self.blocks: dict[int, dict[int, BlockPut]] = {}
        self.tamper: Callable[[BlockGet, BlockPart], BlockPart] = lambda get, part: part

    async def serve(self, bus: Bus) -> None:
        await bus.serve(bus.subjects.cache_put(0), self.put)
        await bus.serve(bus.subjects.cache_get(0), self.get)
        await bus.serve(bus.subjects.cache_has(0), self.has)

    def is_complete(self, block_hash: int) -> bool:
        parts = self.blocks.get(block_hash, {})
        return bool(parts) and len(parts) == next(iter(parts.values())).total

    async def put(self, msg: Message) -> Ack:
        assert isinstance(msg, BlockPut)
        self.blocks.setdefault(msg.block_hash, {})[msg.seq] = msg
        return Ack()

    async def get(self, msg: Message) -> BlockPart:
        assert isinstance(msg, BlockGet)
        if not self.is_complete(msg.block_hash):
            return BlockPart(msg.block_hash, found=False, seq=msg.seq)
        p = self.blocks[msg.block_hash][msg.seq]
        return self.tamper(msg, BlockPart(msg.block_hash, True, p.seq, p.total, p.codec, p.raw_size, p.checksum,
                                          p.data))

    async def has(self, msg: Message) -> BlockHasReply:
        assert isinstance(msg, BlockHas)
        return BlockHasReply([self.is_complete(h) for h in msg.block_hashes])


@dataclass
class Seen:
    """Everything published that a test looks at, by request id."""

    streams: dict[str, list[StreamEvent]] = field(default_factory=dict)
    starts: dict[str, HandoffStart] = field(default_factory=dict)
    chunks: dict[str, list[KvChunk]] = field(default_factory=dict)
    ends: dict[str, HandoffEnd] = field(default_factory=dict)
    kv_events: list[KvEvent] = field(default_factory=list)

    async def on(self, msg: Message) -> None:
        if isinstance(msg, StreamEvent):
            self.streams.setdefault(msg.request_id, []).append(msg)
        elif isinstance(msg, HandoffStart):
            self.starts[msg.request_id] = msg
        elif isinstance(msg, KvChunk):
            assert msg.request_id in self.starts, "a hand-off starts before its first chunk"
            self.chunks.setdefault(msg.request_id, []).append(msg)
        elif isinstance(msg, HandoffEnd):
            self.ends[msg.request_id] = msg
        elif isinstance(msg, KvEvent):
            self.kv_events.append(msg)


@dataclass
class World:
    bus: Bus
    store: FakeStore
    seen: Seen
    prompts: dict[str, list[int]]
    services: list[PrefillService] = field(default_factory=list)
    refs: dict[str, tuple[HandoffEnd, torch.Tensor]] = field(default_factory=dict)  # computed from scratch

    async def prefill(self, instance_id: str, checkpoint) -> PrefillService:  # noqa: ANN001
        settings = load_settings("prefill", {
            "TSUKIMI_SUBJECT_PREFIX": PREFIX, "TSUKIMI_INSTANCE_ID": instance_id, "TSUKIMI_HEARTBEAT_S": "30",
            "TSUKIMI_KV_CHUNK_KB": "64", "TSUKIMI_WARMUP": "off",  # its steps are timed elsewhere
        })
        events = KvEventLog(instance_id, new_epoch(), Role.PREFILL)
        engine = make_engine(checkpoint, events)
        service = PrefillService(settings, self.bus, engine, CacheClient(self.bus, 1), events)
        await service.start()
        self.services.append(service)
        return service

    async def submit(self, instance_id: str, request_id: str, name: str, fetch: bool = True,
                     max_tokens: int = 4) -> None:
        task = PrefillTask(request_id, self.prompts[name], [], SamplingParams(max_tokens=max_tokens, temperature=0.0),
                           "d0", time.time(), fetch)
        await self.bus.publish(self.bus.subjects.prefill_run(instance_id), task)

    async def result(self, request_id: str) -> tuple[HandoffEnd, torch.Tensor]:
        """The end of a request's hand-off (its first token) and the prompt KV that decode got."""
        await until(lambda: request_id in self.seen.ends, timeout_s=60)
        first = self.seen.ends[request_id]
        assert request_id not in self.seen.streams, "prefill writes no response stream for a request it hands off"
        chunks = self.seen.chunks[request_id]
        total = self.seen.starts[request_id].num_kv_chunks
        assert sorted(c.seq for c in chunks) == list(range(total)), "every KV chunk exactly once"
        assembly = KvAssembly(request_id, total)
        for chunk in chunks:
            assembly.add(chunk)
        engine = self.services[0].engine
        cfg, fmt = engine.model_config, engine.block_format
        prompt = PromptKv(*assemble_prompt(assembly, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, fmt))
        return first, tensor_of(prompt, fmt, cfg.num_kv_heads, cfg.head_dim)


async def until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def make_engine(checkpoint, events: KvEventLog) -> LLMEngine:  # noqa: ANN001
    config = EngineConfig(device="cpu", kv_cache_bytes=24 << 20, block_size=BLOCK)
    return LLMEngine(checkpoint, config, on_block_event=events.record)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def world(nats_url: str, checkpoint) -> AsyncIterator[World]:  # noqa: ANN001
    """A store seeded by instance p-a, which computed every prompt from scratch (the reference answers)."""
    bus = await Bus.connect(nats_url, "prefill-test", Subjects(PREFIX))
    store, seen = FakeStore(), Seen()
    await store.serve(bus)
    for subject in (bus.subjects.stream("*"), bus.subjects.decode_handoff("d0"),
                    bus.subjects.kv_events("prefill", "p-b")):
        await bus.serve(subject, seen.on)
    prompts = {name: checkpoint.tokenizer.encode(text)[: 2 * BLOCK + 5] for name, text in TEXTS.items()}
    assert all(len(p) == 2 * BLOCK + 5 for p in prompts.values())
    world = World(bus, store, seen, prompts)
    await world.prefill("p-a", checkpoint)
    for name in prompts:
        await world.submit("p-a", f"ref-{name}", name)
        world.refs[name] = await world.result(f"ref-{name}")
    namespace = world.services[0].engine.block_manager.namespace
    await until(lambda: all(store.is_complete(h) for p in prompts.values() for h in block_hashes(p, BLOCK, namespace)))
    await world.prefill("p-b", checkpoint)
    yield world
    for service in world.services:
        await service.stop()
    await bus.drain()


async def test_a_stored_prefix_is_loaded_and_fetch_from_pool_false_is_honoured(world: World) -> None:
    service = world.services[1]
    block_put = next(iter(world.store.blocks.values()))
    assert len(block_put) == 3 and block_put[0].raw_size == 10 * 2 * 3 * BLOCK * 64 * 4  # parts of whole layers
    blocker = threading.Event()  # hold the engine thread, to see the queue as the heartbeat reports it
    held = asyncio.ensure_future(service.host.call(blocker.wait))
    try:
        await world.submit("p-b", "b-x", "x")
        await world.submit("p-b", "b-w", "w", fetch=False)  # the store holds w too
        await until(lambda: {"b-x", "b-w"} <= set(service._held) and all(
            h.num_store_blocks == 2 for h in service._held.values()))
        load = service.load()
    finally:
        blocker.set()
        await held
    assert load.num_waiting == 2
    assert load.num_queued_tokens == (len(world.prompts["x"]) - 2 * BLOCK) + len(world.prompts["w"])
    x_work, w_work = attention_work(len(world.prompts["x"]), 2 * BLOCK), attention_work(len(world.prompts["w"]), 0)
    assert load.queued_attention_work == x_work + w_work
    for request_id, name, cached in (("b-x", "x", 2 * BLOCK), ("b-w", "w", 0)):
        first, kv = await world.result(request_id)
        ref_first, ref_kv = world.refs[name]
        assert first.first_token == ref_first.first_token and first.num_cached_tokens == cached
        assert torch.allclose(kv, ref_kv, atol=1e-4)
    load = service.load()
    assert load.fetch_bytes_per_s > 0 and load.num_queued_tokens == 0
    assert load.block_bytes == 30 * 2 * 3 * BLOCK * 64 * 4 and load.kv_blocks_total > 0
    assert [len(s) for s in load.samples] == [3] * len(load.samples) and load.samples
    assert all(s[0] > 0 and s[1] >= s[0] and s[2] > 0 for s in load.samples)
    assert service.load().samples == []  # each beat carries the samples since the last one


async def test_a_request_that_ends_at_its_first_token_still_stores_its_blocks(world: World, checkpoint) -> None:  # noqa: ANN001
    text = ("Every autumn the orchard keeper wrote down which trees had borne the sweetest apples, and every spring "
            "she grafted their twigs onto young stock, so that the orchard slowly became a record of good years.")
    prompt = checkpoint.tokenizer.encode(text)[: 2 * BLOCK + 5]
    world.prompts["once"] = prompt
    hashes = block_hashes(prompt, BLOCK, world.services[0].engine.block_manager.namespace)
    assert not any(world.store.is_complete(h) for h in hashes)
    await world.submit("p-a", "once", "once", max_tokens=1)  # answered by prefill: no hand-off to decode
    await until(lambda: bool(world.seen.streams.get("once")), timeout_s=60)
    assert world.seen.streams["once"][-1].finish_reason == "length" and "once" not in world.seen.ends
    await until(lambda: all(world.store.is_complete(h) for h in hashes))


def corrupt(get: BlockGet, part: BlockPart) -> BlockPart:
    return dataclasses.replace(part, data=bytes([part.data[0] ^ 1]) + part.data[1:])


def vanished(get: BlockGet, part: BlockPart) -> BlockPart:
    return BlockPart(get.block_hash, found=False, seq=get.seq)


@pytest.mark.parametrize(("name", "spoil"), [("y", corrupt), ("z", vanished)], ids=["corrupt", "vanished"])
async def test_a_block_spoiled_mid_fetch_is_recomputed(world: World, name: str, spoil: Callable) -> None:
    service = world.services[1]
    namespace = service.engine.block_manager.namespace
    spoiled = block_hashes(world.prompts[name], BLOCK, namespace)[1]

    def spoil_second_part(get: BlockGet, part: BlockPart) -> BlockPart:  # layers 10-19 of the second block
        return spoil(get, part) if get.block_hash == spoiled and get.seq == 1 else part

    world.store.tamper = spoil_second_part
    try:
        await world.submit("p-b", f"b-{name}", name)
        first, kv = await world.result(f"b-{name}")
    finally:
        world.store.tamper = lambda get, part: part
    ref_first, ref_kv = world.refs[name]
    assert first.first_token == ref_first.first_token and first.num_cached_tokens == 0  # computed, not loaded
    assert torch.allclose(kv, ref_kv, atol=1e-4)


async def test_kv_events_and_the_snapshot_describe_the_local_cache(world: World) -> None:
    service = world.services[1]
    snapshot = await world.bus.request(world.bus.subjects.snapshot("prefill", "p-b"), SnapshotRequest("p-b"), Snapshot)
    events = world.seen.kv_events
    await until(lambda: len(events) == snapshot.seq + 1)
    assert [e.seq for e in events] == list(range(len(events))) and snapshot.seq == len(events) - 1
    assert {e.epoch for e in events} == {snapshot.epoch} and all(e.kind == STORED for e in events)
    cached = set(service.engine.block_manager.cached_hashes())
    assert set(snapshot.block_hashes) == cached == {h for e in events for h in e.block_hashes}
    stored = [h for e in events for h in e.block_hashes]
    assert len(stored) == len(set(stored))  # each block announced once
    for name in ("x", "w", "y", "z"):  # loaded, computed and recomputed prefixes are all announced
        assert set(block_hashes(world.prompts[name], BLOCK, service.engine.block_manager.namespace)[:2]) <= cached


async def test_the_client_puts_whole_layers_and_streams_parts_in_order_until_a_bad_one(world: World) -> None:
    client = CacheClient(world.bus, 1, part_bytes=1000)
    data = bytes(range(256)) * 20  # 5120 bytes: "layers" of 300 bytes, three to a part
    assert await client.put_block(0xC0FFEE, data, align_bytes=300)
    assert [p.raw_size for p in world.store.blocks[0xC0FFEE].values()] == [900] * 5 + [620]
    assert b"".join([raw async for raw in client.get_block_parts(0xC0FFEE)]) == data

    def lose_part_two(get: BlockGet, part: BlockPart) -> BlockPart:
        return BlockPart(get.block_hash, found=False, seq=get.seq) if get.seq == 2 else part

    world.store.tamper = lose_part_two
    try:
        assert [len(raw) async for raw in client.get_block_parts(0xC0FFEE)] == [900, 900]
    finally:
        world.store.tamper = lambda get, part: part
    assert [raw async for raw in client.get_block_parts(0xBAD)] == []
