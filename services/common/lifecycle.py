"""One lifecycle for every service: load its settings, log, connect with its role's credentials, build and start
it, wait for SIGTERM or SIGINT (or its engine breaking), stop, drain; and the exit status that tells the supervisor
what happened (2: a configuration error, 1: broken, restart it).
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

from shared.config import ConfigError, ServiceSettings, load_role_settings
from shared.wire.bus import Bus, BusError
from shared.wire.log import configure_logging, get_logger, keep_secret, redact_url
from shared.wire.protocol import Subjects

log = get_logger(__name__)


class ServiceBroken(RuntimeError):
    """A service stopped because it cannot recover (exit status 1: its supervisor restarts it)."""


class Service(Protocol):
    """What `run_service` drives: start serving, then stop (finishing or failing what is in flight). A service that
    can break (its engine) has a `broken` event; once it is set the service is stopped and the process exits 1."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


S = TypeVar("S", bound=ServiceSettings)
ServiceFactory = Callable[[S, Bus], Awaitable[Service]]  # builds a service from its role's settings


def wait_for_signal() -> asyncio.Event:
    """An event set on SIGTERM or SIGINT (installed on the running loop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def connect_service(settings: ServiceSettings) -> Bus:
    """A service's connection: its instance id as the client name, its role's credentials (no log line of this
    process will show them, nor any other of its secrets). Raises BusError."""
    for secret in settings.secrets():
        keep_secret(secret)
    return await Bus.connect(settings.nats_url, settings.instance_id, Subjects(settings.subject_prefix),
                             settings.nats_credentials)


async def serve_until_signalled(role: str, kind: type[S], factory: ServiceFactory[S]) -> None:
    """Load the role's settings (of class `kind`), log, connect, build and start the service, wait for a signal,
    stop, drain."""
    settings = load_role_settings(kind, role)
    configure_logging(role, settings.instance_id, settings.log_level, settings.log_format)
    stop = wait_for_signal()
    bus = await connect_service(settings)
    service = await factory(settings, bus)
    await service.start()
    log.info("started", nats=redact_url(settings.nats_url), nats_user=settings.nats_credentials.user or None)
    broken: asyncio.Event = getattr(service, "broken", None) or asyncio.Event()
    waits = [asyncio.ensure_future(event.wait()) for event in (stop, broken)]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for waiting in waits:
        waiting.cancel()
    log.info("stopping", broken=broken.is_set())
    await service.stop()
    await bus.drain()
    log.info("stopped")
    if broken.is_set():
        raise ServiceBroken(f"{role} {settings.instance_id} stopped: its engine cannot recover")


def run_service(role: str, kind: type[S], factory: ServiceFactory[S]) -> None:
    """The `main()` of every service: exit code 2 with a message on a configuration error."""
    try:
        asyncio.run(serve_until_signalled(role, kind, factory))
    except (ConfigError, BusError) as exc:
        print(f"{role}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except ServiceBroken as exc:
        print(f"{role}: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
