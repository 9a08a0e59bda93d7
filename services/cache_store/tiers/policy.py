"""The small bookkeeping the tiers decide with: read leases, the admission counter (seen how often), latency figures.

Pure and synchronous; `services.cache_store.tiers.tiers` applies them.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class _Lease:
    expires_at: float
    parts_left: set[int] = field(default_factory=set)


class Leases:
    """Blocks being read part by part: eviction skips them until each part was served once or `lease_s` passed.

    A read of part 0 takes (or renews) the lease; reads of the other parts tick them off. With two readers at once the
    lease may end early; the client's own checks then turn a vanished block into a miss, never into wrong bytes.

    Args:
        lease_s: the longest a lease holds.
        clock: monotonic seconds.
    """

    def __init__(self, lease_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.lease_s, self.clock = lease_s, clock
        self._leases: dict[int, _Lease] = {}

    def take(self, block_hash: int, num_parts: int) -> None:
        """Part 0 of a block of `num_parts` was served: hold it until the rest are (a one-part block needs no lease)."""
        if num_parts <= 1:
            return
        if len(self._leases) > 1024:
            self._purge()
        self._leases[block_hash] = _Lease(self.clock() + self.lease_s, set(range(1, num_parts)))

    def served(self, block_hash: int, part: int) -> None:
        """Part `part` (> 0) was served; the lease ends when every part was."""
        lease = self._leases.get(block_hash)
        if lease is not None:
            lease.parts_left.discard(part)
            if not lease.parts_left:
                del self._leases[block_hash]

    def is_leased(self, block_hash: int) -> bool:
        lease = self._leases.get(block_hash)
        if lease is None:
            return False
        if lease.expires_at <= self.clock():
            del self._leases[block_hash]
            return False
        return True

    def __len__(self) -> int:
        self._purge()
        return len(self._leases)

    def _purge(self) -> None:
        now = self.clock()
        for block_hash in [h for h, lease in self._leases.items() if lease.expires_at <= now]:
            del self._leases[block_hash]


class SeenCounter:
    """How often each recently seen block was put or asked for; the least recently seen are forgotten past the bound.

    Args:
        max_entries: how many hashes are remembered.
    """

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._counts: OrderedDict[int, int] = OrderedDict()

    def add(self, block_hash: int) -> int:
        """Count one sighting; returns the count so far."""
        count = self._counts.pop(block_hash, 0) + 1
        self._counts[block_hash] = count
        if len(self._counts) > self.max_entries:
            self._counts.popitem(last=False)
        return count

    def count(self, block_hash: int) -> int:
        return self._counts.get(block_hash, 0)


@dataclass
class LatencyStats:
    """Count, mean and max of measured seconds."""

    count: int = 0
    total_s: float = 0.0
    max_s: float = 0.0

    def record(self, seconds: float) -> None:
        self.count += 1
        self.total_s += seconds
        self.max_s = max(self.max_s, seconds)

    @property
    def mean_ms(self) -> float:
        return 1000.0 * self.total_s / self.count if self.count else 0.0
