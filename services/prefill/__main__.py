"""`python -m services.prefill`: the prefill service, configured by `TSUKIMI_*` variables."""

from __future__ import annotations

from services.common.engine_host import load_engine
from services.common.lifecycle import run_service
from services.prefill.service import PrefillService
from services.prefill.stage import PipelineStage
from shared.config import EngineSettings
from shared.model.stages import split_layers
from shared.wire.block_integrity import BlockSigner
from shared.wire.bus import Bus
from shared.wire.cache_client import CacheClient
from shared.wire.heartbeat import new_epoch
from shared.wire.kv_events import KvEventLog
from shared.wire.log import get_logger
from shared.wire.protocol import Role

log = get_logger("services.prefill")


async def build(settings: EngineSettings, bus: Bus) -> PrefillService:
    events = KvEventLog(settings.instance_id, new_epoch(), Role.PREFILL)  # the engine reports into it from the start
    engine = await load_engine(settings, prompt_only=True, on_block_event=events.record)
    if not settings.cache_block_key:
        log.warning("TSUKIMI_CACHE_BLOCK_KEY is not set: the cache-store's KV blocks are not signed, so a block put "
                    "under another block's hash would be used (see `tsukimi secrets`)")
    signer = BlockSigner(settings.cache_block_key or None)
    cache = CacheClient(bus, settings.cache_shards, signer=signer)
    stage = None
    if settings.cpp_group:  # long prompts run on the group's stages: this instance's, on its own weights
        group = settings.cpp_group
        if settings.instance_id not in group:
            raise ValueError(f"TSUKIMI_CPP_GROUP={','.join(group)} does not name this instance, {settings.instance_id}")
        layers = split_layers(engine.model_config.num_layers, len(group))[group.index(settings.instance_id)]
        stage_engine = engine.stage_engine(layers, settings.cpp_kv_bytes, on_block_event=events.record)
        stage = PipelineStage(settings, bus, stage_engine, cache)
    return PrefillService(settings, bus, engine, cache, events, stage)


def main() -> None:
    run_service(Role.PREFILL, EngineSettings, build)


if __name__ == "__main__":
    main()
