"""The SSD tier's file format: one block per file, a checksummed header (magic, version, hash, part table) then the
parts' bytes as they were put. It only encodes and parses; where files live and when is
`services.cache_store.tiers.ssd`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from services.cache_store.tiers.block import StoredBlock
from shared.wire.payload import CODEC_SIZE_ONLY, checksum
from shared.wire.protocol import BlockPut

MAGIC = b"TKVB"
FORMAT_VERSION = 2  # 2 added each part's tag (shared.wire.block_integrity); re-indexing drops files of version 1
MAX_PARTS = 1 << 16
# magic, version, reserved (0), block hash, number of parts, xxh3-64 of the header (this field zeroed) and part table
HEAD = struct.Struct("<4sHHQIQ")
# one per part: codec (UTF-8, NUL-padded), raw size, data length, xxh3-64 of the data (the wire checksum), tag length,
# tag (NUL-padded)
PART = struct.Struct("<16sQQQB16s")


class BlockFileError(ValueError):
    """Bytes that are not a valid block file, or not the block expected; the message says why."""


@dataclass(frozen=True)
class PartEntry:
    codec: str
    raw_size: int
    data_len: int
    checksum: int
    tag: bytes


@dataclass(frozen=True)
class BlockFileHeader:
    """What a file's header says: enough to index the file without reading its data."""

    block_hash: int
    parts: tuple[PartEntry, ...]

    @property
    def header_len(self) -> int:
        return HEAD.size + PART.size * len(self.parts)

    @property
    def file_len(self) -> int:
        return self.header_len + sum(p.data_len for p in self.parts)

    @property
    def num_counted_bytes(self) -> int:
        """What the block counts for in the tier: the file, with size-only parts at the size they stand for."""
        return self.header_len + sum(p.raw_size if p.codec == CODEC_SIZE_ONLY else p.data_len for p in self.parts)


def encode_header(block_hash: int, block: StoredBlock) -> bytes:
    """The header of the file holding `block`; the parts' data follow it in order.

    Raises:
        ValueError: a hash outside u64, no parts or too many, or a codec name longer than 16 bytes.
    """
    if not 0 <= block_hash < 1 << 64:
        raise ValueError(f"block hash {block_hash} is not a u64")
    if not 1 <= len(block.parts) <= MAX_PARTS:
        raise ValueError(f"a block file holds 1..{MAX_PARTS} parts, not {len(block.parts)}")
    entries = []
    for part in block.parts:
        codec = part.codec.encode()
        if len(codec) > 16:
            raise ValueError(f"codec name {part.codec!r} is longer than 16 bytes")
        if len(part.tag) > 16:
            raise ValueError(f"a tag of {len(part.tag)} bytes")
        entries.append(PART.pack(codec, part.raw_size, len(part.data), part.checksum, len(part.tag), part.tag))
    table = b"".join(entries)
    unsigned = HEAD.pack(MAGIC, FORMAT_VERSION, 0, block_hash, len(block.parts), 0)
    return HEAD.pack(MAGIC, FORMAT_VERSION, 0, block_hash, len(block.parts), checksum(unsigned + table)) + table


def num_parts_in(head: bytes) -> int:
    """How many part entries follow the fixed head (the first `HEAD.size` bytes of a file).

    Raises:
        BlockFileError: too short, a foreign magic, an unknown version, or an impossible part count.
    """
    if len(head) < HEAD.size:
        raise BlockFileError(f"{len(head)} bytes are too short for a header")
    magic, version, _, _, num_parts, _ = HEAD.unpack_from(head)
    if magic != MAGIC:
        raise BlockFileError(f"magic {magic!r} is not {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise BlockFileError(f"format version {version} is not {FORMAT_VERSION}")
    if not 1 <= num_parts <= MAX_PARTS:
        raise BlockFileError(f"{num_parts} parts")
    return int(num_parts)


def parse_header(data: bytes) -> BlockFileHeader:
    """The header at the start of `data` (which may hold more), its checksum verified.

    Raises:
        BlockFileError: see `num_parts_in`; also a truncated part table, a header checksum mismatch, a bad codec.
    """
    num_parts = num_parts_in(data)
    header_len = HEAD.size + PART.size * num_parts
    if len(data) < header_len:
        raise BlockFileError(f"part table truncated at {len(data)} of {header_len} bytes")
    _, _, _, block_hash, _, expected = HEAD.unpack_from(data)
    unsigned = HEAD.pack(MAGIC, FORMAT_VERSION, 0, block_hash, num_parts, 0)
    if checksum(unsigned + data[HEAD.size : header_len]) != expected:
        raise BlockFileError("header checksum mismatch")
    parts = []
    for i in range(num_parts):
        codec, raw_size, data_len, part_checksum, tag_len, tag = PART.unpack_from(data, HEAD.size + i * PART.size)
        try:
            name = codec.rstrip(b"\0").decode()
        except UnicodeDecodeError:
            raise BlockFileError(f"part {i} has an undecodable codec name") from None
        if tag_len > len(tag):
            raise BlockFileError(f"part {i} has a tag of {tag_len} bytes")
        parts.append(PartEntry(name, raw_size, data_len, part_checksum, tag[:tag_len]))
    return BlockFileHeader(block_hash, tuple(parts))


def parse_block_file(data: bytes, block_hash: int) -> StoredBlock:
    """The block a whole file holds, every part's checksum verified.

    Raises:
        BlockFileError: see `parse_header`; also another block's hash, a wrong length, or a part checksum mismatch.
    """
    header = parse_header(data)
    if header.block_hash != block_hash:
        raise BlockFileError(f"file holds block {header.block_hash:#x}, not {block_hash:#x}")
    if len(data) != header.file_len:
        raise BlockFileError(f"{len(data)} bytes where the header says {header.file_len}")
    view, offset, parts = memoryview(data), header.header_len, []
    for index, entry in enumerate(header.parts):
        payload = bytes(view[offset : offset + entry.data_len])
        offset += entry.data_len
        if checksum(payload) != entry.checksum:
            raise BlockFileError(f"checksum mismatch in part {index}")
        parts.append(BlockPut(block_hash, index, len(header.parts), entry.codec, entry.raw_size, entry.checksum,
                              payload, entry.tag))
    return StoredBlock(tuple(parts))
