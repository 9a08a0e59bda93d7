"""The chained block hash of shared/wire/block_hash.py against raw xxhash, and the spec's worked example."""

from __future__ import annotations

import re
import struct
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.wire.block_hash import block_hashes, hash_block, make_namespace

SPEC = Path(__file__).resolve().parents[2] / "docs" / "block-hash.md"
NS = make_namespace("test-model", "fp16")
u32s = st.integers(0, 2**32 - 1)


def raw_chain(token_ids: Sequence[int], block_size: int, namespace: bytes) -> list[int]:
    """The spec computed from scratch with struct and xxhash, independently of shared/engine/blocks.py."""
    hashes: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = struct.pack(f"<{block_size}I", *token_ids[start : start + block_size])
        prefix = namespace if not hashes else struct.pack("<Q", hashes[-1])
        hashes.append(xxhash.xxh3_64(prefix + block, seed=0).intdigest())
    return hashes


# ---- hashing -----------------------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(st.lists(u32s, max_size=40), st.integers(1, 8), st.binary(max_size=40))
def test_block_hashes_match_raw_xxhash(token_ids: list[int], block_size: int, namespace: bytes) -> None:
    assert block_hashes(token_ids, block_size, namespace) == raw_chain(token_ids, block_size, namespace)


@settings(max_examples=50, deadline=None)
@given(st.lists(u32s, min_size=1, max_size=8), st.none() | st.integers(0, 2**64 - 1))
def test_hash_block_is_one_link_of_the_chain(token_ids: list[int], parent: int | None) -> None:
    block = struct.pack(f"<{len(token_ids)}I", *token_ids)
    prefix = NS if parent is None else struct.pack("<Q", parent)
    assert hash_block(parent, token_ids, NS) == xxhash.xxh3_64_intdigest(prefix + block)


@settings(max_examples=100, deadline=None)
@given(st.data(), st.integers(1, 4), st.integers(1, 6))
def test_changing_a_token_changes_its_block_and_every_later_hash(
    data: st.DataObject, block_size: int, num_blocks: int
) -> None:
    token_ids = data.draw(st.lists(u32s, min_size=num_blocks * block_size, max_size=num_blocks * block_size))
    position = data.draw(st.integers(0, len(token_ids) - 1))
    changed = list(token_ids)
    changed[position] = data.draw(u32s.filter(lambda t: t != token_ids[position]))
    before, after = block_hashes(token_ids, block_size, NS), block_hashes(changed, block_size, NS)
    first_changed = position // block_size
    assert before[:first_changed] == after[:first_changed]
    assert all(b != a for b, a in zip(before[first_changed:], after[first_changed:], strict=True))


def test_namespace_separates_codecs_and_models() -> None:
    token_ids = list(range(32))
    fp16 = block_hashes(token_ids, 8, make_namespace("m", "fp16"))
    kvquant = block_hashes(token_ids, 8, make_namespace("m", "kvquant-3b"))
    other_model = block_hashes(token_ids, 8, make_namespace("m2", "fp16"))
    assert len(set(fp16) | set(kvquant) | set(other_model)) == 12


def test_make_namespace_encoding_and_ambiguous_fields() -> None:
    assert make_namespace("smollm2-q4_1", "fp16") == b"tsukimi/v1|smollm2-q4_1|fp16"
    assert make_namespace("mod\u00e8le", "fp16") == "tsukimi/v1|mod\u00e8le|fp16".encode()
    for fingerprint, codec in (("a|b", "fp16"), ("a", "b|c"), ("", "fp16"), ("a", "")):
        with pytest.raises(ValueError):
            make_namespace(fingerprint, codec)


def test_partial_tail_has_no_hash() -> None:
    token_ids = list(range(2 * 4 + 3))
    assert block_hashes(token_ids, 4, NS) == block_hashes(token_ids[:8], 4, NS)
    assert len(block_hashes(token_ids, 4, NS)) == 2
    assert block_hashes([1, 2, 3], 4, NS) == []


def test_out_of_range_inputs_raise_value_error() -> None:
    for bad in ([-1], [2**32]):
        with pytest.raises(ValueError):
            block_hashes(bad, 1, NS)
        with pytest.raises(ValueError):
            hash_block(None, bad, NS)
    with pytest.raises(ValueError):
        hash_block(2**64, [1], NS)
    with pytest.raises(ValueError):
        hash_block(None, [], NS)
    with pytest.raises(ValueError):
        block_hashes([1], 0, NS)


def test_hundred_thousand_tokens_hash_fast() -> None:
    token_ids = [(i * 7919) % 50_000 for i in range(100_000)]
    start = time.perf_counter()
    hashes = block_hashes(token_ids, 64, NS)
    elapsed = time.perf_counter() - start
    assert len(hashes) == 100_000 // 64
    assert hashes[-1] == raw_chain(token_ids, 64, NS)[-1]
    assert elapsed < 1.0, f"hashing 100k tokens took {elapsed:.3f} s"


def _spec_example() -> dict[str, str]:
    text = SPEC.read_text(encoding="utf-8")
    section = text.split("## Worked example", 1)[1]
    block = re.search(r"```text\n(.*?)```", section, re.DOTALL)
    assert block is not None, "the worked example's ```text block is missing from docs/block-hash.md"
    pairs = (line.split("=", 1) for line in block.group(1).splitlines() if "=" in line)
    return {key.strip(): value.strip() for key, value in pairs}


def test_spec_worked_example() -> None:
    example = _spec_example()
    fingerprint, codec = example["namespace"].removeprefix("tsukimi/v1|").split("|")
    namespace = make_namespace(fingerprint, codec)
    block_size = int(example["block_size"])
    token_ids = [int(t) for t in example["token_ids"].split(",")]
    h_0, h_1 = int(example["h_0"], 16), int(example["h_1"], 16)
    input_0, input_1 = bytes.fromhex(example["input_0"]), bytes.fromhex(example["input_1"])
    # The documented bytes follow the layout rules, computed here by hand ...
    assert namespace == bytes.fromhex(example["namespace_hex"]) == example["namespace"].encode()
    assert input_0 == namespace + struct.pack("<4I", *token_ids[:4])
    assert input_1 == struct.pack("<Q", h_0) + struct.pack("<4I", *token_ids[4:8])
    # ... the documented ids are XXH3-64 (seed 0) of those bytes ...
    assert xxhash.xxh3_64_intdigest(input_0) == h_0
    assert xxhash.xxh3_64_intdigest(input_1) == h_1
    # ... and the implementation agrees, leaving the partial tail without an id.
    assert block_hashes(token_ids, block_size, namespace) == [h_0, h_1]
    assert [int(t) for t in example["partial"].split(",")] == token_ids[2 * block_size :]
