"""A cache-store test stack: stores, clients and listeners on a real nats-server under a subject prefix of their own."""

from __future__ import annotations

import uuid

from services.cache_store.service import CacheStoreService
from shared.config import load_settings
from shared.wire.block_integrity import BlockSigner
from shared.wire.bus import Bus
from shared.wire.cache_client import CacheClient
from shared.wire.protocol import Message, Subjects


class Stack:
    """Stores, clients and listeners under one subject prefix of their own; closed at teardown."""

    def __init__(self, nats_url: str) -> None:
        self.nats_url = nats_url
        self.prefix = f"t{uuid.uuid4().hex[:12]}"
        self.services: list[CacheStoreService] = []
        self.buses: list[Bus] = []

    @property
    def subjects(self) -> Subjects:
        return Subjects(self.prefix)

    async def bus(self) -> Bus:
        bus = await Bus.connect(self.nats_url, "test", Subjects(self.prefix))
        self.buses.append(bus)
        return bus

    async def store(
        self, shard: int = 0, num_shards: int = 1, dram_mb: int = 64, env: dict[str, str] | None = None
    ) -> CacheStoreService:
        """A started shard `cache-<shard>`; `env` adds or overrides variables (TSUKIMI_CACHE_SSD_DIR, ...)."""
        settings = load_settings("cache-store", environ={
            "TSUKIMI_NATS_URL": self.nats_url, "TSUKIMI_SUBJECT_PREFIX": self.prefix,
            "TSUKIMI_INSTANCE_ID": f"cache-{shard}", "TSUKIMI_HEARTBEAT_S": "0.1", "TSUKIMI_CACHE_SHARD": str(shard),
            "TSUKIMI_CACHE_SHARDS": str(num_shards), "TSUKIMI_CACHE_DRAM_MB": str(dram_mb), **(env or {}),
        })
        service = CacheStoreService(settings, await self.bus())
        await service.start()
        self.services.append(service)
        return service

    async def stop(self, service: CacheStoreService) -> None:
        self.services.remove(service)
        await service.stop()

    async def client(
        self, num_shards: int = 1, timeout_s: float = 2.0, hot_gets: int = 0, key: bytes | None = None
    ) -> CacheClient:
        """A client; with `key`, one that signs what it puts and checks what it gets."""
        return CacheClient(await self.bus(), num_shards, timeout_s=timeout_s, hot_gets=hot_gets,
                           signer=BlockSigner(key))

    async def listen(self, subject: str) -> list[Message]:
        received: list[Message] = []

        async def on_message(msg: Message) -> None:
            received.append(msg)

        await (await self.bus()).serve(subject, on_message)
        return received

    async def close(self) -> None:
        for service in self.services:
            await service.stop()
        for bus in self.buses:
            await bus.drain()
