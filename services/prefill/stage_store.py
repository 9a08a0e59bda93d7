"""A pipeline stage's side of the cache-store: its layers of a prompt's new full blocks put there, under block ids of
the stage's own namespace (`LayerRange.block_format`: never a whole model's or another stage's), and its layers of a
prompt's prefix loaded from there. The first stage starts a prompt after the longest prefix every stage's layers of
are in the store (or its own cache holds, which the others' mirror: they computed the same prompts); a later stage
fetches what its cache lacks of that prefix."""

from __future__ import annotations

from services.common.engine_host import EngineHost
from services.prefill.fetch import StoreLoader
from shared.engine.engine import LLMEngine, RequestOutput
from shared.engine.kv.prefix_load import PrefixSource
from shared.model.stages import LayerRange, split_layers
from shared.wire.block_hash import block_hashes
from shared.wire.cache_client import CacheClient
from shared.wire.log import get_logger
from shared.wire.payload import Payload

log = get_logger(__name__)


class StageStore:
    """Puts and loads one stage's layers of prompts' blocks (`hashes`: a prompt's block ids in the stage's namespace).

    Args:
        engine: the stage engine; `host` runs its engine thread.
        num_stages: stages in the group (the first stage hashes a prompt under each one's namespace).
        cache: the cache-store's client.
        deadline_s: how long a prefix load may stall.
    """

    def __init__(self, engine: LLMEngine, host: EngineHost[RequestOutput], num_stages: int, cache: CacheClient,
                 deadline_s: float) -> None:
        assert engine.config.stage is not None
        self.engine, self.host, self.num_stages, self.cache = engine, host, num_stages, cache
        self.stage: LayerRange = engine.config.stage
        self.loader = StoreLoader(cache, engine.store, host.loop, deadline_s)

    async def stop(self) -> None:
        await self.loader.stop()

    def export(self, out: RequestOutput, hashes: list[int]) -> tuple[int, list[Payload]] | None:
        """Engine thread: the prompt's full blocks this stage computed (not those it reused), with the first's index."""
        first = out.num_cached_tokens // self.engine.config.block_size
        if not hashes[first:]:
            return None
        if out.finished:  # the engine left its blocks in its prefix cache
            blocks = self.engine.export_cached_payloads(hashes[first:], first)
        else:
            blocks = self.engine.export_block_payloads(out.request_id, first, len(hashes) - first)
        return (first, blocks) if blocks else None

    async def put(self, request_id: str, hashes: list[int], first: int, blocks: list[Payload]) -> None:
        """Off the critical path: the blocks `export` gave into the cache-store, in parts of whole layers."""
        stored = 0
        for i, data in enumerate(blocks):
            layer_bytes = self.engine.store.payload_layer_bytes(first + i == 0)
            stored += await self.cache.put_block(hashes[first + i], data, align_bytes=layer_bytes)
        index = split_layers(self.stage.num_layers, self.num_stages).index(self.stage)
        log.info("pipeline blocks stored", request_id=request_id, stage=index, layers=str(self.stage),
                 first_block=first, blocks=stored, of=len(blocks))

    async def group_prefix(self, request_id: str, prompt: list[int], hashes: list[int]) -> PrefixSource | None:
        """The first stage: a source of the longest prefix of the prompt whose blocks of every stage's layers the
        cache-store holds, when that is longer than this stage's own cache holds (None: start after its own)."""
        size = self.engine.config.block_size
        usable = (len(prompt) - 1) // size  # the last token is always computed
        local = await self.host.call(self.engine.block_manager.num_reusable_tokens, prompt)
        if usable * size <= local:
            return None
        num_blocks = usable
        for layers in split_layers(self.stage.num_layers, self.num_stages):
            stage_hashes = hashes if layers == self.stage else block_hashes(
                prompt, size, self.engine.block_namespace(layers))
            num_blocks = min(num_blocks, await self.cache.longest_prefix(stage_hashes[:num_blocks]))
            if num_blocks * size <= local:
                return None
        return self.loader.source(request_id, hashes[:num_blocks], size)

    async def missing_prefix(self, request_id: str, prompt: list[int], hashes: list[int], start: int
                             ) -> PrefixSource | None:
        """A later stage: a source of the `start` tokens the first stage reused, when this stage's own cache holds
        fewer of them and the cache-store holds them all (else None: the engine fails the request if it lacks
        them)."""
        if start == 0:
            return None
        local = await self.host.call(self.engine.block_manager.num_reusable_tokens, prompt)
        num_blocks = start // self.engine.config.block_size
        if local >= start or await self.cache.longest_prefix(hashes[:num_blocks]) < num_blocks:
            return None
        return self.loader.source(request_id, hashes[:num_blocks], self.engine.config.block_size)
