"""Prompt KV of an engine with a KV codec, prefill -> decode: each layer's whole blocks as the codec's bytes (the very
bytes the pool and the cache-store hold) and its partial last block in full precision, in `KvChunk`s.

Owns chunking by whole blocks and reassembly with exact size checks; the packed forms themselves are the engine's
(`shared.engine.prompt_kv`), which this module reads through `PackedSizes`. Verification, compression and the stall
deadline are `chunks`' and `receiver`'s, shared with raw tensors.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from shared.wire.kv_transfer.chunks import DTYPE_NAMES, WIRE_NAMES, KvAssembly, KvTransferError
from shared.wire.payload import CODEC_RAW, SizeOnly, checksum, compress
from shared.wire.protocol import KvChunk


class PackedSizes(Protocol):
    """What chunking and reassembly read of the engines' packed format (`shared.engine.prompt_kv.PackedFormat`):
    the codec's name, block size, the tail's dtype and the bytes of consecutive blocks."""

    @property
    def kv_format(self) -> str: ...

    @property
    def block_size(self) -> int: ...

    @property
    def block_bytes(self) -> int: ...

    @property
    def tail_dtype(self) -> torch.dtype: ...

    def blocks_bytes(self, num_full_blocks: int, first_block: int = 0) -> int: ...


PackedPrompt = tuple[list[bytes], torch.Tensor, int]  # each layer's block bytes, the tails, num_tokens


def num_packed_chunks(num_layers: int, num_tokens: int, fmt: PackedSizes, max_chunk_bytes: int) -> int:
    """How many chunks `chunk_packed_layer`, called once per layer, makes for a whole prompt."""
    return num_layers * len(_spans(num_tokens, fmt, max_chunk_bytes))


def _spans(num_tokens: int, fmt: PackedSizes, max_chunk_bytes: int) -> list[tuple[int, int]]:
    """Token ranges of one layer's chunks: whole blocks, as many as fit `max_chunk_bytes` (at least one); the partial
    last block travels with the last range."""
    size = fmt.block_size
    per_chunk = max(1, max_chunk_bytes // max(1, fmt.block_bytes))
    full = num_tokens // size
    starts = list(range(0, full, per_chunk)) or [0]
    spans = [(b * size, min(b + per_chunk, full) * size) for b in starts]
    if num_tokens % size:
        if full:
            spans[-1] = (spans[-1][0], num_tokens)
        else:
            spans = [(0, num_tokens)]
    return spans if num_tokens else []


def chunk_packed_layer(
    request_id: str, layer_idx: int, blocks: bytes, tail: torch.Tensor, num_tokens: int, fmt: PackedSizes,
    first_seq: int, total: int, max_chunk_bytes: int, *, compress_payload: bool = True,
) -> list[KvChunk]:
    """One layer as chunks of whole blocks (see `num_packed_chunks` for `total`): its full blocks' codec bytes back
    to back and its partial last block's tokens, tail [2, kv_heads, num_tokens % block_size, head_dim].

    Raises:
        ValueError: the blocks' bytes or the tail do not fit `num_tokens` in this format.
    """
    size = fmt.block_size
    full = num_tokens // size
    if len(blocks) != fmt.blocks_bytes(full) or tail.shape[2] != num_tokens % size:
        raise ValueError(f"{len(blocks)} bytes and a tail of {tail.shape[2]} tokens do not hold "
                         f"{num_tokens} tokens of {fmt.kv_format}")
    tail = tail.detach().cpu().contiguous()
    chunks = []
    for i, (t0, t1) in enumerate(_spans(num_tokens, fmt, max_chunk_bytes)):
        b0, b1 = t0 // size, min(t1 // size, full)
        start = fmt.blocks_bytes(b0)
        raw = blocks[start : start + fmt.blocks_bytes(b1 - b0, b0)]
        if t1 == num_tokens and num_tokens % size:
            raw += tail.view(torch.uint8).numpy().tobytes()
        codec, data = compress(raw, 1) if compress_payload else (CODEC_RAW, raw)
        chunks.append(KvChunk(
            request_id=request_id, seq=first_seq + i, total=total, layer_start=layer_idx, layer_end=layer_idx + 1,
            token_start=t0, token_end=t1, dtype=WIRE_NAMES[fmt.tail_dtype], codec=codec, raw_size=len(raw),
            checksum=checksum(data), data=data, kv_format=fmt.kv_format,
        ))
    return chunks


def assemble_packed(
    assembly: KvAssembly, num_layers: int, kv_heads: int, head_dim: int, fmt: PackedSizes
) -> PackedPrompt:
    """The whole prompt from a complete assembly of packed chunks: each layer's full blocks' bytes, the tails
    [num_layers, 2, kv_heads, num_tokens % block_size, head_dim] in the format's dtype, and num_tokens.

    Raises:
        KvTransferError: chunks missing or overlapping, another KV format than this engine's, or a chunk whose size
            does not fit its token range in this format.
    """
    rid = assembly.request_id
    if assembly.kv_format != fmt.kv_format:
        sent = assembly.kv_format or "raw tensors"
        raise KvTransferError(f"request {rid}: prefill sent KV as {sent}, this engine keeps {fmt.kv_format}")
    num_tokens = assembly.check_complete(num_layers)
    size = fmt.block_size
    full, num_tail = num_tokens // size, num_tokens % size
    wire_dtype = DTYPE_NAMES[assembly.wire_dtype]
    layers: list[list[tuple[int, bytes]]] = [[] for _ in range(num_layers)]
    tail = torch.zeros(num_layers, 2, kv_heads, num_tail, head_dim, dtype=wire_dtype)
    for header, raw in assembly.pieces():
        t0, t1 = header.token_start, header.token_end
        if t0 % size or (t1 % size and t1 != num_tokens):
            raise KvTransferError(f"request {rid}: chunk {header.seq} covers tokens [{t0}, {t1}), not whole blocks")
        b0, b1 = t0 // size, min(t1 // size, full)
        blocks_size = fmt.blocks_bytes(b1 - b0, b0)
        tail_tokens = num_tail if t1 == num_tokens else 0
        expected = blocks_size + 2 * kv_heads * tail_tokens * head_dim * wire_dtype.itemsize
        if header.raw_size != expected or header.layer_end != header.layer_start + 1:
            raise KvTransferError(
                f"request {rid}: chunk {header.seq} holds {header.raw_size} bytes, {fmt.kv_format} tokens "
                f"[{t0}, {t1}) of one layer take {expected}"
            )
        if isinstance(raw, SizeOnly):
            raise KvTransferError(f"request {rid}: chunk {header.seq} is size-only, packed KV carries bytes")
        data = bytes(raw)
        layers[header.layer_start].append((t0, data[:blocks_size]))
        if tail_tokens:
            values = np.frombuffer(data, dtype=np.uint8, offset=blocks_size).copy()
            tail[header.layer_start] = torch.from_numpy(values).view(wire_dtype).view(2, kv_heads, num_tail, head_dim)
    joined = [b"".join(part for _, part in sorted(parts)) for parts in layers]
    return joined, tail.to(fmt.tail_dtype), num_tokens
