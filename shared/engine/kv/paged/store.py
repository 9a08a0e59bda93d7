"""The paged store: KV as raw tensors of the engine's dtype in one pool (`pool`), attended by the paged kernels
(`attention`). A block's bytes, on the wire and in the cache-store, are one layer's [2, kv_heads, block_size,
head_dim] in C order.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

import torch

from kernels.backend import KernelBackend
from kernels.paged_attention import prefill_takes_cpu_kernel
from shared.engine.kv.fastgen.lane_store import LaneStore, RawLaneStore
from shared.engine.kv.paged.attention import PagedAttention, step_metadata
from shared.engine.kv.paged.pool import KVPool
from shared.engine.kv.pooled import PooledStore
from shared.engine.kv.store import BlockFormat, LayerCallback, PromptKv, PromptLayerKv

if TYPE_CHECKING:
    from shared.engine.batching import ScheduledChunk
    from shared.engine.blocks import BlockManager
    from shared.engine.kv.fastgen.kv import FastGenKv


class PagedKvStore(PooledStore[KVPool]):
    """`KvStore` over a `KVPool`.

    Args:
        pool: the storage.
        blocks: the block manager of its `num_blocks`.
        kv_format: the engine's (`EngineConfig.kv_format`: the dtype's name).
        scale: the attention scale.
        backend: the kernels attention runs on.
        max_num_seqs: the engine's batch cap.
    """

    fastgen: FastGenKv | None = None

    def __init__(
        self, pool: KVPool, blocks: BlockManager, kv_format: str, scale: float, backend: KernelBackend,
        max_num_seqs: int,
    ) -> None:
        self.pool, self.blocks, self.scale, self.backend, self.max_num_seqs = pool, blocks, scale, backend, max_num_seqs
        self.num_blocks, self.block_size, self.num_layers = pool.num_blocks, pool.block_size, pool.tensor.shape[0]
        _, _, self.kv_heads, _, _, self.head_dim = pool.tensor.shape
        self.block_format = BlockFormat(kv_format, self.block_size, pool.payload_layer_bytes(False), 0,
                                        pool.tensor.dtype)

    def read_prompt_layer(self, seq_id: Hashable, block_ids: list[int], num_tokens: int, layer: int) -> PromptLayerKv:
        full, rest = divmod(num_tokens, self.block_size)
        kv = self.pool.tensor[layer]  # [2, kv_heads, num_blocks, block_size, head_dim]
        blocks = b""
        if full:
            index = torch.tensor(block_ids[:full], dtype=torch.long, device=kv.device)
            picked = kv.index_select(2, index).permute(2, 0, 1, 3, 4)  # [full, 2, kv_heads, block_size, head_dim]
            blocks = _tensor_bytes(picked.cpu())
        tail = kv[:, :, block_ids[full], :rest].clone() if rest else kv.new_zeros(2, self.kv_heads, 0, self.head_dim)
        return PromptLayerKv(blocks, tail, num_tokens)

    def write_prompt(self, seq_id: Hashable, block_ids: list[int], kv: PromptKv, first_block: int) -> None:
        self.block_format.check(kv, self.num_layers, self.kv_heads, self.head_dim)
        full, rest = divmod(kv.num_tokens, self.block_size)
        tensor, fmt = self.pool.tensor, self.block_format
        shape = (-1, 2, self.kv_heads, self.block_size, self.head_dim)
        index = torch.tensor(block_ids[first_block:full], dtype=torch.long, device=tensor.device)
        for layer, data in enumerate(kv.layers):
            assert isinstance(data, bytes)  # `check` refused sizes alone
            if full > first_block:
                raw = torch.frombuffer(bytearray(data[first_block * fmt.block_bytes :]), dtype=torch.uint8)
                blocks = raw.view(tensor.dtype).view(shape).permute(1, 2, 0, 3, 4)  # [2, kv_heads, n, bs, D]
                tensor[layer].index_copy_(2, index, blocks.to(tensor.device))
            if rest:
                tensor[layer, :, :, block_ids[full], :rest] = kv.tail[layer].to(tensor.device, tensor.dtype)

    def attention(
        self, chunks: list[ScheduledChunk], block_tables: dict[str, list[int]],
        after_layer: LayerCallback | None = None, before_layer: LayerCallback | None = None,
    ) -> tuple[list[ScheduledChunk], PagedAttention]:
        pool = self.pool.tensor
        prefill_kernel = prefill_takes_cpu_kernel(self.backend, pool.dtype, pool.shape[-1])
        meta = step_metadata(chunks, block_tables, self.block_size, self.backend, pool.device, prefill_kernel)
        return chunks, PagedAttention(self.pool, meta, self.scale, self.backend, after_layer, before_layer)

    def lane_store(self) -> LaneStore:
        return RawLaneStore(self.pool.tensor)

    def release(self, seq_id: Hashable) -> None:
        pass  # nothing held besides blocks


def _tensor_bytes(t: torch.Tensor) -> bytes:
    # numpy does the strided copy: single-threaded, so it never waits on a busy intra-op thread pool
    ints = {4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()]  # numpy has no bf16
    return t.view(ints).numpy().tobytes()


# ---- a raw prompt's KV as tensors (for tools and tests that make or check it) ------------------------------------


def prompt_layer_of(kv: torch.Tensor, block_size: int) -> PromptLayerKv:
    """One layer of a prompt, [2, kv_heads, num_tokens, head_dim], in the paged store's block form."""
    _, kv_heads, num_tokens, head_dim = kv.shape
    full = num_tokens // block_size
    blocks = kv[:, :, : full * block_size].reshape(2, kv_heads, full, block_size, head_dim).permute(2, 0, 1, 3, 4)
    tail = kv[:, :, full * block_size :].clone(memory_format=torch.contiguous_format)
    return PromptLayerKv(_tensor_bytes(blocks.cpu()), tail, num_tokens)


def tensor_of(prompt: PromptKv, fmt: BlockFormat, kv_heads: int, head_dim: int) -> torch.Tensor:
    """A prompt in the paged store's block form as [num_layers, 2, kv_heads, num_tokens, head_dim] of its dtype."""
    full = prompt.num_tokens // fmt.block_size
    layers = []
    for data, tail in zip(prompt.layers, prompt.tail, strict=True):
        assert isinstance(data, bytes), "a prompt of sizes alone has no values"
        if not full:  # a prompt shorter than a block: its tail alone
            layers.append(tail)
            continue
        blocks = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(fmt.tail_dtype)
        blocks = blocks.view(full, 2, kv_heads, fmt.block_size, head_dim).permute(1, 2, 0, 3, 4)
        layers.append(torch.cat([blocks.reshape(2, kv_heads, full * fmt.block_size, head_dim), tail], dim=2))
    return torch.stack(layers)
