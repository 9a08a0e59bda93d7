"""The virtual cluster's load sampler: each pool's load averaged over its live instances' last heartbeats, and the
series counted from the replay's start."""

from __future__ import annotations

import pytest

from services.virtual.load import LoadSampler
from shared.wire.heartbeat import LiveInstances
from shared.wire.protocol import Heartbeat


def beat(instance: str, role: str, **load: int) -> Heartbeat:
    return Heartbeat(instance, role, 1, 0.0, **load)


def test_each_pool_is_averaged_over_its_live_instances() -> None:
    now = [100.0]
    live = LiveInstances(timeout_s=5.0, clock=lambda: now[0])
    live.record(beat("prefill-0", "prefill", num_queued_tokens=1000))
    live.record(beat("prefill-1", "prefill", num_queued_tokens=3000))
    live.record(beat("decode-0", "decode", num_running=64, max_num_seqs=256, kv_blocks_used=10, kv_blocks_total=40))
    sampler = LoadSampler(live, interval_s=10.0)
    sampler.sample(at_s=50.0)
    now[0] += 10.0  # every beat is now older than the timeout: nobody is live
    sampler.sample(at_s=60.0)
    assert sampler.series(start_s=45.0) == {"t_s": [5.0, 15.0], "prefill_queued_tokens": [2000.0, 0.0],
                                           "decode_running_share": [0.25, 0.0], "decode_kv_share": [0.25, 0.0]}
    assert sampler.series(start_s=55.0)["t_s"] == [5.0]  # samples before the replay's start are dropped


def test_colocated_instances_count_as_both_pools() -> None:
    live = LiveInstances(timeout_s=5.0, clock=lambda: 0.0)
    live.record(beat("decode-0", "decode", num_queued_tokens=500, num_running=1, max_num_seqs=2))
    sampler = LoadSampler(live, interval_s=1.0, colocated=True)
    sampler.sample(at_s=0.0)
    assert sampler.prefill_queued_tokens == [500.0] and sampler.decode_running_share == [0.5]
    with pytest.raises(ValueError, match="positive"):
        LoadSampler(live, interval_s=0.0)
