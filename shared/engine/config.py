"""Engine settings: one frozen dataclass, validated once, built by the CLI or a service's config."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs.

    Args:
        device: "cpu", "cuda", "cuda:1", or "auto" (CUDA when present).
        dtype: "fp32", "bf16" or "fp16"; weights and KV cache use it, logits and norms compute in fp32.
        block_size: tokens per KV block (the unit of paging and prefix reuse).
        kv_cache_bytes: bytes of the paged KV pool (all layers, K and V).
        max_num_seqs: most sequences in the running batch.
        max_num_batched_tokens: tokens per forward step (decode tokens plus prefill chunks): the chunk size.
        kernels: "auto", "torch" or "triton" (see kernels.backend).
        num_threads: CPU threads for torch; 0 keeps torch's default.
        enable_prefix_caching: reuse full KV blocks of earlier requests by chained hash.
    Raises:
        ValueError: an unknown dtype or a setting out of range.
    """

    device: str = "auto"
    dtype: str = "fp32"
    block_size: int = 64
    kv_cache_bytes: int = 1 << 30
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    kernels: str = "auto"
    num_threads: int = 0
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}: choose one of {', '.join(DTYPES)}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.kv_cache_bytes <= 0:
            raise ValueError("max_num_seqs, max_num_batched_tokens and kv_cache_bytes must be positive")

    @property
    def kv_codec(self) -> str:
        """How this engine's KV blocks are stored: raw tensors of the dtype. Part of the block-hash namespace, so
        engines (and cache-store copies) with different KV formats never share block ids."""
        return self.dtype

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)
