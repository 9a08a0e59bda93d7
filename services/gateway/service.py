"""The gateway as a service: its NATS backend and its HTTP server, started and stopped by the lifecycle every
service shares (`services.common.lifecycle`). The HTTP side itself is `app.py`'s."""

from __future__ import annotations

from aiohttp import web

from services.gateway.app import Gateway, GatewayConfig
from services.gateway.backend import NatsBackend
from services.gateway.http_server import make_runner
from services.gateway.prompt import ModelInfo
from shared.config import ConfigError, GatewaySettings
from shared.wire.bus import Bus
from shared.wire.log import get_logger

log = get_logger(__name__)


class GatewayService:
    """Serves the OpenAI-compatible API on `settings.host:settings.port` in front of the cluster on `bus`.

    Args:
        settings: the gateway's settings.
        bus: its NATS connection.
        model: the served model (manifest, limits).
        config: the HTTP side's settings.
    """

    def __init__(self, settings: GatewaySettings, bus: Bus, model: ModelInfo, config: GatewayConfig) -> None:
        self.settings, self.model, self.config = settings, model, config
        self.backend = NatsBackend(bus, settings.instance_timeout_s)
        self.gateway = Gateway(model, self.backend, config)
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        """Follow the cluster, then listen. Raises ConfigError: the address cannot be listened on."""
        await self.backend.start()
        runner = make_runner(self.gateway.build_app(), self.settings.http_read_timeout_s)
        await runner.setup()
        try:
            await web.TCPSite(runner, self.settings.host, self.settings.port).start()
        except OSError as exc:
            await runner.cleanup()
            raise ConfigError(f"cannot listen on {self.settings.host}:{self.settings.port}: {exc.strerror}") from None
        self._runner = runner
        num_keys = len(self.config.api_keys.keys) if self.config.api_keys else None
        log.info("listening", host=self.settings.host, port=self.settings.port, model=self.model.name,
                 simulated=self.model.is_simulated, deployment=self.settings.deployment, num_api_keys=num_keys)

    async def stop(self) -> None:
        """Stop listening (in-flight requests end with the connections), then stop following the cluster."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.backend.stop()
