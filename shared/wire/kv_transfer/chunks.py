"""How a request's prompt KV travels prefill -> decode: split into `KvChunk`s, compressed, verified and reassembled.

Owns chunking and each stream's checks and reassembly (payload codecs are `shared.wire.payload`; a meta tensor, the sim
engine's KV, travels as size-only chunks, one per layer; a decode instance's streams, their deadline and budgets are
`shared.wire.kv_transfer.receiver`). It does not send anything (services do, on `Subjects.decode_kv`) and it does
not know the KV pool's layout.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch

from shared.wire.payload import (
    CODEC_RAW,
    CODEC_SIZE_ONLY,
    Payload,
    PayloadError,
    SizeOnly,
    checksum,
    compress,
    decompress,
)
from shared.wire.protocol import KvChunk


class KvTransferError(PayloadError):
    """A chunk is corrupt or inconsistent, or chunks are missing; the message says which."""


DTYPE_NAMES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
WIRE_NAMES = {dtype: name for name, dtype in DTYPE_NAMES.items()}  # torch dtype -> the name chunks carry
_INT_OF_SIZE = {4: torch.int32, 2: torch.int16}  # same-size stand-ins numpy understands (it has no bf16)


# ---- sending side -------------------------------------------------------------------------------------------


def num_kv_chunks(
    num_layers: int, num_tokens: int, bytes_per_layer_token: int, max_chunk_bytes: int, is_size_only: bool = False
) -> int:
    """How many chunks `chunk_layer_kv`, called once per layer, makes for a whole prompt (`KvChunk.total`).

    Args:
        bytes_per_layer_token: 2 * num_kv_heads * head_dim * itemsize.
        is_size_only: the KV is a meta tensor (size-only chunks, one per layer).
    Raises:
        ValueError: a negative count or a non-positive size.
    """
    if num_layers < 0 or num_tokens < 0 or bytes_per_layer_token < 1 or max_chunk_bytes < 1:
        raise ValueError("counts must be >= 0 and sizes >= 1")
    if is_size_only:
        return num_layers if num_tokens else 0
    return num_layers * -(-num_tokens // _tokens_per_chunk(bytes_per_layer_token, max_chunk_bytes))


def _tokens_per_chunk(bytes_per_layer_token: int, max_chunk_bytes: int) -> int:
    return max(1, max_chunk_bytes // bytes_per_layer_token)


def chunk_layer_kv(
    request_id: str, layer_idx: int, kv: torch.Tensor, first_seq: int, total: int, max_chunk_bytes: int,
    *, compress_payload: bool = True,
) -> list[KvChunk]:
    """One layer's KV as chunks split along tokens, each raw payload at most `max_chunk_bytes` (or one token).

    Args:
        kv: [2, num_kv_heads, num_tokens, head_dim] (K then V) in a dtype of `DTYPE_NAMES`; moved to CPU if needed.
            A meta tensor (no values) becomes one size-only chunk.
        first_seq: the seq of the first chunk; the others follow (first_seq + 1, ...).
        total: the request's chunk count over all layers (see `num_kv_chunks`).
        compress_payload: False sends every payload raw (a baseline for benchmarks).
    Raises:
        ValueError: a tensor of another shape or dtype, or a non-positive `max_chunk_bytes`.
    """
    if kv.dim() != 4 or kv.shape[0] != 2 or kv.shape[1] < 1 or kv.shape[3] < 1:
        raise ValueError(f"kv must be [2, num_kv_heads, num_tokens, head_dim], got {list(kv.shape)}")
    if kv.dtype not in WIRE_NAMES:
        raise ValueError(f"kv dtype {kv.dtype} has no wire name (one of {sorted(DTYPE_NAMES)})")
    if max_chunk_bytes < 1:
        raise ValueError("max_chunk_bytes must be >= 1")
    _, num_kv_heads, num_tokens, head_dim = kv.shape
    itemsize = kv.element_size()
    if kv.is_meta:
        if num_tokens == 0:
            return []
        return [KvChunk(request_id, first_seq, total, layer_idx, layer_idx + 1, 0, num_tokens, WIRE_NAMES[kv.dtype],
                        CODEC_SIZE_ONLY, kv.numel() * itemsize, checksum(b""), b"")]
    kv = kv.detach().cpu()
    step = _tokens_per_chunk(2 * num_kv_heads * head_dim * itemsize, max_chunk_bytes)
    chunks = []
    for i, t0 in enumerate(range(0, num_tokens, step)):
        t1 = min(t0 + step, num_tokens)
        raw = _tensor_bytes(kv[:, :, t0:t1, :])  # [2, num_kv_heads, t1 - t0, head_dim]
        codec, data = compress(raw, itemsize) if compress_payload else (CODEC_RAW, raw)
        chunks.append(KvChunk(
            request_id=request_id, seq=first_seq + i, total=total, layer_start=layer_idx, layer_end=layer_idx + 1,
            token_start=t0, token_end=t1, dtype=WIRE_NAMES[kv.dtype], codec=codec, raw_size=len(raw),
            checksum=checksum(data), data=data,
        ))
    return chunks


def _tensor_bytes(t: torch.Tensor) -> bytes:
    # numpy does the strided copy: single-threaded, so it never waits on a busy intra-op thread pool
    return t.view(_INT_OF_SIZE[t.element_size()]).numpy().tobytes()


# ---- receiving side -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Piece:
    """A verified chunk, decompressed; `header` (the chunk without its data) tells a true duplicate from a conflict."""

    header: KvChunk
    raw: Payload


class KvAssembly:
    """Chunks of one request as they arrive; verifies each; builds the KV tensor once all `total` are in.

    Args:
        request_id: the request every chunk must belong to.
        total: how many chunks make the whole prompt.
    Raises:
        KvTransferError: `total` < 1.
    """

    def __init__(self, request_id: str, total: int) -> None:
        if total < 1:
            raise KvTransferError(f"request {request_id}: a KV transfer of {total} chunks")
        self.request_id = request_id
        self.total = total
        self.wire_dtype = ""  # a DTYPE_NAMES key, fixed by the first chunk
        self.kv_format = ""  # the engines' KV codec for packed chunks (kv_transfer.packed), fixed by the first chunk
        self.num_wire_bytes = 0  # compressed bytes of the accepted (non-duplicate) chunks
        self.num_held_bytes = 0  # decompressed bytes held (size-only chunks hold none)
        self._pieces: dict[int, _Piece] = {}

    @property
    def num_received(self) -> int:
        return len(self._pieces)

    @property
    def is_complete(self) -> bool:
        return len(self._pieces) == self.total

    def missing(self) -> list[int]:
        """The seqs not received yet, ascending."""
        return [seq for seq in range(self.total) if seq not in self._pieces]

    def add(self, chunk: KvChunk) -> None:
        """Verify one chunk and keep its decompressed payload; an identical duplicate is ignored.

        The checksum is checked before anything is decompressed, so unverified bytes never reach LZ4 or the pool.
        Raises:
            KvTransferError: another request or total, a seq out of range, an unknown dtype or codec, insane
                layer/token ranges or sizes, a failed checksum, a conflicting duplicate, or a bad payload.
        """
        where = f"request {self.request_id}: chunk {chunk.seq}/{chunk.total}"
        if chunk.request_id != self.request_id:
            raise KvTransferError(f"{where} belongs to request {chunk.request_id}")
        if chunk.total != self.total:
            raise KvTransferError(f"{where} says {chunk.total} chunks, earlier ones said {self.total}")
        if not 0 <= chunk.seq < self.total:
            raise KvTransferError(f"{where}: seq out of range 0..{self.total - 1}")
        self._check_shape(chunk, where)
        if checksum(chunk.data) != chunk.checksum:
            raise KvTransferError(f"{where} failed its checksum")
        header = dataclasses.replace(chunk, data=b"")
        earlier = self._pieces.get(chunk.seq)
        if earlier is not None:
            if earlier.header != header:
                raise KvTransferError(f"{where} arrived twice with different contents")
            return
        itemsize = 1 if chunk.kv_format else DTYPE_NAMES[chunk.dtype].itemsize  # packed bytes shuffle as bytes
        try:
            raw = decompress(chunk.codec, chunk.data, chunk.raw_size, itemsize)
        except PayloadError as exc:
            raise KvTransferError(f"{where}: {exc}") from None
        self.wire_dtype = self.wire_dtype or chunk.dtype
        self.kv_format = self.kv_format or chunk.kv_format
        self.num_wire_bytes += len(chunk.data)
        self.num_held_bytes += len(raw) if isinstance(raw, bytes) else 0
        self._pieces[chunk.seq] = _Piece(header, raw)

    def _check_shape(self, chunk: KvChunk, where: str) -> None:
        if chunk.dtype not in DTYPE_NAMES:
            raise KvTransferError(f"{where}: unknown dtype {chunk.dtype!r}")
        if self.wire_dtype and chunk.dtype != self.wire_dtype:
            raise KvTransferError(f"{where} is {chunk.dtype}, earlier chunks were {self.wire_dtype}")
        if self._pieces and chunk.kv_format != self.kv_format:
            raise KvTransferError(f"{where} is KV format {chunk.kv_format!r}, earlier chunks were {self.kv_format!r}")
        if not (0 <= chunk.layer_start < chunk.layer_end and 0 <= chunk.token_start < chunk.token_end):
            raise KvTransferError(
                f"{where}: empty or negative range layers [{chunk.layer_start}, {chunk.layer_end}) "
                f"tokens [{chunk.token_start}, {chunk.token_end})"
            )
        per_head_dim = (chunk.layer_end - chunk.layer_start) * 2 * (chunk.token_end - chunk.token_start)
        element = 1 if chunk.kv_format else per_head_dim * DTYPE_NAMES[chunk.dtype].itemsize  # packed: see assemble
        if chunk.raw_size < 1 or chunk.raw_size % element:
            raise KvTransferError(f"{where}: raw size {chunk.raw_size} does not fit its layer and token ranges")

    def assemble(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
        """The whole prompt's KV, converted to `dtype` when the wire dtype differs.

        Returns:
            [num_layers, 2, num_kv_heads, num_tokens, head_dim]; num_tokens is the largest token_end received. A meta
            tensor when every chunk was size-only.
        Raises:
            KvTransferError: chunks missing, a chunk whose size does not fit this shape, size-only chunks mixed with
                others, or a layer not covered exactly once over tokens [0, num_tokens).
        """
        if self.kv_format:
            raise KvTransferError(f"request {self.request_id}: packed {self.kv_format} KV needs assemble_packed")
        num_tokens = self.check_complete(num_layers)
        wire_dtype = DTYPE_NAMES[self.wire_dtype]
        num_size_only = sum(isinstance(piece.raw, SizeOnly) for piece in self._pieces.values())
        if num_size_only not in (0, self.total):
            raise KvTransferError(f"request {self.request_id}: {num_size_only} of {self.total} chunks are size-only")
        device = "meta" if num_size_only else "cpu"
        out = torch.empty(num_layers, 2, num_kv_heads, num_tokens, head_dim, dtype=wire_dtype, device=device)
        dest = None if num_size_only else out.view(_INT_OF_SIZE[wire_dtype.itemsize]).numpy()  # shares out's memory
        for seq, piece in sorted(self._pieces.items()):
            l0, l1, t0, t1 = _ranges(piece.header)
            shape = (l1 - l0, 2, num_kv_heads, t1 - t0, head_dim)
            if piece.header.raw_size != wire_dtype.itemsize * math.prod(shape):
                raise KvTransferError(
                    f"request {self.request_id}: chunk {seq}/{self.total} holds {piece.header.raw_size} bytes, "
                    f"which is not {num_kv_heads} kv heads x head dim {head_dim} of {self.wire_dtype}"
                )
            if dest is not None:
                dest[l0:l1, :, :, t0:t1, :] = np.frombuffer(piece.raw, dest.dtype).reshape(shape)  # type: ignore
        return out if dtype == wire_dtype else out.to(dtype)  # e.g. fp32 on the wire -> a bf16 pool

    def check_complete(self, num_layers: int) -> int:
        """Every chunk is in and every layer covers tokens [0, num_tokens) exactly once; returns num_tokens.

        Raises:
            KvTransferError: chunks missing, or a layer with a gap, an overlap, or beyond the model's layers.
        """
        missing = self.missing()
        if missing:
            shown = ", ".join(map(str, missing[:10])) + (", ..." if len(missing) > 10 else "")
            raise KvTransferError(f"request {self.request_id}: {len(missing)} of {self.total} chunks missing ({shown})")
        num_tokens = max(piece.header.token_end for piece in self._pieces.values())
        self._check_coverage(num_layers, num_tokens)
        return num_tokens

    def pieces(self) -> list[tuple[KvChunk, Payload]]:
        """(chunk without its data, decompressed payload) of every chunk received, in seq order."""
        return [(piece.header, piece.raw) for _, piece in sorted(self._pieces.items())]

    def _check_coverage(self, num_layers: int, num_tokens: int) -> None:
        ranges: list[list[tuple[int, int]]] = [[] for _ in range(num_layers)]
        for seq, piece in self._pieces.items():
            l0, l1, t0, t1 = _ranges(piece.header)
            if l1 > num_layers:
                raise KvTransferError(
                    f"request {self.request_id}: chunk {seq}/{self.total} holds layer {l1 - 1}, "
                    f"the model has {num_layers}"
                )
            for layer in range(l0, l1):
                ranges[layer].append((t0, t1))
        for layer, spans in enumerate(ranges):
            end = 0
            for t0, t1 in sorted(spans):
                if t0 != end:
                    kind = "a gap" if t0 > end else "an overlap"
                    raise KvTransferError(f"request {self.request_id}: layer {layer} has {kind} at token {end}")
                end = t1
            if end != num_tokens:
                raise KvTransferError(f"request {self.request_id}: layer {layer} covers tokens [0, {end}), "
                                      f"expected [0, {num_tokens})")


def _ranges(chunk: KvChunk) -> tuple[int, int, int, int]:
    return chunk.layer_start, chunk.layer_end, chunk.token_start, chunk.token_end
