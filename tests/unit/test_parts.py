"""Checksummed parts (`shared.wire.parts`): cutting and coding a payload, and assembling it back: every part verified
before it is decoded, parts that disagree refused, duplicates told apart, missing parts named, stalled wholes
expired, parts kept as they came for a store, the shuffle width of a part that is not whole elements."""

from __future__ import annotations

import array
import dataclasses
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from shared.wire import parts
from shared.wire.parts import PartAssembly, PartBody, PartError, cut_payload, encode_part, shuffle_width
from shared.wire.payload import (
    CODEC_LZ4_SHUFFLE,
    CODEC_RAW,
    CODEC_SIZE_ONLY,
    Payload,
    SizeOnly,
    checksum,
    decompress,
    join,
)

GIB = 1 << 30


@dataclass(frozen=True)
class Piece:
    """A part message as callers have them: where it belongs, what whole it is of, and its coded bytes."""

    whole: str
    seq: int
    total: int
    codec: str
    raw_size: int
    checksum: int
    data: bytes


def pieces_of(raw: Payload, part_bytes: int, whole: str = "w", itemsize: int = 4) -> list[Piece]:
    bodies = cut_payload(raw, part_bytes, itemsize)
    return [Piece(whole, seq, len(bodies), **body.fields()) for seq, body in enumerate(bodies)]


def assembly(
    total: int, itemsize: int = 4, deadline_s: float = float("inf"), decode: bool = True,
    clock: Callable[[], float] = time.monotonic,
) -> PartAssembly[Piece]:
    return PartAssembly(
        "whole w", total, lambda p: {"whole": p.whole}, lambda p: shuffle_width(p.raw_size, itemsize), deadline_s,
        decode, clock,
    )


