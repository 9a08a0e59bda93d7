"""The paged block manager; the prefix-cache index it registers blocks in is `shared.engine.prefix_index`'s, under the
chained block hash of `shared.wire.block_hash`.

Owns block ids, the sequences' block tables, reference counts, the free list and the raw blocks; the index, its LRU and
the events that report the index's changes are the `PrefixIndex`'s. Owns no tensors (no torch here).
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from shared.engine.block_checks import InvariantChecks
from shared.engine.prefix_index import BlockEventHook, PrefixIndex
from shared.wire.block_hash import u32_tokens

__all__ = ["BlockEventHook", "BlockManager", "BlockStats", "OutOfBlocks"]


class OutOfBlocks(Exception):
    """The free pool holds fewer blocks than an operation needs; the manager's state is unchanged."""


@dataclass(frozen=True, slots=True)
class BlockStats:
    num_cached_blocks: int  # entries in the prefix-cache index
    num_evictions: int  # cached blocks evicted to hand out fresh ones
    num_reused_blocks_total: int  # blocks handed to new sequences by prefix reuse


@dataclass(slots=True)
class _Seq:
    token_ids: array[int]
    block_ids: list[int]
    num_computed: int
    num_published: int  # leading blocks already registered, or found registered elsewhere (reused or duplicate)
    hashes: list[int] = field(default_factory=list)  # chained ids of the first len(hashes) full blocks
    is_loading: bool = False  # blocks from num_published on wait for KV written from outside (start_loading)


