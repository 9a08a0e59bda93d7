"""The prefix-cache index of the paged block manager (`shared.engine.blocks`): which block holds the KV of which chained
block hash (`shared.wire.block_hash`'s).

Owns the registrations (block hash -> block id, each registered block's hash and tokens), the evictable LRU of
registered blocks no sequence references, the live private copies that take a registration over, the eviction count
and the events that report the index's changes; owns neither reference counts nor the free list (the block manager's),
and no tensors (no torch here).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Callable

from shared.wire.block_hash import chain_hashes
from shared.wire.protocol.messages import REMOVED, STORED  # the index's event kinds are the KvEvent kinds

__all__ = ["BlockEventHook", "PrefixIndex"]

# Called with (STORED or REMOVED, block hashes) each time blocks enter or leave the prefix-cache index.
BlockEventHook = Callable[[str, list[int]], None]


class PrefixIndex:
    """Registers computed full blocks of ``block_size`` tokens under their chained hashes, so new sequences reuse them.

    A registered block is either referenced by sequences or cached-unreferenced, waiting in the evictable LRU (least
    recently freed first); the block manager, which counts references, says which (``release``, ``revive``). One block
    is registered per hash: another block computed with the same tokens stays a private copy, and takes the
    registration over when the registered block loses its last reference, so the index keeps every prefix whose KV a
    live sequence holds. A hit whose stored tokens differ is a 64-bit hash collision: a miss, the block stays private.

    ``on_event`` hears every change of the index: ``(STORED, hashes)`` on registration, ``(REMOVED, hashes)`` on
    eviction; a listener that replays them knows the index exactly.

    The block manager's hot paths and self-check read the attributes; only these methods change them.
    """

    def __init__(
        self, num_blocks: int, block_size: int, namespace: bytes, on_event: BlockEventHook | None = None
    ) -> None:
        self.block_size = block_size
        self.namespace = namespace
        self.by_hash: dict[int, int] = {}  # block hash -> block id
        self.block_hash: list[int | None] = [None] * num_blocks  # set only while registered in by_hash
        self.block_tokens: list[array[int] | None] = [None] * num_blocks  # same
        self.evictable: OrderedDict[int, int] = OrderedDict()  # block id -> hash, least recently freed first
        # block hash -> live sequences' private computed copies of its registered block. One takes the registration
        # over when that block loses its last reference, so the index keeps every prefix whose KV a sequence holds.
        self.copies: dict[int, list[int]] = {}
        self.num_evictions = 0  # cached blocks evicted to hand out fresh ones
        self.on_event = on_event

    def match(self, tokens: array[int]) -> tuple[list[int], list[int]]:
        """The registered blocks reusable for ``tokens`` and the chained hashes computed on the way; read-only.

        Only full blocks inside ``tokens[:-1]`` count: the caller must always compute the last token.
        """
        reused: list[int] = []
        hashes: list[int] = []
        by_hash, tokens_of = self.by_hash, self.block_tokens
        for block_tokens, block_hash in chain_hashes(tokens[:-1], self.block_size, self.namespace):  # last: computed
            hashes.append(block_hash)
            block_id = by_hash.get(block_hash)
            # A hit whose stored tokens differ is a 64-bit hash collision: treat it as a miss.
            if block_id is None or tokens_of[block_id] != block_tokens:
                break
            reused.append(block_id)
        return reused, hashes

    def register(
        self, hashes: list[int], block_ids: list[int], token_ids: array[int], start: int, end: int
    ) -> list[int]:
        """Register a sequence's computed full blocks ``start`` to ``end``, referenced and not registered yet.

        ``block_ids`` is the sequence's table, ``token_ids`` its tokens and ``hashes`` the chained ids of its leading
        full blocks, which this extends to ``end`` blocks. A block whose hash another block holds stays private: a copy
        of that registered block if their tokens match (else a 64-bit hash collision). If that holder is
        cached-unreferenced, the copy takes its registration over at once, which displaces the holder.

        Returns:
            The displaced holders, unregistered and unreferenced: the caller's to free.
        """
        size, by_hash, hash_of, tokens_of, evictable = (
            self.block_size, self.by_hash, self.block_hash, self.block_tokens, self.evictable
        )
        done = len(hashes)
        if done < end:
            parent = hashes[-1] if hashes else None
            hashes += [h for _, h in chain_hashes(token_ids[: end * size], size, self.namespace, done, parent)]
        stored: list[int] = []
        displaced: list[int] = []
        for i in range(start, end):
            block_hash, block_id = hashes[i], block_ids[i]
            tokens = token_ids[i * size : (i + 1) * size]
            holder = by_hash.get(block_hash)
            if holder is None:
                by_hash[block_hash] = block_id
                hash_of[block_id] = block_hash
                tokens_of[block_id] = tokens
                stored.append(block_hash)
            elif tokens_of[holder] == tokens:  # else a 64-bit hash collision: this block stays private
                self.copies.setdefault(block_hash, []).append(block_id)
                if evictable.pop(holder, None) is not None:  # unreferenced: the copy takes the registration now
                    self.release(holder, block_hash)
                    displaced.append(holder)
        if stored and self.on_event is not None:
            self.on_event(STORED, stored)
        return displaced

    def release(self, block_id: int, block_hash: int) -> bool:
        """Registered block ``block_id`` (under ``block_hash``) lost its last reference: a live copy takes the
        registration over (the hash stays in the index: no event), else the block joins the LRU.

        Returns:
            Whether a copy took over: then ``block_id`` is unregistered, its KV garbage, the caller's to free.
        """
        copies = self.copies.get(block_hash)
        if not copies:
            self.evictable[block_id] = block_hash
            return False
        successor = copies[0]
        self.drop_copy(block_hash, successor)
        self.by_hash[block_hash] = successor
        self.block_hash[successor] = block_hash
        self.block_tokens[successor] = self.block_tokens[block_id]
        self.block_hash[block_id] = None
        self.block_tokens[block_id] = None
        return True

    def revive(self, block_ids: list[int]) -> None:
        """Registered blocks are referenced again (reused by a new sequence): the cached-unreferenced leave the LRU."""
        evictable = self.evictable
        for block_id in block_ids:
            evictable.pop(block_id, None)

    def drop_copy(self, block_hash: int, block_id: int) -> None:
        """Private copy ``block_id`` of the block registered under ``block_hash`` is gone (lost its last reference)."""
        copies = self.copies.get(block_hash, [])
        if block_id in copies:  # absent only after a 64-bit hash collision left the block private
            copies.remove(block_id)
        if not copies:
            self.copies.pop(block_hash, None)

    def evict(self, count: int) -> list[int]:
        """Unregister the ``count`` least recently freed cached-unreferenced blocks, reporting them REMOVED.

        Returns:
            The evicted blocks, their KV garbage now: the caller's to hand out. The caller makes sure the LRU holds
            ``count`` blocks.
        """
        evictable, by_hash, hash_of, tokens_of = self.evictable, self.by_hash, self.block_hash, self.block_tokens
        evicted: list[int] = []
        removed: list[int] = []
        for _ in range(count):
            block_id, block_hash = evictable.popitem(last=False)
            del by_hash[block_hash]
            hash_of[block_id] = None
            tokens_of[block_id] = None
            evicted.append(block_id)
            removed.append(block_hash)
        self.num_evictions += len(evicted)
        if removed and self.on_event is not None:
            self.on_event(REMOVED, removed)
        return evicted
