"""The paged KV pool layout that the engine allocates and every kernel reads.

Per layer, K and V are each [num_kv_heads, num_blocks, block_size, head_dim]: a head's tokens are contiguous, so
a sequence gathered block by block is one matrix per head. A slot is block_id * block_size + offset.
"""

from __future__ import annotations

import torch


def pool_dims(k_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """(num_kv_heads, num_blocks, block_size, head_dim) of one layer's K or V pool."""
    num_kv_heads, num_blocks, block_size, head_dim = k_cache.shape
    return num_kv_heads, num_blocks, block_size, head_dim
