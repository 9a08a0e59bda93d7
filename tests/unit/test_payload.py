"""Size-only payloads (the sim engine's KV): they compress to nothing and back to their size, split and join as a size;
and a store of sizes (`SizedKvStore`) sends a prompt as one size-only chunk per layer, which reassembles into sizes and
a meta tail of the right shape, and keeps a block as the size of a real one."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from shared.engine.blocks import BlockManager
from shared.engine.kv.paged.pool import KVPool
from shared.engine.kv.sized import SizedKvStore
from shared.engine.kv.store import BlockFormat, PromptKv
from shared.model.config import LlamaConfig
from shared.wire.handoff.prompt import KvAssembly, assemble_prompt, chunk_prompt_layer, num_prompt_chunks
from shared.wire.parts import PartError
from shared.wire.payload import (
    CODEC_SIZE_ONLY,
    PayloadError,
    SizeOnly,
    checksum,
    compress,
    decompress,
    join,
)
from shared.wire.protocol import KvChunk, decode, encode

LAYERS, HEADS, TOKENS, HEAD_DIM, BLOCK = 5, 4, 37, 16, 8  # 37 tokens: 4 full blocks and a tail of 5
CONFIG = LlamaConfig(
    vocab_size=8, hidden_size=HEADS * HEAD_DIM, intermediate_size=8, num_layers=LAYERS, num_heads=HEADS,
    num_kv_heads=HEADS, head_dim=HEAD_DIM, rope_theta=1e4, rms_norm_eps=1e-5, max_position=64,
    tie_word_embeddings=True,
)
LAYER_BYTES = 2 * HEADS * TOKENS * HEAD_DIM * 2  # one layer of the prompt, raw bf16


def sized_store() -> SizedKvStore:
    return SizedKvStore(CONFIG, BlockManager(8, BLOCK, b"ns"), "bf16", max_num_seqs=4)


def raw_bf16() -> BlockFormat:
    """The block form of a raw bf16 store of the same model (what the sim's sizes stand for)."""
    return BlockFormat("bf16", BLOCK, 2 * HEADS * BLOCK * HEAD_DIM * 2, 0, torch.bfloat16)


def meta_chunks(request_id: str = "r1", num_tokens: int = TOKENS) -> list[KvChunk]:
    """Every chunk of a prompt in the sized store, streamed layer by layer as prefill does."""
    store = sized_store()
    fmt = store.block_format
    total = num_prompt_chunks(LAYERS, num_tokens, fmt, 100)
    chunks: list[KvChunk] = []
    block_ids = list(range(num_tokens // BLOCK + 1))
    for layer in range(LAYERS):
        kv = store.read_prompt_layer(request_id, block_ids, num_tokens, layer)
        chunks += chunk_prompt_layer(request_id, layer, kv.blocks, kv.tail, kv.num_tokens, fmt, len(chunks), total,
                                     max_chunk_bytes=100)  # 100 B would split real KV
    return chunks


def one_layer(layer: int = 0, first_seq: int = 0, total: int = 1) -> KvChunk:
    (chunk,) = meta_chunks()[:1]
    return dataclasses.replace(chunk, layer_start=layer, layer_end=layer + 1, seq=first_seq, total=total)


def assembly_of(chunks: list[KvChunk]) -> KvAssembly:
    assembly = KvAssembly(chunks[0].request_id, chunks[0].total)
    for chunk in chunks:
        assembly.add(chunk)
    return assembly


def test_size_only_compresses_to_nothing_and_decompresses_to_its_size() -> None:
    assert compress(SizeOnly(10 << 30), 2) == (CODEC_SIZE_ONLY, b"")
    out = decompress(CODEC_SIZE_ONLY, b"", 10 << 30, 2)
    assert out == SizeOnly(10 << 30) and len(out) == 10 << 30


def test_size_only_codec_with_data_or_an_odd_size_is_refused() -> None:
    with pytest.raises(PayloadError, match="carries 3 bytes"):
        decompress(CODEC_SIZE_ONLY, b"abc", 4096, 2)
    with pytest.raises(PayloadError, match="whole number"):
        decompress(CODEC_SIZE_ONLY, b"", 4097, 2)


def test_bytes_and_sizes_join() -> None:
    data = bytes(range(10))
    assert join([data[:4], data[4:8], data[8:]]) == data and join([b""]) == b""
    assert join([SizeOnly(3), SizeOnly(5)]) == SizeOnly(8)
    assert join([SizeOnly(3), b"ab"]) == SizeOnly(5)  # any size-only part makes the whole a size


def test_a_sized_layer_is_one_size_only_chunk_that_survives_the_wire() -> None:
    store = sized_store()
    kv = store.read_prompt_layer("r1", [0, 1, 2, 3, 4], TOKENS, 3)
    assert isinstance(kv.blocks, SizeOnly) and kv.tail.is_meta and tuple(kv.tail.shape) == (2, HEADS, 5, HEAD_DIM)
    (chunk,) = chunk_prompt_layer("r1", 3, kv.blocks, kv.tail, TOKENS, store.block_format, first_seq=7, total=9,
                                  max_chunk_bytes=100)
    assert chunk.codec == CODEC_SIZE_ONLY and chunk.data == b"" and chunk.checksum == checksum(b"")
    assert chunk.raw_size == LAYER_BYTES  # as big as the raw bf16 layer it stands for
    assert (chunk.seq, chunk.total, chunk.layer_start, chunk.layer_end) == (7, 9, 3, 4)
    assert (chunk.token_start, chunk.token_end, chunk.dtype, chunk.kv_format) == (0, TOKENS, "bf16", "bf16")
    assert decode(encode(chunk), KvChunk) == chunk


def test_size_only_chunk_count_is_one_per_layer() -> None:
    fmt = sized_store().block_format
    assert num_prompt_chunks(LAYERS, TOKENS, fmt, 100) == LAYERS
    assert num_prompt_chunks(LAYERS, TOKENS, raw_bf16(), 100) > LAYERS  # the same KV with values would be split
    assert num_prompt_chunks(LAYERS, 0, fmt, 100) == 0
    assert len(meta_chunks()) == LAYERS


def test_an_empty_sized_layer_makes_no_chunk_as_num_prompt_chunks_counts() -> None:
    store = sized_store()
    kv = store.read_prompt_layer("r1", [], 0, 0)
    assert chunk_prompt_layer("r1", 0, kv.blocks, kv.tail, 0, store.block_format, 0, 1, 100) == []
    assert meta_chunks(num_tokens=0) == []


@pytest.mark.parametrize("num_tokens", [TOKENS, 4 * BLOCK, 3])
def test_size_only_chunks_assemble_into_sizes_and_a_meta_tail_in_any_order(num_tokens: int) -> None:
    chunks = [decode(encode(c), KvChunk) for c in meta_chunks(num_tokens=num_tokens)]
    random.Random(0).shuffle(chunks)
    assembly = KvAssembly("r1", LAYERS)
    for chunk in chunks:
        assembly.add(chunk)
        assembly.add(chunk)  # an identical duplicate is ignored
    assert assembly.is_complete and assembly.num_wire_bytes == assembly.num_held_bytes == 0
    assert {(header.dtype, header.kv_format) for header, _ in assembly.pieces()} == {("bf16", "bf16")}
    store = sized_store()
    layers, tail, got_tokens = assemble_prompt(assembly, LAYERS, HEADS, HEAD_DIM, store.block_format)
    full, rest = divmod(num_tokens, BLOCK)
    assert got_tokens == num_tokens
    assert layers == [SizeOnly(full * raw_bf16().block_bytes)] * LAYERS
    assert tail.is_meta and tail.dtype == torch.bfloat16 and tuple(tail.shape) == (LAYERS, 2, HEADS, rest, HEAD_DIM)
    store.write_prompt("r1", list(range(full + 1)), PromptKv(layers, tail, got_tokens), 0)  # the store takes it


def test_a_size_only_chunk_mixed_with_real_ones_is_refused() -> None:
    size_only = one_layer(0, 0, 2)
    real_kv = torch.randn(2, HEADS, TOKENS, HEAD_DIM).to(torch.bfloat16)
    full = TOKENS // BLOCK * BLOCK
    blocks = real_kv[:, :, :full].reshape(2, HEADS, -1, BLOCK, HEAD_DIM).permute(2, 0, 1, 3, 4).contiguous()
    blocks_bytes = blocks.reshape(-1).view(torch.uint8).numpy().tobytes()
    (real,) = chunk_prompt_layer("r1", 1, blocks_bytes, real_kv[:, :, full:], TOKENS, raw_bf16(), 1, 2, 1 << 20)
    assert real.codec != CODEC_SIZE_ONLY and real.raw_size == size_only.raw_size
    assembly = assembly_of([size_only, real])
    with pytest.raises(PartError, match="chunk 0 is size-only, this engine's KV carries bytes"):
        assemble_prompt(assembly, 2, HEADS, HEAD_DIM, raw_bf16())  # a decode engine with values
    with pytest.raises(PartError, match="chunk 1 is not the size-only layer"):
        assemble_prompt(assembly, 2, HEADS, HEAD_DIM, sized_store().block_format)  # the sim's decode engine
    with pytest.raises(ValueError, match="sizes alone for bf16 blocks"):
        chunk_prompt_layer("r1", 0, SizeOnly(len(blocks_bytes)), real_kv[:, :, full:], TOKENS, raw_bf16(), 0, 1, 100)


def test_a_size_only_chunk_whose_size_does_not_fit_is_refused() -> None:
    chunk = one_layer()
    fmt = sized_store().block_format
    with pytest.raises(PartError, match=f"chunk 0 is not the size-only layer of {LAYER_BYTES} bytes"):
        assemble_prompt(assembly_of([dataclasses.replace(chunk, raw_size=chunk.raw_size + 2)]), 1, HEADS, HEAD_DIM,
                        fmt)
    with pytest.raises(PartError, match="raw size 0"):
        KvAssembly("r1", 1).add(dataclasses.replace(chunk, raw_size=0))
    with pytest.raises(PartError, match="whole number of 2-byte elements"):
        KvAssembly("r1", 1).add(dataclasses.replace(chunk, raw_size=chunk.raw_size + 1))
    # A layer of twice the kv heads: the chunk is sane, the model's shape does not fit it.
    doubled = assembly_of([dataclasses.replace(chunk, raw_size=2 * chunk.raw_size)])
    with pytest.raises(PartError, match="not the size-only layer"):
        assemble_prompt(doubled, 1, HEADS, HEAD_DIM, fmt)
    assert assemble_prompt(assembly_of([chunk]), 1, HEADS, HEAD_DIM, fmt)[2] == TOKENS
    with pytest.raises(PartError, match="prefill sent KV as bf16, this engine keeps fp16"):
        assemble_prompt(assembly_of([chunk]), 1, HEADS, HEAD_DIM, dataclasses.replace(fmt, kv_format="fp16"))


def test_a_size_only_chunk_carrying_data_is_refused() -> None:
    chunk = one_layer()
    smuggled = dataclasses.replace(chunk, data=b"xy", checksum=checksum(b"xy"))
    with pytest.raises(PartError, match="size-only payload carries 2 bytes"):
        KvAssembly("r1", 1).add(smuggled)


def test_a_sized_block_is_stored_as_the_size_of_a_real_one() -> None:
    sized = sized_store()
    assert sized.block_payload(1, False) == SizeOnly(LAYERS * 2 * HEADS * BLOCK * HEAD_DIM * 2)
    assert sized.payload_layer_bytes(False) == raw_bf16().block_bytes
    real = KVPool(CONFIG, 3, BLOCK, torch.bfloat16, torch.device("cpu"))
    real.tensor.fill_(1.0)
    data = real.block_payload(1, False)
    assert isinstance(data, bytes) and len(data) == len(sized.block_payload(1, False))