class BlockManager(InvariantChecks):
    """Pages sequences onto ``num_blocks`` physical blocks of ``block_size`` token slots, reusing prefixes.

    Every block is in exactly one state: free (contents are garbage), cached-unreferenced (registered in
    the prefix index, waiting in an LRU, evictable), or referenced by one or more sequences. Only full blocks
    whose KV the caller reported computed (``mark_computed``) are registered, so a reused block holds valid
    KV. Operations cost O(1) per block touched, plus O(block_size) per block hashed.

    Blocks whose KV is loaded from outside (``start_loading``) stay unregistered until ``finish_loading``.
    ``on_event`` hears every change of the index: ``(STORED, hashes)`` on registration, ``(REMOVED,
    hashes)`` on eviction; a listener that replays them knows the index exactly.
    """

    def __init__(
        self, num_blocks: int, block_size: int, namespace: bytes = b"", on_event: BlockEventHook | None = None
    ) -> None:
        """Raises ValueError if num_blocks or block_size is not positive."""
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive: {num_blocks}, {block_size}")
        self._num_blocks = num_blocks
        self._block_size = block_size
        self._namespace = bytes(namespace)
        self._ref_counts = [0] * num_blocks
        # A stack, block 0 on top: the most recently freed block is taken first, its pages already mapped (the CPU pool
        # maps pages on first touch) and likely still in cache, where taking the oldest cycled through the whole pool.
        self._free: deque[int] = deque(range(num_blocks - 1, -1, -1))
        self._prefix_index = PrefixIndex(num_blocks, block_size, self._namespace, on_event)
        self._seqs: dict[Hashable, _Seq] = {}
        self._raw: set[int] = set()  # blocks handed out whole by `take_raw`, outside any sequence
        self._num_reused_blocks_total = 0

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def namespace(self) -> bytes:
        return self._namespace

    @property
    def on_event(self) -> BlockEventHook | None:
        """Hears every change of the prefix-cache index (the `PrefixIndex`'s listener)."""
        return self._prefix_index.on_event

    @on_event.setter
    def on_event(self, on_event: BlockEventHook | None) -> None:
        self._prefix_index.on_event = on_event

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now: free ones plus cached-unreferenced (evictable) ones."""
        return len(self._free) + len(self._prefix_index.evictable)

    @property
    def stats(self) -> BlockStats:
        index = self._prefix_index
        return BlockStats(len(index.by_hash), index.num_evictions, self._num_reused_blocks_total)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def num_reusable_tokens(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens ``allocate(token_ids)`` would reuse (a multiple of block_size); read-only.

        Only full blocks inside ``token_ids[:-1]`` count: the caller must always compute the last token.
        """
        reused, _ = self._prefix_index.match(u32_tokens(token_ids))
        return len(reused) * self._block_size

    def blocks_needed(self, token_ids: Sequence[int]) -> int:
        """How many blocks ``allocate(token_ids)`` would take out of ``num_free_blocks``.

        That is the fresh blocks past the reused prefix plus the reused blocks now cached-unreferenced (they
        leave the evictable LRU), so ``allocate`` succeeds iff ``blocks_needed(t) <= num_free_blocks``.
        """
        tokens = u32_tokens(token_ids)
        reused, _ = self._prefix_index.match(tokens)
        return self._pool_cost(len(tokens), reused)

    def can_append(self, seq_id: Hashable, num_tokens: int) -> bool:
        """Whether appending ``num_tokens`` tokens would succeed now. Raises KeyError for unknown seq_id."""
        return self._num_new_blocks(self._seqs[seq_id], num_tokens) <= self.num_free_blocks

    def block_ids(self, seq_id: Hashable) -> list[int]:
        """A copy of the sequence's block table. Raises KeyError for an unknown seq_id."""
        return list(self._seqs[seq_id].block_ids)

    def num_tokens(self, seq_id: Hashable) -> int:
        return len(self._seqs[seq_id].token_ids)

    def num_computed_tokens(self, seq_id: Hashable) -> int:
        return self._seqs[seq_id].num_computed

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def block_token_ids(self, block_id: int) -> tuple[int, ...]:
        """The tokens of a block registered in the prefix index. Raises KeyError for an unregistered block."""
        tokens = self._prefix_index.block_tokens[block_id]
        if tokens is None:
            raise KeyError(f"block {block_id} is not registered in the prefix index")
        return tuple(tokens)

    def allocate(self, seq_id: Hashable, token_ids: Sequence[int], max_reused_tokens: int | None = None) -> int:
        """Create the block table of a new sequence holding ``token_ids``, reusing cached prefix blocks.

        Reuses the longest chain of cached computed full blocks inside ``token_ids[:-1]`` (at most
        ``max_reused_tokens`` of them: a pipeline stage reuses what the first stage did) and takes fresh
        blocks for the rest (evicting least recently freed cached blocks when the free list is empty). The new
        sequence starts with its reused tokens counted as computed.

        Returns:
            The number of reused tokens, a multiple of block_size.

        Raises:
            ValueError: seq_id already exists, token_ids is empty, or a token is out of range.
            OutOfBlocks: the free pool is too small; no state changes.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already exists")
        tokens = u32_tokens(token_ids)
        if len(tokens) == 0:
            raise ValueError("cannot allocate an empty sequence")
        reused, hashes = self._prefix_index.match(tokens)
        if max_reused_tokens is not None:
            del reused[max_reused_tokens // self._block_size :]
        cost = self._pool_cost(len(tokens), reused)
        if cost > self.num_free_blocks:
            raise OutOfBlocks(f"sequence {seq_id!r} needs {cost} blocks, {self.num_free_blocks} free")
        self._prefix_index.revive(reused)
        ref_counts = self._ref_counts
        for block_id in reused:
            ref_counts[block_id] += 1
        fresh = self._take_fresh(self._num_blocks_for(len(tokens)) - len(reused))
        num_reused = len(reused) * self._block_size
        self._seqs[seq_id] = _Seq(tokens, reused + fresh, num_reused, len(reused), hashes)
        self._num_reused_blocks_total += len(reused)
        return num_reused

    def append(self, seq_id: Hashable, token_ids: Sequence[int]) -> None:
        """Extend the sequence with more tokens (generated ones, say), taking fresh blocks as needed.

        Raises:
            KeyError: unknown seq_id.
            ValueError: a token is out of range.
            OutOfBlocks: not enough free blocks; no state changes.
        """
        seq = self._seqs[seq_id]
        tokens = u32_tokens(token_ids)
        needed = self._num_new_blocks(seq, len(tokens))
        if needed > self.num_free_blocks:
            raise OutOfBlocks(f"sequence {seq_id!r} needs {needed} more blocks, {self.num_free_blocks} free")
        if needed:
            seq.block_ids.extend(self._take_fresh(needed))
        seq.token_ids.extend(tokens)

    def mark_computed(self, seq_id: Hashable, num_computed_tokens: int) -> None:
        """Record that KV is now written for the sequence's first ``num_computed_tokens`` tokens.

        Every full block newly inside that range is registered in the prefix index under its chained hash,
        unless another block already holds that hash (that registration stays; this copy stays private, and takes
        it over if that block loses its last reference first). While loading, registration waits for ``finish_loading``.

        Raises:
            KeyError: unknown seq_id.
            ValueError: num_computed_tokens is below the current count or above the sequence's length.
        """
        seq = self._seqs[seq_id]
        if not seq.num_computed <= num_computed_tokens <= len(seq.token_ids):
            bounds = f"[{seq.num_computed}, {len(seq.token_ids)}]"
            raise ValueError(f"num_computed_tokens {num_computed_tokens} outside {bounds}")
        seq.num_computed = num_computed_tokens
        self._publish(seq)

    def start_loading(self, seq_id: Hashable, num_tokens: int) -> None:
        """Declare that the KV of tokens [num_computed, num_tokens) will be written from outside (a fetched prefix).

        They count as computed at once (the caller computes only what follows), but their blocks and every block after
        them stay out of the prefix index, so no sequence reuses KV that has not arrived, until ``finish_loading``.
        To give up on the load, ``free`` the sequence: its blocks go back unregistered.

        Raises:
            KeyError: unknown seq_id.
            ValueError: already loading, the computed count or num_tokens is not a whole number of blocks, or
                num_tokens is not past the computed count and within the sequence.
        """
        seq = self._seqs[seq_id]
        size = self._block_size
        if seq.is_loading or seq.num_computed % size or num_tokens % size:
            raise ValueError(f"cannot load {num_tokens} tokens into {seq_id!r} (computed {seq.num_computed})")
        if not seq.num_computed < num_tokens <= len(seq.token_ids):
            raise ValueError(f"num_tokens {num_tokens} outside ({seq.num_computed}, {len(seq.token_ids)}]")
        seq.num_computed, seq.is_loading = num_tokens, True

    def finish_loading(self, seq_id: Hashable) -> None:
        """The loaded KV is in: register the loaded blocks and the computed full blocks after them.

        Raises:
            KeyError: unknown seq_id.
            ValueError: the sequence is not loading.
        """
        seq = self._seqs[seq_id]
        if not seq.is_loading:
            raise ValueError(f"sequence {seq_id!r} is not loading")
        seq.is_loading = False
        self._publish(seq)

    def is_loading(self, seq_id: Hashable) -> bool:
        """Raises KeyError for an unknown seq_id."""
        return self._seqs[seq_id].is_loading

    def cached_hashes(self) -> list[int]:
        """Every block hash in the prefix-cache index (what a snapshot of this cache lists)."""
        return list(self._prefix_index.by_hash)

    def cached_block_ids(self, block_hashes: Sequence[int]) -> list[int] | None:
        """The blocks the prefix-cache index holds under `block_hashes`, in order (a finished sequence's, until they
        are evicted); None when one of them is not there."""
        by_hash = self._prefix_index.by_hash
        block_ids = [by_hash.get(block_hash) for block_hash in block_hashes]
        return None if None in block_ids else block_ids  # type: ignore[return-value]

    def free(self, seq_id: Hashable) -> None:
        """Drop the sequence; each of its blocks loses a reference.

        A block left with no references joins the evictable LRU if it is registered (last block first, so a
        prefix's head is evicted after its tail), else goes straight back to the free list. A registered block
        that another live sequence holds a computed copy of hands its registration to that copy and is freed.

        Raises:
            KeyError: unknown seq_id.
        """
        seq = self._seqs.pop(seq_id)
        index, ref_counts, free = self._prefix_index, self._ref_counts, self._free
        hash_of = index.block_hash
        for i, block_id in reversed(list(enumerate(seq.block_ids))):
            ref_counts[block_id] -= 1
            if ref_counts[block_id] > 0:
                continue
            block_hash = hash_of[block_id]
            if block_hash is not None:
                if index.release(block_id, block_hash):  # a copy took the registration over
                    free.append(block_id)
                continue
            if i < seq.num_published:  # computed, yet unregistered: a copy of a block registered elsewhere
                index.drop_copy(seq.hashes[i], block_id)
            free.append(block_id)

    def take_raw(self, count: int) -> list[int]:
        """Hand out ``count`` blocks that belong to no sequence and are never registered (storage a caller lays out
        its own way, e.g. FastGen's per-head lanes); they count as used until ``give_back_raw``.

        Raises:
            OutOfBlocks: fewer than ``count`` free blocks; no state changes.
        """
        if count > self.num_free_blocks:
            raise OutOfBlocks(f"{count} raw blocks wanted, {self.num_free_blocks} free")
        taken = self._take_fresh(count)
        self._raw.update(taken)
        return taken

    def give_back_raw(self, block_ids: Sequence[int]) -> None:
        """Return blocks from ``take_raw`` to the free list. Raises KeyError for a block not handed out raw."""
        for block_id in block_ids:
            self._raw.remove(block_id)
            self._ref_counts[block_id] = 0
            self._free.append(block_id)

    def _num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self._block_size)

    def _num_new_blocks(self, seq: _Seq, num_tokens: int) -> int:
        return self._num_blocks_for(len(seq.token_ids) + num_tokens) - len(seq.block_ids)

    def _pool_cost(self, num_tokens: int, reused: list[int]) -> int:
        num_revived = sum(1 for block_id in reused if self._ref_counts[block_id] == 0)
        return self._num_blocks_for(num_tokens) - len(reused) + num_revived

    def _publish(self, seq: _Seq) -> None:
        """Register the sequence's computed full blocks not yet registered (none while it is loading)."""
        end = seq.num_computed // self._block_size
        if seq.is_loading or end <= seq.num_published:
            return
        displaced = self._prefix_index.register(seq.hashes, seq.block_ids, seq.token_ids, seq.num_published, end)
        seq.num_published = end
        self._free.extend(displaced)

    def _take_fresh(self, count: int) -> list[int]:
        """Take ``count`` blocks, free list first (last freed first), then evicting least recently freed cached ones."""
        free, ref_counts = self._free, self._ref_counts
        num_free = len(free)
        taken: list[int] = []
        for _ in range(min(count, num_free)):
            block_id = free.pop()
            ref_counts[block_id] = 1
            taken.append(block_id)
        if count > num_free:
            evicted = self._prefix_index.evict(count - num_free)
            for block_id in evicted:
                ref_counts[block_id] = 1
            taken += evicted
        return taken
