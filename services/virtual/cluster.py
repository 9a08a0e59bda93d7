"""A virtual cluster: every instance of a topology built by its own service's `build` from the settings its role
reads (the same variables `tsukimi up --engine sim` gives it), each on its own node of the modelled network and
connected through the in-process NATS; started, and stopped, as `tsukimi up` would.

What differs from production, and why: there is no gateway's HTTP side (the replay drives the gateway's own
`NatsBackend` and `Session`, `replay.py`): HTTP to a virtual clock would need virtual sockets, and what it adds to a
request is this machine's, not the cluster's. Log lines are one process's, each with the service and instance that
wrote it. A prefill instance's engine executor runs in lock-step on a real thread (it waits for prefix KV layer by
layer); every other executor runs on the loop's thread.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import structlog
from nats.aio.client import Client

import services.cache_store.__main__ as cache_store_main
import services.decode.__main__ as decode_main
import services.prefill.__main__ as prefill_main
import services.scheduler.__main__ as scheduler_main
from services.common.lifecycle import Service
from services.scheduler.service import SchedulerService
from services.virtual.clock import VirtualCondition, VirtualLoop, is_installed_for
from services.virtual.nats import VirtualNats
from services.virtual.network import Network, NetworkSpec
from shared.config import CacheStoreSettings, EngineSettings, SchedulerSettings, ServiceSettings, load_role_settings
from shared.engine.kv.prefix_load import PrefixLoad
from shared.sim.profiles import SIM_ENV_DEFAULTS
from shared.tools.topology import Topology
from shared.wire.bus import Bus
from shared.wire.heartbeat import LiveInstances
from shared.wire.protocol import Subjects

VIRTUAL_URL = "nats://virtual"  # never dialled: every connection is in-process
Build = Callable[[Any, Bus], Coroutine[Any, Any, Service]]
_BUILDS: dict[str, tuple[type[ServiceSettings], Build]] = {
    "scheduler": (SchedulerSettings, scheduler_main.build),
    "prefill": (EngineSettings, prefill_main.build),
    "decode": (EngineSettings, decode_main.build),
    "cache-store": (CacheStoreSettings, cache_store_main.build_service),
}


@dataclass(frozen=True)
class ClusterSpec:
    """What to simulate.

    Attributes:
        prefill, decode: instances of each (colocated: `decode` instances that prefill too, `prefill` 0).
        cache_stores: cache-store shards; shard i runs on the node of the i-th engine instance (Mooncake's pool is
            the DRAM of the serving nodes).
        cpp_group: prefill instances per pipeline group (1: none), as `tsukimi up --cpp-group`.
        profile: the sim profile every engine instance stands for.
        env: more TSUKIMI_* variables for every instance (policy, SLOs, rejection, capacities).
        network: each node's interface.
    """

    prefill: int = 1
    decode: int = 1
    cache_stores: int = 1
    colocated: bool = False
    cpp_group: int = 1
    profile: str = "llama3-70b-8xa800"
    env: Mapping[str, str] = field(default_factory=dict)
    network: NetworkSpec = field(default_factory=NetworkSpec)

    def topology(self) -> Topology:
        return Topology(prefill=0 if self.colocated else self.prefill, decode=self.decode,
                        cache_stores=self.cache_stores, colocated=self.colocated, cpp_group=self.cpp_group,
                        nats_url=VIRTUAL_URL,
                        extra_env=tuple(self.env_for_all().items()))

    def env_for_all(self) -> dict[str, str]:
        return {**SIM_ENV_DEFAULTS, "TSUKIMI_ENGINE": "sim", "TSUKIMI_SIM_PROFILE": self.profile,
                **self.env}


@dataclass
class Instance:
    """One running service of the cluster."""

    instance_id: str
    role: str
    node: str
    settings: ServiceSettings
    bus: Bus
    service: Service
    context: contextvars.Context


class VirtualCluster:
    """The instances of a `ClusterSpec` on one `VirtualLoop`; `connect` gives whoever drives it a bus of its own."""

    def __init__(self, spec: ClusterSpec, loop: VirtualLoop) -> None:
        if not is_installed_for(inspect.signature(LiveInstances).parameters["clock"].default):
            raise RuntimeError("the services were imported before services.virtual.clock.install(): their clocks "
                               "would be real")
        self.spec, self.loop = spec, loop
        # For this process's life: a prefill engine waits for prefix KV in lock-step with the loop.
        PrefixLoad.condition_type = VirtualCondition  # type: ignore[assignment]
        self.network = Network(spec.network)
        self.nats = VirtualNats(self.network)
        self.subjects = Subjects(load_role_settings(SchedulerSettings, "scheduler", spec.env_for_all()).subject_prefix)
        self.instances: list[Instance] = []

    def scheduler(self) -> SchedulerService:
        """The (first) scheduler instance."""
        return next(cast(SchedulerService, i.service) for i in self.instances if i.role == "scheduler")

    def connect(self, name: str, node: str) -> Bus:
        """A bus for something outside the services (the replay's gateway side)."""
        return Bus(cast(Client, self.nats.connect(name, node)), self.subjects)

    async def start(self) -> None:
        """Build and start every instance: cache-stores first, then engines, the scheduler last (as each would find
        the others once they beat). When one fails to build or start, those started are stopped.

        Raises:
            ConfigError: a setting a role refuses.
        """
        topology = self.spec.topology()
        engines = [s.name for s in topology.process_specs() if s.name.startswith(("prefill", "decode"))]
        order = ("cache-store", "prefill", "decode", "scheduler")
        specs = sorted((s for s in topology.process_specs() if not s.name.startswith("gateway")),
                       key=lambda s: order.index(s.name.rsplit("-", 1)[0]))
        try:
            for spec in specs:
                role = spec.name.rsplit("-", 1)[0]
                if role == "cache-store":
                    node = engines[int(spec.env["TSUKIMI_CACHE_SHARD"]) % len(engines)]
                else:
                    node = spec.name if role != "scheduler" else "scheduler"
                await self._start_instance(spec.name, role, node, {**spec.env})
        except BaseException:  # a setting one role refuses: what started stops, as `tsukimi up` would
            await self.stop()
            raise

    async def _start_instance(self, instance_id: str, role: str, node: str, env: dict[str, str]) -> None:
        kind, build = _BUILDS[role]
        settings = load_role_settings(kind, role, env)
        context = contextvars.copy_context()
        context.run(structlog.contextvars.bind_contextvars, service=role, instance=instance_id)
        client = self.nats.connect(instance_id, node)
        client.context = context
        bus = Bus(cast(Client, client), self.subjects)
        service = await _in_context(context, build(settings, bus))
        if role == "prefill":  # its engines wait for prefix KV from the cache-store, layer by layer
            for owner in (service, getattr(service, "stage", None)):
                host = getattr(owner, "host", None)
                if host is not None:
                    self.loop.mark_threaded(host.executor)
        await _in_context(context, service.start())
        self.instances.append(Instance(instance_id, role, node, settings, bus, service, context))

    async def stop(self) -> None:
        for instance in reversed(self.instances):
            await _in_context(instance.context, instance.service.stop())
            await instance.bus.drain()
        self.instances.clear()


async def _in_context(context: contextvars.Context, coro: Coroutine[Any, Any, Any]) -> Any:
    """Await `coro` as a task of its own in `context` (so the tasks it starts inherit the instance's log fields)."""
    return await asyncio.get_running_loop().create_task(coro, context=context)

