"""`python -m services.cache_store`: one shard of the KV block pool, configured by `TSUKIMI_*` variables."""

from __future__ import annotations

from services.cache_store.service import CacheStoreService
from services.common.lifecycle import run_service
from shared.config import CacheStoreSettings
from shared.wire.bus import Bus
from shared.wire.protocol import Role


async def build_service(settings: CacheStoreSettings, bus: Bus) -> CacheStoreService:
    return CacheStoreService(settings, bus)


def main() -> None:
    """Serve the shard `TSUKIMI_CACHE_SHARD` (SSD tier in `TSUKIMI_CACHE_SSD_DIR`) until SIGTERM or SIGINT."""
    run_service(Role.CACHE_STORE.value, CacheStoreSettings, build_service)


if __name__ == "__main__":
    main()
