"""Random and mutated messages on every subject of a running system (`tsukimi up`, 2 prefill, 2 decode), sent with
credentials allowed everything (a compromised or broken peer of any role): afterwards every service still runs,
nothing raised past a handler's validation, /health counts the real instances, and a normal request gets the same
greedy answer as before."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch

from shared.engine.kv.paged.store import prompt_layer_of
from shared.engine.kv.store import BlockFormat
from shared.wire.block_hash import block_hashes
from shared.wire.bus import Bus
from shared.wire.cache_client import split_block
from shared.wire.handoff.prompt import chunk_prompt_layer
from shared.wire.protocol import (
    BlockGet,
    BlockHas,
    Cancel,
    ExpectHandoff,
    HandoffEnd,
    HandoffStart,
    Heartbeat,
    KvChunk,
    KvEvent,
    Message,
    PrefillTask,
    SamplingParams,
    SnapshotRequest,
    StreamEvent,
    Subjects,
    SubmitRequest,
    encode,
    message_types,
)
from tests.integration.system_fixture import System, start_system, stop_system

MODEL = "SmolLM2-135M-Instruct"
SEED = 20261201
NUM_PER_SUBJECT = 24
NUM_RANDOM_BYTES = 150
INSTANCES = {"prefill": ["prefill-0", "prefill-1"], "decode": ["decode-0", "decode-1"],
             "cache-store": ["cache-store-0"], "scheduler": ["scheduler-0"]}
EVIL_INTS = [0, 1, -1, 7, 2**31, 2**63 - 1, 2**64 - 1, -(2**63), 49_152, 60_000, 10**9]
EVIL_STRS = ["", "a.b", "x" * 300, "decode-0", "prefill-1", "fuzz-1", "*", ">", "\u00e9", "raw", "lz4-shuffle",
             "fp32", "stored", "decode"]


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[System]:
    running = start_system(tmp_path_factory.mktemp("fuzz"))
    yield running
    stop_system(running)


def _answer(system: System) -> str:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 16,
            "temperature": 0}
    status, _, reply = system.post("/v1/chat/completions", body)
    assert status == 200, reply
    return str(reply["choices"][0]["message"]["content"])


def _subjects(s: Subjects) -> list[str]:
    names = [s.submit, s.cancel, s.failed, s.stream("fuzz-1"), s.stream("fuzz-2"), s.cache_put(0), s.cache_get(0),
             s.cache_has(0), s.heartbeat("decode", "fuzz-decode"), s.heartbeat("prefill", "fuzz-prefill")]
    for role, ids in INSTANCES.items():
        for instance in ids:
            names += [s.heartbeat(role, instance), s.kv_events(role, instance), s.snapshot(role, instance)]
    for instance in INSTANCES["prefill"]:
        names.append(s.prefill_run(instance))
    for instance in INSTANCES["decode"]:
        names += [s.decode_run(instance), s.decode_handoff(instance)]
    return names


def _value(rng: random.Random, hint: Any) -> Any:
    """A value that fits the annotation, often an unkind one, and now and then one of another type."""
    if rng.random() < 0.1:
        return rng.choice([None, "x", -5, 1.5, [1], {"a": 1}, b"\x00", True])
    origin = typing.get_origin(hint)
    if origin is list:
        (item,) = typing.get_args(hint)
        return [_value(rng, item) for _ in range(rng.choice([0, 1, 3, 200]))]
    if origin is not None:  # an optional scalar
        return _value(rng, rng.choice(typing.get_args(hint)))
    if hint is int:
        return rng.choice(EVIL_INTS + [rng.randint(0, 5000)])
    if hint is float:
        return rng.choice([0.0, -1.0, 1e308, float("nan"), float("inf"), rng.random() * 100])
    if hint is str:
        return rng.choice(EVIL_STRS)
    if hint is bytes:
        return rng.randbytes(rng.choice([0, 16, 300, 4000]))
    if hint is bool:
        return rng.random() < 0.5
    if hint is type(None):
        return None
    return {name: _value(rng, h) for name, h in typing.get_type_hints(hint).items()}  # a nested message


def _fields(rng: random.Random, cls: type[Message]) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    fields = {f.name: _value(rng, hints[f.name]) for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    if rng.random() < 0.5 and "request_id" in fields:
        fields["request_id"] = f"fuzz-{rng.randint(1, 40)}"  # a valid id: the message goes further in
    for name in rng.sample(sorted(fields), k=min(len(fields), rng.randint(0, 2))):
        del fields[name]  # missing fields now and then
    return fields


def _valid(rng: random.Random, subject: str, subjects: Subjects) -> Message:
    """A message a real peer could send on `subject` (a fuzz request's, with small prompts and few tokens)."""
    request_id = f"fuzz-{rng.randint(1, 40)}"
    prompt = [rng.randrange(49_152) for _ in range(rng.randint(1, 80))]
    sampling = SamplingParams(
        max_tokens=rng.randint(1, 8), temperature=rng.choice([0.0, 0.7]), seed=rng.choice([None, 3])
    )
    sender = subjects.sender_of(subject)
    if sender is not None and ".sched.heartbeat." in subject:
        return Heartbeat(sender[1], sender[0], rng.randint(1, 9), time.time(), rng.randint(0, 3),
                         request_ids=[request_id], samples=[[1.0, 100.0, 0.01]], block_bytes=1 << 20)
    if sender is not None and ".kv.events." in subject:
        return KvEvent(sender[1], rng.randint(1, 9), rng.randint(0, 3), "stored", [rng.getrandbits(64)], sender[0])
    if sender is not None:
        return SnapshotRequest(sender[1])
    hashes = block_hashes(prompt, 64, b"")
    by_subject: dict[str, list[Message]] = {
        ".sched.submit": [SubmitRequest(request_id, prompt, hashes, sampling, time.time())],
        ".prefill.": [PrefillTask(request_id, prompt, hashes, sampling, rng.choice(INSTANCES["decode"]), time.time())],
        ".run": [ExpectHandoff(request_id, rng.choice(INSTANCES["prefill"]), len(prompt)),
                 PrefillTask(request_id, prompt, hashes, sampling, "decode-0", time.time())],
        ".handoff": [HandoffStart(request_id, prompt, sampling, "prefill-0", rng.randint(1, 60)),
                     *_kv_chunks(request_id, len(prompt))[:1], HandoffEnd(request_id, prompt[0], "forged", 0)],
        ".stream.": [StreamEvent(request_id, rng.randint(0, 3), prompt[:2], "forged")],
        ".cancel": [Cancel(request_id, "fuzz")],
        ".get": [BlockGet(rng.getrandbits(64))],
        ".has": [BlockHas(hashes)],
        ".put": split_block(rng.getrandbits(64), rng.randbytes(3000), 1024)[:2],
    }
    fitting = [m for needle, messages in by_subject.items() if needle in subject for m in messages]
    everything = [m for messages in by_subject.values() for m in messages]
    return rng.choice(fitting if fitting and rng.random() < 0.8 else everything)


def _payloads(rng: random.Random, subject: str, subjects: Subjects, kinds: list[type[Message]]) -> Iterator[bytes]:
    """A third each: real messages (a few fields changed, or none), random fields of any kind, flipped bytes."""
    for _ in range(NUM_PER_SUBJECT):
        choice = rng.random()
        if choice < 0.4:
            msg = _valid(rng, subject, subjects)
            fields = msgpack.unpackb(encode(msg), raw=False)[2]
            for name in rng.sample(sorted(fields), k=min(len(fields), rng.choice([0, 0, 1, 2]))):
                fields[name] = _value(rng, typing.get_type_hints(type(msg))[name])
            cls = type(msg)
        else:
            cls = rng.choice(kinds)
            fields = _fields(rng, cls)
        raw = bytearray(msgpack.packb([cls.KIND, cls.VERSION, fields], use_bin_type=True))
        if choice > 0.8 and raw:
            raw[rng.randrange(len(raw))] = rng.randrange(256)  # a flipped byte
        yield bytes(raw)


async def _fuzz(system: System) -> None:
    rng = random.Random(SEED)
    bus = await Bus.connect(system.nats.url, "itest-fuzz", Subjects(), system.watcher)
    kinds = message_types()
    sent = 0
    for subject in _subjects(bus.subjects):
        for payload in _payloads(rng, subject, bus.subjects, kinds):
            await bus.client.publish(subject, payload)
            sent += 1
            if sent % 40 == 0:
                await bus.client.flush()
                await asyncio.sleep(0.05)  # a fuzzer, not a flood: the system must read every message
        for _ in range(NUM_RANDOM_BYTES // 20):
            await bus.client.publish(subject, rng.randbytes(rng.randint(0, 2000)))
    await bus.client.flush()
    await asyncio.sleep(1.0)
    for i in range(1, 41):  # whatever the fuzz set running (a forged prompt, say) stops
        await bus.publish(bus.subjects.cancel, Cancel(f"fuzz-{i}", "fuzz test over"))
    await bus.drain()


def _log_lines(log_dir: Path, needle: str) -> list[str]:
    return [f"{path.name}: {line[:300]}" for path in sorted(log_dir.glob("*.log"))
            for line in path.read_text(errors="replace").splitlines() if needle in line]


def test_fuzzed_messages_on_every_subject_leave_every_service_serving(system: System) -> None:
    before, pids = _answer(system), system.service_pids()
    asyncio.run(_fuzz(system))
    assert system.service_pids() == pids  # nothing crashed or restarted
    for _ in range(60):  # forged instances are forgotten after TSUKIMI_INSTANCE_TIMEOUT_S
        status, body = system.get("/health")
        if status == 200 and '"prefill": 2' in body and '"decode": 2' in body:
            break
        asyncio.run(asyncio.sleep(0.5))
    assert status == 200 and '"prefill": 2' in body and '"decode": 2' in body, body
    assert _answer(system) == before
    for needle in ("handler failed", "engine tick failed", "Traceback"):  # every message refused before acting
        assert not _log_lines(system.log_dir, needle), _log_lines(system.log_dir, needle)[:5]
    assert _log_lines(system.log_dir, "refused a message")  # and the refusals were said
    reached = [line for line in _log_lines(system.log_dir, "fuzz-") if "refused a message" not in line]
    assert any("placed" in line for line in reached) and any("prefill" in line.split(":")[0] for line in reached)


def _kv_chunks(request_id: str, num_tokens: int) -> list[KvChunk]:
    """Layer 0 of a prompt's KV as prefill sends it (SmolLM2's shape, fp32, blocks of 64)."""
    fmt = BlockFormat("fp32", 64, 2 * 3 * 64 * 64 * 4, 0, torch.float32)
    kv = prompt_layer_of(torch.randn(2, 3, num_tokens, 64), fmt.block_size)
    return chunk_prompt_layer(request_id, 0, kv.blocks, kv.tail, kv.num_tokens, fmt, 0, 30, 1 << 16)
