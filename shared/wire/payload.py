"""How payload bytes are coded (every part of `shared.wire.parts`): the xxh3 checksum, byte-shuffle + LZ4 when it
pays, and size-only payloads, which carry no bytes but the size they stand for (the sim engine's KV).

It knows nothing of tensors, chunks or blocks: `shared.wire.parts` cuts and frames the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import lz4.frame
import numpy as np
import xxhash

CODEC_RAW = "raw"
CODEC_LZ4_SHUFFLE = "lz4-shuffle"
CODEC_SIZE_ONLY = "size-only"  # no data travels; `raw_size` is the size of what it stands for
_MIN_SAVING = 0.05  # compress only when it saves at least this fraction of the bytes


class PayloadError(Exception):
    """A payload that does not decode: an unknown codec, bad LZ4, or the wrong size."""


@dataclass(frozen=True)
class SizeOnly:
    """A payload of `num_bytes` bytes whose contents are not carried (the sim engine's KV has sizes, not values)."""

    num_bytes: int

    def __len__(self) -> int:
        return self.num_bytes


Payload = bytes | SizeOnly


def join(parts: list[Payload]) -> Payload:
    """Parts back into one payload: bytes when every part has bytes, else the size of them all."""
    if all(isinstance(p, bytes) for p in parts):
        return b"".join(parts)  # type: ignore[arg-type]
    return SizeOnly(sum(len(p) for p in parts))


def checksum(data: bytes) -> int:
    """xxh3-64 of `data` (what `KvChunk.checksum` holds, over the compressed bytes)."""
    return xxhash.xxh3_64_intdigest(data)


def compress(raw: Payload, itemsize: int) -> tuple[str, bytes]:
    """Byte-shuffle then LZ4 `raw`, if that pays.

    Shuffling puts the i-th byte of every element together, so the sign/exponent bytes of floats form long, repetitive
    runs that LZ4 can shorten; the mantissa bytes stay near-random (LZ4 frames store such blocks uncompressed).

    Args:
        raw: the elements' bytes, a whole number of elements.
        itemsize: bytes per element (4 for fp32, 2 for bf16/fp16).
    Returns:
        (CODEC_LZ4_SHUFFLE, compressed) when it saves at least 5% of the bytes, else (CODEC_RAW, raw);
        (CODEC_SIZE_ONLY, b"") for a `SizeOnly` payload.
    Raises:
        ValueError: `len(raw)` is not a multiple of `itemsize`.
    """
    if isinstance(raw, SizeOnly):
        return CODEC_SIZE_ONLY, b""
    if itemsize < 1 or len(raw) % itemsize:
        raise ValueError(f"{len(raw)} bytes are not a whole number of {itemsize}-byte elements")
    if not raw:
        return CODEC_RAW, raw
    packed = lz4.frame.compress(_shuffle(raw, itemsize), store_size=True)
    if len(packed) <= (1.0 - _MIN_SAVING) * len(raw):
        return CODEC_LZ4_SHUFFLE, packed
    return CODEC_RAW, raw


def decompress(codec: str, data: bytes, raw_size: int, itemsize: int) -> Payload:
    """The raw bytes of a payload made by `compress`.

    Args:
        codec, data, raw_size: as the chunk carries them.
        itemsize: bytes per element of the chunk's dtype.
    Raises:
        PayloadError: an unknown codec, undecodable LZ4, or a result that is not `raw_size` bytes.
    """
    if itemsize < 1 or raw_size % itemsize:
        raise PayloadError(f"a raw size of {raw_size} bytes is not a whole number of {itemsize}-byte elements")
    if codec == CODEC_SIZE_ONLY:
        if data:
            raise PayloadError(f"a size-only payload carries {len(data)} bytes")
        return SizeOnly(raw_size)
    if codec == CODEC_RAW:
        raw = data
    elif codec == CODEC_LZ4_SHUFFLE:
        try:
            raw = lz4.frame.decompress(data)
        except (RuntimeError, ValueError, MemoryError) as exc:  # python-lz4 reports frame errors as RuntimeError
            raise PayloadError(f"LZ4 payload does not decode: {exc}") from None
    else:
        raise PayloadError(f"unknown payload codec {codec!r}")
    if len(raw) != raw_size:
        raise PayloadError(f"payload is {len(raw)} bytes after decoding, expected {raw_size}")
    return _unshuffle(raw, itemsize) if codec == CODEC_LZ4_SHUFFLE else raw


def _shuffle(raw: bytes, itemsize: int) -> bytes:
    return np.frombuffer(raw, np.uint8).reshape(-1, itemsize).T.tobytes()  # [itemsize, num_elements]


def _unshuffle(shuffled: bytes, itemsize: int) -> bytes:
    planes = np.frombuffer(shuffled, np.uint8).reshape(itemsize, -1)  # [itemsize, num_elements]
    out = np.empty((planes.shape[1], itemsize), np.uint8)
    for i in range(itemsize):  # a plane at a time: several times faster than numpy's copy of planes.T
        out[:, i] = planes[i]
    return out.tobytes()
