"""Packed prompt KV on the wire: whole blocks per chunk (the sequence's first with its sink), the partial last block
in full precision with the last chunk, reassembled byte for byte; another KV format, a chunk that does not fit its
token range, and a missing chunk are refused with a clear error."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from shared.engine.prompt_kv import PackedFormat, PackedLayerKv, PackedPromptKv
from shared.wire.kv_transfer.chunks import KvAssembly, KvTransferError
from shared.wire.kv_transfer.packed import assemble_packed, chunk_packed_layer, num_packed_chunks

LAYERS, HEADS, DIM, BLOCK = 3, 2, 8, 4
FMT = PackedFormat("kvquant-3:abc", BLOCK, block_bytes=50, sink_bytes=32, tail_dtype=torch.float32)


def layer_kv(num_tokens: int, seed: int) -> PackedLayerKv:
    rng = random.Random(seed)
    full = num_tokens // BLOCK
    blocks = bytes(rng.randrange(256) for _ in range(FMT.blocks_bytes(full)))
    tail = torch.randn(2, HEADS, num_tokens % BLOCK, DIM, generator=torch.Generator().manual_seed(seed))
    return PackedLayerKv(blocks, tail, num_tokens)


def fields(kv: PackedLayerKv) -> tuple[bytes, torch.Tensor, int]:
    return kv.blocks, kv.tail, kv.num_tokens


def send(num_tokens: int, max_chunk_bytes: int, compress: bool = True) -> tuple[KvAssembly, list[PackedLayerKv]]:
    layers = [layer_kv(num_tokens, seed) for seed in range(LAYERS)]
    total = num_packed_chunks(LAYERS, num_tokens, FMT, max_chunk_bytes)
    assembly = KvAssembly("r", total)
    seq = 0
    for index, kv in enumerate(layers):
        chunks = chunk_packed_layer("r", index, *fields(kv), FMT, seq, total, max_chunk_bytes,
                                    compress_payload=compress)
        seq += len(chunks)
        for chunk in chunks:
            assembly.add(chunk)
    assert seq == total
    return assembly, layers


@pytest.mark.parametrize("num_tokens", [1, 3, 4, 7, 8, 21])
@pytest.mark.parametrize("max_chunk_bytes", [1, 120, 10_000])
def test_packed_layers_arrive_byte_for_byte(num_tokens: int, max_chunk_bytes: int) -> None:
    assembly, layers = send(num_tokens, max_chunk_bytes)
    prompt = PackedPromptKv(*assemble_packed(assembly, LAYERS, HEADS, DIM, FMT))
    assert prompt.num_tokens == num_tokens
    assert prompt.layers == [kv.blocks for kv in layers]
    assert torch.equal(prompt.tail, torch.stack([kv.tail for kv in layers]))


def test_chunks_hold_whole_blocks_and_the_sink_goes_with_block_0() -> None:
    kv = layer_kv(21, 0)  # 5 full blocks and 1 tail token
    chunks = chunk_packed_layer("r", 0, *fields(kv), FMT, 0, 3, 2 * FMT.block_bytes, compress_payload=False)
    assert [(c.token_start, c.token_end) for c in chunks] == [(0, 8), (8, 16), (16, 21)]
    assert [c.raw_size for c in chunks] == [2 * 50 + 32, 2 * 50, 50 + 2 * HEADS * DIM * 4]
    assert all(c.kv_format == FMT.kv_format for c in chunks)


def test_another_format_a_misfit_chunk_and_a_gap_are_refused() -> None:
    assembly, _ = send(9, 120)
    with pytest.raises(KvTransferError, match="prefill sent KV as kvquant-3:abc, this engine keeps kvquant-3:xyz"):
        assemble_packed(assembly, LAYERS, HEADS, DIM, dataclasses.replace(FMT, kv_format="kvquant-3:xyz"))
    with pytest.raises(KvTransferError, match="take"):
        assemble_packed(assembly, LAYERS, HEADS, DIM, dataclasses.replace(FMT, block_bytes=51))
    kv = layer_kv(13, 0)
    chunks = chunk_packed_layer("r", 0, *fields(kv), FMT, 0, 3, 1)
    assert len(chunks) == 3
    partial = KvAssembly("r", 3)
    partial.add(chunks[0])
    partial.add(chunks[2])
    with pytest.raises(KvTransferError, match="missing"):
        assemble_packed(partial, 1, HEADS, DIM, FMT)


def test_a_layer_that_does_not_hold_its_tokens_is_not_sent() -> None:
    kv = layer_kv(9, 0)
    with pytest.raises(ValueError, match="do not hold"):
        chunk_packed_layer("r", 0, kv.blocks, kv.tail, 13, FMT, 0, 1, 1000)
