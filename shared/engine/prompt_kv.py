"""A prompt's KV in the engine's packed form (an engine with a KV codec: `PackedFormat`, one layer `PackedLayerKv`, a
whole prompt `PackedPromptKv`), and prompt KV computed elsewhere as it enters an engine: whether it is a whole prompt
in the form the engine's pool keeps (raw tensors or packed blocks), and packed KV written into a codec pool. How the
packed form travels is `shared.wire.kv_transfer.packed`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.engine.codec_pool import CodecKvPool
from shared.model.config import LlamaConfig


@dataclass(frozen=True)
class PackedFormat:
    """What the two engines must agree on: the codec (with its calibration), block size and byte sizes."""

    kv_format: str  # EngineConfig.kv_format
    block_size: int
    block_bytes: int  # one layer of one block
    sink_bytes: int  # added to a sequence's first block
    tail_dtype: torch.dtype

    def blocks_bytes(self, num_full_blocks: int, first_block: int = 0) -> int:
        """Bytes of `num_full_blocks` consecutive blocks starting at the sequence's block `first_block`."""
        sink = self.sink_bytes if first_block == 0 and num_full_blocks else 0
        return num_full_blocks * self.block_bytes + sink

    def tail_bytes(self, num_tokens: int, kv_heads: int, head_dim: int) -> int:
        return 2 * kv_heads * num_tokens * head_dim * self.tail_dtype.itemsize


@dataclass(frozen=True)
class PackedLayerKv:
    """One layer of a prompt: its full blocks' codec bytes back to back, and the partial last block's tokens."""

    blocks: bytes
    tail: torch.Tensor  # [2, kv_heads, num_tokens % block_size, head_dim]
    num_tokens: int


@dataclass(frozen=True)
class PackedPromptKv:
    """A whole prompt: `PackedLayerKv` of every layer, as decode receives it."""

    layers: list[bytes]
    tail: torch.Tensor  # [num_layers, 2, kv_heads, num_tokens % block_size, head_dim]
    num_tokens: int


def check_prompt_kv(
    kv: torch.Tensor | PackedPromptKv, num_tokens: int, cfg: LlamaConfig, fmt: PackedFormat | None
) -> None:
    """Raises ValueError unless `kv` is a whole prompt of `num_tokens` in the form an engine keeps (`fmt`: its
    packed format, None for raw tensors)."""
    if isinstance(kv, PackedPromptKv):
        if fmt is None:
            raise ValueError("packed prompt KV for an engine that keeps raw tensors")
        full = num_tokens // fmt.block_size
        tail = (cfg.num_layers, 2, cfg.num_kv_heads, num_tokens % fmt.block_size, cfg.head_dim)
        if kv.num_tokens != num_tokens or len(kv.layers) != cfg.num_layers or tuple(kv.tail.shape) != tail or any(
            len(layer) != fmt.blocks_bytes(full) for layer in kv.layers
        ):
            raise ValueError(f"packed prompt KV does not hold {num_tokens} tokens of {fmt.kv_format}")
        return
    if fmt is not None:
        raise ValueError(f"raw prompt KV for an engine that keeps {fmt.kv_format}")
    expected = (cfg.num_layers, 2, cfg.num_kv_heads, num_tokens, cfg.head_dim)
    if tuple(kv.shape) != expected:
        raise ValueError(f"prompt KV has shape {tuple(kv.shape)}, expected {expected}")


def write_packed(
    pool: CodecKvPool, request_id: str, block_ids: list[int], kv: PackedPromptKv, first_block: int
) -> None:
    """Packed prompt KV into the codec pool: its blocks from `first_block` on (earlier ones are reused), its tail."""
    size = pool.block_size
    for layer, data in enumerate(kv.layers):
        for block in range(first_block, kv.num_tokens // size):
            start = block * pool.block_bytes + (pool.sink_bytes if block else 0)
            end = start + pool.payload_layer_bytes(block == 0)
            pool.write_block_bytes(layer, block_ids[block], data[start:end], block == 0)
        if kv.num_tokens % size:
            pool.write_tail(request_id, layer, kv.tail[layer])
