"""A codec store's prompt KV on the wire: its block form (`BlockFormat` of a codec: opaque bytes a block, the
sequence's first block with a sink) travels in whole blocks per chunk, the partial last block in full precision with
a layer's last chunk, and is reassembled byte for byte in any order; another KV format, a chunk that does not fit its
token range, and a missing chunk are refused with a clear error. Raw stores' tensors: `test_kv_wire`."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from shared.engine.kv.store import BlockFormat, PromptKv, PromptLayerKv
from shared.wire.handoff.prompt import KvAssembly, assemble_prompt, chunk_prompt_layer, num_prompt_chunks
from shared.wire.parts import PartError
from shared.wire.payload import CODEC_LZ4_SHUFFLE, CODEC_RAW, Payload
from shared.wire.protocol import KvChunk, decode, encode

LAYERS, HEADS, DIM, BLOCK = 3, 2, 8, 4
FMT = BlockFormat("kvquant-3:abc", BLOCK, block_bytes=50, sink_bytes=32, tail_dtype=torch.float32)


def layer_kv(num_tokens: int, seed: int) -> PromptLayerKv:
    """Layer 0's blocks repeat (LZ4 shortens them), the others' are random."""
    rng = random.Random(seed)
    num_bytes = FMT.blocks_bytes(num_tokens // BLOCK)
    blocks = bytes(i % 7 if seed == 0 else rng.randrange(256) for i in range(num_bytes))
    tail = torch.randn(2, HEADS, num_tokens % BLOCK, DIM, generator=torch.Generator().manual_seed(seed))
    return PromptLayerKv(blocks, tail, num_tokens)


def fields(kv: PromptLayerKv) -> tuple[Payload, torch.Tensor, int]:
    return kv.blocks, kv.tail, kv.num_tokens


def all_chunks(layers: list[PromptLayerKv], max_chunk_bytes: int, compress: bool = True) -> list[KvChunk]:
    total = num_prompt_chunks(LAYERS, layers[0].num_tokens, FMT, max_chunk_bytes)
    chunks: list[KvChunk] = []
    for index, kv in enumerate(layers):
        chunks += chunk_prompt_layer("r", index, *fields(kv), FMT, len(chunks), total, max_chunk_bytes,
                                     compress_payload=compress)
    assert [c.seq for c in chunks] == list(range(total))
    return chunks


def send(num_tokens: int, max_chunk_bytes: int, compress: bool = True) -> tuple[KvAssembly, list[PromptLayerKv]]:
    layers = [layer_kv(num_tokens, seed) for seed in range(LAYERS)]
    chunks = all_chunks(layers, max_chunk_bytes, compress)
    total = len(chunks)
    random.Random(num_tokens + max_chunk_bytes).shuffle(chunks)  # any arrival order, through msgpack
    assembly = KvAssembly("r", total)
    for chunk in chunks:
        assembly.add(decode(encode(chunk), KvChunk))
    return assembly, layers


@pytest.mark.parametrize("num_tokens", [1, 3, 4, 7, 8, 21])
@pytest.mark.parametrize("max_chunk_bytes", [1, 120, 10_000])
@pytest.mark.parametrize("compress", [True, False], ids=["lz4", "raw"])
def test_codec_layers_arrive_byte_for_byte(num_tokens: int, max_chunk_bytes: int, compress: bool) -> None:
    assembly, layers = send(num_tokens, max_chunk_bytes, compress)
    prompt = PromptKv(*assemble_prompt(assembly, LAYERS, HEADS, DIM, FMT))
    assert prompt.num_tokens == num_tokens
    assert prompt.layers == [kv.blocks for kv in layers]
    assert torch.equal(prompt.tail, torch.stack([kv.tail for kv in layers]))


def test_codec_bytes_are_compressed_where_it_pays() -> None:
    layers = [layer_kv(21, seed) for seed in range(LAYERS)]
    packed, plain = all_chunks(layers, 10_000), all_chunks(layers, 10_000, compress=False)
    assert [c.codec for c in packed] == [CODEC_LZ4_SHUFFLE, CODEC_RAW, CODEC_RAW]  # one chunk a layer
    assert len(packed[0].data) < 0.95 * packed[0].raw_size and packed[1:] == plain[1:]
    assert all(c.codec == CODEC_RAW and len(c.data) == c.raw_size for c in plain)


def test_chunks_hold_whole_blocks_and_the_sink_goes_with_block_0() -> None:
    kv = layer_kv(21, 0)  # 5 full blocks and 1 tail token
    chunks = chunk_prompt_layer("r", 0, *fields(kv), FMT, 0, 3, 2 * FMT.block_bytes, compress_payload=False)
    assert [(c.token_start, c.token_end) for c in chunks] == [(0, 8), (8, 16), (16, 21)]
    assert [c.raw_size for c in chunks] == [2 * 50 + 32, 2 * 50, 50 + 2 * HEADS * DIM * 4]
    assert all(c.kv_format == FMT.kv_format for c in chunks)


def test_another_format_a_misfit_chunk_and_a_gap_are_refused() -> None:
    assembly, _ = send(9, 120)
    with pytest.raises(PartError, match="prefill sent KV as kvquant-3:abc, this engine keeps kvquant-3:xyz"):
        assemble_prompt(assembly, LAYERS, HEADS, DIM, dataclasses.replace(FMT, kv_format="kvquant-3:xyz"))
    with pytest.raises(PartError, match="take"):
        assemble_prompt(assembly, LAYERS, HEADS, DIM, dataclasses.replace(FMT, block_bytes=51))
    kv = layer_kv(13, 0)
    chunks = chunk_prompt_layer("r", 0, *fields(kv), FMT, 0, 3, 1)
    assert len(chunks) == 3
    partial = KvAssembly("r", 3)
    partial.add(chunks[0])
    partial.add(chunks[2])
    with pytest.raises(PartError, match="missing"):
        assemble_prompt(partial, 1, HEADS, DIM, FMT)


def test_a_layer_that_does_not_hold_its_tokens_is_not_sent() -> None:
    kv = layer_kv(9, 0)
    with pytest.raises(ValueError, match="do not hold"):
        chunk_prompt_layer("r", 0, kv.blocks, kv.tail, 13, FMT, 0, 1, 1000)
