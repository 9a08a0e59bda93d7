"""The sized store: the sim engine's KV, which has sizes and no values. Its blocks are as big as raw tensors of the
simulated model would be, travel and are kept by the cache-store as size-only payloads (`shared.wire.payload`), and
no step attends over them (the sim runner sleeps instead of running a model).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

import torch

from shared.engine.kv.store import BlockFormat, LayerCallback, PromptKv, PromptLayerKv
from shared.kvcompress.registry import codec_block_bytes
from shared.model.config import LlamaConfig
from shared.wire.payload import SizeOnly

if TYPE_CHECKING:
    from shared.engine.batching import ScheduledChunk
    from shared.engine.blocks import BlockManager
    from shared.engine.kv.fastgen.kv import FastGenKv
    from shared.engine.kv.fastgen.lane_store import LaneStore
    from shared.model.llama import AttentionContext


class SizedKvStore:
    """`KvStore` of sizes: the blocks `blocks` pages, each as big as raw `dtype` tensors of `model`'s shape.

    Args:
        kv_format: the engine's (`EngineConfig.kv_format`).
        max_num_seqs: the engine's batch cap.
        sized_codec: "none", or a codec (`shared.kvcompress`) whose bytes a full block has instead of raw tensors'
            (in the cache-store and on every wire; the GPU's capacity stays the dtype's).
    """

    fastgen: FastGenKv | None = None

    def __init__(
        self, model: LlamaConfig, blocks: BlockManager, kv_format: str, max_num_seqs: int,
        dtype: torch.dtype = torch.bfloat16, sized_codec: str = "none",
    ) -> None:
        self.blocks, self.num_blocks, self.block_size = blocks, blocks.num_blocks, blocks.block_size
        block_size, self.num_layers = blocks.block_size, model.num_layers
        self.kv_heads, self.head_dim, self.dtype, self.max_num_seqs = model.num_kv_heads, model.head_dim, dtype, \
            max_num_seqs
        layer_bytes = (2 * model.num_kv_heads * block_size * model.head_dim * dtype.itemsize if sized_codec == "none"
                       else codec_block_bytes(sized_codec, model.num_kv_heads, block_size, model.head_dim))
        self.block_format = BlockFormat(kv_format, block_size, layer_bytes, 0, dtype, has_values=False)

    @property
    def block_footprint(self) -> int:
        return self.num_layers * self.block_format.block_bytes

    @property
    def num_bytes_held(self) -> int:
        return (self.blocks.num_blocks - self.blocks.num_free_blocks) * self.block_footprint

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.block_footprint

    def payload_layer_bytes(self, starts_sequence: bool) -> int:
        return self.block_format.block_bytes

    def block_payload(self, block_id: int, starts_sequence: bool) -> SizeOnly:
        return SizeOnly(self.block_footprint)

    def write_payload_layers(self, block_id: int, first_layer: int, data: bytes | bytearray,
                             starts_sequence: bool) -> None:
        pass  # no values to keep

    def read_prompt_layer(self, seq_id: Hashable, block_ids: list[int], num_tokens: int, layer: int) -> PromptLayerKv:
        full, rest = divmod(num_tokens, self.block_size)
        tail = torch.empty(2, self.kv_heads, rest, self.head_dim, dtype=self.dtype, device="meta")
        return PromptLayerKv(SizeOnly(self.block_format.blocks_bytes(full)), tail, num_tokens)

    def write_prompt(self, seq_id: Hashable, block_ids: list[int], kv: PromptKv, first_block: int) -> None:
        self.block_format.check(kv, self.num_layers, self.kv_heads, self.head_dim)

    def attention(
        self, chunks: list[ScheduledChunk], block_tables: dict[str, list[int]],
        after_layer: LayerCallback | None = None, before_layer: LayerCallback | None = None,
    ) -> tuple[list[ScheduledChunk], AttentionContext]:
        raise RuntimeError("the sized store holds no values to attend over (the sim runner runs no model)")

    def lane_store(self) -> LaneStore:
        raise ValueError("FastGen profiles real attention; the sim engine's KV has sizes only")

    def release(self, seq_id: Hashable) -> None:
        pass
