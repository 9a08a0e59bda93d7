"""The codec store: full blocks as a KV codec's bytes, each running sequence's partial last block whole in a tail
(`pool`), attended by dequantizing (`attention`) or, for kvquant on the Triton backend, by the fused kernels
(`fused_decode`). A block's bytes, on the wire and in the cache-store, are the codec's own, a sequence's first block
with its sink.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

from kernels.backend import KernelBackend
from shared.engine.kv.codec.attention import CodecAttention, CodecStepLayout
from shared.engine.kv.codec.fused_decode import FusedDecode
from shared.engine.kv.codec.pool import CodecKvPool
from shared.engine.kv.fastgen.lane_store import CodedLaneStore, LaneStore
from shared.engine.kv.pooled import PooledStore
from shared.engine.kv.store import BlockFormat, LayerCallback, PromptKv, PromptLayerKv
from shared.model.llama import RotaryEmbedding

if TYPE_CHECKING:
    from shared.engine.batching import ScheduledChunk
    from shared.engine.blocks import BlockManager
    from shared.engine.kv.fastgen.kv import FastGenKv


class CodecKvStore(PooledStore[CodecKvPool]):
    """`KvStore` over a `CodecKvPool`.

    Args:
        pool: the storage; its tails bound the sequences held at once (`max_num_seqs`).
        blocks: the block manager of its `num_blocks`.
        kv_format: the engine's (`EngineConfig.kv_format`: the codec and its calibration's digest).
        rotary: the model's RoPE tables (keys a codec keeps before RoPE are rotated after decoding).
        scale: the attention scale.
        backend: on Triton, a kvquant pool packs and decodes through the fused kernels.
    """

    fastgen: FastGenKv | None = None

    def __init__(
        self, pool: CodecKvPool, blocks: BlockManager, kv_format: str, rotary: RotaryEmbedding, scale: float,
        backend: KernelBackend,
    ) -> None:
        self.pool, self.blocks, self.rotary, self.scale, self.backend = pool, blocks, rotary, scale, backend
        self.num_blocks, self.block_size, self.num_layers = pool.num_blocks, pool.block_size, pool.packed.shape[0]
        self.max_num_seqs = pool.num_tails
        is_fused = backend is KernelBackend.TRITON and FusedDecode.supports(pool)
        self.fused_decode = FusedDecode(pool, rotary) if is_fused else None
        self.block_format = BlockFormat(kv_format, pool.block_size, pool.block_bytes, pool.sink_bytes, pool.dtype)

    @property
    def num_bytes_held(self) -> int:
        tails = self.pool.num_tails_held * self.pool.tails[:, :, 0].numel() * self.pool.tails.element_size()
        return super().num_bytes_held + tails

    def read_prompt_layer(self, seq_id: Hashable, block_ids: list[int], num_tokens: int, layer: int) -> PromptLayerKv:
        pool = self.pool
        num_full = num_tokens // pool.block_size
        blocks = b"".join(pool.read_block_bytes(layer, block_ids[i], i == 0) for i in range(num_full))
        return PromptLayerKv(blocks, pool.read_tail(seq_id, layer, num_tokens % pool.block_size), num_tokens)

    def write_prompt(self, seq_id: Hashable, block_ids: list[int], kv: PromptKv, first_block: int) -> None:
        pool = self.pool
        self.block_format.check(kv, self.num_layers, pool.kv_heads, pool.head_dim)
        size = pool.block_size
        for layer, data in enumerate(kv.layers):
            assert isinstance(data, bytes)  # `check` refused sizes alone
            for block in range(first_block, kv.num_tokens // size):
                start = block * pool.block_bytes + (pool.sink_bytes if block else 0)
                end = start + pool.payload_layer_bytes(block == 0)
                pool.write_block_bytes(layer, block_ids[block], data[start:end], block == 0)
            if kv.num_tokens % size:
                pool.write_tail(seq_id, layer, kv.tail[layer])

    def attention(
        self, chunks: list[ScheduledChunk], block_tables: dict[str, list[int]],
        after_layer: LayerCallback | None = None, before_layer: LayerCallback | None = None,
    ) -> tuple[list[ScheduledChunk], CodecAttention]:
        layout = CodecStepLayout.build(chunks, block_tables, self.pool, self.pool.tails.device)
        return chunks, CodecAttention(self.pool, layout, self.scale, self.rotary, after_layer, before_layer,
                                      self.fused_decode, self.backend)

    def lane_store(self) -> LaneStore:
        return CodedLaneStore(self.pool, self.rotary)

    def release(self, seq_id: Hashable) -> None:
        self.pool.release(seq_id)
