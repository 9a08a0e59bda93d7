"""Checksummed parts: how every payload too big for one message travels (a prompt's KV prefill -> decode, its FastGen
profile, cache-store puts and gets).

A part says where it belongs (`seq` of `total`), how its bytes are coded (`codec`, `raw_size`) and their xxh3-64
`checksum`; each part is coded on its own, so it can be verified and used as it comes. `PartAssembly` takes one
whole's parts: it verifies each before anything decodes it, checks that the parts agree with each other, ignores an
identical duplicate, refuses a conflicting one, and expires when parts stop coming. Payload codecs are
`shared.wire.payload`'s; what the bytes mean, and which fields must agree, is the caller's.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from shared.wire.payload import (
    CODEC_LZ4_SHUFFLE,
    CODEC_RAW,
    CODEC_SIZE_ONLY,
    Payload,
    PayloadError,
    checksum,
    compress,
    decompress,
)


class PartError(PayloadError):
    """A part is corrupt or disagrees with the others, or parts are missing; the message says which."""


class Part(Protocol):
    """What every part message carries (`KvChunk`, `FastGenProfilePart`, `BlockPut`, `BlockPart`)."""

    @property
    def seq(self) -> int: ...

    @property
    def total(self) -> int: ...

    @property
    def codec(self) -> str: ...

    @property
    def raw_size(self) -> int: ...

    @property
    def checksum(self) -> int: ...

    @property
    def data(self) -> bytes: ...


P = TypeVar("P", bound=Part)


@dataclass(frozen=True)
class PartBody:
    """One part's coded bytes and what a receiver checks them by (the fields every part message carries)."""

    codec: str
    raw_size: int
    checksum: int
    data: bytes

    def fields(self) -> dict[str, Any]:
        return {"codec": self.codec, "raw_size": self.raw_size, "checksum": self.checksum, "data": self.data}


def encode_part(raw: Payload, itemsize: int, compress_payload: bool = True) -> PartBody:
    """One part's bytes, byte-shuffled + LZ4 when that pays (`shared.wire.payload.compress`), with their checksum.

    Args:
        itemsize: the element width to shuffle by (the bytes' dtype; 1 for bytes that are not numbers).
        compress_payload: False sends bytes as they are (a baseline for benchmarks); sizes alone are always coded.
    Raises:
        ValueError: bytes that are not a whole number of `itemsize`-byte elements.
    """
    if compress_payload or not isinstance(raw, bytes):
        codec, data = compress(raw, itemsize)
    else:
        codec, data = CODEC_RAW, raw
    return PartBody(codec, len(raw), checksum(data), data)


def shuffle_width(raw_size: int, itemsize: int) -> int:
    """`itemsize` when `raw_size` bytes are whole elements of it, else 1: the width for bytes of no fixed dtype (a
    cache-store block), the same on both ends."""
    return itemsize if itemsize > 0 and raw_size % itemsize == 0 else 1


