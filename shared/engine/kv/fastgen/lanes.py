"""Lane slots: FastGen's storage inside the paged KV pool, where each KV head of each layer keeps its own tokens.

A pool block is cut into `slots_per_block` lane slots, each a run of token entries (one head's K and V of one token);
how a block is cut, and where a slot lies, is the pool's `lane_store`'s (a raw pool: one slot per layer and KV head,
block_size entries each). A FastGen sequence keeps, per layer and KV head (a lane), only the tokens its policy keeps,
packed into lane slots of its own; any free slot serves any lane (the attention reads a lane's entries by slot,
wherever they lie), so a head that keeps 10% of the tokens holds 10% of the slots. Blocks come whole from the block
manager (`take_raw`) and go back whole once none of their slots is used: that is how FastGen's eviction becomes free
blocks the scheduler can admit new requests into.

Owns the slot numbering (slot s lies in block s // slots_per_block) and which slots are free; no tensors.
"""

from __future__ import annotations

from shared.engine.blocks import BlockManager, OutOfBlocks


class LaneSlots:
    """Hands out lane slots, taking blocks from the block manager as needed and returning them when empty.

    Args:
        block_manager: whose blocks the slots are cut from.
        slots_per_block: lane slots one block holds.
    """

    def __init__(self, block_manager: BlockManager, slots_per_block: int) -> None:
        self.block_manager = block_manager
        self.slots_per_block = slots_per_block
        self._free: list[int] = []  # free slots of held blocks
        self._used: dict[int, int] = {}  # held block -> slots in use

    @property
    def num_blocks_held(self) -> int:
        return len(self._used)

    @property
    def num_slots_used(self) -> int:
        return sum(self._used.values())

    def take(self, count: int) -> list[int]:
        """`count` free slots: the held blocks' free ones first (the last freed first), then new blocks'.

        Raises:
            OutOfBlocks: the pool cannot supply them; nothing changes.
        """
        missing = count - len(self._free)
        if missing > 0:
            new_blocks = self.block_manager.take_raw(-(-missing // self.slots_per_block))  # may raise: no change
            fresh: list[int] = []
            for block in new_blocks:
                self._used[block] = 0
                first = block * self.slots_per_block
                fresh.extend(range(first + self.slots_per_block - 1, first - 1, -1))
            self._free[:0] = fresh  # under the held blocks' free slots, which go first
        taken = [self._free.pop() for _ in range(count)]
        for slot in taken:
            self._used[slot // self.slots_per_block] += 1
        return taken

    def give_back(self, slots: list[int]) -> None:
        """Free slots; a block left with none in use goes back to the block manager.

        Raises:
            KeyError: a slot of a block not held here.
        """
        emptied = []
        for slot in slots:
            block = slot // self.slots_per_block
            self._used[block] -= 1
            if self._used[block] == 0:
                emptied.append(block)
            self._free.append(slot)
        if emptied:
            gone = set(emptied)
            for block in emptied:
                del self._used[block]
            self._free = [s for s in self._free if s // self.slots_per_block not in gone]
            self.block_manager.give_back_raw(emptied)


__all__ = ["LaneSlots", "OutOfBlocks"]
