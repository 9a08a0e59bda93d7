"""Settings from the environment, per role: each role reads and checks only the variables it acts on (an unknown
`TSUKIMI_*` variable is an error for every role, so typos do not pass silently).

This is the only module that reads `os.environ`. Services load their settings once at start; a bad value raises
`ConfigError` naming the variable.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from shared.config.reader import ConfigError, Reader, check_http_exposure, default_instance_id, nats_credentials, secret
from shared.config.settings import (
    CacheStoreSettings,
    ClusterSettings,
    EngineSettings,
    GatewaySettings,
    SchedulerSettings,
    ServiceSettings,
)
from shared.engine.config import EngineConfig
from shared.env_vars import ENV_VARS, PREFILL_BATCHED_TOKENS
from shared.fastgen.policies import FastGenSettings, parse_shares
from shared.kvcompress.names import CODEC_NAMES
from shared.sim.profiles import PROFILES

POLICIES = ("random", "round_robin", "least_loaded", "local_cache_aware", "conductor")
COLOCATED_POLICIES = ("random", "round_robin", "least_loaded")  # routing when every instance prefills and decodes
DEPLOYMENTS = ("disaggregated", "colocated")
ENGINES = ("real", "sim")
REJECTION_MODES = ("off", "current", "predicted")
LOG_LEVELS = ("debug", "info", "warning", "error")

S = TypeVar("S", bound=ServiceSettings)
Fields = dict[str, Any]


def load_settings(
    role: str, environ: Mapping[str, str] | None = None, overrides: Mapping[str, str] | None = None
) -> ServiceSettings:
    """The settings of `role` ("gateway", "scheduler", "prefill", "decode", "cache-store"; "up": every role's).

    Args:
        role: the service name, also its NATS user and the start of its default instance id.
        environ: the variables to read (default: `os.environ`); tests pass a dict.
        overrides: variables that win over `environ` (a command line's flags).
    Raises:
        ConfigError: a value of the wrong type or out of range, or an unknown `TSUKIMI_*` variable (a typo).
    """
    return load_role_settings(ROLE_SETTINGS[role], role, environ, overrides)


def load_role_settings(
    kind: type[S], role: str, environ: Mapping[str, str] | None = None, overrides: Mapping[str, str] | None = None
) -> S:
    """`load_settings`, typed: the settings of class `kind` for `role`."""
    env = {**(os.environ if environ is None else environ), **(overrides or {})}
    unknown = sorted(k for k in env if k.startswith("TSUKIMI_") and k not in ENV_VARS)
    if unknown:
        raise ConfigError(f"unknown variable(s) {', '.join(unknown)}; known: {', '.join(ENV_VARS)}")
    get = Reader(env)
    fields = _service(get, role)
    for reader in _READERS[kind]:
        fields |= reader(get, role)
    return kind(**fields)


def _service(get: Reader, role: str) -> Fields:
    engine, engine_kind = _engine(get, role), get.choice("TSUKIMI_ENGINE", ENGINES)
    if engine_kind == "sim" and engine.kv_codec != "none":
        raise ConfigError("TSUKIMI_KV_CODEC applies to the real engine; the sim engine's KV travels as sizes only")
    if engine_kind == "sim" and engine.kv_policy != "full":
        raise ConfigError("TSUKIMI_KV_POLICY=fastgen applies to the real engine (it profiles real attention)")
    return dict(
        nats_url=get.text("TSUKIMI_NATS_URL"),
        nats_credentials=nats_credentials(get, role),
        subject_prefix=get.subject_token("TSUKIMI_SUBJECT_PREFIX"),
        instance_id=get.subject_token("TSUKIMI_INSTANCE_ID") or default_instance_id(role),
        log_level=get.choice("TSUKIMI_LOG_LEVEL", LOG_LEVELS),
        log_format=get.choice("TSUKIMI_LOG_FORMAT", ("json", "console")),
        model_path=get.text("TSUKIMI_MODEL") or None,
        engine=engine,
        engine_kind=engine_kind,
        sim_profile=get.choice("TSUKIMI_SIM_PROFILE", tuple(PROFILES)),
        sim_kv_codec=get.choice("TSUKIMI_SIM_KV_CODEC", ("none", *CODEC_NAMES)),
        sim_kv_tokens=get.integer("TSUKIMI_SIM_KV_TOKENS", minimum=0),
        deployment=get.choice("TSUKIMI_DEPLOYMENT", DEPLOYMENTS),
        heartbeat_s=get.number("TSUKIMI_HEARTBEAT_S", minimum=0.05),
    )


def _engine(get: Reader, role: str) -> EngineConfig:
    try:
        fastgen = FastGenSettings(
            threshold=get.number("TSUKIMI_FASTGEN_T", minimum=0.0),
            r_local=get.number("TSUKIMI_FASTGEN_R_LOCAL", minimum=0.0),
            r_frequent=get.number("TSUKIMI_FASTGEN_R_FREQUENT", minimum=0.0),
            profile_rows=get.integer("TSUKIMI_FASTGEN_PROFILE_ROWS", minimum=1),
            wider_local=parse_shares(get.text("TSUKIMI_FASTGEN_WIDER_LOCAL")),
            frequent_alone=get.switch("TSUKIMI_FASTGEN_FREQUENT_ALONE"),
        )
        return EngineConfig(
            device=get.text("TSUKIMI_DEVICE"), dtype=get.text("TSUKIMI_DTYPE"), kernels=get.text("TSUKIMI_KERNELS"),
            num_threads=get.integer("TSUKIMI_NUM_THREADS", minimum=0),
            kv_cache_bytes=get.integer_or_auto("TSUKIMI_KV_CACHE_MB", minimum=1) << 20,
            kv_memory_fraction=get.number("TSUKIMI_KV_MEMORY_FRACTION", minimum=0.0),
            block_size=get.integer("TSUKIMI_BLOCK_SIZE", minimum=1),
            max_num_seqs=get.integer("TSUKIMI_MAX_NUM_SEQS", minimum=1),
            max_num_batched_tokens=_step_tokens(get, role),
            enable_prefix_caching=get.switch("TSUKIMI_PREFIX_CACHING"),
            kv_codec=get.text("TSUKIMI_KV_CODEC"), kv_calib=get.text("TSUKIMI_KV_CALIB") or None,
            kv_policy=get.text("TSUKIMI_KV_POLICY"), fastgen=fastgen,
        )
    except ValueError as exc:
        raise ConfigError(f"engine settings: {exc}") from None


def _step_tokens(get: Reader, role: str) -> int:
    """TSUKIMI_MAX_BATCHED_TOKENS, or where it is not set on a prefill instance (no decodes in its steps), larger
    steps: `PREFILL_BATCHED_TOKENS`."""
    if role == "prefill" and not get.is_set("TSUKIMI_MAX_BATCHED_TOKENS"):
        return PREFILL_BATCHED_TOKENS
    return get.integer("TSUKIMI_MAX_BATCHED_TOKENS", minimum=1)


def _gateway(get: Reader, role: str) -> Fields:
    if role == "gateway":  # `tsukimi up` checks the host it is given (its --host wins over TSUKIMI_HOST)
        check_http_exposure(get.text("TSUKIMI_HOST"), get.text("TSUKIMI_API_KEYS_FILE"),
                            get.switch("TSUKIMI_INSECURE_HTTP"))
    return dict(
        model_name=get.text("TSUKIMI_MODEL_NAME"),
        instance_timeout_s=get.number("TSUKIMI_INSTANCE_TIMEOUT_S", minimum=0.1),
        host=get.text("TSUKIMI_HOST"),
        port=get.integer("TSUKIMI_PORT", minimum=0),
        max_body_bytes=get.integer("TSUKIMI_MAX_BODY_KB", minimum=1) << 10,
        request_timeout_s=get.number("TSUKIMI_REQUEST_TIMEOUT_S", minimum=0.1),
        progress_timeout_s=get.number("TSUKIMI_PROGRESS_TIMEOUT_S", minimum=0.1),
        migration_limit=get.integer("TSUKIMI_MIGRATION_LIMIT", minimum=0),
        scheduler_wait_s=get.number("TSUKIMI_SCHEDULER_WAIT_S", minimum=0.0),
        http_read_timeout_s=get.number("TSUKIMI_HTTP_READ_TIMEOUT_S", minimum=0.1),
        api_keys_file=get.text("TSUKIMI_API_KEYS_FILE") or None,
        insecure_http=get.switch("TSUKIMI_INSECURE_HTTP"),
    )


def _scheduler(get: Reader, role: str) -> Fields:
    policy = get.choice("TSUKIMI_POLICY", POLICIES)
    if get.choice("TSUKIMI_DEPLOYMENT", DEPLOYMENTS) == "colocated" and policy not in COLOCATED_POLICIES:
        raise ConfigError(f"TSUKIMI_POLICY={policy} needs a prefill pool; a colocated deployment routes with "
                          f"{', '.join(COLOCATED_POLICIES)}")
    return dict(
        instance_timeout_s=get.number("TSUKIMI_INSTANCE_TIMEOUT_S", minimum=0.1),
        policy=policy,
        slo_ttft_s=get.number("TSUKIMI_SLO_TTFT_MS", minimum=1.0) / 1000,
        slo_tbt_s=get.number("TSUKIMI_SLO_TBT_MS", minimum=1.0) / 1000,
        rejection=get.choice("TSUKIMI_REJECTION", REJECTION_MODES),
        cache_balance_ratio=get.number("TSUKIMI_CACHE_BALANCE_RATIO", minimum=1.0),
        local_prefill_tokens=get.integer("TSUKIMI_LOCAL_PREFILL_TOKENS", minimum=0),
        policy_seed=get.integer("TSUKIMI_POLICY_SEED", minimum=0) if get.text("TSUKIMI_POLICY_SEED") else None,
    )


def _engine_service(get: Reader, role: str) -> Fields:
    return dict(
        warmup=get.switch("TSUKIMI_WARMUP"),
        request_timeout_s=get.number("TSUKIMI_REQUEST_TIMEOUT_S", minimum=0.1),
        kv_deadline_s=get.number("TSUKIMI_KV_DEADLINE_S", minimum=0.1),
        kv_chunk_bytes=get.integer("TSUKIMI_KV_CHUNK_KB", minimum=1) << 10,
        kv_buffer_bytes=get.integer("TSUKIMI_KV_BUFFER_MB", minimum=1) << 20,
        kv_compress=get.switch("TSUKIMI_KV_COMPRESS"),
        cache_shards=get.integer("TSUKIMI_CACHE_SHARDS", minimum=1),
        cpp_group=_cpp_group(get.text("TSUKIMI_CPP_GROUP")),
        cpp_min_tokens=get.integer("TSUKIMI_CPP_MIN_TOKENS", minimum=1),
        cpp_kv_bytes=get.integer("TSUKIMI_CPP_KV_MB", minimum=1) << 20,
        cache_block_key=secret(get, "TSUKIMI_CACHE_BLOCK_KEY").encode(),
    )


def _cpp_group(text: str) -> tuple[str, ...]:
    """TSUKIMI_CPP_GROUP: distinct instance ids, at least two (empty: no group)."""
    group = tuple(part.strip() for part in text.split(",") if part.strip())
    if group and (len(group) < 2 or len(set(group)) != len(group)):
        raise ConfigError(f"TSUKIMI_CPP_GROUP={text!r} must name at least two distinct prefill instances")
    return group


def _cache_store(get: Reader, role: str) -> Fields:
    shards = get.integer("TSUKIMI_CACHE_SHARDS", minimum=1)
    shard = get.integer("TSUKIMI_CACHE_SHARD", minimum=0)
    if shard >= shards:
        raise ConfigError(f"TSUKIMI_CACHE_SHARD={shard} must be below TSUKIMI_CACHE_SHARDS={shards}")
    return dict(
        cache_shard=shard,
        cache_shards=shards,
        cache_dram_bytes=get.integer("TSUKIMI_CACHE_DRAM_MB", minimum=1) << 20,
        cache_ssd_dir=get.text("TSUKIMI_CACHE_SSD_DIR") or None,
        cache_ssd_bytes=get.integer("TSUKIMI_CACHE_SSD_MB", minimum=1) << 20,
        cache_ssd_admit_seen=get.integer("TSUKIMI_CACHE_SSD_ADMIT_SEEN", minimum=1),
    )


_READERS: dict[type[ServiceSettings], tuple[Callable[[Reader, str], Fields], ...]] = {
    GatewaySettings: (_gateway,),
    SchedulerSettings: (_scheduler,),
    EngineSettings: (_engine_service,),
    CacheStoreSettings: (_cache_store,),
    ClusterSettings: (_gateway, _scheduler, _engine_service, _cache_store),
}
ROLE_SETTINGS: dict[str, type[ServiceSettings]] = {
    "gateway": GatewaySettings, "scheduler": SchedulerSettings, "prefill": EngineSettings, "decode": EngineSettings,
    "cache-store": CacheStoreSettings, "up": ClusterSettings,
}
