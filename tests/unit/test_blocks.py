"""Unit tests of shared/blocks.py: the chained block hash, its spec's worked example, the block manager."""

from __future__ import annotations

import re
import struct
import time
from collections.abc import Hashable, Sequence
from pathlib import Path

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from shared.blocks import BlockManager, OutOfBlocks, block_hashes, hash_block, make_namespace

SPEC = Path(__file__).resolve().parents[2] / "docs" / "block-hash.md"
NS = make_namespace("test-model", "fp16")
u32s = st.integers(0, 2**32 - 1)


def raw_chain(token_ids: Sequence[int], block_size: int, namespace: bytes) -> list[int]:
    """The spec computed from scratch with struct and xxhash, independently of shared/blocks.py."""
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


# ---- block manager: examples -------------------------------------------------------------------------------


def computed(manager: BlockManager, seq_id: Hashable, token_ids: Sequence[int]) -> int:
    """Allocate a sequence and mark all of it computed; returns the reused token count."""
    reused = manager.allocate(seq_id, token_ids)
    manager.mark_computed(seq_id, len(token_ids))
    manager.check_invariants()
    return reused


def observable(manager: BlockManager, seq_ids: Sequence[Hashable]) -> tuple[object, ...]:
    """Everything the public API shows about the manager's state."""
    tables = [
        (s, manager.block_ids(s), manager.num_tokens(s), manager.num_computed_tokens(s))
        for s in seq_ids
        if s in manager
    ]
    refs = [manager.ref_count(b) for b in range(manager.num_blocks)]
    registered = [registered_tokens(manager, b) for b in range(manager.num_blocks)]
    return manager.num_free_blocks, manager.stats, tables, refs, registered


def registered_tokens(manager: BlockManager, block_id: int) -> tuple[int, ...] | None:
    try:
        return manager.block_token_ids(block_id)
    except KeyError:
        return None


def test_shared_prefix_reuses_the_same_physical_blocks() -> None:
    manager = BlockManager(num_blocks=10, block_size=4, namespace=NS)
    prefix = list(range(100, 112))  # three full blocks
    assert computed(manager, "a", prefix + [1, 2]) == 0
    assert manager.num_reusable_tokens(prefix + [7, 8, 9]) == 12
    assert manager.blocks_needed(prefix + [7, 8, 9]) == 1
    assert manager.allocate("b", prefix + [7, 8, 9]) == 12
    manager.check_invariants()
    assert manager.block_ids("b")[:3] == manager.block_ids("a")[:3]
    assert manager.block_ids("b")[3] not in manager.block_ids("a")
    assert [manager.ref_count(b) for b in manager.block_ids("b")] == [2, 2, 2, 1]
    assert manager.num_computed_tokens("b") == 12
    assert manager.stats.num_reused_blocks_total == 3
    for i, block_id in enumerate(manager.block_ids("b")[:3]):
        assert manager.block_token_ids(block_id) == tuple(prefix[4 * i : 4 * i + 4])


def test_a_fully_cached_prompt_still_computes_its_last_block() -> None:
    manager = BlockManager(num_blocks=10, block_size=4, namespace=NS)
    prompt = list(range(8))  # exactly two full blocks
    computed(manager, "a", prompt)
    assert manager.num_reusable_tokens(prompt) == 4
    assert manager.allocate("b", prompt) == 4
    assert manager.block_ids("b")[1] != manager.block_ids("a")[1]
    assert manager.num_reusable_tokens(prompt + [8]) == 8
    assert manager.num_reusable_tokens(prompt[:1]) == 0


def test_only_computed_full_blocks_are_reusable() -> None:
    manager = BlockManager(num_blocks=10, block_size=4, namespace=NS)
    prompt = list(range(13))
    manager.allocate("a", prompt)
    assert manager.num_reusable_tokens(prompt) == 0
    manager.mark_computed("a", 7)  # block 0 full, block 1 only partly written
    assert manager.num_reusable_tokens(prompt) == 4
    with pytest.raises(KeyError):
        manager.block_token_ids(manager.block_ids("a")[1])
    manager.mark_computed("a", 13)
    assert manager.num_reusable_tokens(prompt) == 12
    assert manager.stats.num_cached_blocks == 3
    manager.check_invariants()


