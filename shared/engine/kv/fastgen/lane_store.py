"""Where FastGen's lane entries lie in the engine's pool, and in what form: raw K/V rows of a tensor pool, or kvquant
records (`lane_codec`) in the bytes of a codec pool.

A lane slot is a run of `slot_entries` entries; a pool block is cut into `slots_per_block` of them (`lanes.LaneSlots`
hands them out). An entry's address is its slot's base plus its index in the slot times `entry_stride`. `sparse_kv`
keeps which entry is where and reads, writes and moves entries through a store; it never sees the layout.

- `RawLaneStore`: the tensor pool [layers, 2, kv_heads, blocks, block_size, head_dim] cut per (layer, KV head) into
  slots of block_size entries; an address is the K row in the pool viewed as rows of head_dim (V is a fixed offset
  further). Keys are stored after RoPE, as the pool holds them.
- `CodedLaneStore`: each layer's byte row of a block of a `CodecKvPool` holding kvquant blocks is cut into slots of
  entry records (about block_size / 2 entries each; SmolLM2 at 4 bits and block_size 64: 6 slots of 30 records of 74
  bytes in a 13,420-byte row, 99% of it used; the blocks' sink rows stay unused). An address is a byte offset into
  the pool's bytes. Keys are stored before RoPE and rotated after decoding. As the codec pool keeps a sequence's
  partial last block whole, the lanes keep its newest `window` (= block_size) positions whole: a ring in the
  sequence's full-precision tail of the pool, at index position % block_size, which every step overwrites with its
  own token; an entry that recent reads the ring instead of its record (most of the lane codec's loss is in the
  newest tokens: README, FastGen).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Protocol

import torch

from kernels.layer_ops import apply_rotary_ref
from shared.engine.kv.codec.pool import CodecKvPool
from shared.fastgen.lane_codec import LaneCodec
from shared.kvcompress.kvquant import KvQuantCodec
from shared.model.llama import RotaryEmbedding


class LaneStore(Protocol):
    """How a pool holds lane entries."""

    slot_entries: int  # entries a slot holds
    slots_per_block: int
    entry_stride: int  # address step from one entry of a slot to the next
    entry_bytes: int  # pool bytes one entry takes, K and V
    keys_before_rope: bool  # `write` and `read_prompt` take keys before RoPE
    lossy: bool  # entries come back changed (the caller keeps the attention sink whole beside them)
    dtype: torch.dtype  # what `read` returns
    device: torch.device
    head_dim: int
    window: int  # the newest positions `read` takes from a sequence's ring (0: no ring)

    def slot_base(self, slot: int) -> int:
        """The address of a slot's first entry."""
        ...

    def write(self, layer: int, heads: torch.Tensor, addresses: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store E entries of one layer: heads, addresses long [E]; k (as `keys_before_rope` says), v: [E, D]."""
        ...

    def read(
        self, layer: int, heads: torch.Tensor, addresses: torch.Tensor, positions: torch.Tensor,
        recent: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K (after RoPE, at `positions`) and V, [E, D] each, of E entries of one layer; `recent` = (each entry's
        ring, long [E]; bool [E], which entries read it instead of the record)."""
        ...

    def move(self, sources: torch.Tensor, targets: torch.Tensor) -> None:
        """Copy entries (K and V) from addresses `sources` to `targets`, long [M] each."""
        ...

    def read_prompt(self, layer: int, seq_id: Hashable, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        """A prompt's K and V in the paged pool, [2, kv_heads, num_tokens, head_dim], keys as `write` takes them."""
        ...

    def prompt_keys(self, layer: int, seq_id: Hashable, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        """A prompt's keys after RoPE, [kv_heads, num_tokens, head_dim] (what profiling reads)."""
        ...

    def open_ring(self, seq_id: Hashable) -> int | None:
        """The ring of a sequence moving to lanes (its tail in the paged pool, kept), or None without rings."""
        ...

    def write_ring(
        self, layer: int, rings: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Put N tokens whole in their rings: rings, positions long [N]; k (as `write` takes them), v: [N, kv_heads,
        D]."""
        ...


class RawLaneStore:
    """Lane entries as K/V rows of a tensor pool (see the module docstring).

    Args:
        pool: [num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim].
    """

    keys_before_rope = False
    lossy = False
    window = 0

    def __init__(self, pool: torch.Tensor) -> None:
        self.pool = pool
        num_layers, _, self.num_kv_heads, self.num_blocks, self.slot_entries, head_dim = pool.shape
        self.slots_per_block = num_layers * self.num_kv_heads
        self.entry_stride = 1
        self.entry_bytes = 2 * head_dim * pool.element_size()
        self.dtype, self.device, self.head_dim = pool.dtype, pool.device, head_dim
        self.rows = pool.view(-1, head_dim)
        self.v_offset = self.num_kv_heads * self.num_blocks * self.slot_entries  # V's rows follow K's by this many

    def slot_base(self, slot: int) -> int:
        block, lane = divmod(slot, self.slots_per_block)
        layer, head = divmod(lane, self.num_kv_heads)
        return ((layer * 2 * self.num_kv_heads + head) * self.num_blocks + block) * self.slot_entries

    def write(self, layer: int, heads: torch.Tensor, addresses: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.rows[addresses] = k.to(self.rows.dtype)
        self.rows[addresses + self.v_offset] = v.to(self.rows.dtype)

    def read(
        self, layer: int, heads: torch.Tensor, addresses: torch.Tensor, positions: torch.Tensor,
        recent: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rows.index_select(0, addresses), self.rows.index_select(0, addresses + self.v_offset)

    def move(self, sources: torch.Tensor, targets: torch.Tensor) -> None:
        for offset in (0, self.v_offset):
            self.rows[targets + offset] = self.rows[sources + offset]

    def read_prompt(self, layer: int, seq_id: Hashable, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        index = torch.tensor(block_ids, dtype=torch.long, device=self.pool.device)
        return self.pool[layer].index_select(2, index).flatten(2, 3)[:, :, :num_tokens]

    def prompt_keys(self, layer: int, seq_id: Hashable, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        return self.read_prompt(layer, seq_id, block_ids, num_tokens)[0]

    def open_ring(self, seq_id: Hashable) -> int | None:
        return None

    def write_ring(
        self, layer: int, rings: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        pass


class CodedLaneStore:
    """Lane entries as kvquant records in a codec pool's bytes (see the module docstring).

    Args:
        pool: a codec pool whose codecs are kvquant ones (`LaneCodec` is built from them).
        rotary: the model's RoPE tables.
    Raises:
        ValueError: a pool of another codec, or rows too small for one record.
    """

    keys_before_rope = True
    lossy = True

    def __init__(self, pool: CodecKvPool, rotary: RotaryEmbedding) -> None:
        self.pool, self.rotary, self.dtype, self.device = pool, rotary, pool.dtype, pool.packed.device
        self.head_dim = pool.head_dim
        codecs = [codec for codec in pool.codecs if isinstance(codec, KvQuantCodec)]
        if len(codecs) != len(pool.codecs):
            raise ValueError(f"FastGen's lanes hold kvquant records; this pool's codec is {pool.codecs[0].name}")
        self.codec = LaneCodec(codecs).to(pool.packed.device)
        self.entry_bytes = self.entry_stride = self.codec.entry_bytes
        row_entries = pool.block_bytes // self.entry_bytes
        if row_entries < 1:
            raise ValueError(f"a {pool.block_bytes}-byte block row holds no {self.entry_bytes}-byte lane record")
        # slots of about half a block: a lane's last slot is half empty on average, so smaller slots waste less
        self.slots_per_row = max(1, round(row_entries / max(1, pool.block_size // 2)))
        self.slot_entries = row_entries // self.slots_per_row
        self.slots_per_block = pool.packed.shape[0] * self.slots_per_row
        self.window = pool.block_size
        self.bytes = pool.packed.view(-1)
        self._offsets = torch.arange(self.entry_bytes, device=pool.packed.device)

    def slot_base(self, slot: int) -> int:
        block, index = divmod(slot, self.slots_per_block)
        layer, part = divmod(index, self.slots_per_row)
        row = layer * self.pool.num_blocks + block
        return row * self.pool.block_bytes + part * self.slot_entries * self.entry_bytes

    def write(self, layer: int, heads: torch.Tensor, addresses: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.bytes[self._bytes_of(addresses)] = self.codec.encode(layer, heads, k, v)

    def read(
        self, layer: int, heads: torch.Tensor, addresses: torch.Tensor, positions: torch.Tensor,
        recent: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.codec.decode(layer, heads, self.bytes[self._bytes_of(addresses)])
        if recent is not None and bool(recent[1].any()):
            picked = recent[1].nonzero().flatten()
            where = (recent[0][picked], heads[picked], positions[picked] % self.window)
            k[picked] = self.pool.tails[layer, 0][where].float()
            v[picked] = self.pool.tails[layer, 1][where].float()
        cos, sin = self.rotary.cos_sin(positions.to(self.rotary.cos.device), torch.float32)
        k = apply_rotary_ref(k[:, None], cos.to(k.device), sin.to(k.device))[:, 0]
        return k.to(self.dtype), v.to(self.dtype)

    def move(self, sources: torch.Tensor, targets: torch.Tensor) -> None:
        self.bytes[self._bytes_of(targets)] = self.bytes[self._bytes_of(sources)]

    def read_prompt(self, layer: int, seq_id: Hashable, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        pool = self.pool
        num_full = num_tokens // pool.block_size
        tail = pool.read_tail(seq_id, layer, num_tokens % pool.block_size)  # [2, kv_heads, rest, D]
        if not num_full:
            return tail
        k, v = pool.decode_blocks(layer, block_ids[:num_full], [i == 0 for i in range(num_full)])  # [B, H, T, D]
        full = torch.stack([k, v]).transpose(2, 3).flatten(1, 2).transpose(1, 2)  # [2, H, B * T, D]
        return torch.cat([full, tail.to(full.dtype)], dim=2)

    def prompt_keys(self, layer: int, seq_id: Hashable, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        keys = self.read_prompt(layer, seq_id, block_ids, num_tokens)[0].transpose(0, 1)  # [n, kv_heads, D]
        cos, sin = self.rotary.cos_sin(torch.arange(num_tokens, device=self.rotary.cos.device), keys.dtype)
        return apply_rotary_ref(keys, cos.to(keys.device), sin.to(keys.device)).transpose(0, 1)

    def open_ring(self, seq_id: Hashable) -> int | None:
        return self.pool.tail(seq_id)

    def write_ring(
        self, layer: int, rings: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        index = positions % self.window
        self.pool.tails[layer, 0, rings, :, index] = k.to(self.dtype)
        self.pool.tails[layer, 1, rings, :, index] = v.to(self.dtype)

    def _bytes_of(self, addresses: torch.Tensor) -> torch.Tensor:
        """long [E, entry_bytes]: every byte of each entry."""
        return addresses[:, None] + self._offsets
