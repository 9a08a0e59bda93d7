"""The KV-event log prefill and the cache-store share: nothing said of no blocks, `cleared` empties the mirror a
snapshot reports, and a big change goes out in events of at most `max_hashes` hashes, numbered without gaps."""

from __future__ import annotations

from shared.wire.kv_events import KvEventLog
from shared.wire.protocol.messages import CLEARED, REMOVED, STORED


def test_cleared_empties_the_snapshot_and_big_changes_split_without_gaps() -> None:
    log = KvEventLog("cache-0", epoch=3, role="cache-store", max_hashes=2)
    log.record(CLEARED, [])
    log.record(STORED, [])  # a re-index that found nothing: no event
    log.record(STORED, [1, 2, 3, 4, 5])
    log.record(REMOVED, [2])
    events = log.take()
    assert [(e.seq, e.kind, e.block_hashes) for e in events] == [
        (0, CLEARED, []), (1, STORED, [1, 2]), (2, STORED, [3, 4]), (3, STORED, [5]), (4, REMOVED, [2])]
    assert {e.role for e in events} == {"cache-store"} and {e.epoch for e in events} == {3}
    log.record(CLEARED, [7])  # hashes of a `cleared` mean nothing
    snapshot, more = log.snapshot()
    assert [(e.seq, e.kind, e.block_hashes) for e in more] == [(5, CLEARED, [])]
    assert (snapshot.seq, snapshot.block_hashes) == (5, [])
