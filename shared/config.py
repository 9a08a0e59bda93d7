"""Service settings: every `TSUKIMI_*` environment variable, its default and meaning, read in one place.

This is the only module that reads `os.environ`. Services call `load_settings()` once at start; a bad value raises
`ConfigError` naming the variable. The variables, their defaults and meanings are `shared.env_vars.ENV_VARS`.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from shared.engine.config import EngineConfig
from shared.env_vars import ENV_VARS
from shared.fastgen.policies import FastGenSettings, parse_shares
from shared.sim.profiles import PROFILES
from shared.wire.nats_auth import NatsCredentials, inbox_prefix

POLICIES = ("random", "round_robin", "least_loaded", "local_cache_aware", "conductor")
COLOCATED_POLICIES = ("random", "round_robin", "least_loaded")  # routing when every instance prefills and decodes
DEPLOYMENTS = ("disaggregated", "colocated")
ENGINES = ("real", "sim")
REJECTION_MODES = ("off", "current", "predicted")


class ConfigError(ValueError):
    """An environment variable holds a value that cannot be used; the message names it."""


@dataclass(frozen=True)
class Settings:
    """Everything a service may be configured with; built by `load_settings`."""

    nats_url: str
    nats_credentials: NatsCredentials
    subject_prefix: str
    instance_id: str
    log_level: str
    log_format: str
    model_path: str | None
    model_name: str
    engine: EngineConfig
    engine_kind: str  # "real" or "sim"
    sim_profile: str
    deployment: str  # "disaggregated" or "colocated"
    heartbeat_s: float
    warmup: bool
    instance_timeout_s: float
    kv_deadline_s: float
    kv_chunk_bytes: int
    kv_buffer_bytes: int
    kv_compress: bool
    policy: str
    slo_ttft_s: float
    slo_tbt_s: float
    rejection: str
    cache_balance_ratio: float
    local_prefill_tokens: int
    host: str
    port: int
    max_body_bytes: int
    request_timeout_s: float
    progress_timeout_s: float
    http_read_timeout_s: float
    api_keys_file: str | None
    insecure_http: bool
    cache_block_key: bytes = field(repr=False)
    cache_shard: int
    cache_shards: int
    cache_dram_bytes: int
    cache_ssd_dir: str | None
    cache_ssd_bytes: int
    cache_ssd_admit_seen: int


def load_settings(
    role: str, environ: Mapping[str, str] | None = None, overrides: Mapping[str, str] | None = None
) -> Settings:
    """Read every `TSUKIMI_*` variable (missing ones take their defaults).

    Args:
        role: the service name, used in the default instance id.
        environ: the variables to read (default: `os.environ`); tests pass a dict.
        overrides: variables that win over `environ` (a command line's flags).
    Raises:
        ConfigError: a value of the wrong type or out of range, or an unknown `TSUKIMI_*` variable (a typo).
    """
    env = {**(os.environ if environ is None else environ), **(overrides or {})}
    unknown = sorted(k for k in env if k.startswith("TSUKIMI_") and k not in ENV_VARS)
    if unknown:
        raise ConfigError(f"unknown variable(s) {', '.join(unknown)}; known: {', '.join(ENV_VARS)}")
    get = _Reader(env)
    engine_kwargs = dict(
        device=get.text("TSUKIMI_DEVICE"), dtype=get.text("TSUKIMI_DTYPE"), kernels=get.text("TSUKIMI_KERNELS"),
        num_threads=get.integer("TSUKIMI_NUM_THREADS", minimum=0),
        kv_cache_bytes=get.integer("TSUKIMI_KV_CACHE_MB", minimum=1) << 20,
        block_size=get.integer("TSUKIMI_BLOCK_SIZE", minimum=1),
        max_num_seqs=get.integer("TSUKIMI_MAX_NUM_SEQS", minimum=1),
        max_num_batched_tokens=get.integer("TSUKIMI_MAX_BATCHED_TOKENS", minimum=1),
        kv_codec=get.text("TSUKIMI_KV_CODEC"), kv_calib=get.text("TSUKIMI_KV_CALIB") or None,
        kv_policy=get.text("TSUKIMI_KV_POLICY"),
    )
    try:
        engine_kwargs["fastgen"] = FastGenSettings(
            threshold=get.number("TSUKIMI_FASTGEN_T", minimum=0.0),
            r_local=get.number("TSUKIMI_FASTGEN_R_LOCAL", minimum=0.0),
            r_frequent=get.number("TSUKIMI_FASTGEN_R_FREQUENT", minimum=0.0),
            profile_rows=get.integer("TSUKIMI_FASTGEN_PROFILE_ROWS", minimum=1),
            wider_local=parse_shares(get.text("TSUKIMI_FASTGEN_WIDER_LOCAL")),
            frequent_alone=get.switch("TSUKIMI_FASTGEN_FREQUENT_ALONE"),
        )
        engine = EngineConfig(**engine_kwargs)  # type: ignore[arg-type]
    except ValueError as exc:
        raise ConfigError(f"engine settings: {exc}") from None
    shards = get.integer("TSUKIMI_CACHE_SHARDS", minimum=1)
    shard = get.integer("TSUKIMI_CACHE_SHARD", minimum=0)
    if shard >= shards:
        raise ConfigError(f"TSUKIMI_CACHE_SHARD={shard} must be below TSUKIMI_CACHE_SHARDS={shards}")
    level = get.text("TSUKIMI_LOG_LEVEL").lower()
    if level not in ("debug", "info", "warning", "error"):
        raise ConfigError(f"TSUKIMI_LOG_LEVEL must be debug, info, warning or error, got {level!r}")
    if role == "gateway":
        check_http_exposure(get.text("TSUKIMI_HOST"), get.text("TSUKIMI_API_KEYS_FILE"),
                            get.switch("TSUKIMI_INSECURE_HTTP"))
    deployment, policy = get.choice("TSUKIMI_DEPLOYMENT", DEPLOYMENTS), get.choice("TSUKIMI_POLICY", POLICIES)
    if deployment == "colocated" and policy not in COLOCATED_POLICIES:
        raise ConfigError(f"TSUKIMI_POLICY={policy} needs a prefill pool; a colocated deployment routes with "
                          f"{', '.join(COLOCATED_POLICIES)}")
    engine_kind = get.choice("TSUKIMI_ENGINE", ENGINES)
    if engine_kind == "sim" and engine.kv_codec != "none":
        raise ConfigError("TSUKIMI_KV_CODEC applies to the real engine; the sim engine's KV travels as sizes only")
    if engine_kind == "sim" and engine.kv_policy != "full":
        raise ConfigError("TSUKIMI_KV_POLICY=fastgen applies to the real engine (it profiles real attention)")
    log_format = get.text("TSUKIMI_LOG_FORMAT").lower()
    if log_format not in ("json", "console"):
        raise ConfigError(f"TSUKIMI_LOG_FORMAT must be json or console, got {log_format!r}")
    return Settings(
        nats_url=get.text("TSUKIMI_NATS_URL"),
        nats_credentials=_nats_credentials(get, role),
        subject_prefix=get.subject_token("TSUKIMI_SUBJECT_PREFIX"),
        instance_id=get.subject_token("TSUKIMI_INSTANCE_ID") or default_instance_id(role),
        log_level=level,
        log_format=log_format,
        model_path=get.text("TSUKIMI_MODEL") or None,
        model_name=get.text("TSUKIMI_MODEL_NAME"),
        engine=engine,
        engine_kind=engine_kind,
        sim_profile=get.choice("TSUKIMI_SIM_PROFILE", tuple(PROFILES)),
        deployment=deployment,
        heartbeat_s=get.number("TSUKIMI_HEARTBEAT_S", minimum=0.05),
        warmup=get.switch("TSUKIMI_WARMUP"),
        instance_timeout_s=get.number("TSUKIMI_INSTANCE_TIMEOUT_S", minimum=0.1),
        kv_deadline_s=get.number("TSUKIMI_KV_DEADLINE_S", minimum=0.1),
        kv_chunk_bytes=get.integer("TSUKIMI_KV_CHUNK_KB", minimum=1) << 10,
        kv_buffer_bytes=get.integer("TSUKIMI_KV_BUFFER_MB", minimum=1) << 20,
        kv_compress=get.switch("TSUKIMI_KV_COMPRESS"),
        policy=policy,
        slo_ttft_s=get.number("TSUKIMI_SLO_TTFT_MS", minimum=1.0) / 1000,
        slo_tbt_s=get.number("TSUKIMI_SLO_TBT_MS", minimum=1.0) / 1000,
        rejection=get.choice("TSUKIMI_REJECTION", REJECTION_MODES),
        cache_balance_ratio=get.number("TSUKIMI_CACHE_BALANCE_RATIO", minimum=1.0),
        local_prefill_tokens=get.integer("TSUKIMI_LOCAL_PREFILL_TOKENS", minimum=0),
        host=get.text("TSUKIMI_HOST"),
        port=get.integer("TSUKIMI_PORT", minimum=0),
        max_body_bytes=get.integer("TSUKIMI_MAX_BODY_KB", minimum=1) << 10,
        request_timeout_s=get.number("TSUKIMI_REQUEST_TIMEOUT_S", minimum=0.1),
        progress_timeout_s=get.number("TSUKIMI_PROGRESS_TIMEOUT_S", minimum=0.1),
        http_read_timeout_s=get.number("TSUKIMI_HTTP_READ_TIMEOUT_S", minimum=0.1),
        api_keys_file=get.text("TSUKIMI_API_KEYS_FILE") or None,
        insecure_http=get.switch("TSUKIMI_INSECURE_HTTP"),
        cache_block_key=_secret(get, "TSUKIMI_CACHE_BLOCK_KEY").encode(),
        cache_shard=shard,
        cache_shards=shards,
        cache_dram_bytes=get.integer("TSUKIMI_CACHE_DRAM_MB", minimum=1) << 20,
        cache_ssd_dir=get.text("TSUKIMI_CACHE_SSD_DIR") or None,
        cache_ssd_bytes=get.integer("TSUKIMI_CACHE_SSD_MB", minimum=1) << 20,
        cache_ssd_admit_seen=get.integer("TSUKIMI_CACHE_SSD_ADMIT_SEEN", minimum=1),
    )


def is_loopback(host: str) -> bool:
    """`host` (a listen address) reaches this machine only: 127.0.0.0/8, ::1 or localhost."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: whatever it resolves to may be public


def check_http_exposure(host: str, api_keys_file: str, insecure: bool) -> None:
    """Refuse to serve the API beyond loopback without API keys, unless told to.

    Raises:
        ConfigError: a non-loopback `host`, no `api_keys_file` and not `insecure`; the message says what to do.
    """
    if not (is_loopback(host) or api_keys_file or insecure):
        raise ConfigError(
            f"the gateway would listen on {host} without API keys: anyone who reaches it could use it and read its "
            "answers. Create keys (tsukimi keys add NAME --file keys.json; TSUKIMI_API_KEYS_FILE=keys.json), listen "
            "on 127.0.0.1, or accept it with TSUKIMI_INSECURE_HTTP=on (tsukimi up --insecure)")


def _secret(get: _Reader, name: str) -> str:
    """A secret from variable `name`, or from the file `name`_FILE names (not both)."""
    value, path = get.text(name), get.text(f"{name}_FILE")
    if value and path:
        raise ConfigError(f"set {name} or {name}_FILE, not both")
    if not path:
        return value
    try:
        return Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(f"{name}_FILE={path}: {exc.strerror}") from None


def _nats_credentials(get: _Reader, role: str) -> NatsCredentials:
    """TSUKIMI_NATS_* as credentials: the password from the variable or its file, the user the role unless set."""
    password = _secret(get, "TSUKIMI_NATS_PASSWORD")
    user = get.text("TSUKIMI_NATS_USER") or (role if password else "")
    if password and not user:
        raise ConfigError("TSUKIMI_NATS_PASSWORD needs a user: set TSUKIMI_NATS_USER")
    files = {name: get.text(f"TSUKIMI_NATS_TLS_{name}_FILE") for name in ("CA", "CERT", "KEY")}
    if bool(files["CERT"]) != bool(files["KEY"]):
        raise ConfigError("TSUKIMI_NATS_TLS_CERT_FILE and TSUKIMI_NATS_TLS_KEY_FILE go together")
    for name, file in files.items():
        if file and not Path(file).is_file():
            raise ConfigError(f"TSUKIMI_NATS_TLS_{name}_FILE={file}: no such file")
    return NatsCredentials(user, password, inbox_prefix(role), files["CA"], files["CERT"], files["KEY"])


def default_instance_id(role: str) -> str:
    """`<role>-<host>-<pid>-<4 random hex>`: unique even where containers share a hostname and each is PID 1."""
    host = "".join(c if c.isalnum() or c in "-_" else "-" for c in socket.gethostname())[:32]
    return f"{role}-{host}-{os.getpid()}-{secrets.token_hex(2)}"


class _Reader:
    """Typed access to the variables, with errors that name the variable."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self._env = env

    def text(self, name: str) -> str:
        return self._env.get(name, ENV_VARS[name].default).strip()

    def integer(self, name: str, minimum: int) -> int:
        raw = self.text(name)
        try:
            value = int(raw)
        except ValueError:
            raise ConfigError(f"{name} must be an integer, got {raw!r}") from None
        if value < minimum:
            raise ConfigError(f"{name} must be at least {minimum}, got {value}")
        return value

    def number(self, name: str, minimum: float) -> float:
        raw = self.text(name)
        try:
            value = float(raw)
        except ValueError:
            raise ConfigError(f"{name} must be a number, got {raw!r}") from None
        if not value >= minimum:
            raise ConfigError(f"{name} must be at least {minimum}, got {value}")
        return value

    def choice(self, name: str, choices: tuple[str, ...]) -> str:
        raw = self.text(name).lower()
        if raw not in choices:
            raise ConfigError(f"{name} must be one of {', '.join(choices)}, got {raw!r}")
        return raw

    def switch(self, name: str) -> bool:
        raw = self.text(name).lower()
        if raw not in ("on", "off", "1", "0", "true", "false"):
            raise ConfigError(f"{name} must be on or off, got {raw!r}")
        return raw in ("on", "1", "true")

    def subject_token(self, name: str) -> str:
        """A value used inside NATS subjects: letters, digits, '-' and '_' only."""
        raw = self.text(name)
        if any(not (c.isascii() and (c.isalnum() or c in "-_")) for c in raw):
            raise ConfigError(f"{name} may hold only letters, digits, '-' and '_', got {raw!r}")
        return raw
