"""What tests can observe of a BlockManager through its public API (shared by the block manager tests)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from shared.engine.blocks import BlockManager


def observable(manager: BlockManager, seq_ids: Sequence[Hashable]) -> tuple[object, ...]:
    """Everything the public API shows about the manager's state."""
    tables = [
        (s, manager.block_ids(s), manager.num_tokens(s), manager.num_computed_tokens(s))
        for s in seq_ids
        if s in manager
    ]
    refs = [manager.ref_count(b) for b in range(manager.num_blocks)]
    registered = [registered_tokens(manager, b) for b in range(manager.num_blocks)]
    return manager.num_free_blocks, manager.stats, tables, refs, registered


def registered_tokens(manager: BlockManager, block_id: int) -> tuple[int, ...] | None:
    try:
        return manager.block_token_ids(block_id)
    except KeyError:
        return None
