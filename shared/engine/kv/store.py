"""The KV store: where a running request's KV lives, and the one interface the engine and the services reach it by.

A store pages KV in blocks of `block_size` tokens (its block manager hands out their ids) and knows, for its kind:
what it holds and what one block costs; the form a block takes as bytes (`BlockFormat`: the same bytes the wire and
the cache-store carry); reading a prompt layer by layer and writing a whole prompt computed elsewhere; the model's
attention context for a step; and what a finished request gives back. The kinds are `paged` (raw tensors), `codec`
(full blocks through a KV codec, the last partial block whole), `sized` (sizes only: the sim engine's) and `fastgen`
(a wrapper that moves profiled prompts into per-head lanes, over a store that supports it); `factory` builds the one
an `EngineConfig` asks for.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from shared.wire.payload import Payload

if TYPE_CHECKING:
    from shared.engine.batching import ScheduledChunk
    from shared.engine.blocks import BlockManager
    from shared.engine.kv.fastgen.kv import FastGenKv
    from shared.engine.kv.fastgen.lane_store import LaneStore
    from shared.model.llama import AttentionContext

LayerCallback = Callable[[int], None]  # called with a layer's index during the forward pass


@dataclass(frozen=True)
class BlockFormat:
    """A store's blocks as bytes, what two engines exchanging KV must agree on: one layer of one full block is
    `block_bytes` (a sequence's first block `sink_bytes` more), and a prompt's partial last block travels as tokens
    of `tail_dtype`; `has_values` is False for a store of sizes alone."""

    kv_format: str  # EngineConfig.kv_format: the dtype of raw tensors, or the codec with its calibration
    block_size: int
    block_bytes: int
    sink_bytes: int
    tail_dtype: torch.dtype
    has_values: bool = True

    def blocks_bytes(self, num_full_blocks: int, first_block: int = 0) -> int:
        """Bytes of `num_full_blocks` consecutive blocks starting at the sequence's block `first_block`."""
        sink = self.sink_bytes if first_block == 0 and num_full_blocks else 0
        return num_full_blocks * self.block_bytes + sink

    def tail_bytes(self, num_tokens: int, kv_heads: int, head_dim: int) -> int:
        return 2 * kv_heads * num_tokens * head_dim * self.tail_dtype.itemsize

    def check(self, kv: PromptKv, num_layers: int, kv_heads: int, head_dim: int) -> None:
        """Raises ValueError unless `kv` is a whole prompt of `kv.num_tokens` tokens in this format."""
        full, rest = divmod(kv.num_tokens, self.block_size)
        tail = (num_layers, 2, kv_heads, rest, head_dim)
        if len(kv.layers) != num_layers or tuple(kv.tail.shape) != tail or any(
            len(layer) != self.blocks_bytes(full) for layer in kv.layers
        ):
            raise ValueError(f"prompt KV does not hold {kv.num_tokens} tokens of {self.kv_format}")
        if self.has_values and not all(isinstance(layer, bytes) for layer in kv.layers):
            raise ValueError(f"prompt KV of sizes alone for a store of {self.kv_format} values")


@dataclass(frozen=True)
class PromptLayerKv:
    """One layer of a prompt: its full blocks' bytes back to back (a size for the sized store), and the tokens of
    its partial last block, [2, kv_heads, num_tokens % block_size, head_dim]."""

    blocks: Payload
    tail: torch.Tensor
    num_tokens: int


@dataclass(frozen=True)
class PromptKv:
    """A whole prompt, `PromptLayerKv` of every layer, as a decode engine receives it."""

    layers: list[Payload]
    tail: torch.Tensor  # [num_layers, 2, kv_heads, num_tokens % block_size, head_dim]
    num_tokens: int

    @staticmethod
    def of_layers(layers: list[PromptLayerKv]) -> PromptKv:
        """The prompt of its layers, in layer order."""
        return PromptKv([layer.blocks for layer in layers], torch.stack([layer.tail for layer in layers]),
                        layers[0].num_tokens)


class KvStore(Protocol):
    """What the engine, the prefix loader and the services need of a store (see the module doc)."""

    blocks: BlockManager  # hands out its block ids and keeps the prefix cache
    num_blocks: int
    block_size: int
    num_layers: int
    max_num_seqs: int  # the most sequences it can hold at once (a codec store: one tail each)

    @property
    def fastgen(self) -> FastGenKv | None:
        """The lanes of a FastGen store (None: every token's KV stays in blocks)."""
        ...

    @property
    def num_bytes(self) -> int:
        """Bytes it holds allocated, every block and tail."""
        ...

    @property
    def block_footprint(self) -> int:
        """What one block id costs, every layer."""
        ...

    @property
    def num_bytes_held(self) -> int:
        """Bytes in use now: the blocks handed out, and whatever else running sequences hold (a codec's tails)."""
        ...

    @property
    def block_format(self) -> BlockFormat: ...

    def payload_layer_bytes(self, starts_sequence: bool) -> int:
        """Bytes of one layer of one block in `block_payload`."""
        ...

    def block_payload(self, block_id: int, starts_sequence: bool) -> Payload:
        """Every layer of one full block, layer after layer (what the cache-store keeps)."""
        ...

    def write_payload_layers(self, block_id: int, first_layer: int, data: bytes | bytearray,
                             starts_sequence: bool) -> None:
        """Fill layers [first_layer, first_layer + n) of a block from whole layers of its `block_payload`."""
        ...

    def read_prompt_layer(self, seq_id: Hashable, block_ids: list[int], num_tokens: int, layer: int) -> PromptLayerKv:
        """One layer of a running sequence's first `num_tokens` (its prompt), in `block_format`."""
        ...

    def write_prompt(self, seq_id: Hashable, block_ids: list[int], kv: PromptKv, first_block: int) -> None:
        """A prompt computed elsewhere into the sequence's blocks, from its block `first_block` on (the earlier ones
        hold the same KV already, from the prefix cache).

        Raises:
            ValueError: KV that is not a whole prompt of `kv.num_tokens` in this store's format.
        """
        ...

    def attention(
        self, chunks: list[ScheduledChunk], block_tables: dict[str, list[int]],
        after_layer: LayerCallback | None = None, before_layer: LayerCallback | None = None,
    ) -> tuple[list[ScheduledChunk], AttentionContext]:
        """The step's chunks in the order their tokens go through the model, and its attention context: each layer
        stores the new K/V, calls `before_layer` (which may wait for loaded prefix KV), then `after_layer` (every
        K/V it attends over is in place), then attends."""
        ...

    def lane_store(self) -> LaneStore:
        """How FastGen's lanes lie in this store. Raises ValueError for a store that cannot hold them."""
        ...

    def release(self, seq_id: Hashable) -> None:
        """The sequence is finished, aborted or preempted: whatever it holds besides its blocks is free."""
        ...