def float_bytes(num_bytes: int) -> bytes:
    """Random bytes for the first third (nothing shrinks them), smooth float32 after (shuffled LZ4 does)."""
    noise = random.Random(1).randbytes(num_bytes // 3)
    floats = array.array("f", (math.sin(i * 0.01) for i in range((num_bytes - len(noise)) // 4))).tobytes()
    return noise + floats


def test_bytes_cut_into_parts_come_back_whole_in_any_order() -> None:
    raw = float_bytes(12_000)
    pieces = pieces_of(raw, 1000)
    assert len(pieces) == 12 and {p.codec for p in pieces} == {CODEC_RAW, CODEC_LZ4_SHUFFLE}
    whole = assembly(len(pieces))
    for piece in random.Random(2).sample(pieces, len(pieces)):
        assert whole.add(piece) == raw[1000 * piece.seq : 1000 * (piece.seq + 1)]
    assert whole.is_complete and whole.missing() == []
    whole.check_complete()
    assert join([kept for _, kept in whole.pieces()]) == raw
    assert whole.num_held_bytes == len(raw) and whole.num_wire_bytes == sum(len(p.data) for p in pieces) < len(raw)
    assert [header.data for header, _ in whole.pieces()] == [b""] * 12  # kept without their coded bytes


def test_a_size_only_payload_is_one_part_that_comes_back_as_its_size() -> None:
    (piece,) = pieces_of(SizeOnly(10 * GIB), 1 << 20)
    assert (piece.codec, piece.raw_size, piece.data, piece.checksum) == (CODEC_SIZE_ONLY, 10 * GIB, b"", checksum(b""))
    whole = assembly(1)
    assert whole.add(piece) == SizeOnly(10 * GIB)
    assert whole.num_held_bytes == whole.num_wire_bytes == 0  # it allocates nothing


def test_empty_bytes_are_one_empty_part() -> None:
    (piece,) = pieces_of(b"", 100)
    assert (piece.codec, piece.raw_size, piece.data) == (CODEC_RAW, 0, b"")
    assert assembly(1).add(piece) == b""


def test_parts_hold_whole_units_where_one_fits() -> None:
    assert [body.raw_size for body in cut_payload(bytes(10), 4, align_bytes=3)] == [3, 3, 3, 1]
    assert [body.raw_size for body in cut_payload(bytes(10), 4, align_bytes=8)] == [4, 4, 2]  # no unit fits


def test_a_corrupt_part_is_refused_before_anything_decodes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    (piece,) = pieces_of(bytes(4000), 4000)
    assert piece.codec == CODEC_LZ4_SHUFFLE
    decoded: list[str] = []
    real = parts.decompress

    def counted(codec: str, data: bytes, raw_size: int, itemsize: int) -> Payload:
        decoded.append(codec)
        return real(codec, data, raw_size, itemsize)

    monkeypatch.setattr(parts, "decompress", counted)
    whole = assembly(1)
    flipped = dataclasses.replace(piece, data=bytes([piece.data[0] ^ 1]) + piece.data[1:])
    with pytest.raises(PartError, match="whole w.*part 0/1 failed its checksum"):
        whole.add(flipped)
    assert decoded == [] and whole.num_received == 0
    garbage = dataclasses.replace(piece, data=b"not lz4", checksum=checksum(b"not lz4"))  # verifies, does not decode
    with pytest.raises(PartError, match="does not decode"):
        whole.add(garbage)
    assert decoded == [CODEC_LZ4_SHUFFLE] and whole.num_received == 0
    assert whole.add(piece) == bytes(4000)


def test_an_identical_duplicate_is_ignored_and_a_conflicting_one_refused() -> None:
    first, second = pieces_of(float_bytes(2000), 1000)
    whole = assembly(2)
    assert whole.add(first) is not None
    held, wire = whole.num_held_bytes, whole.num_wire_bytes
    assert whole.add(dataclasses.replace(first)) is None
    assert (whole.num_received, whole.num_held_bytes, whole.num_wire_bytes) == (1, held, wire)
    other = encode_part(bytes(1000), 4)
    with pytest.raises(PartError, match="part 0/2 arrived twice with different contents"):
        whole.add(dataclasses.replace(first, **other.fields()))
    assert whole.add(second) is not None and whole.is_complete


@pytest.mark.parametrize(("change", "complaint"), [
    ({"total": 3}, "says 3 parts, earlier ones said 2"),
    ({"seq": 2}, "seq out of range 0..1"),
    ({"seq": -1}, "seq out of range 0..1"),
    ({"whole": "v"}, "has whole 'v', the earlier parts 'w'"),
    ({"raw_size": -1}, "raw size -1"),
])
def test_a_part_that_does_not_fit_the_whole_is_refused(change: dict[str, object], complaint: str) -> None:
    first, second = pieces_of(b"ab" * 1000, 1000)
    whole = assembly(2)
    whole.add(first)
    with pytest.raises(PartError, match=complaint):
        whole.add(dataclasses.replace(second, **change))
    assert whole.missing() == [1]


def test_the_first_part_sets_what_the_others_must_agree_on() -> None:
    pieces = pieces_of(b"ab" * 1000, 1000, whole="v")
    whole = assembly(2)
    whole.add(pieces[1])
    with pytest.raises(PartError, match="has whole 'w', the earlier parts 'v'"):
        whole.add(dataclasses.replace(pieces[0], whole="w"))
    with pytest.raises(PartError, match="a whole of 0 parts"):
        assembly(0)


def test_missing_parts_are_listed_and_named() -> None:
    pieces = pieces_of(bytes(13), 1)
    whole = assembly(13)
    whole.add(pieces[3])
    assert whole.missing() == [0, 1, 2, *range(4, 13)]
    with pytest.raises(PartError, match=r"whole w.* 12 of 13 parts missing \(0, 1, 2, 4, 5, 6, 7, 8, 9, 10, \.\.\.\)"):
        whole.check_complete()
    for piece in pieces:
        whole.add(piece)
    whole.check_complete()


def test_a_whole_expires_when_its_parts_stop_not_when_it_began() -> None:
    now = [100.0]
    pieces = pieces_of(bytes(30), 10)
    whole, forever = assembly(3, deadline_s=10.0, clock=lambda: now[0]), assembly(3, clock=lambda: now[0])
    now[0] = 109.0
    assert not whole.is_expired() and whole.stalled_s() == 9.0
    whole.add(pieces[0])
    now[0] = 118.0  # 18 s since it opened, 9 since its last part
    assert not whole.is_expired()
    whole.add(pieces[0])  # a duplicate is no progress
    now[0] = 119.0
    assert whole.is_expired()
    now[0] += 1e9
    assert not forever.is_expired()  # no deadline by default


def test_without_decoding_the_parts_are_kept_as_they_came() -> None:
    raw = float_bytes(3000)
    pieces = pieces_of(raw, 1000)
    whole = assembly(3, decode=False)
    for piece in pieces:
        assert whole.add(piece) == piece.data
    assert [kept for _, kept in whole.pieces()] == [p.data for p in pieces]
    assert whole.parts() == pieces
    assert whole.num_held_bytes == whole.num_wire_bytes == sum(len(p.data) for p in pieces) < len(raw)
    assert pieces[1].codec == CODEC_LZ4_SHUFFLE
    kept = assembly(3, decode=False)  # not decoded: LZ4 the reader refuses is kept, what is cheap to check is refused
    assert kept.add(dataclasses.replace(pieces[1], data=b"zz", checksum=checksum(b"zz"))) == b"zz"
    with pytest.raises(PartError, match="3 raw bytes, expected 4"):
        kept.add(dataclasses.replace(pieces[0], codec=CODEC_RAW, raw_size=4, data=b"abc", checksum=checksum(b"abc")))
    with pytest.raises(PartError, match="unknown payload codec 'zstd'"):
        kept.add(dataclasses.replace(pieces[0], codec="zstd"))
    decoding = assembly(3)
    decoding.add(pieces[0])
    with pytest.raises(ValueError, match="decoded"):
        decoding.parts()


def test_a_part_not_of_whole_elements_is_shuffled_by_one() -> None:
    assert (shuffle_width(12, 4), shuffle_width(10, 4), shuffle_width(0, 4), shuffle_width(7, 0)) == (4, 1, 4, 1)
    raw = bytes(range(10)) * 200 + b"x"  # compressible by any width; 1001 + 1000 bytes in two parts
    bodies = cut_payload(raw, 1001, itemsize=4)
    assert [(b.codec, b.raw_size) for b in bodies] == [(CODEC_LZ4_SHUFFLE, 1001), (CODEC_LZ4_SHUFFLE, 1000)]
    assert decompress(bodies[1].codec, bodies[1].data, 1000, 1) != raw[1001:]  # the whole elements: shuffled by 4
    whole = assembly(2, itemsize=4)
    for seq, body in enumerate(bodies):
        whole.add(Piece("w", seq, 2, **body.fields()))
    assert join([kept for _, kept in whole.pieces()]) == raw
    with pytest.raises(ValueError, match="not a whole number of 4-byte elements"):
        encode_part(raw[:1001], 4)  # one part is coded by the width it is given
    assert encode_part(raw, 1, compress_payload=False) == PartBody(CODEC_RAW, len(raw), checksum(raw), raw)
