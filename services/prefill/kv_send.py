"""A computed prompt's KV into its hand-off to decode, layer by layer: the engine's per-layer hook copies a layer on
the engine thread, an encoder thread cuts it into `KvChunk`s, and the event loop publishes them, while the next layer
computes. One per engine: the prefill service's, and its pipeline stage's (which encodes its hidden states here too).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from services.common.engine_host import EngineHost
from services.common.tasks import BackgroundTasks
from shared.config import EngineSettings
from shared.engine.kv.store import BlockFormat, PromptLayerKv
from shared.wire.bus import Bus
from shared.wire.handoff.prompt import chunk_prompt_layer
from shared.wire.protocol import PrefillTask

T = TypeVar("T")


class LayerSender:
    """Sends prompt layers of one engine's requests, counting the bytes.

    Args:
        settings: the prefill service's (chunk size, compression).
        bus: the NATS connection.
        host: the engine's host (its event loop).
        tasks: where the sends run.
    Attributes:
        part_bytes: the most payload bytes a chunk (or another part) carries: TSUKIMI_KV_CHUNK_KB, at most half of
            what the NATS server takes in a message.
        num_bytes: KV bytes sent so far, as coded on the wire.
    """

    def __init__(self, settings: EngineSettings, bus: Bus, host: EngineHost[Any], tasks: BackgroundTasks) -> None:
        self.bus, self.host, self.tasks, self.compress = bus, host, tasks, settings.kv_compress
        self.part_bytes = min(settings.kv_chunk_bytes, bus.max_payload // 2)
        self.num_bytes = 0
        self._encoder = ThreadPoolExecutor(1, thread_name_prefix="kv-encode")

    async def encode(self, fn: Callable[[], T]) -> T:
        """Run `fn` (cutting bytes into parts) on the encoder thread, off the event loop."""
        return await self.host.loop.run_in_executor(self._encoder, fn)

    def send(self, task: PrefillTask, layer: int, kv: PromptLayerKv, block_format: BlockFormat, num_chunks: int,
             num_layers: int) -> asyncio.Future[None]:
        """Engine thread: send `layer` (the model's numbering) of `task`'s prompt as the chunks of its hand-off stream
        of `num_chunks` (as many each layer) that belong to that layer. The future settles once they are published,
        with the exception that stopped them, or cancelled when the service stops."""
        done = self.host.loop.create_future()
        self.host.loop.call_soon_threadsafe(self._spawn, task, layer, kv, block_format, num_chunks, num_layers, done)
        return done

    def _spawn(self, task: PrefillTask, layer: int, kv: PromptLayerKv, block_format: BlockFormat, num_chunks: int,
               num_layers: int, done: asyncio.Future[None]) -> None:
        async def send() -> None:
            first = layer * (num_chunks // num_layers)
            chunks = await self.encode(functools.partial(
                chunk_prompt_layer, task.request_id, layer, kv.blocks, kv.tail, kv.num_tokens, block_format, first,
                num_chunks, self.part_bytes, compress_payload=self.compress,
            ))
            self.num_bytes += sum(len(chunk.data) for chunk in chunks)
            for chunk in chunks:
                await self.bus.publish(self.bus.subjects.decode_handoff(task.decode_id), chunk)

        self.tasks.spawn(send(), f"send-kv-{task.request_id}-{layer}").add_done_callback(
            functools.partial(_settle, done))

    def close(self) -> None:
        self._encoder.shutdown(wait=True)


def _settle(done: asyncio.Future[None], task: asyncio.Future[None]) -> None:
    """Pass a send task's end on to the future its request waits on."""
    if done.done():
        return
    if task.cancelled():  # the service is stopping
        done.cancel()
    elif (error := task.exception()) is not None:
        done.set_exception(error)
    else:
        done.set_result(None)
