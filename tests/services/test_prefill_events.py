"""The prefill's reports without NATS: block manager events as gapless KvEvents and snapshots, step samples, and the
fetch bandwidth average."""

from __future__ import annotations

import pytest

from services.common.step_samples import StepSamples
from services.prefill.measure import MovingRate
from shared.engine.blocks import BlockManager
from shared.engine.engine import StepStats
from shared.wire.block_hash import block_hashes, make_namespace
from shared.wire.kv_events import KvEventLog
from shared.wire.protocol.messages import REMOVED, STORED

NS = make_namespace("test-model", "fp16")


def test_events_are_merged_per_kind_run_numbered_without_gaps_and_mirror_the_index() -> None:
    log = KvEventLog("p0", epoch=7, role="prefill")
    manager = BlockManager(4, 2, NS, on_event=log.record)
    manager.allocate("a", [1, 2, 3, 4, 5])
    manager.mark_computed("a", 2)
    manager.mark_computed("a", 5)  # two registrations before anyone takes: one event
    assert log.has_pending
    (first,) = log.take()
    hashes = block_hashes([1, 2, 3, 4], 2, NS)
    assert (first.instance_id, first.epoch, first.seq, first.kind, first.block_hashes) == ("p0", 7, 0, STORED, hashes)
    assert log.take() == [] and not log.has_pending
    manager.free("a")
    manager.allocate("b", [9, 9, 9, 9, 9, 9, 9])  # evicts both cached blocks, then registers its own
    manager.mark_computed("b", 7)
    removed, stored = log.take()
    assert (removed.seq, removed.kind, set(removed.block_hashes)) == (1, REMOVED, set(hashes))
    assert (stored.seq, stored.kind) == (2, STORED)
    snapshot, events = log.snapshot()
    assert events == [] and snapshot.seq == 2 and snapshot.epoch == 7
    assert set(snapshot.block_hashes) == set(manager.cached_hashes()) == set(stored.block_hashes)


def test_a_snapshot_numbers_the_pending_events_it_includes() -> None:
    log = KvEventLog("p0", epoch=1, role="prefill")
    snapshot, events = log.snapshot()
    assert (snapshot.seq, snapshot.block_hashes, events) == (-1, [], [])
    log.record(STORED, [5, 6])
    log.record(REMOVED, [5])
    snapshot, events = log.snapshot()
    assert [(e.seq, e.kind) for e in events] == [(0, STORED), (1, REMOVED)]
    assert (snapshot.seq, snapshot.block_hashes) == (1, [6])


def test_step_samples_are_taken_once_and_bounded() -> None:
    samples = StepSamples(max_samples=2)
    for n in (1, 2, 3):
        samples.add(StepStats(num_new_tokens=n, attention_work=10 * n, seconds=0.5 * n, load_wait_s=0.0))
    assert samples.take() == [[2.0, 20.0, 1.0], [3.0, 30.0, 1.5]]  # the newest kept
    assert samples.take() == []


def test_moving_rate_starts_at_the_first_measurement_then_averages() -> None:
    rate = MovingRate(weight=0.5)
    assert rate.value == 0.0
    rate.add(100, 0)  # not a measurement
    rate.add(1000, 1.0)
    assert rate.value == 1000
    rate.add(3000, 1.0)
    assert rate.value == 2000
    with pytest.raises(ValueError):
        MovingRate(weight=0)
