"""How a request's prompt KV travels prefill -> decode, chunk by chunk: `KvChunk`s verified and held until the
stream is whole.

Owns each stream's checks (checksum before anything is decompressed, consistency, coverage) and the decompressed
pieces; what a chunk holds (whole blocks of one layer) is `shared.wire.kv_transfer.prompt`'s, payload codecs are
`shared.wire.payload`'s, a decode instance's streams, their deadline and budgets are
`shared.wire.kv_transfer.receiver`'s. It does not send anything (services do, on `Subjects.decode_kv`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from shared.wire.payload import Payload, PayloadError, checksum, decompress
from shared.wire.protocol import KvChunk


class KvTransferError(PayloadError):
    """A chunk is corrupt or inconsistent, or chunks are missing; the message says which."""


DTYPE_NAMES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
WIRE_NAMES = {dtype: name for name, dtype in DTYPE_NAMES.items()}  # torch dtype -> the name chunks carry


def shuffle_width(kv_format: str) -> int:
    """The element size a chunk's bytes are shuffled by before compression: a raw tensor's itemsize when the KV
    format names a dtype (an engine without a codec), else 1 (a codec's bytes)."""
    dtype = DTYPE_NAMES.get(kv_format)
    return 1 if dtype is None else dtype.itemsize


@dataclass(frozen=True)
class _Piece:
    """A verified chunk, decompressed; `header` (the chunk without its data) tells a true duplicate from a conflict."""

    header: KvChunk
    raw: Payload


class KvAssembly:
    """Chunks of one request as they arrive, each verified and decompressed (`kv_transfer.prompt` reassembles
the prompt once all `total` are in).

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
        self.kv_format = ""  # the engines' KV format (EngineConfig.kv_format), fixed by the first chunk
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
        try:
            raw = decompress(chunk.codec, chunk.data, chunk.raw_size, shuffle_width(chunk.kv_format))
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
        if not chunk.kv_format:
            raise KvTransferError(f"{where} names no KV format")
        if self._pieces and chunk.kv_format != self.kv_format:
            raise KvTransferError(f"{where} is KV format {chunk.kv_format!r}, earlier chunks were {self.kv_format!r}")
        if not (0 <= chunk.layer_start < chunk.layer_end and 0 <= chunk.token_start < chunk.token_end):
            raise KvTransferError(
                f"{where}: empty or negative range layers [{chunk.layer_start}, {chunk.layer_end}) "
                f"tokens [{chunk.token_start}, {chunk.token_end})"
            )
        if chunk.raw_size < 1:  # exact sizes are checked on reassembly, which knows the format
            raise KvTransferError(f"{where}: raw size {chunk.raw_size}")

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
