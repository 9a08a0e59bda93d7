"""Synthetic KV and the raw block form for the KV wire tests (`test_kv_wire`, `test_kv_receiver`): a tensor
[num_layers, 2, kv_heads, num_tokens, head_dim] cut into each layer's full blocks' bytes and tail as a paged store
holds them (`prompt_layer_of`), chunked as prefill sends it, and reassembled with checks."""

from __future__ import annotations

import math

import torch

from shared.engine.kv.paged.store import prompt_layer_of, tensor_of
from shared.engine.kv.store import BlockFormat, PromptKv
from shared.wire.handoff.prompt import (
    DTYPE_NAMES,
    WIRE_NAMES,
    KvAssembly,
    assemble_prompt,
    chunk_prompt_layer,
    num_prompt_chunks,
)
from shared.wire.protocol import KvChunk

DTYPES = list(DTYPE_NAMES.values())
BLOCK = 16
TOKENS = 100  # 6 full blocks and a tail of 4: six chunks a layer at one block a chunk
ONE_BLOCK = 3000  # a max_chunk_bytes under any block here: one block a chunk


def smooth_kv(num_layers: int, num_kv_heads: int, num_tokens: int, head_dim: int, seed: int = 0) -> torch.Tensor:
    """Synthetic KV [num_layers, 2, heads, tokens, head_dim], fp32: smooth along tokens, a scale per channel.

    Calibrated so shuffle+LZ4 shrinks it about as much as SmolLM2-135M's real KV (fp32 ~0.93, bf16 ~0.85).
    """
    window = 16
    if num_tokens == 0:
        return torch.zeros(num_layers, 2, num_kv_heads, 0, head_dim)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_layers, 2, num_kv_heads, head_dim, num_tokens + window - 1, generator=g)
    x = x.unfold(-1, window, 1).mean(-1) * math.sqrt(window)  # moving average along tokens, unit variance
    scale = torch.exp(0.5 * torch.randn(num_layers, 2, num_kv_heads, 1, head_dim, generator=g))
    return (x.transpose(3, 4) * scale).contiguous()


def noise(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random bits of `dtype` (NaNs and all): nothing for LZ4 to find."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (*shape, itemsize), dtype=torch.uint8, generator=g).view(dtype).squeeze(-1)


def raw_format(dtype: torch.dtype, kv_heads: int, head_dim: int, block_size: int = BLOCK) -> BlockFormat:
    """A raw store's block form: one layer of one block is [2, kv_heads, block_size, head_dim] of `dtype`."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return BlockFormat(WIRE_NAMES[dtype], block_size, 2 * kv_heads * block_size * head_dim * itemsize, 0, dtype)


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The tensor's bytes in C order (bit-exact, whatever the dtype)."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def as_blocks(kv_layer: torch.Tensor, block_size: int = BLOCK) -> tuple[bytes, torch.Tensor]:
    """One layer [2, heads, tokens, head_dim] in the raw block form (`prompt_layer_of`): its full blocks' bytes,
    block after block, each [2, heads, block_size, head_dim]; and its tail [2, heads, tokens % block_size, head_dim]."""
    layer = prompt_layer_of(kv_layer, block_size)
    assert isinstance(layer.blocks, bytes)
    return layer.blocks, layer.tail


def from_blocks(layers: list[bytes], tail: torch.Tensor, block_size: int = BLOCK) -> torch.Tensor:
    """The inverse of `as_blocks` for every layer (`tensor_of`): [num_layers, 2, heads, tokens, head_dim]."""
    _, _, heads, rest, head_dim = tail.shape
    num_tokens = len(layers[0]) // (2 * heads * head_dim * tail.element_size()) + rest
    prompt = PromptKv(list(layers), tail, num_tokens)
    return tensor_of(prompt, raw_format(tail.dtype, heads, head_dim, block_size), heads, head_dim)


def all_chunks(request_id: str, kv: torch.Tensor, max_chunk_bytes: int, block_size: int = BLOCK,
               compress_payload: bool = True) -> list[KvChunk]:
    """Every chunk of `kv` [layers, 2, heads, tokens, head_dim] in a raw format, layer by layer as prefill sends."""
    num_layers, _, heads, num_tokens, head_dim = kv.shape
    fmt = raw_format(kv.dtype, heads, head_dim, block_size)
    total = num_prompt_chunks(num_layers, num_tokens, fmt, max_chunk_bytes)
    chunks: list[KvChunk] = []
    for layer in range(num_layers):
        blocks, tail = as_blocks(kv[layer], block_size)
        chunks += chunk_prompt_layer(request_id, layer, blocks, tail, num_tokens, fmt, len(chunks), total,
                                     max_chunk_bytes, compress_payload=compress_payload)
    return chunks


def filled(chunks: list[KvChunk]) -> KvAssembly:
    assembly = KvAssembly(chunks[0].request_id, chunks[0].total)
    for chunk in chunks:
        assembly.add(chunk)
    return assembly


def assembled(assembly: KvAssembly, kv: torch.Tensor, block_size: int = BLOCK) -> torch.Tensor:
    """The prompt of a complete assembly as a tensor like `kv`, checking the raw form it came in against `kv`'s."""
    num_layers, _, heads, num_tokens, head_dim = kv.shape
    layers, tail, got_tokens = assemble_prompt(assembly, num_layers, heads, head_dim,
                                               raw_format(kv.dtype, heads, head_dim, block_size))
    assert got_tokens == num_tokens and tail.dtype == kv.dtype
    expected = [as_blocks(kv[layer], block_size) for layer in range(num_layers)]
    assert layers == [blocks for blocks, _ in expected]
    assert tensor_bytes(tail) == tensor_bytes(torch.stack([t for _, t in expected]))
    assert all(isinstance(layer, bytes) for layer in layers)
    return from_blocks(layers, tail, block_size)  # type: ignore[arg-type]


def check_chunk_sizes(chunks: list[KvChunk], fmt: BlockFormat, num_tokens: int, max_chunk_bytes: int) -> None:
    """Chunks hold whole blocks, as many as fit `max_chunk_bytes` (at least one); the tail rides with a layer's last."""
    full = num_tokens // fmt.block_size
    for chunk in chunks:
        assert chunk.token_start % fmt.block_size == 0
        num_blocks = min(chunk.token_end, full * fmt.block_size) // fmt.block_size - chunk.token_start // fmt.block_size
        assert fmt.blocks_bytes(num_blocks) <= max(max_chunk_bytes, fmt.block_bytes)
        assert chunk.token_end % fmt.block_size == 0 or chunk.token_end == num_tokens
