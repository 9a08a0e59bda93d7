"""The paged pool's storage: one tensor for every layer's K and V, read and written by block or by token.

Owns the tensor and the decode gather workspace; the store over it is `store`, the step's attention `attention`, block
bookkeeping `shared.engine.blocks`.
"""

from __future__ import annotations

import torch

from shared.engine.kv.sizing import lazy_zeros
from shared.model.config import LlamaConfig


class KVPool:
    """K and V of every layer: [num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim].

    Also keeps the decode gather workspace, sized on demand and reused by every layer and step.
    """

    def __init__(
        self, config: LlamaConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        shape = (config.num_layers, 2, config.num_kv_heads, num_blocks, block_size, config.head_dim)
        self.tensor = lazy_zeros(shape, dtype, device)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._block_elements = config.num_kv_heads * block_size * config.head_dim
        self._workspace = torch.empty(0, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_block(config: LlamaConfig, block_size: int, dtype: torch.dtype) -> int:
        element_size = torch.empty((), dtype=dtype).element_size()
        return config.kv_elements_per_token * block_size * element_size

    @property
    def num_bytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    @property
    def block_footprint(self) -> int:
        """What one block id costs, every layer, K and V."""
        return self.num_bytes // self.num_blocks

    # --- blocks as payloads: what the cache-store keeps (layer-major, so loads can use each layer as it arrives) ---

    def payload_layer_bytes(self, starts_sequence: bool) -> int:
        """Bytes of one layer of one block in `block_payload` (the same for every block of a raw pool)."""
        return self.block_footprint // self.tensor.shape[0]

    def block_payload(self, block_id: int, starts_sequence: bool) -> bytes:
        """Every layer of one block: [num_layers, 2, kv_heads, block_size, head_dim] raw, C order."""
        return self.read_blocks([block_id]).contiguous().view(torch.uint8).numpy().tobytes()

    def write_payload_layers(self, block_id: int, first_layer: int, data: bytes | bytearray,
                             starts_sequence: bool) -> None:
        """Fill layers [first_layer, first_layer + n) of a block from whole layers of its `block_payload`."""
        _, _, kv_heads, _, block_size, head_dim = self.tensor.shape
        kv = torch.frombuffer(data, dtype=torch.uint8).view(self.tensor.dtype)
        self.write_block_layers(block_id, first_layer, kv.view(-1, 2, kv_heads, block_size, head_dim))

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tensor[layer_idx, 0], self.tensor[layer_idx, 1]

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of whole blocks, every layer: [num_layers, 2, kv_heads, len(block_ids), block_size, head_dim]."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.tensor.device)
        return self.tensor.index_select(3, index)

    def write_block_layers(self, block_id: int, first_layer: int, kv: torch.Tensor) -> None:
        """Fill layers [first_layer, first_layer + n) of one block; `kv`: [n, 2, kv_heads, block_size, head_dim]."""
        layers = slice(first_layer, first_layer + kv.shape[0])
        self.tensor[layers, :, :, block_id] = kv.to(self.tensor.device, self.tensor.dtype)

    def gather_workspace(self, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Two flat buffers that hold `num_blocks` gathered blocks of K and of V (grown, never shrunk)."""
        needed = num_blocks * self._block_elements
        if self._workspace.numel() < 2 * needed:
            self._workspace = torch.empty(2 * needed, dtype=self.tensor.dtype, device=self.tensor.device)
        half = self._workspace.numel() // 2
        return self._workspace[:half], self._workspace[half:]


