"""Size-only payloads (the sim engine's KV): they compress to nothing and back to their size, split and join as a size,
and a meta KV tensor travels as one size-only chunk per layer that reassembles into a meta tensor of the right shape."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from shared.engine.kv_cache import KVPool
from shared.model.config import LlamaConfig
from shared.wire.kv_transfer.chunks import KvAssembly, KvTransferError, chunk_layer_kv, num_kv_chunks
from shared.wire.payload import (
    CODEC_SIZE_ONLY,
    PayloadError,
    SizeOnly,
    checksum,
    compress,
    decompress,
    join,
    split,
)
from shared.wire.protocol import KvChunk, decode, encode

LAYERS, HEADS, TOKENS, HEAD_DIM = 5, 4, 37, 16


def meta_kv(num_tokens: int = TOKENS, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """One layer's KV as the sim engine's pool gives it: [2, kv_heads, tokens, head_dim], no values."""
    return torch.empty(2, HEADS, num_tokens, HEAD_DIM, dtype=dtype, device="meta")


def meta_chunks(request_id: str = "r1", num_layers: int = LAYERS) -> list[KvChunk]:
    """Every chunk of a meta prompt KV, streamed layer by layer as prefill does."""
    total = num_kv_chunks(num_layers, TOKENS, 2 * HEADS * HEAD_DIM * 2, 100, is_size_only=True)
    chunks: list[KvChunk] = []
    for layer in range(num_layers):
        chunks += chunk_layer_kv(request_id, layer, meta_kv(), len(chunks), total, max_chunk_bytes=100)
    return chunks


def test_size_only_compresses_to_nothing_and_decompresses_to_its_size() -> None:
    assert compress(SizeOnly(10 << 30), 2) == (CODEC_SIZE_ONLY, b"")
    out = decompress(CODEC_SIZE_ONLY, b"", 10 << 30, 2)
    assert out == SizeOnly(10 << 30) and len(out) == 10 << 30


def test_size_only_codec_with_data_or_an_odd_size_is_refused() -> None:
    with pytest.raises(PayloadError, match="carries 3 bytes"):
        decompress(CODEC_SIZE_ONLY, b"abc", 4096, 2)
    with pytest.raises(PayloadError, match="whole number"):
        decompress(CODEC_SIZE_ONLY, b"", 4097, 2)


def test_bytes_split_into_bounded_parts_and_join_back() -> None:
    data = bytes(range(10))
    parts = split(data, 4)
    assert parts == [data[:4], data[4:8], data[8:]]
    assert join(parts) == data
    assert split(b"", 4) == [b""] and join([b""]) == b""


def test_size_only_stays_whole_and_joins_as_a_size() -> None:
    assert split(SizeOnly(1 << 40), 4) == [SizeOnly(1 << 40)]  # nothing to bound, however small the parts
    assert join([SizeOnly(3), SizeOnly(5)]) == SizeOnly(8)
    assert join([SizeOnly(3), b"ab"]) == SizeOnly(5)  # any size-only part makes the whole a size


def test_a_meta_layer_is_one_size_only_chunk_that_survives_the_wire() -> None:
    kv = meta_kv()
    (chunk,) = chunk_layer_kv("r1", 3, kv, first_seq=7, total=9, max_chunk_bytes=100)  # 100 B would split real KV
    assert chunk.codec == CODEC_SIZE_ONLY and chunk.data == b"" and chunk.checksum == checksum(b"")
    assert chunk.raw_size == kv.numel() * kv.element_size() == 2 * HEADS * TOKENS * HEAD_DIM * 2
    assert (chunk.seq, chunk.total, chunk.layer_start, chunk.layer_end) == (7, 9, 3, 4)
    assert (chunk.token_start, chunk.token_end, chunk.dtype) == (0, TOKENS, "bf16")
    assert decode(encode(chunk), KvChunk) == chunk


def test_size_only_chunk_count_is_one_per_layer() -> None:
    per_token = 2 * HEADS * HEAD_DIM * 2
    assert num_kv_chunks(LAYERS, TOKENS, per_token, 100, is_size_only=True) == LAYERS
    assert num_kv_chunks(LAYERS, TOKENS, per_token, 100) > LAYERS  # the same KV with values would be split
    assert num_kv_chunks(LAYERS, 0, per_token, 100, is_size_only=True) == 0
    assert len(meta_chunks()) == LAYERS


def test_an_empty_meta_layer_makes_no_chunk_as_num_kv_chunks_counts() -> None:
    assert chunk_layer_kv("r1", 0, meta_kv(num_tokens=0), 0, 1, 100) == []


def test_size_only_chunks_assemble_into_a_meta_tensor_in_any_order() -> None:
    chunks = [decode(encode(c), KvChunk) for c in meta_chunks()]
    random.Random(0).shuffle(chunks)
    assembly = KvAssembly("r1", LAYERS)
    for chunk in chunks:
        assembly.add(chunk)
        assembly.add(chunk)  # an identical duplicate is ignored
    assert assembly.is_complete and assembly.num_wire_bytes == 0 and assembly.wire_dtype == "bf16"
    out = assembly.assemble(LAYERS, HEADS, HEAD_DIM, torch.bfloat16)
    assert out.is_meta and out.dtype == torch.bfloat16
    assert tuple(out.shape) == (LAYERS, 2, HEADS, TOKENS, HEAD_DIM)
    converted = assembly.assemble(LAYERS, HEADS, HEAD_DIM, torch.float32)
    assert converted.is_meta and converted.dtype == torch.float32


def test_a_size_only_chunk_mixed_with_real_ones_is_refused() -> None:
    (size_only,) = chunk_layer_kv("r1", 0, meta_kv(), 0, 2, max_chunk_bytes=1 << 20)
    (real,) = chunk_layer_kv("r1", 1, torch.randn(2, HEADS, TOKENS, HEAD_DIM).to(torch.bfloat16), 1, 2, 1 << 20)
    assert real.codec != CODEC_SIZE_ONLY
    assembly = KvAssembly("r1", 2)
    assembly.add(size_only)
    assembly.add(real)
    with pytest.raises(KvTransferError, match="1 of 2 chunks are size-only"):
        assembly.assemble(2, HEADS, HEAD_DIM, torch.bfloat16)


def test_a_size_only_chunk_whose_size_does_not_fit_is_refused() -> None:
    (chunk,) = chunk_layer_kv("r1", 0, meta_kv(), 0, 1, max_chunk_bytes=100)
    with pytest.raises(KvTransferError, match="does not fit its layer and token ranges"):
        KvAssembly("r1", 1).add(dataclasses.replace(chunk, raw_size=chunk.raw_size + 2))
    with pytest.raises(KvTransferError, match="does not fit"):
        KvAssembly("r1", 1).add(dataclasses.replace(chunk, raw_size=0))
    # A whole number of tokens, but of twice the kv heads: the ranges allow it, the model's shape does not.
    doubled = KvAssembly("r1", 1)
    doubled.add(dataclasses.replace(chunk, raw_size=2 * chunk.raw_size))
    with pytest.raises(KvTransferError, match=f"not {HEADS} kv heads"):
        doubled.assemble(1, HEADS, HEAD_DIM, torch.bfloat16)


def test_a_size_only_chunk_carrying_data_is_refused() -> None:
    (chunk,) = chunk_layer_kv("r1", 0, meta_kv(), 0, 1, max_chunk_bytes=100)
    smuggled = dataclasses.replace(chunk, data=b"xy", checksum=checksum(b"xy"))
    with pytest.raises(KvTransferError, match="size-only payload carries 2 bytes"):
        KvAssembly("r1", 1).add(smuggled)


def test_a_meta_block_is_stored_as_its_size() -> None:
    config = LlamaConfig(
        vocab_size=8, hidden_size=HEADS * HEAD_DIM, intermediate_size=8, num_layers=LAYERS, num_heads=HEADS,
        num_kv_heads=HEADS, head_dim=HEAD_DIM, rope_theta=1e4, rms_norm_eps=1e-5, max_position=64,
        tie_word_embeddings=True,
    )
    meta = KVPool(config, 3, 8, torch.bfloat16, torch.device("meta"))
    assert meta.block_payload(1, False) == SizeOnly(LAYERS * 2 * HEADS * 8 * HEAD_DIM * 2)
    real = KVPool(config, 3, 8, torch.bfloat16, torch.device("cpu"))
    real.tensor.fill_(1.0)
    data = real.block_payload(1, False)
    assert isinstance(data, bytes) and len(data) == LAYERS * 2 * HEADS * 8 * HEAD_DIM * 2
