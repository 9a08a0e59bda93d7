"""The cache-store's SSD tier: one file per block in a folder, bounded bytes, least recently used evicted first; files
written to a temp name then renamed, every part verified on read, the folder re-indexed from headers on open.

It does not decide what is admitted, and reports nothing: `services.cache_store.tiers.tiers` does both.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import re
import uuid
from collections import OrderedDict
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import aiofiles
import aiofiles.os

from services.cache_store.tiers import blockfile
from services.cache_store.tiers.block import StoredBlock
from services.cache_store.tiers.blockfile import BlockFileError, encode_header, parse_block_file

BLOCK_FILE = re.compile(r"([0-9a-f]{16})\.kvb")
TEMP_FILE = re.compile(r"\.[0-9a-f]{16}-[0-9a-f]{8}\.kvb\.tmp")
LOCK_NAME = ".tsukimi-cache.lock"


class CorruptBlockError(Exception):
    """A block file failed its checks (or could not be read); it was deleted and is no longer indexed."""


class SsdFullError(ValueError):
    """No room: the block is larger than the tier, or the files that would have to go are pinned."""


@dataclass
class ReindexReport:
    """What opening the folder found."""

    num_blocks: int = 0
    num_bytes: int = 0
    num_temp_removed: int = 0
    num_corrupt_removed: int = 0
    num_unknown: int = 0  # files that are not ours: left alone, not indexed
    num_evicted: int = 0  # over the capacity (it shrank since the last run)


@dataclass(frozen=True)
class SsdReservation:
    """Room made for one block (`SsdTier.reserve`), to be filled by `SsdTier.write`."""

    block_hash: int
    block: StoredBlock
    header: bytes
    num_bytes: int
    evicted: list[int]


class SsdTier:
    """Blocks as files `<hash:016x>.kvb` in `folder`, at most `capacity_bytes` of them (file sizes).

    Call `open()` before use (it locks the folder, so two stores never share one) and `close()` after.

    Args:
        folder: the tier's own folder (created if missing).
        capacity_bytes: the most bytes of block files kept.
        durable: fsync each file before renaming it into place.
    Raises:
        ValueError: a capacity below 1.
    """

    def __init__(self, folder: Path, capacity_bytes: int, durable: bool = True) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be at least 1, got {capacity_bytes}")
        self.folder, self.capacity_bytes, self.durable = folder, capacity_bytes, durable
        self._index: OrderedDict[int, int] = OrderedDict()  # hash -> file bytes, least recently used first
        self._num_bytes = 0  # indexed files plus reservations being written
        self._lock: IO[str] | None = None

    @property
    def num_bytes(self) -> int:
        return self._num_bytes

    @property
    def num_blocks(self) -> int:
        return len(self._index)

    def path_of(self, block_hash: int) -> Path:
        return self.folder / f"{block_hash:016x}.kvb"

    def has(self, block_hash: int) -> bool:
        return block_hash in self._index

    def hashes(self) -> list[int]:
        """Every indexed hash, least recently used first."""
        return list(self._index)

    def open(self) -> ReindexReport:
        """Create and lock the folder, then index it from file headers (blocking: run it in a thread).

        Temp files and corrupt block files are deleted; files that are not ours are left alone. Recency is the files'
        modification times (a read touches its file). Over capacity, the least recently used files are deleted.

        Raises:
            OSError: the folder cannot be created or read, or another cache-store holds its lock.
        """
        self.folder.mkdir(parents=True, exist_ok=True)
        self._take_lock()
        report, found = ReindexReport(), []
        for entry in os.scandir(self.folder):
            if not entry.is_file(follow_symlinks=False) or entry.name == LOCK_NAME:
                continue
            if TEMP_FILE.fullmatch(entry.name):
                _unlink(Path(entry.path))
                report.num_temp_removed += 1
            elif (match := BLOCK_FILE.fullmatch(entry.name)) is None:
                report.num_unknown += 1
            elif (mtime_size := _checked_file(Path(entry.path), int(match[1], 16))) is None:
                _unlink(Path(entry.path))
                report.num_corrupt_removed += 1
            else:
                found.append((*mtime_size, int(match[1], 16)))
        index = OrderedDict((block_hash, size) for _, size, block_hash in sorted(found))
        self._index, self._num_bytes = index, sum(index.values())  # swapped whole: readers see before or after
        report.num_evicted = len(self._evict_for(0, lambda h: False))
        report.num_blocks, report.num_bytes = len(self._index), self._num_bytes
        return report

    def close(self) -> None:
        """Release the folder's lock; the files stay for the next `open`."""
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def reserve(self, block_hash: int, block: StoredBlock, is_pinned: Callable[[int], bool]) -> SsdReservation:
        """Make room for a block by deleting the least recently used unpinned files (listed in the result).

        Raises:
            SsdFullError: the block does not fit even after evicting every unpinned file (nothing is deleted then).
            ValueError: the block cannot be encoded (see `encode_header`), or it is already indexed.
        """
        if block_hash in self._index:
            raise ValueError(f"block {block_hash:#x} is already on SSD")
        header = encode_header(block_hash, block)
        num_bytes = len(header) + len(block)
        if num_bytes > self.capacity_bytes:
            raise SsdFullError(f"block {block_hash:#x} of {num_bytes} bytes exceeds the SSD capacity")
        evicted = self._evict_for(num_bytes, is_pinned)
        if self._num_bytes + num_bytes > self.capacity_bytes:
            raise SsdFullError(f"no room for block {block_hash:#x}: the files that would have to go are pinned")
        self._num_bytes += num_bytes
        return SsdReservation(block_hash, block, header, num_bytes, evicted)

    async def write(self, reservation: SsdReservation) -> None:
        """Write a reserved block to a temp file, flush (and fsync), and rename it into place; then it is indexed.

        Raises:
            OSError: the write failed; the reservation is released and no file is left.
        """
        final = self.path_of(reservation.block_hash)
        temp = self.folder / f".{reservation.block_hash:016x}-{uuid.uuid4().hex[:8]}.kvb.tmp"
        try:
            async with aiofiles.open(temp, "wb") as f:
                await f.write(reservation.header)
                for part in reservation.block.parts:
                    await f.write(part.data)
                await f.flush()
                if self.durable:
                    await asyncio.to_thread(os.fsync, f.fileno())
            await aiofiles.os.replace(temp, final)
        except BaseException:  # cancellation too: never leave a reservation or a temp file behind
            self._num_bytes -= reservation.num_bytes
            _unlink(temp)
            raise
        self._index[reservation.block_hash] = reservation.num_bytes

    async def put(self, block_hash: int, block: StoredBlock, is_pinned: Callable[[int], bool]) -> list[int]:
        """`reserve` then `write`: the hashes evicted to make room. Raises what those raise."""
        reservation = self.reserve(block_hash, block, is_pinned)
        await self.write(reservation)
        return reservation.evicted

    async def get(self, block_hash: int) -> StoredBlock | None:
        """The block, every part verified and now the most recently used; None when not indexed.

        Raises:
            CorruptBlockError: the file failed a check or could not be read; it was deleted and un-indexed.
        """
        if block_hash not in self._index:
            return None
        path = self.path_of(block_hash)
        try:
            async with aiofiles.open(path, "rb") as f:
                data = await f.read()
            block = parse_block_file(data, block_hash)
        except FileNotFoundError:
            size = self._index.pop(block_hash, None)
            if size is None:
                return None  # evicted while we were opening it
            self._num_bytes -= size
            raise CorruptBlockError(f"block file {path.name} vanished") from None
        except (OSError, BlockFileError) as exc:
            if not self.remove(block_hash):
                return None
            raise CorruptBlockError(f"block file {path.name}: {exc}") from None
        if block_hash in self._index:
            self._index.move_to_end(block_hash)
            with suppress(OSError):
                os.utime(path)  # recency survives a restart
        return block

    def remove(self, block_hash: int) -> bool:
        """Delete one block's file; True when it was indexed."""
        size = self._index.pop(block_hash, None)
        if size is None:
            return False
        self._num_bytes -= size
        _unlink(self.path_of(block_hash))
        return True

    def _evict_for(self, num_bytes: int, is_pinned: Callable[[int], bool]) -> list[int]:
        """Delete least recently used unpinned files until `num_bytes` more fit; nothing when that cannot be done."""
        excess = self._num_bytes + num_bytes - self.capacity_bytes
        victims: list[int] = []
        for block_hash, size in self._index.items():
            if excess <= 0:
                break
            if not is_pinned(block_hash):
                victims.append(block_hash)
                excess -= size
        if excess > 0:
            return []
        for block_hash in victims:
            self.remove(block_hash)
        return victims

    def _take_lock(self) -> None:
        if self._lock is not None:
            return
        lock = open(self.folder / LOCK_NAME, "a")  # held open (and locked) until close()
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise OSError(f"{self.folder} is in use by another cache-store") from None
        self._lock = lock


def _checked_file(path: Path, block_hash: int) -> tuple[int, int] | None:
    """(mtime_ns, counted size) of a block file whose header is valid, names `block_hash` and matches its size; else
    None. A size-only block counts the size it stands for, as when it was written."""
    try:
        with path.open("rb") as f:
            head = f.read(blockfile.HEAD.size)
            header = blockfile.parse_header(head + f.read(blockfile.PART.size * blockfile.num_parts_in(head)))
            stat = os.fstat(f.fileno())
    except (OSError, BlockFileError):
        return None
    if header.block_hash != block_hash or header.file_len != stat.st_size:
        return None
    return stat.st_mtime_ns, header.num_counted_bytes


def _unlink(path: Path) -> None:
    with suppress(FileNotFoundError):
        path.unlink()