def test_reuse_needs_the_same_whole_prefix_and_namespace() -> None:
    manager = BlockManager(num_blocks=10, block_size=2, namespace=NS)
    computed(manager, "a", [1, 2, 3, 4, 5])
    assert manager.num_reusable_tokens([9, 2, 3, 4, 5]) == 0  # same later blocks, other head
    assert manager.num_reusable_tokens([1, 2, 3, 9, 5]) == 2
    other = BlockManager(num_blocks=10, block_size=2, namespace=make_namespace("test-model", "kvquant-3b"))
    computed(other, "a", [1, 2, 3, 4, 5])
    assert other.stats.num_cached_blocks == 2
    assert block_hashes([1, 2, 3, 4], 2, NS) != block_hashes([1, 2, 3, 4], 2, other.namespace)


def test_out_of_blocks_leaves_all_state_unchanged() -> None:
    manager = BlockManager(num_blocks=4, block_size=2, namespace=NS)
    computed(manager, "a", [1, 2, 3])
    manager.free("a")  # one cached block in the LRU, one on the free list
    computed(manager, "b", [7, 8])
    before = observable(manager, ["a", "b", "c"])
    too_long = [1, 2, 3, 4, 5, 6, 7]  # reuses the cached block, needs 3 more: 4 > 3 free
    assert manager.blocks_needed(too_long) == 4 > manager.num_free_blocks == 3
    with pytest.raises(OutOfBlocks):
        manager.allocate("c", too_long)
    assert observable(manager, ["a", "b", "c"]) == before
    assert not manager.can_append("b", 7)
    with pytest.raises(OutOfBlocks):
        manager.append("b", [1, 2, 3, 4, 5, 6, 7])
    assert observable(manager, ["a", "b", "c"]) == before
    manager.check_invariants()
    assert manager.can_append("b", 6)
    manager.append("b", [1, 2, 3, 4, 5, 6])
    assert manager.num_free_blocks == 0 and manager.stats.num_evictions == 1


def test_blocks_needed_counts_reused_blocks_taken_off_the_lru() -> None:
    manager = BlockManager(num_blocks=2, block_size=2, namespace=NS)
    computed(manager, "a", [1, 2, 3])
    manager.free("a")
    assert manager.num_free_blocks == 2
    assert manager.blocks_needed([1, 2, 3]) == 2
    assert manager.allocate("b", [1, 2, 3]) == 2
    assert manager.num_free_blocks == 0
    manager.check_invariants()


def test_eviction_takes_the_least_recently_freed_block_and_a_sequences_tail_first() -> None:
    manager = BlockManager(num_blocks=3, block_size=2, namespace=NS)
    blocks = {}
    for name, prompt in (("a", [1, 2]), ("b", [3, 4]), ("c", [5, 6])):
        computed(manager, name, prompt)
        blocks[name] = manager.block_ids(name)[0]
        manager.free(name)
    assert manager.num_free_blocks == 3 and manager.stats.num_cached_blocks == 3
    manager.allocate("d", [7])  # the free list is empty: evicts a, the least recently freed
    assert manager.block_ids("d") == [blocks["a"]]
    assert manager.stats.num_evictions == 1
    assert manager.num_reusable_tokens([1, 2, 0]) == 0
    assert manager.num_reusable_tokens([3, 4, 0]) == 2
    manager.free("d")
    manager.allocate("e", [3, 4, 9, 9, 9])  # revives b, takes d's block from the free list, evicts c
    assert manager.block_ids("e") == [blocks["b"], blocks["a"], blocks["c"]]
    assert manager.stats.num_evictions == 2
    manager.check_invariants()


def test_a_freed_sequence_evicts_its_tail_before_its_head() -> None:
    manager = BlockManager(num_blocks=2, block_size=2, namespace=NS)
    computed(manager, "a", [1, 2, 3, 4])
    head, tail = manager.block_ids("a")
    manager.free("a")
    manager.allocate("b", [9])
    assert manager.block_ids("b") == [tail]
    assert manager.num_reusable_tokens([1, 2, 3, 4, 5]) == 2
    manager.check_invariants()


