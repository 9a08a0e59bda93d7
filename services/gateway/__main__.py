"""`python -m services.gateway`: the gateway service, configured by `TSUKIMI_*` variables (shared/env_vars.py);
listens on TSUKIMI_HOST:TSUKIMI_PORT."""

from __future__ import annotations

import asyncio

from services.common.lifecycle import run_service
from services.gateway.app import GatewayConfig
from services.gateway.backend import COLOCATED_ROLES_FOR_HEALTH, ROLES_FOR_HEALTH
from services.gateway.prompt import ModelInfo
from services.gateway.service import GatewayService
from shared.config import ConfigError, GatewaySettings
from shared.model.dummy import is_dummy
from shared.model.manifest import read_manifest
from shared.sim.manifest import sim_kv_format, sim_manifest, sim_model_name
from shared.sim.profiles import get_profile
from shared.wire.api_keys import ApiKeysError, load_api_keys
from shared.wire.bus import Bus
from shared.wire.protocol import Role


def model_info(settings: GatewaySettings) -> ModelInfo:
    """The served model's tokenizer and limits, from its manifest (no weights are loaded). Under the sim backend:
    the profile's limits, the default tokenizer, and a model id that says it is simulated; a model of random weights
    (`dummy:NAME`) is served under that name."""
    if settings.engine_kind == "sim":
        profile = get_profile(settings.sim_profile)
        manifest, name = sim_manifest(profile), sim_model_name(profile)
    elif is_dummy(settings.model_path):
        manifest, name = read_manifest(settings.model_path), str(settings.model_path)
    else:
        manifest, name = read_manifest(settings.model_path), settings.model_name
    return ModelInfo(
        name=name, tokenizer=manifest.tokenizer, fingerprint=manifest.fingerprint,
        context_len=manifest.config.max_position,
        # sim: prompts are never embedded, but streamed tokens are detokenized by the stand-in tokenizer
        vocab_size=manifest.tokenizer.vocab_size if settings.engine_kind == "sim" else manifest.config.vocab_size,
        kv_format=(sim_kv_format(settings.engine.kv_format, settings.sim_kv_codec) if settings.engine_kind == "sim"
                   else settings.engine.kv_format),
        is_simulated=settings.engine_kind == "sim",
    )


async def build(settings: GatewaySettings, bus: Bus) -> GatewayService:
    """The gateway for these settings. Raises ConfigError: an API key file or a model that cannot be used."""
    try:
        api_keys = load_api_keys(settings.api_keys_file) if settings.api_keys_file else None
        model = await asyncio.to_thread(model_info, settings)
    except (ApiKeysError, OSError, ValueError) as exc:
        raise ConfigError(str(exc)) from None
    health_roles = COLOCATED_ROLES_FOR_HEALTH if settings.deployment == "colocated" else ROLES_FOR_HEALTH
    config = GatewayConfig(
        settings.engine.block_size, settings.request_timeout_s, settings.max_body_bytes, health_roles,
        progress_timeout_s=settings.progress_timeout_s, http_read_timeout_s=settings.http_read_timeout_s,
        migration_limit=settings.migration_limit, scheduler_wait_s=settings.scheduler_wait_s,
        api_keys=api_keys,
    )
    return GatewayService(settings, bus, model, config)


def main() -> None:
    run_service(Role.GATEWAY, GatewaySettings, build)


if __name__ == "__main__":
    main()
