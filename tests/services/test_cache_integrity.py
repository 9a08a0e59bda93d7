"""KV blocks bound to their hash by the writers' key, against a real nats-server and cache-store: another prompt's
parts relabelled under a hash are stored (the store has no key) but never used, and the writer's next put replaces
them; blocks of another key or none are misses; the tags survive the SSD tier and a restart."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from cache_stack import Stack

from shared.wire.block_integrity import TAG_BYTES, BlockSigner
from shared.wire.cache_client import split_block
from shared.wire.protocol import Ack, BlockPut

KEY = b"the-deployments-block-key-0123456789"


@pytest.fixture
async def stack(nats_url: str) -> AsyncIterator[Stack]:
    stack = Stack(nats_url)
    yield stack
    await stack.close()


def test_a_tag_binds_the_bytes_to_their_hash_and_place() -> None:
    signer = BlockSigner(KEY)
    [part] = split_block(7, b"kv of block seven" * 100, 1 << 20, signer)
    assert len(part.tag) == TAG_BYTES and signer.verifies(part)
    for changed in (dataclasses.replace(part, block_hash=8), dataclasses.replace(part, data=part.data[:-1] + b"!"),
                    dataclasses.replace(part, seq=1, total=2), dataclasses.replace(part, tag=b""),
                    dataclasses.replace(part, codec="raw" if part.codec != "raw" else "lz4"),
                    dataclasses.replace(part, raw_size=part.raw_size + 1)):
        assert not signer.verifies(changed)
    assert not BlockSigner(b"another-deployments-key-000000").verifies(part)
    assert BlockSigner(None).verifies(dataclasses.replace(part, tag=b""))  # no key: nothing to check
    assert split_block(7, b"x", 10, BlockSigner(None))[0].tag == b""


async def test_relabelled_parts_are_refused_and_the_writers_next_put_replaces_them(stack: Stack) -> None:
    """The attack of the issue: parts of one prompt's block, re-put under the hash of a block not asked for yet."""
    await stack.store()
    writer = await stack.client(key=KEY)
    albatross, other = os.urandom(50_000), os.urandom(50_000)
    assert await writer.put_block(0xA, albatross)
    sniffed = split_block(0xA, albatross, 16 << 10, writer.signer)
    attacker = await stack.bus()
    for part in sniffed:
        relabelled = dataclasses.replace(part, block_hash=0xB)
        assert (await attacker.request(stack.subjects.cache_put(0), relabelled, Ack)).ok  # the store cannot tell
    assert await writer.has_blocks([0xB]) == [True]
    assert await writer.get_block(0xB) is None  # ... the reader can: a miss, never the wrong KV
    assert await writer.get_block(0xA) == albatross
    assert await writer.put_block(0xB, other)  # recomputed by prefill and put again: it replaces the bad copy
    assert await writer.get_block(0xB) == other
    assert [p async for p in writer.get_block_parts(0xB)] != []


async def test_blocks_of_another_key_or_none_are_misses(stack: Stack) -> None:
    await stack.store()
    unsigned, ours = await stack.client(), await stack.client(key=KEY)
    assert await unsigned.put_block(0xC, b"z" * 9000)
    assert await ours.get_block(0xC) is None and await unsigned.get_block(0xC) == b"z" * 9000
    theirs = await stack.client(key=b"a-different-deployment-key-000000")
    assert await theirs.put_block(0xD, b"y" * 9000)
    assert await ours.get_block(0xD) is None


async def test_tags_survive_the_ssd_tier_and_a_restart(stack: Stack, tmp_path: Path) -> None:
    env = {"TSUKIMI_CACHE_SSD_DIR": str(tmp_path / "ssd"), "TSUKIMI_CACHE_SSD_ADMIT_SEEN": "1"}
    service = await stack.store(dram_mb=1, env=env)
    client = await stack.client(key=KEY)
    blocks = {h: os.urandom(300_000) for h in range(1, 9)}  # 2.4 MB through 1 MiB of DRAM: most go to SSD
    for block_hash, data in blocks.items():
        assert await client.put_block(block_hash, data)
    await service.store.flush()
    await stack.stop(service)
    restarted = await stack.store(dram_mb=1, env=env)  # re-indexed from the block files; DRAM's blocks are gone
    on_ssd = restarted.store.hashes()
    assert len(on_ssd) >= 4
    for block_hash in on_ssd:
        assert await client.get_block(block_hash) == blocks[block_hash], block_hash  # tags read back from the files


def test_a_put_with_a_tag_of_the_wrong_size_is_refused_at_decode() -> None:
    from shared.wire.protocol import ProtocolError, decode, encode

    part = split_block(1, b"abc", 10, BlockSigner(KEY))[0]
    with pytest.raises(ProtocolError, match="a tag of 3 bytes"):
        decode(encode(dataclasses.replace(part, tag=b"abc")))
    assert isinstance(decode(encode(part)), BlockPut)
