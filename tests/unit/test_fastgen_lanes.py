"""FastGen's storage: lane slots cut from whole blocks of the block manager (taken as needed, given back once empty,
evicting the prefix cache like any allocation), and a sequence's lanes: entries appended, attended, evicted and
moved into holes, with their K/V, positions and scores kept together and emptied slots given back."""

from __future__ import annotations

import math

import pytest
import torch

from shared.engine.blocks import BlockManager, OutOfBlocks
from shared.engine.kv.fastgen.lane_store import RawLaneStore
from shared.engine.kv.fastgen.lanes import LaneSlots
from shared.engine.kv.fastgen.sparse_kv import SparseKv, append_lanes
from shared.fastgen.policies import FastGenSettings

LAYERS, HEADS, BLOCKS, BLOCK_SIZE, DIM = 2, 3, 6, 4, 8


def test_raw_blocks_count_as_used_until_given_back() -> None:
    manager = BlockManager(num_blocks=4, block_size=2)
    manager.allocate("a", [1, 2, 3])
    manager.mark_computed("a", 3)
    manager.free("a")  # one registered block waits in the prefix cache, one is free
    taken = manager.take_raw(4)  # the cached block is evicted for it
    assert manager.num_free_blocks == 0 and manager.stats.num_evictions == 1
    manager.check_invariants()
    with pytest.raises(OutOfBlocks):
        manager.take_raw(1)
    manager.give_back_raw(taken)
    assert manager.num_free_blocks == 4
    manager.check_invariants()
    with pytest.raises(KeyError):
        manager.give_back_raw(taken[:1])


def test_slots_are_cut_from_whole_blocks_and_blocks_go_back_empty() -> None:
    manager = BlockManager(num_blocks=3, block_size=4)
    lanes = LaneSlots(manager, LAYERS * HEADS)  # 6 slots per block, as a raw pool is cut
    first = lanes.take(4)
    assert lanes.num_blocks_held == 1 and manager.num_free_blocks == 2
    second = lanes.take(5)  # 2 left in the first block, 3 from a new one
    assert lanes.num_blocks_held == 2 and len(set(first + second)) == 9
    assert {s // 6 for s in first + second} == {0, 1}
    with pytest.raises(OutOfBlocks):
        lanes.take(10)  # 3 free slots and 1 free block hold 9
    assert lanes.num_slots_used == 9 and manager.num_free_blocks == 1  # nothing changed
    lanes.give_back(first)
    assert lanes.num_blocks_held == 2  # the first block still holds two of `second`
    lanes.give_back(second)
    assert lanes.num_blocks_held == 0 and manager.num_free_blocks == 3
    manager.check_invariants()


WINDOW_ALONE = FastGenSettings(r_local=0.3, r_frequent=0.0, wider_local=())  # policy 2: special, punct, the window
LOCAL = 2


def _sparse(policy: int, manager: BlockManager | None = None) -> tuple[SparseKv, torch.Tensor]:
    pool = torch.zeros(LAYERS, 2, HEADS, BLOCKS, BLOCK_SIZE, DIM)
    store = RawLaneStore(pool)
    lanes = LaneSlots(manager or BlockManager(BLOCKS, BLOCK_SIZE), store.slots_per_block)
    policies = torch.full((LAYERS, HEADS), policy)
    return SparseKv(lanes, store, policies, WINDOW_ALONE, capacity=2), pool


def _step(sparse: SparseKv, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token through layer 0: append, attend, evict; returns (q, k, v) of the token."""
    sparse.reserve(1)
    sparse.length += 1
    q, k, v = (torch.randn(HEADS, DIM, generator=generator) for _ in range(3))
    false = torch.zeros(1, dtype=torch.bool)
    append_lanes([sparse], 0, k[None], v[None], false, false)
    out = sparse.attend(0, q, DIM**-0.5)
    sparse.evict(0)
    return out, k, v


def test_full_lanes_attend_over_every_token_as_dense_attention_does() -> None:
    sparse, _ = _sparse(WINDOW_ALONE.full)
    generator = torch.Generator().manual_seed(0)
    keys, values = [], []
    for _ in range(10):
        sparse.reserve(1)
        sparse.length += 1
        q, k, v = (torch.randn(HEADS, DIM, generator=generator) for _ in range(3))
        keys.append(k)
        values.append(v)
        append_lanes([sparse], 0, k[None], v[None], *torch.zeros(2, 1, dtype=torch.bool))
        out = sparse.attend(0, q, DIM**-0.5)
        sparse.evict(0)
        k_all, v_all = torch.stack(keys, dim=1), torch.stack(values, dim=1)  # [heads, n, dim]
        expected = torch.softmax(q[:, None] @ k_all.transpose(1, 2) / math.sqrt(DIM), dim=-1) @ v_all
        torch.testing.assert_close(out, expected[:, 0])
    assert sparse.counts[0].tolist() == [10] * HEADS and sparse.num_slots[0] == [3] * HEADS  # ceil(10 / 4)
    assert sparse.counts[1].tolist() == [0] * HEADS


def test_a_local_lane_keeps_the_newest_tokens_with_their_kv_and_gives_slots_back() -> None:
    manager = BlockManager(BLOCKS, BLOCK_SIZE)
    sparse, _ = _sparse(LOCAL, manager)
    generator = torch.Generator().manual_seed(1)
    keys = []
    for _ in range(20):
        _, k, _ = _step(sparse, generator)
        keys.append(k)
    window = math.ceil(0.3 * 20)
    count = int(sparse.counts[0, 0])
    assert sparse.counts[0].tolist() == [window] * HEADS
    assert sorted(sparse.positions[0, 0, :count].tolist()) == list(range(20 - window, 20))
    entries = torch.arange(count).expand(HEADS, count)
    stored = sparse.store.rows[sparse.addresses(0, entries)]  # [heads, count, dim], in entry order
    for head in range(HEADS):
        for entry in range(count):
            position = int(sparse.positions[0, head, entry])
            torch.testing.assert_close(stored[head, entry], keys[position][head])
    assert sparse.num_slots[0] == [2] * HEADS  # ceil(6 / 4): the rest went back
    sparse.release()
    assert manager.num_free_blocks == BLOCKS
    manager.check_invariants()


def test_reserve_takes_nothing_when_the_pool_is_out_of_blocks() -> None:
    manager = BlockManager(1, BLOCK_SIZE)
    sparse, _ = _sparse(WINDOW_ALONE.full, manager)
    sparse.reserve(BLOCK_SIZE)  # one slot per lane: the whole block
    with pytest.raises(OutOfBlocks):
        sparse.reserve(BLOCK_SIZE + 1)
    assert sparse.num_slots_held == LAYERS * HEADS and manager.num_free_blocks == 0
