"""The block manager of shared/engine/blocks.py by example: reuse, the last-token rule, OutOfBlocks, LRU eviction."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import pytest
from block_probes import observable

from shared.engine.blocks import BlockManager, OutOfBlocks
from shared.wire.block_hash import block_hashes, make_namespace

NS = make_namespace("test-model", "fp16")

# ---- block manager: examples -------------------------------------------------------------------------------


def computed(manager: BlockManager, seq_id: Hashable, token_ids: Sequence[int]) -> int:
    """Allocate a sequence and mark all of it computed; returns the reused token count."""
    reused = manager.allocate(seq_id, token_ids)
    manager.mark_computed(seq_id, len(token_ids))
    manager.check_invariants()
    return reused


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


def test_a_finished_sequences_blocks_are_found_by_hash_until_evicted() -> None:
    manager = BlockManager(num_blocks=4, block_size=4, namespace=NS)
    tokens = list(range(100, 108))  # two full blocks
    computed(manager, "a", tokens)
    held = manager.block_ids("a")
    hashes = block_hashes(tokens, 4, NS)
    manager.free("a")
    assert manager.cached_block_ids(hashes) == held
    assert manager.cached_block_ids([hashes[0], 12345]) is None
    computed(manager, "b", list(range(200, 216)))  # takes every block: the evictable ones go
    assert manager.cached_block_ids(hashes) is None


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


@pytest.mark.parametrize("registrant_frees_first", [False, True])
def test_a_live_copy_keeps_its_prefix_cached_when_the_registered_block_is_freed(registrant_frees_first: bool) -> None:
    # Two sequences compute the same block; the one holding the registered copy goes, its block is reused for
    # another prompt. The survivor still holds that KV, so its prefix must stay findable (and its later blocks).
    manager = BlockManager(num_blocks=4, block_size=2, namespace=NS)
    manager.allocate("a", [1, 2, 3])
    manager.allocate("b", [1, 2, 3])
    manager.mark_computed("a", 3)  # a registers block [1, 2]; b's copy of it stays private
    if registrant_frees_first:
        manager.free("a")
        manager.mark_computed("b", 3)
    else:
        manager.mark_computed("b", 3)
        manager.free("a")
    manager.allocate("c", [9, 9, 9])  # takes the rest of the pool: evicts whatever a left cached
    manager.check_invariants()
    assert manager.num_reusable_tokens([1, 2, 3]) == 2  # b still holds that KV: the index must still find it
    manager.append("b", [4])
    manager.mark_computed("b", 4)  # b's next block registers under a parent the index still holds
    assert manager.num_reusable_tokens([1, 2, 3, 4, 5]) == 4
    assert manager.stats.num_cached_blocks == 2
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
