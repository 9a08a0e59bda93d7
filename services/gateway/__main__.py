"""`python -m services.gateway`: load settings and the tokenizer, connect to NATS, serve HTTP until a signal.

Configured only by `TSUKIMI_*` variables (shared/config.py); listens on TSUKIMI_HOST:TSUKIMI_PORT.
"""

from __future__ import annotations

import asyncio
import sys

from aiohttp import web

from services.common.lifecycle import connect_service, wait_for_signal
from services.gateway.app import Gateway, GatewayConfig
from services.gateway.backend import COLOCATED_ROLES_FOR_HEALTH, ROLES_FOR_HEALTH, NatsBackend
from services.gateway.http_server import make_runner
from services.gateway.prompt import ModelInfo
from shared.config import ConfigError, Settings, load_settings
from shared.model.manifest import read_manifest
from shared.sim.manifest import sim_manifest, sim_model_name
from shared.sim.profiles import get_profile
from shared.wire.api_keys import ApiKeysError, load_api_keys
from shared.wire.bus import BusError
from shared.wire.log import configure_logging, get_logger, redact_url

log = get_logger("services.gateway")


def model_info(settings: Settings) -> ModelInfo:
    """The served model's tokenizer and limits, from its manifest (no weights are loaded). Under the sim backend:
    the profile's limits, the default tokenizer, and a model id that says it is simulated."""
    if settings.engine_kind == "sim":
        profile = get_profile(settings.sim_profile)
        manifest, name = sim_manifest(profile), sim_model_name(profile)
    else:
        manifest, name = read_manifest(settings.model_path), settings.model_name
    return ModelInfo(
        name=name, tokenizer=manifest.tokenizer, fingerprint=manifest.fingerprint,
        context_len=manifest.config.max_position,
        # sim: prompts are never embedded, but streamed tokens are detokenized by the stand-in tokenizer
        vocab_size=manifest.tokenizer.vocab_size if settings.engine_kind == "sim" else manifest.config.vocab_size,
        kv_format=settings.engine.kv_format, is_simulated=settings.engine_kind == "sim",
    )


async def serve(settings: Settings) -> None:
    """Connect, serve HTTP on settings.host:settings.port, wait for SIGTERM/SIGINT, shut down and drain."""
    stop = wait_for_signal()
    api_keys = load_api_keys(settings.api_keys_file) if settings.api_keys_file else None  # fail before loading
    model = await asyncio.to_thread(model_info, settings)
    bus = await connect_service(settings)
    backend = NatsBackend(bus, settings.instance_timeout_s)
    await backend.start()
    health_roles = COLOCATED_ROLES_FOR_HEALTH if settings.deployment == "colocated" else ROLES_FOR_HEALTH
    config = GatewayConfig(
        settings.engine.block_size, settings.request_timeout_s, settings.max_body_bytes, health_roles,
        progress_timeout_s=settings.progress_timeout_s, http_read_timeout_s=settings.http_read_timeout_s,
        api_keys=api_keys,
    )
    runner = make_runner(Gateway(model, backend, config).build_app(), settings.http_read_timeout_s)
    await runner.setup()
    await web.TCPSite(runner, settings.host, settings.port).start()
    log.info("started", host=settings.host, port=settings.port, nats=redact_url(settings.nats_url), model=model.name,
             simulated=model.is_simulated, deployment=settings.deployment,
             num_api_keys=len(api_keys.keys) if api_keys else None)
    await stop.wait()
    log.info("stopping")
    await runner.cleanup()
    await backend.stop()
    await bus.drain()
    log.info("stopped")


def main() -> None:
    try:
        settings = load_settings("gateway")
        configure_logging("gateway", settings.instance_id, settings.log_level, settings.log_format)
        asyncio.run(serve(settings))
    except (ConfigError, ApiKeysError, BusError, OSError) as exc:
        print(f"gateway: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
