"""What a store over a pool of block bytes answers from the pool alone: its size, a block's cost and the block
payloads the cache-store keeps. The paged and codec stores build on it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

if TYPE_CHECKING:
    from shared.engine.blocks import BlockManager


class BlockPool(Protocol):
    """A pool's storage as a store reads it (`KVPool`, `CodecKvPool`)."""

    @property
    def num_bytes(self) -> int: ...

    @property
    def block_footprint(self) -> int: ...

    def payload_layer_bytes(self, starts_sequence: bool) -> int: ...

    def block_payload(self, block_id: int, starts_sequence: bool) -> bytes: ...

    def write_payload_layers(self, block_id: int, first_layer: int, data: bytes | bytearray,
                             starts_sequence: bool) -> None: ...


P = TypeVar("P", bound=BlockPool)


class PooledStore(Generic[P]):
    """The `KvStore` members a pool answers; `pool` and `blocks` are the subclass's."""

    pool: P
    blocks: BlockManager

    @property
    def num_bytes(self) -> int:
        return self.pool.num_bytes

    @property
    def block_footprint(self) -> int:
        return self.pool.block_footprint

    @property
    def num_bytes_held(self) -> int:
        """The blocks handed out (a store whose sequences hold more adds it)."""
        return (self.blocks.num_blocks - self.blocks.num_free_blocks) * self.block_footprint

    def payload_layer_bytes(self, starts_sequence: bool) -> int:
        return self.pool.payload_layer_bytes(starts_sequence)

    def block_payload(self, block_id: int, starts_sequence: bool) -> bytes:
        return self.pool.block_payload(block_id, starts_sequence)

    def write_payload_layers(self, block_id: int, first_layer: int, data: bytes | bytearray,
                             starts_sequence: bool) -> None:
        self.pool.write_payload_layers(block_id, first_layer, data, starts_sequence)
