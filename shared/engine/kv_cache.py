"""The paged KV pool (one tensor for every layer's K and V) and the per-step attention context over it.

Owns the pool tensors and the step metadata (slots, block tables); block bookkeeping is `shared.engine.blocks`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels.backend import KernelBackend
from kernels.paged_attention import (
    paged_decode_attention,
    paged_prefill_attention,
    paged_prefill_attention_padded_ref,
    store_kv,
)
from shared.model.config import LlamaConfig
from shared.wire.payload import Payload, SizeOnly


class KVPool:
    """K and V of every layer: [num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim].

    Also keeps the decode gather workspace, sized on demand and reused by every layer and step.
    """

    def __init__(
        self, config: LlamaConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        shape = (config.num_layers, 2, config.num_kv_heads, num_blocks, block_size, config.head_dim)
        self.tensor = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._block_elements = config.num_kv_heads * block_size * config.head_dim
        self._workspace = torch.empty(0, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_block(config: LlamaConfig, block_size: int, dtype: torch.dtype) -> int:
        element_size = torch.empty((), dtype=dtype).element_size()
        return config.kv_elements_per_token * block_size * element_size

    @property
    def num_bytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    @property
    def block_footprint(self) -> int:
        """What one block id costs, every layer, K and V."""
        return self.num_bytes // self.num_blocks

    # --- blocks as payloads: what the cache-store keeps (layer-major, so loads can use each layer as it arrives) ---

    def payload_layer_bytes(self, starts_sequence: bool) -> int:
        """Bytes of one layer of one block in `block_payload` (the same for every block of a raw pool)."""
        return self.block_footprint // self.tensor.shape[0]

    def block_payload(self, block_id: int, starts_sequence: bool) -> Payload:
        """Every layer of one block: [num_layers, 2, kv_heads, block_size, head_dim] raw, C order; the sim engine's
        meta pool gives the size alone."""
        if self.tensor.is_meta:
            return SizeOnly(self.block_footprint)
        return self.read_blocks([block_id]).contiguous().view(torch.uint8).numpy().tobytes()

    def write_payload_layers(self, block_id: int, first_layer: int, data: bytes | bytearray,
                             starts_sequence: bool) -> None:
        """Fill layers [first_layer, first_layer + n) of a block from whole layers of its `block_payload`."""
        _, _, kv_heads, _, block_size, head_dim = self.tensor.shape
        kv = torch.frombuffer(data, dtype=torch.uint8).view(self.tensor.dtype)
        self.write_block_layers(block_id, first_layer, kv.view(-1, 2, kv_heads, block_size, head_dim))

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tensor[layer_idx, 0], self.tensor[layer_idx, 1]

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of whole blocks, every layer: [num_layers, 2, kv_heads, len(block_ids), block_size, head_dim]."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.tensor.device)
        return self.tensor.index_select(3, index)

    def write_blocks(self, block_ids: list[int], kv: torch.Tensor) -> None:
        """Fill whole blocks, every layer; `kv` as `read_blocks` returns it (any device, cast to the pool dtype)."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.tensor.device)
        self.tensor.index_copy_(3, index, kv.to(self.tensor.device, self.tensor.dtype))

    def write_block_layers(self, block_id: int, first_layer: int, kv: torch.Tensor) -> None:
        """Fill layers [first_layer, first_layer + n) of one block; `kv`: [n, 2, kv_heads, block_size, head_dim]."""
        layers = slice(first_layer, first_layer + kv.shape[0])
        self.tensor[layers, :, :, block_id] = kv.to(self.tensor.device, self.tensor.dtype)

    def read_tokens(self, layer_idx: int, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        """A copy of one layer's K and V for a sequence's first `num_tokens`: [2, kv_heads, num_tokens, head_dim]."""
        num_blocks = -(-num_tokens // self.block_size)
        index = torch.tensor(block_ids[:num_blocks], dtype=torch.long, device=self.tensor.device)
        kv = self.tensor[layer_idx].index_select(2, index)  # [2, kv_heads, num_blocks, block_size, head_dim]
        return kv.flatten(2, 3)[:, :, :num_tokens].contiguous()

    def write_tokens(self, block_ids: list[int], kv: torch.Tensor, first_block: int = 0) -> None:
        """Write a sequence's KV of every layer, `kv`: [num_layers, 2, kv_heads, num_tokens, head_dim], into its
        blocks, skipping the first `first_block` blocks (already holding the same KV, e.g. from the prefix cache)."""
        num_layers, _, num_kv_heads, num_tokens, head_dim = kv.shape
        num_blocks = -(-num_tokens // self.block_size)
        if first_block >= num_blocks:
            return
        padded = kv.new_zeros(num_layers, 2, num_kv_heads, num_blocks * self.block_size, head_dim)
        padded[:, :, :, :num_tokens] = kv
        blocks = padded.unflatten(3, (num_blocks, self.block_size))[:, :, :, first_block:]
        self.write_blocks(block_ids[first_block:num_blocks], blocks)

    def gather_workspace(self, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Two flat buffers that hold `num_blocks` gathered blocks of K and of V (grown, never shrunk)."""
        needed = num_blocks * self._block_elements
        if self._workspace.numel() < 2 * needed:
            self._workspace = torch.empty(2 * needed, dtype=self.tensor.dtype, device=self.tensor.device)
        half = self._workspace.numel() // 2
        return self._workspace[:half], self._workspace[half:]


@dataclass(frozen=True)
class PrefillSegment:
    """A run of >1 new tokens of one sequence inside the step's flat token list."""

    start: int  # first row in the step's token list
    num_tokens: int
    context_len: int  # tokens visible after this chunk (cached + earlier chunks + this one)
    block_table: torch.Tensor  # [num_blocks_of_seq]


@dataclass(frozen=True)
class PaddedPrefill:
    """Every prefill segment of the step attended in one padded call (chosen when lengths are alike)."""

    block_tables: torch.Tensor  # [num_segments, max_blocks]
    num_new: list[int]
    context_lens: list[int]

    @staticmethod
    def is_worth_it(segments: list[PrefillSegment], block_size: int) -> bool:
        """True when padding to the longest segment wastes at most a quarter of the attention work."""
        if len(segments) < 2:
            return False
        max_keys = max(-(-s.context_len // block_size) for s in segments) * block_size
        padded = len(segments) * max(s.num_tokens for s in segments) * max_keys
        return padded <= 1.25 * sum(s.num_tokens * s.context_len for s in segments)


@dataclass(frozen=True)
class StepMetadata:
    """Where each token's K/V goes and what each query may see; shared by all layers of one step."""

    slot_mapping: torch.Tensor  # [num_tokens] flat pool slot of each token
    num_decode_tokens: int  # rows [0, num_decode_tokens) are single-token sequences
    decode_block_tables: torch.Tensor  # [num_decode_tokens, max_blocks]
    decode_context_lens: torch.Tensor  # [num_decode_tokens]
    prefill_segments: list[PrefillSegment]
    padded_prefill: PaddedPrefill | None = None


LayerCallback = Callable[[int], None]


class PagedAttention:
    """The model's `AttentionContext` for one step: store this step's K/V, then attend over the pool.

    Per layer: store the step's K/V, `before_layer(layer_idx)` (may block until K/V loaded from outside is in the
    pool), `after_layer(layer_idx)` (every K/V this layer attends over is in place), then attend.
    """

    def __init__(
        self, pool: KVPool, meta: StepMetadata, scale: float, backend: KernelBackend,
        after_layer: LayerCallback | None = None, before_layer: LayerCallback | None = None,
    ) -> None:
        self.pool, self.meta, self.scale, self.backend = pool, meta, scale, backend
        self.after_layer, self.before_layer = after_layer, before_layer
        # Only the reference path gathers; Triton reads the pool in place.
        is_reference = backend is KernelBackend.TORCH
        self.workspace = pool.gather_workspace(meta.decode_block_tables.numel()) if is_reference else None

    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pre_rope: torch.Tensor
    ) -> torch.Tensor:
        meta, backend = self.meta, self.backend
        k_cache, v_cache = self.pool.layer(layer_idx)
        store_kv(k_cache, v_cache, k, v, meta.slot_mapping, backend)
        if self.before_layer is not None:
            self.before_layer(layer_idx)
        if self.after_layer is not None:
            self.after_layer(layer_idx)
        num_decode = meta.num_decode_tokens
        if not meta.prefill_segments:
            return self._decode(q, k_cache, v_cache)
        out = torch.empty_like(q)
        if num_decode:
            out[:num_decode] = self._decode(q[:num_decode], k_cache, v_cache)
        if meta.padded_prefill is not None:
            batch = meta.padded_prefill
            out[num_decode:] = paged_prefill_attention_padded_ref(
                q[num_decode:], k_cache, v_cache, batch.block_tables, batch.num_new, batch.context_lens, self.scale
            )
            return out
        for seg in meta.prefill_segments:
            rows = slice(seg.start, seg.start + seg.num_tokens)
            out[rows] = paged_prefill_attention(
                q[rows], k_cache, v_cache, seg.block_table, seg.context_len, self.scale, backend
            )
        return out

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        meta = self.meta
        return paged_decode_attention(
            q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, self.scale, self.backend,
            self.workspace,
        )
