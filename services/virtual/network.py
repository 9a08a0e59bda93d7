"""The network a virtual cluster's messages cross: every node has one network interface of `bandwidth` bytes/s
each way and a one-way `latency`; a message occupies its sender's egress and its receiver's ingress for
bytes / bandwidth, first come first served, then lands after the latency. Messages between services of one node
cross no interface.

What differs from production, and why: tsukimi's messages all go through one NATS server; here each goes straight
from its sender's node to each receiver's, as Mooncake's transfer engine moves KV (RDMA between the nodes' NICs),
because the cluster being simulated is the paper's, not this machine. A message's bytes are its encoded size plus
the bytes its size-only payload stands for (the sim engine's KV).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

GBIT = 1e9 / 8  # bytes/s in one Gbit/s


@dataclass(frozen=True)
class NetworkSpec:
    """Per node: the interface's bandwidth (bytes/s, each direction) and the one-way latency in seconds.

    The default is the paper's nodes: 4 x 200 Gbps RDMA NICs (Mooncake FAST'25, section 8.1), and a few
    microseconds of RDMA latency.
    """

    bandwidth: float = 4 * 200 * GBIT
    latency_s: float = 5e-6

    def __post_init__(self) -> None:
        if not (self.bandwidth > 0 and self.latency_s >= 0):
            raise ValueError(f"a network needs a positive bandwidth and a latency >= 0, got {self}")


class Network:
    """When each message lands; how many bytes crossed between nodes."""

    def __init__(self, spec: NetworkSpec) -> None:
        self.spec = spec
        self._egress_free: dict[str, float] = defaultdict(float)  # node -> when its interface is free to send
        self._ingress_free: dict[str, float] = defaultdict(float)
        self.bytes_moved = 0
        self.num_messages = 0

    def arrival(self, source: str, target: str, num_bytes: int, now: float) -> float:
        """When a message of `num_bytes` sent at `now` from node `source` lands on node `target`."""
        if source == target:
            return now
        seconds = num_bytes / self.spec.bandwidth
        start = max(now, self._egress_free[source], self._ingress_free[target])
        end = start + seconds
        self._egress_free[source] = self._ingress_free[target] = end
        self.bytes_moved += num_bytes
        self.num_messages += 1
        return end + self.spec.latency_s
