"""The FastGen store: a wrapper over any store whose blocks can hold lanes (`KvStore.lane_store`). Sequences FastGen
has moved into lanes decode over them (their rows first in every step); every other sequence, and every prompt until
it is profiled, is the inner store's.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

from shared.engine.kv.fastgen.attention import FastGenAttention, split_chunks
from shared.engine.kv.fastgen.kv import FastGenKv
from shared.engine.kv.fastgen.lane_store import LaneStore
from shared.engine.kv.store import BlockFormat, KvStore, LayerCallback, PromptKv, PromptLayerKv
from shared.wire.payload import Payload

if TYPE_CHECKING:
    from shared.engine.batching import ScheduledChunk


class FastGenKvStore:
    """`KvStore` with FastGen's lanes (`fastgen`) cut from the blocks of `inner`."""

    def __init__(self, inner: KvStore, fastgen: FastGenKv) -> None:
        self.inner, self.fastgen = inner, fastgen
        self.blocks, self.num_blocks, self.block_size = inner.blocks, inner.num_blocks, inner.block_size
        self.num_layers, self.max_num_seqs = inner.num_layers, inner.max_num_seqs

    @property
    def num_bytes(self) -> int:
        return self.inner.num_bytes

    @property
    def block_footprint(self) -> int:
        return self.inner.block_footprint

    @property
    def num_bytes_held(self) -> int:
        return self.inner.num_bytes_held

    @property
    def block_format(self) -> BlockFormat:
        return self.inner.block_format

    def payload_layer_bytes(self, starts_sequence: bool) -> int:
        return self.inner.payload_layer_bytes(starts_sequence)

    def block_payload(self, block_id: int, starts_sequence: bool) -> Payload:
        return self.inner.block_payload(block_id, starts_sequence)

    def write_payload_layers(self, block_id: int, first_layer: int, data: bytes | bytearray,
                             starts_sequence: bool) -> None:
        self.inner.write_payload_layers(block_id, first_layer, data, starts_sequence)

    def read_prompt_layer(self, seq_id: Hashable, block_ids: list[int], num_tokens: int, layer: int) -> PromptLayerKv:
        return self.inner.read_prompt_layer(seq_id, block_ids, num_tokens, layer)

    def write_prompt(self, seq_id: Hashable, block_ids: list[int], kv: PromptKv, first_block: int) -> None:
        self.inner.write_prompt(seq_id, block_ids, kv, first_block)

    def attention(
        self, chunks: list[ScheduledChunk], block_tables: dict[str, list[int]],
        after_layer: LayerCallback | None = None, before_layer: LayerCallback | None = None,
    ) -> tuple[list[ScheduledChunk], FastGenAttention]:
        lane_chunks, paged_chunks = split_chunks(chunks, self.fastgen)
        paged_chunks, paged = self.inner.attention(paged_chunks, block_tables, after_layer, before_layer)
        return lane_chunks + paged_chunks, FastGenAttention(paged, self.fastgen, lane_chunks, paged_chunks,
                                                            block_tables)

    def lane_store(self) -> LaneStore:
        return self.fastgen.store

    def release(self, seq_id: Hashable) -> None:
        self.fastgen.release(str(seq_id))
        self.inner.release(seq_id)
