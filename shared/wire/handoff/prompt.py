"""A prompt's KV prefill -> decode in `KvChunk`s: each layer's full blocks in the engines' block form (the very bytes
their KV stores and the cache-store hold: raw tensors, or a codec's bytes) and its partial last block's tokens, cut
at block boundaries; and the prompt reassembled from a complete stream with exact size and coverage checks. A store
of sizes alone (the sim engine's) sends one size-only chunk per layer.

The block form itself is the engine's (`shared.engine.kv.store.BlockFormat`), which this module reads through
`BlockSizes`. Each chunk is a checksummed part (`shared.wire.parts`); the stream around the chunks is `stream`'s.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from typing import Protocol

import numpy as np
import torch

from shared.wire.parts import PartAssembly, PartError, encode_part
from shared.wire.payload import Payload, SizeOnly
from shared.wire.protocol import KvChunk

DTYPE_NAMES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
WIRE_NAMES = {dtype: name for name, dtype in DTYPE_NAMES.items()}  # torch dtype -> the name chunks carry


def kv_shuffle_width(kv_format: str) -> int:
    """The element size a chunk's bytes are shuffled by before compression: a raw tensor's itemsize when the KV
    format names a dtype (an engine without a codec), else 1 (a codec's bytes)."""
    dtype = DTYPE_NAMES.get(kv_format)
    return 1 if dtype is None else dtype.itemsize


class KvAssembly(PartAssembly[KvChunk]):
    """A request's KV chunks as they arrive (the parts primitive): each chunk's own fields are checked first
    (`_check_chunk`), and every chunk must name the same dtype, KV format and block size.

    Raises:
        PartError: `total` < 1.
    """

    def __init__(self, request_id: str, total: int, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(f"request {request_id}: KV", total, _kv_agreed, _kv_width, clock=clock, part_name="chunk")
        self.request_id = request_id

    def add(self, part: KvChunk) -> Payload | None:
        """See `PartAssembly.add`; also raises PartError for another request's chunk or one whose fields fail
        `_check_chunk`."""
        if part.request_id != self.request_id:
            raise PartError(f"request {self.request_id}: KV chunk {part.seq}/{part.total} belongs to request "
                            f"{part.request_id}")
        _check_chunk(part)
        return super().add(part)


def _kv_agreed(chunk: KvChunk) -> dict[str, Hashable]:
    return {"dtype": chunk.dtype, "kv_format": chunk.kv_format, "block_size": chunk.block_size}


def _kv_width(chunk: KvChunk) -> int:
    return kv_shuffle_width(chunk.kv_format)


def _check_chunk(chunk: KvChunk) -> None:
    """What a chunk's fields must say before it joins an assembly: a known dtype, a KV format, sane ranges.

    Raises:
        PartError: the first of these that fails.
    """
    where = f"request {chunk.request_id}: KV chunk {chunk.seq}/{chunk.total}"
    if chunk.dtype not in DTYPE_NAMES:
        raise PartError(f"{where}: unknown dtype {chunk.dtype!r}")
    if not chunk.kv_format:
        raise PartError(f"{where} names no KV format")
    if not (0 <= chunk.layer_start < chunk.layer_end and 0 <= chunk.token_start < chunk.token_end):
        raise PartError(
            f"{where}: empty or negative range layers [{chunk.layer_start}, {chunk.layer_end}) "
            f"tokens [{chunk.token_start}, {chunk.token_end})"
        )
    if chunk.raw_size < 1:  # exact sizes are checked on reassembly, which knows the format
        raise PartError(f"{where}: raw size {chunk.raw_size}")


class BlockSizes(Protocol):
    """What chunking and reassembly read of the engines' block form: the KV format's name, block size, the bytes of
    consecutive blocks, the tail's dtype, and whether the blocks carry values."""

    @property
    def kv_format(self) -> str: ...

    @property
    def block_size(self) -> int: ...

    @property
    def block_bytes(self) -> int: ...

    @property
    def tail_dtype(self) -> torch.dtype: ...

    @property
    def has_values(self) -> bool: ...

    def blocks_bytes(self, num_full_blocks: int, first_block: int = 0) -> int: ...

    def tail_bytes(self, num_tokens: int, kv_heads: int, head_dim: int) -> int: ...


PromptLayers = tuple[list[Payload], torch.Tensor, int]  # each layer's block bytes, the tails, num_tokens


def num_prompt_chunks(num_layers: int, num_tokens: int, fmt: BlockSizes, max_chunk_bytes: int) -> int:
    """How many chunks `chunk_prompt_layer`, called once per layer, makes for a whole prompt (`KvChunk.total`)."""
    return num_layers * len(_spans(num_tokens, fmt, max_chunk_bytes))


def _spans(num_tokens: int, fmt: BlockSizes, max_chunk_bytes: int) -> list[tuple[int, int]]:
    """Token ranges of one layer's chunks: whole blocks, as many as fit `max_chunk_bytes` (at least one); the partial
    last block travels with the last range. Sizes alone travel in one range."""
    if not num_tokens:
        return []
    if not fmt.has_values:
        return [(0, num_tokens)]
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
    return spans


def chunk_prompt_layer(
    request_id: str, layer_idx: int, blocks: Payload, tail: torch.Tensor, num_tokens: int, fmt: BlockSizes,
    first_seq: int, total: int, max_chunk_bytes: int, *, compress_payload: bool = True,
) -> list[KvChunk]:
    """One layer as chunks of whole blocks (see `num_prompt_chunks` for `total`): its full blocks' bytes back to back
    and its partial last block's tokens, tail [2, kv_heads, num_tokens % block_size, head_dim].

    Args:
        first_seq: the seq of the layer's first chunk; the others follow.
        compress_payload: False sends every payload raw (a baseline for benchmarks).
    Raises:
        ValueError: the blocks' bytes or the tail do not fit `num_tokens` in this format.
    """
    size = fmt.block_size
    full = num_tokens // size
    if len(blocks) != fmt.blocks_bytes(full) or tail.shape[2] != num_tokens % size:
        raise ValueError(f"{len(blocks)} bytes and a tail of {tail.shape[2]} tokens do not hold "
                         f"{num_tokens} tokens of {fmt.kv_format}")
    dtype = WIRE_NAMES[fmt.tail_dtype]

    def chunk(seq: int, t0: int, t1: int, raw: Payload) -> KvChunk:
        body = encode_part(raw, width, compress_payload)
        return KvChunk(
            request_id=request_id, seq=seq, total=total, layer_start=layer_idx, layer_end=layer_idx + 1,
            token_start=t0, token_end=t1, dtype=dtype, kv_format=fmt.kv_format, block_size=fmt.block_size,
            **body.fields(),
        )

    width = kv_shuffle_width(fmt.kv_format)
    if not fmt.has_values:
        if not num_tokens:
            return []
        return [chunk(first_seq, 0, num_tokens, SizeOnly(len(blocks) + tail.numel() * tail.element_size()))]
    if isinstance(blocks, SizeOnly):
        raise ValueError(f"sizes alone for {fmt.kv_format} blocks, which carry values")
    tail_raw = tail.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    chunks = []
    for i, (t0, t1) in enumerate(_spans(num_tokens, fmt, max_chunk_bytes)):
        b0, b1 = t0 // size, min(t1 // size, full)
        start = fmt.blocks_bytes(b0)
        raw = blocks[start : start + fmt.blocks_bytes(b1 - b0, b0)]
        if t1 == num_tokens and num_tokens % size:
            raw += tail_raw
        chunks.append(chunk(first_seq + i, t0, t1, raw))
    return chunks


def assemble_prompt(
    assembly: KvAssembly, num_layers: int, kv_heads: int, head_dim: int, fmt: BlockSizes
) -> PromptLayers:
    """The whole prompt from a complete assembly: each layer's full blocks' bytes (sizes alone for a store of
    sizes), the tails [num_layers, 2, kv_heads, num_tokens % block_size, head_dim] in the format's dtype (a meta tensor
    for sizes alone), and num_tokens.

    Raises:
        PartError: chunks missing, a layer with a gap or an overlap, another KV format or block size than this
            engine's, a chunk whose size does not fit its token range in this format, or sizes where values are due.
    """
    assembly.check_complete()
    pieces = assembly.pieces()
    first = pieces[0][0]
    rid = first.request_id
    if first.kv_format != fmt.kv_format:
        raise PartError(f"request {rid}: prefill sent KV as {first.kv_format}, this engine keeps {fmt.kv_format}")
    if first.block_size != fmt.block_size:
        raise PartError(f"request {rid}: prefill sent blocks of {first.block_size} tokens, this engine pages "
                        f"{fmt.block_size}")
    num_tokens = _check_coverage([header for header, _ in pieces], num_layers)
    if not fmt.has_values:
        return _assemble_sizes(pieces, num_layers, kv_heads, head_dim, fmt, num_tokens)
    size = fmt.block_size
    full, num_tail = num_tokens // size, num_tokens % size
    wire_dtype = DTYPE_NAMES[first.dtype]
    tail_bytes = 2 * kv_heads * num_tail * head_dim * wire_dtype.itemsize  # in the wire's dtype, converted below
    layers: list[list[tuple[int, bytes]]] = [[] for _ in range(num_layers)]
    tail = torch.zeros(num_layers, 2, kv_heads, num_tail, head_dim, dtype=wire_dtype)
    for header, raw in pieces:
        t0, t1 = header.token_start, header.token_end
        if t0 % size or (t1 % size and t1 != num_tokens):
            raise PartError(f"request {rid}: chunk {header.seq} covers tokens [{t0}, {t1}), not whole blocks")
        b0, b1 = t0 // size, min(t1 // size, full)
        blocks_size = fmt.blocks_bytes(b1 - b0, b0)
        has_tail = t1 == num_tokens and num_tail > 0
        expected = blocks_size + (tail_bytes if has_tail else 0)
        if header.raw_size != expected or header.layer_end != header.layer_start + 1:
            raise PartError(
                f"request {rid}: chunk {header.seq} holds {header.raw_size} bytes, {fmt.kv_format} tokens "
                f"[{t0}, {t1}) of one layer take {expected}"
            )
        if isinstance(raw, SizeOnly):
            raise PartError(f"request {rid}: chunk {header.seq} is size-only, this engine's KV carries bytes")
        layers[header.layer_start].append((t0, raw[:blocks_size]))
        if has_tail:
            values = np.frombuffer(raw, dtype=np.uint8, offset=blocks_size).copy()
            tail[header.layer_start] = torch.from_numpy(values).view(wire_dtype).view(2, kv_heads, num_tail, head_dim)
    joined: list[Payload] = [b"".join(part for _, part in sorted(parts)) for parts in layers]
    return joined, tail.to(fmt.tail_dtype), num_tokens


def _check_coverage(headers: list[KvChunk], num_layers: int) -> int:
    """Every layer covers tokens [0, num_tokens) exactly once; returns num_tokens.

    Raises:
        PartError: a layer with a gap or an overlap, or beyond the model's layers.
    """
    rid, num_tokens = headers[0].request_id, max(header.token_end for header in headers)
    ranges: list[list[tuple[int, int]]] = [[] for _ in range(num_layers)]
    for header in headers:
        if header.layer_end > num_layers:
            raise PartError(f"request {rid}: chunk {header.seq}/{header.total} holds layer {header.layer_end - 1}, "
                            f"the model has {num_layers}")
        for layer in range(header.layer_start, header.layer_end):
            ranges[layer].append((header.token_start, header.token_end))
    for layer, spans in enumerate(ranges):
        end = 0
        for t0, t1 in sorted(spans):
            if t0 != end:
                kind = "a gap" if t0 > end else "an overlap"
                raise PartError(f"request {rid}: layer {layer} has {kind} at token {end}")
            end = t1
        if end != num_tokens:
            raise PartError(f"request {rid}: layer {layer} covers tokens [0, {end}), expected [0, {num_tokens})")
    return num_tokens


def _assemble_sizes(
    pieces: list[tuple[KvChunk, Payload]], num_layers: int, kv_heads: int, head_dim: int, fmt: BlockSizes,
    num_tokens: int,
) -> PromptLayers:
    """A store of sizes: one size-only chunk a layer, as big as the layer's blocks and tail."""
    rid, full, num_tail = pieces[0][0].request_id, num_tokens // fmt.block_size, num_tokens % fmt.block_size
    expected = fmt.blocks_bytes(full) + fmt.tail_bytes(num_tail, kv_heads, head_dim)
    for header, raw in pieces:
        if not isinstance(raw, SizeOnly) or header.raw_size != expected or header.layer_end != header.layer_start + 1:
            raise PartError(f"request {rid}: chunk {header.seq} is not the size-only layer of {expected} bytes "
                            "this engine expects")
    tail = torch.empty(num_layers, 2, kv_heads, num_tail, head_dim, dtype=fmt.tail_dtype, device="meta")
    return [SizeOnly(fmt.blocks_bytes(full)) for _ in range(num_layers)], tail, num_tokens
