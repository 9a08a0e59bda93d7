"""The scheduler's global block index: events apply in order; a gap, a new epoch or an instance joining a scheduler
started after it asks for a snapshot, and events that arrive meanwhile are replayed on top of it."""

from __future__ import annotations

from services.scheduler.index import BlockIndex
from shared.wire.protocol import KvEvent, Snapshot


def test_events_in_order_and_prefix_questions() -> None:
    index = BlockIndex()
    assert not index.apply(KvEvent("c0", 1, 0, "stored", [1, 2, 3]))
    assert not index.apply(KvEvent("c0", 1, 1, "removed", [2]))
    assert index.prefix_len("c0", [1, 2, 3]) == 1 and index.num_blocks("c0") == 2
    assert not index.apply(KvEvent("c1", 7, 0, "stored", [2]))
    assert index.pool_prefix_len(["c0", "c1"], [1, 2, 3, 4]) == 3  # blocks spread over shards
    assert not index.apply(KvEvent("c0", 1, 1, "stored", [9]))  # a duplicate seq is ignored
    assert not index.holds("c0", 9)


def test_a_gap_asks_for_a_snapshot_and_replays_newer_events() -> None:
    index = BlockIndex()
    index.apply(KvEvent("c0", 1, 0, "stored", [1, 2]))
    assert index.apply(KvEvent("c0", 1, 2, "stored", [5]))  # seq 1 lost
    assert index.is_resyncing("c0")
    assert not index.apply(KvEvent("c0", 1, 3, "removed", [1]))  # buffered
    index.load_snapshot(Snapshot("c0", 1, 2, [1, 2, 4, 5]))  # reflects events up to seq 2
    assert not index.is_resyncing("c0")
    assert sorted(h for h in (1, 2, 4, 5) if index.holds("c0", h)) == [2, 4, 5]  # seq 3 replayed on top
    assert not index.apply(KvEvent("c0", 1, 4, "stored", [6]))
    assert index.holds("c0", 6)


def test_a_new_epoch_voids_what_was_known() -> None:
    index = BlockIndex()
    index.apply(KvEvent("c0", 1, 0, "stored", [1, 2]))
    # The restarted store's first event arrived: a fresh start, nothing missed.
    assert not index.apply(KvEvent("c0", 2, 0, "stored", [7]))
    assert not index.holds("c0", 1) and index.holds("c0", 7)
    # A restart seen mid-stream: snapshot needed, the old blocks are not trusted meanwhile... but kept until then.
    assert index.apply(KvEvent("c0", 3, 5, "stored", [8]))
    index.load_snapshot(Snapshot("c0", 3, 5, [7, 8]))
    assert index.holds("c0", 8) and index.num_blocks("c0") == 2
    index.resync_failed("c0")  # a late answer to an older request: the snapshot since stands
    assert index.num_blocks("c0") == 2
    assert index.apply(KvEvent("c0", 3, 9, "stored", [9]))  # a gap: the old blocks kept until a snapshot...
    index.resync_failed("c0")  # ...that never comes: dropped
    assert index.num_blocks("c0") == 0


def test_an_instance_that_joins_a_restarted_scheduler_is_learnt_from_its_snapshot() -> None:
    """The scheduler started after the instance: none of its past events reached it."""
    index = BlockIndex()
    assert index.needs_snapshot("c0", 4)
    assert not index.apply(KvEvent("c0", 4, 7, "stored", [9]))  # buffered until the snapshot
    assert index.is_resyncing("c0") and not index.holds("c0", 9)
    index.load_snapshot(Snapshot("c0", 4, 6, [1, 2, 3]))
    assert index.prefix_len("c0", [1, 2, 3, 9]) == 4 and not index.is_resyncing("c0")
    assert not index.needs_snapshot("c0", 4)  # known in this epoch
    # An instance that joins before its first event: that event tells everything; a later snapshot adds nothing.
    assert index.needs_snapshot("c1", 1)
    assert not index.apply(KvEvent("c1", 1, 0, "cleared", []))
    assert not index.apply(KvEvent("c1", 1, 1, "stored", [5]))
    assert not index.is_resyncing("c1") and index.holds("c1", 5)
    index.load_snapshot(Snapshot("c1", 1, 0, []))  # as of seq 0: older than what the events told
    index.resync_failed("c1")
    assert index.holds("c1", 5)