def test_a_duplicate_block_keeps_the_first_registration() -> None:
    manager = BlockManager(num_blocks=6, block_size=2, namespace=NS)
    manager.allocate("a", [1, 2, 3])
    manager.allocate("b", [1, 2, 4])  # computed side by side: nothing to reuse yet
    manager.mark_computed("a", 3)
    manager.mark_computed("b", 3)
    first, second = manager.block_ids("a")[0], manager.block_ids("b")[0]
    assert first != second and manager.stats.num_cached_blocks == 1
    assert manager.block_token_ids(first) == (1, 2)
    with pytest.raises(KeyError):
        manager.block_token_ids(second)
    manager.free("b")  # its unregistered copy is garbage: straight back to the free list
    assert manager.stats.num_cached_blocks == 1 and manager.num_free_blocks == 4
    assert manager.allocate("c", [1, 2, 5]) == 2
    assert manager.block_ids("c")[0] == first
    manager.check_invariants()


def test_misuse_raises() -> None:
    with pytest.raises(ValueError):
        BlockManager(num_blocks=0, block_size=2)
    with pytest.raises(ValueError):
        BlockManager(num_blocks=2, block_size=0)
    manager = BlockManager(num_blocks=4, block_size=2, namespace=NS)
    manager.allocate("a", [1, 2, 3])
    with pytest.raises(ValueError):
        manager.allocate("a", [1])
    with pytest.raises(ValueError):
        manager.allocate("b", [])
    with pytest.raises(ValueError):
        manager.allocate("b", [-1])
    with pytest.raises(ValueError):
        manager.mark_computed("a", 4)
    manager.mark_computed("a", 2)
    with pytest.raises(ValueError):
        manager.mark_computed("a", 1)
    for call in (manager.free, manager.block_ids, manager.num_tokens, manager.num_computed_tokens):
        with pytest.raises(KeyError):
            call("missing")
    assert "a" in manager and "missing" not in manager
    manager.free("a")
    assert "a" not in manager
    manager.check_invariants()