def cut_payload(
    raw: Payload, part_bytes: int, itemsize: int = 1, align_bytes: int = 1, compress_payload: bool = True
) -> list[PartBody]:
    """`raw` in parts of at most `part_bytes` raw bytes, each coded on its own (at least one part) and shuffled by
    `itemsize` where it holds whole elements (`shuffle_width`); parts hold whole units of `align_bytes` where one
    fits in a part. Sizes alone stay one part. `compress_payload` as `encode_part`'s."""
    if not isinstance(raw, bytes):
        return [encode_part(raw, 1)]
    step = max(1, part_bytes // align_bytes * align_bytes or part_bytes)
    pieces = [raw[i : i + step] for i in range(0, len(raw), step)] or [b""]
    return [encode_part(piece, shuffle_width(len(piece), itemsize), compress_payload) for piece in pieces]


def _header(part: P) -> P:
    return dataclasses.replace(part, data=b"")  # type: ignore[type-var]


class PartAssembly(Generic[P]):
    """The parts of one whole as they arrive, each verified (and decoded, unless `decode` is False) before it is kept.

    Args:
        what: names the whole in errors ("request r-1: KV", "block 0x2a").
        total: how many parts make it.
        part_name: what its parts are called in errors ("chunk" makes "request r-1: KV chunk 3/12 ...").
        agree: the fields every part must share (besides `total`), by name, e.g. its request id and format.
        itemsize: the element width a part's bytes were shuffled by (a function of the part; `shuffle_width` of its
            raw size for parts that `cut_payload` made of bytes with no fixed dtype).
        deadline_s: a whole with no new part for this long `is_expired`.
        decode: False keeps each verified part as it came, undecoded (a store serves parts as they were put).
        clock: monotonic seconds (tests pass a fake).
    Raises:
        PartError: `total` < 1.
    """

    def __init__(
        self, what: str, total: int, agree: Callable[[P], dict[str, Hashable]], itemsize: Callable[[P], int],
        deadline_s: float = float("inf"), decode: bool = True, clock: Callable[[], float] = time.monotonic,
        part_name: str = "part",
    ) -> None:
        if total < 1:
            raise PartError(f"{what}: a whole of {total} {part_name}s")
        self.what, self.total, self.agree, self.itemsize = what, total, agree, itemsize
        self.part_name = part_name
        self.deadline_s, self.decode, self.clock = deadline_s, decode, clock
        self.last_part_s = clock()
        self.num_wire_bytes = 0  # coded bytes of the parts kept
        self.num_held_bytes = 0  # bytes held: decoded (or, with decode False, as they came); sizes alone hold none
        self._agreed: dict[str, Hashable] = {}
        self._pieces: dict[int, tuple[P, Payload]] = {}  # seq -> (part without its data, what is kept)

    @property
    def num_received(self) -> int:
        return len(self._pieces)

    @property
    def is_complete(self) -> bool:
        return len(self._pieces) == self.total

    def missing(self) -> list[int]:
        """The seqs not received yet, ascending."""
        return [seq for seq in range(self.total) if seq not in self._pieces]

    def add(self, part: P) -> Payload | None:
        """Verify one part and keep it; returns what it holds (decoded), or None for an identical duplicate.

        The checksum is checked before anything is decoded, so unverified bytes never reach LZ4 or the caller.
        Raises:
            PartError: another total, a seq out of range, fields that disagree with earlier parts, a failed
                checksum, a conflicting duplicate, or a payload that does not decode to `raw_size` bytes.
        """
        where = f"{self.what} {self.part_name} {part.seq}/{part.total}"
        if part.total != self.total:
            raise PartError(f"{where} says {part.total} {self.part_name}s, earlier ones said {self.total}")
        if not 0 <= part.seq < self.total:
            raise PartError(f"{where}: seq out of range 0..{self.total - 1}")
        agreed = self.agree(part)
        for name, value in agreed.items():
            if self._pieces and value != self._agreed[name]:
                raise PartError(f"{where} has {name} {value!r}, the earlier {self.part_name}s {self._agreed[name]!r}")
        if part.raw_size < 0:
            raise PartError(f"{where}: raw size {part.raw_size}")
        if checksum(part.data) != part.checksum:
            raise PartError(f"{where} failed its checksum")
        header = _header(part)
        earlier = self._pieces.get(part.seq)
        if earlier is not None:
            if earlier[0] != header:
                raise PartError(f"{where} arrived twice with different contents")
            return None
        kept = self._decode(part, where)
        self._agreed = agreed
        self.num_wire_bytes += len(part.data)
        self.num_held_bytes += len(kept) if isinstance(kept, bytes) else 0
        self._pieces[part.seq] = (header, kept)
        self.last_part_s = self.clock()
        return kept

    def _decode(self, part: P, where: str) -> Payload:
        """What to keep of a verified part: its decoded bytes, or (`decode` False) its coded bytes, checked only as
        far as that is cheap (a known codec, raw bytes of their stated size, sizes alone carrying none): the reader
        decodes them and refuses what does not decode."""
        if not self.decode:
            if part.codec not in (CODEC_RAW, CODEC_LZ4_SHUFFLE, CODEC_SIZE_ONLY):
                raise PartError(f"{where}: unknown payload codec {part.codec!r}")
            if part.codec == CODEC_RAW and len(part.data) != part.raw_size:
                raise PartError(f"{where}: {len(part.data)} raw bytes, expected {part.raw_size}")
            if part.codec == CODEC_SIZE_ONLY and part.data:
                raise PartError(f"{where}: a size-only payload carries {len(part.data)} bytes")
            return part.data
        try:
            return decompress(part.codec, part.data, part.raw_size, self.itemsize(part))
        except PayloadError as exc:
            raise PartError(f"{where}: {exc}") from None

    def check_complete(self) -> None:
        """Raises PartError naming the missing seqs (the first ten), if any."""
        missing = self.missing()
        if missing:
            shown = ", ".join(map(str, missing[:10])) + (", ..." if len(missing) > 10 else "")
            raise PartError(f"{self.what}: {len(missing)} of {self.total} {self.part_name}s missing ({shown})")

    def pieces(self) -> list[tuple[P, Payload]]:
        """(part without its data, what it holds) of every part received, in seq order."""
        return [self._pieces[seq] for seq in sorted(self._pieces)]

    def parts(self) -> list[P]:
        """Every part received, as it came, in seq order (what a store serves).

        Raises:
            ValueError: the assembly decodes (`decode` True), so it no longer has the parts' coded bytes.
        """
        if self.decode:
            raise ValueError(f"{self.what}: parts were decoded, not kept as they came")
        return [dataclasses.replace(header, data=kept) for header, kept in self.pieces()]  # type: ignore[type-var]

    def stalled_s(self) -> float:
        """Seconds since the last new part (or since the assembly opened)."""
        return self.clock() - self.last_part_s

    def is_expired(self) -> bool:
        return self.stalled_s() >= self.deadline_s
