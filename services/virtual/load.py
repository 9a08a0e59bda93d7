"""The cluster's load over time as the scheduler sees it: every `interval_s` virtual seconds, the prefill pool's
queued prompt tokens and the decode pool's running requests and KV blocks, averaged over the live instances of each
(from their last heartbeats, as stale as the scheduler's own decisions). For Mooncake's Figs. 9-10: does the load
of the two pools oscillate in anti-phase?
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from shared.wire.heartbeat import LiveInstances
from shared.wire.protocol import Heartbeat, Role


class LoadSampler:
    """Samples `instances` (the scheduler's view) until stopped; `series()` is what it saw."""

    def __init__(self, instances: LiveInstances, interval_s: float, colocated: bool = False) -> None:
        if interval_s <= 0:
            raise ValueError(f"the load sampling interval must be positive, got {interval_s}")
        self.instances, self.interval_s = instances, interval_s
        self.prefill_role = Role.DECODE if colocated else Role.PREFILL  # colocated instances prefill too
        self.times_s: list[float] = []
        self.prefill_queued_tokens: list[float] = []
        self.decode_running_share: list[float] = []
        self.decode_kv_share: list[float] = []
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="load-sampler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def sample(self, at_s: float) -> None:
        """One sample, taken at `at_s` (the loop's clock)."""
        prefill, decode = self.instances.alive(self.prefill_role), self.instances.alive(Role.DECODE)
        self.times_s.append(at_s)
        self.prefill_queued_tokens.append(_mean([b.num_queued_tokens for b in prefill]))
        self.decode_running_share.append(_mean([b.num_running / b.max_num_seqs for b in decode if b.max_num_seqs]))
        self.decode_kv_share.append(_mean([_kv_share(b) for b in decode]))

    def series(self, start_s: float) -> dict[str, list[float]]:
        """The samples from `start_s` (the loop's clock) on, their times counted from it."""
        first = next((i for i, t in enumerate(self.times_s) if t >= start_s), len(self.times_s))
        return {"t_s": [round(t - start_s, 3) for t in self.times_s[first:]],
                "prefill_queued_tokens": self.prefill_queued_tokens[first:],
                "decode_running_share": self.decode_running_share[first:],
                "decode_kv_share": self.decode_kv_share[first:]}

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.interval_s)
            self.sample(loop.time())


def _kv_share(beat: Heartbeat) -> float:
    return beat.kv_blocks_used / beat.kv_blocks_total if beat.kv_blocks_total else 0.0


def _mean(values: Sequence[float]) -> float:
    return round(sum(values) / len(values), 4) if values else 0.0
