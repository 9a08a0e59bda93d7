"""The KV pool of an engine with a KV codec: full blocks as the codec's bytes, each sequence's last, partial block in
full precision.

Owns the storage and its bookkeeping: per layer a uint8 row of `block_bytes` per block id (the codec's bytes of that
block, the sink section excluded), a sink row per block id for codecs that keep a sequence's first token apart
(KVQuant), and "tails": one full-precision block per running sequence holding the tokens of its partial last block
(KIVI's full-precision window). A block is encoded once, when its last token is written. Which tokens a step writes
and attends is `codec_attention`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch

from shared.engine.kv.sizing import lazy_zeros
from shared.kvcompress import KvCodec
from shared.kvcompress.kvquant import KvQuantCodec
from shared.model.config import LlamaConfig


class OutOfTails(RuntimeError):
    """More sequences hold a partial block than the pool has tails for (max_num_seqs is the bound)."""


class CodecKvPool:
    """Codec-encoded KV blocks plus full-precision tails.

    Args:
        config: the model's shape.
        codecs: one codec per layer, all with the same byte size per block (as `layer_codecs` builds them).
        num_blocks: block ids, as the block manager pages them.
        num_tails: partial blocks held at once (one per running sequence).
        dtype: of the tails and of what `decode_blocks` returns.
    """

    def __init__(
        self, config: LlamaConfig, codecs: list[KvCodec], num_blocks: int, block_size: int, num_tails: int,
        dtype: torch.dtype, device: torch.device,
    ) -> None:
        self.codecs, self.num_blocks, self.block_size, self.dtype = codecs, num_blocks, block_size, dtype
        self.kv_heads, self.head_dim = config.num_kv_heads, config.head_dim
        shape = (config.num_kv_heads, block_size, config.head_dim)
        self.block_bytes = codecs[0].num_bytes(*shape)
        self.sink_bytes = codecs[0].num_bytes(*shape, starts_sequence=True) - self.block_bytes
        self.keys_before_rope = codecs[0].keys_before_rope
        self.packed = lazy_zeros((config.num_layers, num_blocks, self.block_bytes), torch.uint8, device)
        self.sinks = lazy_zeros((config.num_layers, num_blocks, self.sink_bytes), torch.uint8, device)
        # [layers, 2, tails, kv_heads, block_size, head_dim]; keys as the codec takes them (before RoPE for KVQuant)
        self.tails = torch.zeros(config.num_layers, 2, num_tails, *shape, dtype=dtype, device=device)
        self._tail_of: dict[Hashable, int] = {}
        self._free_tails = list(range(num_tails - 1, -1, -1))
        # Replaces the codec's torch encoding when set (the Triton pack kernel on GPUs): (layer, k, v, starts) ->
        # (rows, sink rows or None), bit for bit what the codec writes.
        self.encoder: Callable[[int, torch.Tensor, torch.Tensor, bool], tuple[torch.Tensor, torch.Tensor | None]] \
            | None = None

    @staticmethod
    def bytes_per_block(codec: KvCodec, config: LlamaConfig, block_size: int) -> int:
        """Pool bytes one block id costs over every layer (its codec row and its sink row)."""
        shape = (config.num_kv_heads, block_size, config.head_dim)
        return config.num_layers * codec.num_bytes(*shape, starts_sequence=True)

    @staticmethod
    def bytes_per_tail(config: LlamaConfig, block_size: int, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return config.num_layers * 2 * config.num_kv_heads * block_size * config.head_dim * element

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.sinks, self.tails))

    @property
    def num_tails(self) -> int:
        return self.tails.shape[2]

    @property
    def num_tails_held(self) -> int:
        return len(self._tail_of)

    @property
    def block_footprint(self) -> int:
        """What one block id costs, every layer (its codec row and its sink row; tails not included)."""
        return self.packed.shape[0] * (self.block_bytes + self.sink_bytes)

    # --- blocks as payloads: what the cache-store keeps, the codec's bytes layer after layer ----------------------

    def payload_layer_bytes(self, starts_sequence: bool) -> int:
        """Bytes of one layer of one block in `block_payload`: a sequence's first block carries the sink too."""
        return self.block_bytes + (self.sink_bytes if starts_sequence else 0)

    def block_payload(self, block_id: int, starts_sequence: bool) -> bytes:
        """Every layer of one block, each exactly as the codec's `encode` wrote it."""
        return b"".join(self.read_block_bytes(layer, block_id, starts_sequence) for layer in range(len(self.codecs)))

    def write_payload_layers(self, block_id: int, first_layer: int, data: bytes | bytearray,
                             starts_sequence: bool) -> None:
        """Fill layers [first_layer, first_layer + n) of a block from whole layers of its `block_payload`."""
        size = self.payload_layer_bytes(starts_sequence)
        for i in range(len(data) // size):
            self.write_block_bytes(first_layer + i, block_id, bytes(data[i * size : (i + 1) * size]), starts_sequence)

    def read_tail(self, seq_id: Hashable, layer_idx: int, num_tokens: int) -> torch.Tensor:
        """The first `num_tokens` tokens of a sequence's tail, one layer: [2, kv_heads, num_tokens, head_dim]."""
        if num_tokens == 0:  # a block-aligned prompt: no tail to take
            return self.tails.new_zeros(2, self.kv_heads, 0, self.head_dim)
        return self.tails[layer_idx, :, self.tail(seq_id), :, :num_tokens].clone()

    def write_tail(self, seq_id: Hashable, layer_idx: int, kv: torch.Tensor) -> None:
        """Put a sequence's partial-block tokens, `kv` [2, kv_heads, n, head_dim], at the start of its tail."""
        self.tails[layer_idx, :, self.tail(seq_id), :, : kv.shape[2]] = kv.to(self.tails.device, self.dtype)

    # --- tails ----------------------------------------------------------------------------------------------------

    def tail(self, seq_id: Hashable) -> int:
        """The tail of a sequence, taken on first use.

        Raises:
            OutOfTails: every tail is held.
        """
        slot = self._tail_of.get(seq_id)
        if slot is None:
            if not self._free_tails:
                raise OutOfTails(f"all {self.num_tails} KV tails are held")
            slot = self._tail_of[seq_id] = self._free_tails.pop()
        return slot

    def release(self, seq_id: Hashable) -> None:
        """The sequence is gone (finished, aborted, preempted): its tail is free. Unknown ids are ignored."""
        slot = self._tail_of.pop(seq_id, None)
        if slot is not None:
            self._free_tails.append(slot)

    # --- blocks ---------------------------------------------------------------------------------------------------

    def encode_blocks(
        self, layer_idx: int, block_ids: list[int], k: torch.Tensor, v: torch.Tensor, starts_sequence: list[bool]
    ) -> None:
        """Encode full blocks, k and v [B, kv_heads, block_size, head_dim], into their rows of one layer."""
        codec = self.codecs[layer_idx]
        for flag in (False, True):
            picked = [i for i, starts in enumerate(starts_sequence) if starts == flag]
            if not picked:
                continue
            ids = torch.tensor([block_ids[i] for i in picked], dtype=torch.long, device=self.packed.device)
            if self.encoder is not None:
                rows, sinks = self.encoder(layer_idx, k[picked], v[picked], flag)
            else:
                rows, sinks = self._encode(codec, k[picked], v[picked], flag)
            self.packed[layer_idx].index_copy_(0, ids, rows.to(self.packed.device))
            if sinks is not None:
                self.sinks[layer_idx].index_copy_(0, ids, sinks.to(self.packed.device))

    def decode_blocks(
        self, layer_idx: int, block_ids: list[int], starts_sequence: list[bool]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [B, kv_heads, block_size, head_dim] of one layer's blocks (keys as stored, see keys_before_rope)."""
        codec, shape = self.codecs[layer_idx], (self.kv_heads, self.block_size, self.head_dim)
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.packed.device)
        rows = self.packed[layer_idx].index_select(0, ids)
        sinks = self.sinks[layer_idx].index_select(0, ids)
        out_k = torch.empty(len(block_ids), *shape, dtype=self.dtype, device=self.packed.device)
        out_v = torch.empty_like(out_k)
        for flag in (False, True):
            picked = [i for i, starts in enumerate(starts_sequence) if starts == flag]
            if picked:
                k, v = self._decode(codec, rows[picked], sinks[picked] if flag else None, flag)
                out_k[picked], out_v[picked] = k.to(self.dtype), v.to(self.dtype)
        return out_k, out_v

    def read_block_bytes(self, layer_idx: int, block_id: int, starts_sequence: bool) -> bytes:
        """One layer of one block exactly as the codec's `encode` wrote it (what the wire and the cache-store hold)."""
        row = self.packed[layer_idx, block_id].cpu().numpy().tobytes()
        return row + (self.sinks[layer_idx, block_id].cpu().numpy().tobytes() if starts_sequence else b"")

    def write_block_bytes(self, layer_idx: int, block_id: int, data: bytes, starts_sequence: bool) -> None:
        """The inverse of `read_block_bytes`.

        Raises:
            ValueError: `data` is not the size the codec gives such a block.
        """
        expected = self.block_bytes + (self.sink_bytes if starts_sequence else 0)
        if len(data) != expected:
            raise ValueError(f"a {self.codecs[layer_idx].name} block is {expected} bytes here, got {len(data)}")
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.packed.device)
        self.packed[layer_idx, block_id] = buffer[: self.block_bytes]
        if starts_sequence:
            self.sinks[layer_idx, block_id] = buffer[self.block_bytes :]

    def _encode(
        self, codec: KvCodec, k: torch.Tensor, v: torch.Tensor, starts_sequence: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if isinstance(codec, KvQuantCodec):
            return codec.to_rows(codec.encode_blocks(k, v, starts_sequence=starts_sequence))
        encoded = [codec.encode(kb, vb, starts_sequence=starts_sequence) for kb, vb in zip(k, v, strict=True)]
        rows = torch.stack([torch.frombuffer(bytearray(data), dtype=torch.uint8) for data in encoded])
        return rows[:, : self.block_bytes], (rows[:, self.block_bytes :] if self.sink_bytes else None)

    def _decode(
        self, codec: KvCodec, rows: torch.Tensor, sinks: torch.Tensor | None, starts_sequence: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (self.kv_heads, self.block_size, self.head_dim)
        if isinstance(codec, KvQuantCodec):
            return codec.decode_blocks(codec.from_rows(rows, sinks, *shape), *shape)
        if sinks is not None and self.sink_bytes:
            rows = torch.cat([rows, sinks], dim=1)
        pairs = [codec.decode(row.cpu().numpy().tobytes(), *shape, self.dtype, starts_sequence=starts_sequence)
                 for row in rows]
        return torch.stack([k for k, _ in pairs]), torch.stack([v for _, v in pairs])
