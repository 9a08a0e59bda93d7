"""`python -m services.prefill`: the prefill service, configured by `TSUKIMI_*` variables."""

from __future__ import annotations

from services.engine_host import load_engine
from services.prefill.service import PrefillService
from shared.bus import Bus, run_service
from shared.cache.client import CacheClient
from shared.config import Settings
from shared.protocol import Role


async def build(settings: Settings, bus: Bus) -> PrefillService:
    engine = await load_engine(settings)
    return PrefillService(settings, bus, engine, CacheClient(bus, settings.cache_shards))


def main() -> None:
    run_service(Role.PREFILL, build)


if __name__ == "__main__":
    main()
