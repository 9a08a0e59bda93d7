"""The KV series of the gateway's /metrics, from the instances' latest heartbeats: how each engine stores KV (bytes
per block, tokens it holds), what the cache-store's DRAM holds, and what prompt KV has moved prefill -> decode.

Owns these series, their refresh, and reading them back from /metrics' text (benchmarks and tests do); the exposition
format is `metrics`, the heartbeats `shared.wire.heartbeat`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.gateway.metrics import Counter, Gauge
from shared.wire.protocol import Heartbeat

_ENGINE = ("instance", "role", "format")
_INSTANCE = ("instance", "role")


@dataclass
class KvMetrics:
    """Every KV series under `tsukimi_kv_`, rebuilt from the live heartbeats at each scrape."""

    block_bytes: Gauge = field(default_factory=lambda: Gauge(
        "tsukimi_kv_block_bytes", "pool bytes one KV block costs, every layer (codec rows, sinks)", _ENGINE))
    capacity_tokens: Gauge = field(default_factory=lambda: Gauge(
        "tsukimi_kv_capacity_tokens", "tokens the engine's KV pool holds when full", _ENGINE))
    used_tokens: Gauge = field(default_factory=lambda: Gauge(
        "tsukimi_kv_used_tokens", "tokens' worth of KV blocks in use or cached", _ENGINE))
    store_bytes: Gauge = field(default_factory=lambda: Gauge(
        "tsukimi_kv_store_dram_bytes", "bytes of KV blocks in a cache-store's DRAM tier", _INSTANCE))
    store_blocks: Gauge = field(default_factory=lambda: Gauge(
        "tsukimi_kv_store_dram_blocks", "KV blocks in a cache-store's DRAM tier", _INSTANCE))
    moved_bytes: Counter = field(default_factory=lambda: Counter(
        "tsukimi_kv_moved_bytes_total", "prompt KV bytes on the wire, sent (prefill) or received (decode)", _INSTANCE))
    moved_tokens: Counter = field(default_factory=lambda: Counter(
        "tsukimi_kv_moved_tokens_total", "prompt tokens whose KV was sent (prefill) or received (decode)", _INSTANCE))
    saved_bytes: Gauge = field(default_factory=lambda: Gauge(
        "tsukimi_kv_fastgen_saved_bytes", "KV bytes FastGen's eviction frees now, over a decode instance's running "
        "requests (against keeping every token)", _INSTANCE))

    def update(self, beats: list[Heartbeat]) -> None:
        """Replace every series by the figures of these heartbeats (instances gone drop out)."""
        for metric in self._all():
            metric.values.clear()
        for beat in beats:
            who = {"instance": beat.instance_id, "role": beat.role}
            if beat.kv_stored_blocks or beat.kv_stored_bytes:
                self.store_bytes.set(beat.kv_stored_bytes, **who)
                self.store_blocks.set(beat.kv_stored_blocks, **who)
            if beat.kv_format:
                engine = {**who, "format": beat.kv_format}
                self.block_bytes.set(beat.block_bytes, **engine)
                self.capacity_tokens.set(beat.kv_blocks_total * beat.kv_block_tokens, **engine)
                self.used_tokens.set(beat.kv_blocks_used * beat.kv_block_tokens, **engine)
                self.moved_bytes.values[(beat.instance_id, beat.role)] = beat.kv_moved_bytes
                self.moved_tokens.values[(beat.instance_id, beat.role)] = beat.kv_moved_tokens
                self.saved_bytes.set(beat.kv_saved_bytes, **who)

    def render(self) -> list[str]:
        return [line for metric in self._all() for line in metric.render()]

    def _all(self) -> list[Counter]:
        return [self.block_bytes, self.capacity_tokens, self.used_tokens, self.store_bytes, self.store_blocks,
                self.moved_bytes, self.moved_tokens, self.saved_bytes]


def parse_kv_samples(text: str) -> dict[str, float]:
    """The `tsukimi_kv_*` samples of a /metrics page, keyed by `name{labels}`."""
    samples = {}
    for line in text.splitlines():
        if line.startswith("tsukimi_kv_"):
            key, value = line.rsplit(" ", 1)
            samples[key] = float(value)
    return samples


def total_for_role(samples: dict[str, float], name: str, role: str) -> float:
    """The sum of series `name` over the instances of one role."""
    return sum(v for k, v in samples.items() if k.startswith(name + "{") and f'role="{role}"' in k)
