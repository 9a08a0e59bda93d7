"""The block manager's index events and its loading blocks (KV written from outside, registered only once in)."""

from __future__ import annotations

import pytest

from shared.engine.blocks import BlockManager
from shared.wire.block_hash import block_hashes, make_namespace
from shared.wire.protocol.messages import REMOVED, STORED

NS = make_namespace("test-model", "fp16")


class Recorder:
    """An `on_event` listener that replays the events into the set of hashes it believes cached."""

    def __init__(self) -> None:
        self.events: list[tuple[str, list[int]]] = []
        self.cached: set[int] = set()

    def __call__(self, kind: str, hashes: list[int]) -> None:
        self.events.append((kind, list(hashes)))
        if kind == STORED:
            assert not self.cached & set(hashes), "stored twice without a removal"
            self.cached |= set(hashes)
        else:
            assert kind == REMOVED and set(hashes) <= self.cached, "removed what was never stored"
            self.cached -= set(hashes)


def manager_with_events(num_blocks: int = 6, block_size: int = 2) -> tuple[BlockManager, Recorder]:
    recorder = Recorder()
    return BlockManager(num_blocks, block_size, NS, on_event=recorder), recorder


def test_events_report_registrations_and_evictions_and_replay_to_the_index() -> None:
    manager, recorder = manager_with_events(num_blocks=4)
    prompt = [1, 2, 3, 4, 5]
    hashes = block_hashes(prompt, 2, NS)
    manager.allocate("a", prompt)
    manager.mark_computed("a", 3)
    manager.mark_computed("a", 5)  # one event per call, for the blocks it registered
    assert recorder.events == [(STORED, hashes[:1]), (STORED, hashes[1:])]
    manager.allocate("b", [1, 2, 9])  # reuses block 0: nothing changes in the index
    manager.mark_computed("b", 3)
    manager.free("a")
    manager.free("b")  # frees register nothing and evict nothing
    assert len(recorder.events) == 2
    manager.allocate("c", [7] * 7)  # needs all four blocks: evicts both cached ones, in one event
    assert recorder.events[2:] == [(REMOVED, [hashes[1], hashes[0]])]  # a freed sequence's tail goes first
    assert recorder.cached == set(manager.cached_hashes()) == set()
    manager.check_invariants()


def test_a_duplicate_block_is_not_announced() -> None:
    manager, recorder = manager_with_events()
    manager.allocate("a", [1, 2, 3])
    manager.allocate("b", [1, 2, 4])
    manager.mark_computed("a", 3)
    manager.mark_computed("b", 3)  # b's copy of the same block stays private
    assert recorder.events == [(STORED, block_hashes([1, 2], 2, NS))]
    assert recorder.cached == set(manager.cached_hashes())


def test_loading_blocks_count_as_computed_but_are_not_reusable_until_they_arrive() -> None:
    manager, recorder = manager_with_events(num_blocks=8)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    assert manager.allocate("a", prompt) == 0
    manager.start_loading("a", 4)  # blocks 0 and 1 come from outside
    assert manager.is_loading("a") and manager.num_computed_tokens("a") == 4
    manager.mark_computed("a", 7)  # the rest is computed before the load is confirmed
    assert manager.num_reusable_tokens(prompt) == 0 and recorder.events == []
    manager.check_invariants()
    assert manager.allocate("b", prompt) == 0  # nothing of a's is handed out meanwhile
    assert not set(manager.block_ids("b")) & set(manager.block_ids("a"))
    manager.finish_loading("a")  # loaded blocks and the computed full block after them, in one event
    assert recorder.events == [(STORED, block_hashes(prompt, 2, NS))]
    assert not manager.is_loading("a") and manager.num_reusable_tokens(prompt) == 6
    manager.check_invariants()


def test_loading_continues_a_local_prefix() -> None:
    manager, recorder = manager_with_events(num_blocks=8)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    manager.allocate("a", prompt[:3])
    manager.mark_computed("a", 3)
    assert manager.allocate("b", prompt) == 2
    manager.start_loading("b", 6)  # blocks 1 and 2 from outside, block 0 local
    manager.finish_loading("b")
    assert recorder.events[-1] == (STORED, block_hashes(prompt, 2, NS)[1:])
    assert manager.block_ids("b")[0] == manager.block_ids("a")[0]
    manager.check_invariants()


def test_an_abandoned_load_returns_its_blocks_unregistered() -> None:
    manager, recorder = manager_with_events(num_blocks=4)
    prompt = [1, 2, 3, 4, 5]
    manager.allocate("a", prompt)
    manager.start_loading("a", 4)
    manager.mark_computed("a", 5)
    manager.free("a")  # the load failed: its KV never arrived
    assert manager.num_free_blocks == 4 and manager.stats.num_cached_blocks == 0
    assert manager.num_reusable_tokens(prompt) == 0 and recorder.events == []
    manager.check_invariants()


def test_a_load_that_meets_a_registered_copy_keeps_the_first() -> None:
    manager, recorder = manager_with_events(num_blocks=8)
    prompt = [1, 2, 3, 4, 5]
    manager.allocate("a", prompt)
    manager.start_loading("a", 4)
    manager.allocate("b", prompt)  # computed meanwhile, registered first
    manager.mark_computed("b", 5)
    manager.finish_loading("a")
    assert recorder.events == [(STORED, block_hashes(prompt, 2, NS))]
    manager.free("a")
    assert manager.stats.num_cached_blocks == 2 and manager.num_free_blocks == 8 - 3
    manager.check_invariants()


def test_loading_misuse_raises() -> None:
    manager, _ = manager_with_events(num_blocks=8)
    manager.allocate("a", [1, 2, 3, 4, 5])
    for bad in (3, 0, 6):  # not whole blocks, not past the computed count, past the sequence
        with pytest.raises(ValueError):
            manager.start_loading("a", bad)
    with pytest.raises(ValueError):
        manager.finish_loading("a")
    manager.start_loading("a", 2)
    with pytest.raises(ValueError):
        manager.start_loading("a", 4)  # already loading
    manager.mark_computed("a", 3)
    manager.finish_loading("a")
    with pytest.raises(ValueError):
        manager.start_loading("a", 4)  # the computed count is not whole blocks
    with pytest.raises(KeyError):
        manager.start_loading("missing", 2)
    manager.check_invariants()