# ---- block manager: model-based stateful tests -------------------------------------------------------------


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate/append/mark_computed/free over a small pool and vocabulary, so prefixes collide often.

    The model tracks, per physical block, the token prefix whose KV it holds (None: garbage or partial), as a
    runner writing KV would leave it. Reusing a block whose KV belongs to another prefix is the bug to catch.
    """

    num_blocks, block_size, vocab_size, max_len = 8, 2, 2, 7

    def __init__(self) -> None:
        super().__init__()
        self.manager = BlockManager(self.num_blocks, self.block_size, NS)
        self.tokens: dict[int, list[int]] = {}
        self.kv: dict[int, tuple[int, ...] | None] = dict.fromkeys(range(self.num_blocks))
        self.next_seq_id = 0
        self.prompts: list[list[int]] = []  # new prompts often extend a prefix of an earlier one

    def draw_tokens(self, data: st.DataObject, min_size: int) -> list[int]:
        token = st.integers(0, self.vocab_size - 1)
        return data.draw(st.lists(token, min_size=min_size, max_size=self.max_len))

    def cached_kv(self) -> list[tuple[int, ...] | None]:
        """The KV prefixes held by the blocks registered in the prefix index."""
        blocks = range(self.num_blocks)
        return [self.kv[b] for b in blocks if registered_tokens(self.manager, b) is not None]

    def expected_reuse(self, token_ids: list[int]) -> int:
        """Leading full blocks within token_ids[:-1] whose prefix some registered block holds."""
        cached, end = set(self.cached_kv()), self.block_size
        while end < len(token_ids) and tuple(token_ids[:end]) in cached:
            end += self.block_size
        return end - self.block_size

    def draw_prompt(self, data: st.DataObject) -> list[int]:
        if not self.prompts or data.draw(st.booleans()):
            return self.draw_tokens(data, 1)
        earlier = data.draw(st.sampled_from(self.prompts))
        prefix = earlier[: data.draw(st.integers(0, len(earlier)))]
        return (prefix + self.draw_tokens(data, 1))[: self.max_len]

    @rule(data=st.data())
    def allocate(self, data: st.DataObject) -> None:
        token_ids, manager, size = self.draw_prompt(data), self.manager, self.block_size
        self.prompts.append(token_ids)
        seq_id, self.next_seq_id = self.next_seq_id, self.next_seq_id + 1
        predicted, needed = manager.num_reusable_tokens(token_ids), manager.blocks_needed(token_ids)
        num_free = manager.num_free_blocks
        assert predicted == self.expected_reuse(token_ids)
        if needed > num_free:
            before = observable(manager, list(self.tokens))
            with pytest.raises(OutOfBlocks):
                manager.allocate(seq_id, token_ids)
            assert observable(manager, list(self.tokens)) == before
            return
        assert manager.allocate(seq_id, token_ids) == predicted
        assert manager.num_free_blocks == num_free - needed
        assert manager.num_computed_tokens(seq_id) == predicted
        block_ids = manager.block_ids(seq_id)
        for i, block_id in enumerate(block_ids[: predicted // size]):
            end = (i + 1) * size
            assert manager.block_token_ids(block_id) == tuple(token_ids[end - size : end])
            assert self.kv[block_id] == tuple(token_ids[:end]), "reused a block holding another prefix's KV"
        for block_id in block_ids[predicted // size :]:
            self.kv[block_id] = None
        self.tokens[seq_id] = token_ids

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def append(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        new_tokens, manager = self.draw_tokens(data, 0)[: 2 * self.block_size], self.manager
        old_ids, num_free = manager.block_ids(seq_id), manager.num_free_blocks
        if not manager.can_append(seq_id, len(new_tokens)):
            before = observable(manager, list(self.tokens))
            with pytest.raises(OutOfBlocks):
                manager.append(seq_id, new_tokens)
            assert observable(manager, list(self.tokens)) == before
            return
        manager.append(seq_id, new_tokens)
        block_ids = manager.block_ids(seq_id)
        assert block_ids[: len(old_ids)] == old_ids
        assert manager.num_free_blocks == num_free - (len(block_ids) - len(old_ids))
        for block_id in block_ids[len(old_ids) :]:
            self.kv[block_id] = None
        self.tokens[seq_id] += new_tokens

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def mark_computed(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        token_ids, manager, size = self.tokens[seq_id], self.manager, self.block_size
        old = manager.num_computed_tokens(seq_id)
        new = data.draw(st.integers(old, len(token_ids)))
        manager.mark_computed(seq_id, new)
        assert manager.num_computed_tokens(seq_id) == new
        block_ids = manager.block_ids(seq_id)
        for i in range(old // size, new // size):
            self.kv[block_ids[i]] = tuple(token_ids[: (i + 1) * size])
        cached = self.cached_kv()
        for i in range(old // size, new // size):  # now cached exactly once: this block or an earlier copy
            assert cached.count(tuple(token_ids[: (i + 1) * size])) == 1

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        manager = self.manager
        block_ids, num_free = manager.block_ids(seq_id), manager.num_free_blocks
        refs = {b: manager.ref_count(b) for b in block_ids}
        manager.free(seq_id)
        del self.tokens[seq_id]
        assert seq_id not in manager
        assert all(manager.ref_count(b) == refs[b] - 1 for b in block_ids)
        assert manager.num_free_blocks == num_free + sum(1 for b in block_ids if refs[b] == 1)

    @invariant()
    def consistent(self) -> None:
        self.manager.check_invariants()
        for seq_id, token_ids in self.tokens.items():
            assert self.manager.num_tokens(seq_id) == len(token_ids)
        for block_id in range(self.num_blocks):
            tokens = registered_tokens(self.manager, block_id)
            if tokens is not None:  # a cached block holds computed KV of a prefix ending in its tokens
                kv = self.kv[block_id]
                assert kv is not None and kv[-self.block_size :] == tokens


class LargerPoolMachine(BlockManagerMachine):
    num_blocks, block_size, vocab_size, max_len = 12, 3, 2, 13


STATEFUL = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestBlockManagerSmallPool = BlockManagerMachine.TestCase
TestBlockManagerSmallPool.settings = STATEFUL
TestBlockManagerLargerPool = LargerPoolMachine.TestCase
TestBlockManagerLargerPool.settings = STATEFUL
