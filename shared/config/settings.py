"""The settings of each role, as frozen dataclasses: what every service reads (`ServiceSettings`) and what only the
gateway, the scheduler, the engines (prefill and decode) or the cache-store read. `tsukimi up` checks them all
(`ClusterSettings`). Built by `shared.config.load`; the variables behind each field are `shared.env_vars`'.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.engine.config import EngineConfig
from shared.wire.nats_auth import NatsCredentials


@dataclass(frozen=True)
class ServiceSettings:
    """What every service reads: NATS, its identity, logging, the model and the engine the deployment runs."""

    nats_url: str
    nats_credentials: NatsCredentials
    subject_prefix: str
    instance_id: str
    log_level: str
    log_format: str
    model_path: str | None
    engine: EngineConfig
    engine_kind: str  # "real" or "sim"
    sim_profile: str
    sim_kv_codec: str  # "none" or a codec name: the sized KV's bytes in the pool and on the wire
    sim_kv_tokens: int  # 0: the profile's GPU memory decides
    deployment: str  # "disaggregated" or "colocated"
    heartbeat_s: float

    def secrets(self) -> tuple[str, ...]:
        """What no log line of this process may show."""
        return (self.nats_credentials.password,)


@dataclass(frozen=True)
class GatewaySettings(ServiceSettings):
    model_name: str
    instance_timeout_s: float
    host: str
    port: int
    max_body_bytes: int
    request_timeout_s: float
    progress_timeout_s: float
    migration_limit: int
    scheduler_wait_s: float
    http_read_timeout_s: float
    api_keys_file: str | None
    insecure_http: bool


@dataclass(frozen=True)
class SchedulerSettings(ServiceSettings):
    instance_timeout_s: float
    policy: str
    slo_ttft_s: float
    slo_tbt_s: float
    rejection: str
    cache_balance_ratio: float
    local_prefill_tokens: int
    policy_seed: int | None


@dataclass(frozen=True)
class EngineSettings(ServiceSettings):
    """Prefill's and decode's (a colocated decode instance prefills too)."""

    warmup: bool
    request_timeout_s: float
    kv_deadline_s: float
    kv_chunk_bytes: int
    kv_buffer_bytes: int
    kv_compress: bool
    cache_shards: int
    cpp_group: tuple[str, ...]  # this prefill instance's pipeline group, first stage first (empty: none)
    cpp_min_tokens: int
    cpp_kv_bytes: int
    cache_block_key: bytes = field(repr=False)

    def secrets(self) -> tuple[str, ...]:
        return (*super().secrets(), self.cache_block_key.decode(errors="replace"))


@dataclass(frozen=True)
class CacheStoreSettings(ServiceSettings):
    cache_shard: int
    cache_shards: int
    cache_dram_bytes: int
    cache_ssd_dir: str | None
    cache_ssd_bytes: int
    cache_ssd_admit_seen: int


@dataclass(frozen=True)
class ClusterSettings(GatewaySettings, SchedulerSettings, EngineSettings, CacheStoreSettings):
    """Every role's settings at once: what `tsukimi up` checks before it starts anything."""
