"""KV over the wire: a raw store's prompt (its full blocks' bytes and the partial last block's tokens) round-trips
exactly, in whole blocks, under the NATS payload, compressed where it pays; and every corrupt, inconsistent, missing
transfer, or one in another KV format or block size, is refused with a message that names the request and chunk.
The streams' deadline and budget are `test_kv_receiver`'s.

The synthetic KV is a tensor [num_layers, 2, kv_heads, num_tokens, head_dim]; `kv_wire_fixtures.as_blocks` cuts one
layer of it into the raw block form (each full block [2, kv_heads, block_size, head_dim] in C order, back to back,
and the tail), the form `PagedKvStore` reads and writes, as `test_the_raw_block_form_is_the_paged_stores` holds it
to."""

from __future__ import annotations

import dataclasses
import math
import random

import lz4.frame
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_wire_fixtures import (
    BLOCK,
    DTYPES,
    ONE_BLOCK,
    TOKENS,
    all_chunks,
    as_blocks,
    assembled,
    check_chunk_sizes,
    filled,
    noise,
    raw_format,
    smooth_kv,
    tensor_bytes,
)

from kernels.backend import KernelBackend
from shared.engine.blocks import BlockManager
from shared.engine.kv.paged.pool import KVPool
from shared.engine.kv.paged.store import PagedKvStore
from shared.engine.kv.store import PromptKv
from shared.model.config import LlamaConfig
from shared.wire.handoff.prompt import (
    DTYPE_NAMES,
    WIRE_NAMES,
    KvAssembly,
    assemble_prompt,
    chunk_prompt_layer,
    num_prompt_chunks,
)
from shared.wire.parts import PartError
from shared.wire.payload import CODEC_LZ4_SHUFFLE, CODEC_RAW, PayloadError, SizeOnly, checksum, compress, decompress
from shared.wire.protocol import KvChunk, decode, encode


@pytest.mark.parametrize("dtype", DTYPES, ids=list(DTYPE_NAMES))
def test_round_trip_in_any_order_is_exact(dtype: torch.dtype) -> None:
    kv = smooth_kv(4, 3, TOKENS, 64).to(dtype)
    kv[0] = (torch.arange(kv[0].numel()) % 5).view(kv[0].shape) - 1.5  # surely compresses, unlike the next
    kv[1] = noise(tuple(kv[1].shape), dtype)
    fmt = raw_format(dtype, 3, 64)
    chunks = all_chunks("r1", kv, max_chunk_bytes=2 * fmt.block_bytes)
    per_layer = math.ceil((TOKENS // BLOCK) / 2)  # two blocks a chunk, the tail with the last
    assert len(chunks) == num_prompt_chunks(4, TOKENS, fmt, 2 * fmt.block_bytes) == 4 * per_layer
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    assert {c.codec for c in chunks} == {CODEC_RAW, CODEC_LZ4_SHUFFLE}
    assert all(c.kv_format == WIRE_NAMES[dtype] == c.dtype for c in chunks)
    check_chunk_sizes(chunks, fmt, TOKENS, 2 * fmt.block_bytes)
    random.Random(1).shuffle(chunks)
    chunks = [decode(encode(c), KvChunk) for c in chunks]
    out = assembled(filled(chunks), kv)
    assert out.dtype == dtype and out.shape == kv.shape
    assert tensor_bytes(out) == tensor_bytes(kv)  # bit-exact, -0.0 and NaNs all


def test_another_kv_format_is_refused() -> None:
    """The engines must agree on the format: fp32 KV is not converted into a bf16 engine's, it is refused."""
    kv = smooth_kv(2, 3, 20, 16)
    assembly = filled(all_chunks("r1", kv, 1000))
    with pytest.raises(PartError, match="request r1: prefill sent KV as fp32, this engine keeps bf16"):
        assemble_prompt(assembly, 2, 3, 16, raw_format(torch.bfloat16, 3, 16))
    assert tensor_bytes(assembled(assembly, kv)) == tensor_bytes(kv)  # the refusal leaves the assembly whole


def test_another_block_size_is_refused() -> None:
    """Blocks of 16 tokens read as blocks of 8 would have every size right and every value scrambled."""
    kv = smooth_kv(2, 3, 40, 16)
    assembly = filled(all_chunks("r1", kv, 1000, block_size=16))
    with pytest.raises(PartError, match=r"request r1: prefill sent blocks of 16 tokens, this engine pages 8"):
        assemble_prompt(assembly, 2, 3, 16, raw_format(torch.float32, 3, 16, block_size=8))
    assert tensor_bytes(assembled(assembly, kv, block_size=16)) == tensor_bytes(kv)


@settings(max_examples=25, deadline=None)
@given(
    num_layers=st.integers(1, 3), heads=st.integers(1, 4), num_tokens=st.integers(0, 40), head_dim=st.integers(1, 16),
    block_size=st.integers(1, 16), dtype=st.sampled_from(DTYPES), max_chunk_bytes=st.integers(1, 4000),
    seed=st.integers(0, 2**16),
)
def test_round_trip_property(
    num_layers: int, heads: int, num_tokens: int, head_dim: int, block_size: int, dtype: torch.dtype,
    max_chunk_bytes: int, seed: int,
) -> None:
    kv = smooth_kv(num_layers, heads, num_tokens, head_dim, seed).to(dtype)
    fmt = raw_format(dtype, heads, head_dim, block_size)
    chunks = all_chunks("r1", kv, max_chunk_bytes, block_size)
    assert len(chunks) == num_prompt_chunks(num_layers, num_tokens, fmt, max_chunk_bytes)
    check_chunk_sizes(chunks, fmt, num_tokens, max_chunk_bytes)
    if num_tokens == 0:
        assert chunks == []
        return
    random.Random(seed).shuffle(chunks)
    assert tensor_bytes(assembled(filled(chunks), kv, block_size)) == tensor_bytes(kv)


@pytest.mark.parametrize("dtype", DTYPES, ids=list(DTYPE_NAMES))
def test_the_raw_block_form_is_the_paged_stores(dtype: torch.dtype) -> None:
    """What a prefill store reads travels to a decode store's other blocks and lands there exactly."""
    heads, head_dim, block_size, num_tokens = 2, 8, 4, 10
    config = LlamaConfig(
        vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=3, num_heads=2, num_kv_heads=heads,
        head_dim=head_dim, rope_theta=1e4, rms_norm_eps=1e-5, max_position=64, tie_word_embeddings=True,
    )

    def store() -> PagedKvStore:
        pool = KVPool(config, num_blocks=6, block_size=block_size, dtype=dtype, device=torch.device("cpu"))
        return PagedKvStore(pool, BlockManager(6, block_size), WIRE_NAMES[dtype], 0.5, KernelBackend.TORCH, 4)

    prefill, decode_store = store(), store()
    prefill.pool.tensor.copy_(noise(tuple(prefill.pool.tensor.shape), dtype, seed=1))
    fmt = raw_format(dtype, heads, head_dim, block_size)
    assert prefill.block_format == fmt
    sent, received = [3, 0, 5], [1, 4, 2]  # block tables of 10 tokens: 2 full blocks and a tail of 2
    kv = prefill.pool.tensor[:, :, :, sent].flatten(3, 4)[:, :, :, :num_tokens]  # [layers, 2, heads, 10, head_dim]
    total = num_prompt_chunks(3, num_tokens, fmt, 1)
    assembly, seq = KvAssembly("r1", total), 0
    for layer in range(3):
        read = prefill.read_prompt_layer("r1", sent, num_tokens, layer)
        blocks, tail = as_blocks(kv[layer], block_size)
        assert read.blocks == blocks and tensor_bytes(read.tail) == tensor_bytes(tail)
        for chunk in chunk_prompt_layer("r1", layer, read.blocks, read.tail, num_tokens, fmt, seq, total, 1):
            assembly.add(chunk)
            seq += 1
    decode_store.write_prompt("r1", received, PromptKv(*assemble_prompt(assembly, 3, heads, head_dim, fmt)), 0)
    landed = decode_store.pool.tensor[:, :, :, received].flatten(3, 4)[:, :, :, :num_tokens]
    assert tensor_bytes(landed) == tensor_bytes(kv)


def test_messages_stay_well_under_the_nats_payload() -> None:
    max_chunk_bytes = 256 * 1024
    fmt = raw_format(torch.float32, 3, 64)  # a block is 24 KiB: ten to a chunk
    for num_tokens in (2048, 2047):
        for kv in (smooth_kv(1, 3, num_tokens, 64), noise((1, 2, 3, num_tokens, 64), torch.float32)):
            chunks = all_chunks("r1", kv, max_chunk_bytes)
            assert len(chunks) == num_prompt_chunks(1, num_tokens, fmt, max_chunk_bytes) == math.ceil(2048 / 16 / 10)
            check_chunk_sizes(chunks, fmt, num_tokens, max_chunk_bytes)
            largest = max(len(encode(c)) for c in chunks)
            assert largest < max_chunk_bytes + fmt.block_bytes + 1024 < 1024 * 1024  # blocks, a tail, the header
    one_block = all_chunks("r1", torch.zeros(1, 2, 3, 67, 64), 100)  # one block is 24 KiB > 100 B
    assert [(c.token_start, c.token_end) for c in one_block] == [(0, 16), (16, 32), (32, 48), (48, 67)]
    assert len(one_block) == num_prompt_chunks(1, 67, fmt, 100)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_shuffle_then_lz4_shrinks_real_looking_kv(dtype: torch.dtype) -> None:
    piece = smooth_kv(1, 3, 170, 64)[0].to(dtype)  # 256 KiB of fp32
    raw = tensor_bytes(piece)
    codec, data = compress(raw, piece.element_size())
    assert codec == CODEC_LZ4_SHUFFLE
    assert len(data) < 0.95 * len(raw)
    assert len(lz4.frame.compress(raw)) > 0.97 * len(raw)  # without the shuffle LZ4 finds nothing
    assert decompress(codec, data, len(raw), piece.element_size()) == raw
    kv = smooth_kv(2, 3, 170, 64).to(dtype)  # the same through the chunks, and with compression off
    packed, plain = all_chunks("r1", kv, 64 * 1024), all_chunks("r1", kv, 64 * 1024, compress_payload=False)
    assert [(c.seq, c.raw_size) for c in packed] == [(c.seq, c.raw_size) for c in plain]
    assert sum(len(c.data) for c in packed) < 0.95 * sum(c.raw_size for c in packed)
    assert all(c.codec == CODEC_RAW and len(c.data) == c.raw_size for c in plain)
    assert tensor_bytes(assembled(filled(plain), kv)) == tensor_bytes(assembled(filled(packed), kv))


def test_compress_falls_back_to_raw_when_it_does_not_pay() -> None:
    noise_bytes = random.Random(0).randbytes(64 * 1024)
    assert compress(noise_bytes, 4) == (CODEC_RAW, noise_bytes)
    assert compress(b"", 2) == (CODEC_RAW, b"")
    assert decompress(CODEC_RAW, noise_bytes, len(noise_bytes), 4) == noise_bytes
    with pytest.raises(ValueError, match="whole number"):
        compress(b"\x00" * 6, 4)
    chunks = all_chunks("r1", noise((1, 2, 3, 40, 64), torch.float32), 1 << 20)
    assert [c.codec for c in chunks] == [CODEC_RAW]


def test_decompress_refuses_bad_payloads() -> None:
    raw = bytes(4096)
    codec, data = compress(raw, 4)
    assert codec == CODEC_LZ4_SHUFFLE
    with pytest.raises(PayloadError, match="unknown payload codec"):
        decompress("zstd", data, len(raw), 4)
    with pytest.raises(PayloadError, match="expected 4000"):
        decompress(codec, data, 4000, 4)
    with pytest.raises(PayloadError, match="does not decode"):
        decompress(codec, data[:-3], len(raw), 4)
    with pytest.raises(PayloadError, match="expected 10"):
        decompress(CODEC_RAW, b"12345678", 10, 2)


def test_chunking_refuses_what_it_cannot_describe() -> None:
    fmt = raw_format(torch.float32, 2, 8, block_size=4)
    blocks, tail = as_blocks(smooth_kv(1, 2, 10, 8)[0], 4)  # 2 full blocks and a tail of 2
    assert len(chunk_prompt_layer("r1", 0, blocks, tail, 10, fmt, 0, 1, 1 << 20)) == 1
    with pytest.raises(ValueError, match="do not hold 11 tokens of fp32"):
        chunk_prompt_layer("r1", 0, blocks, tail, 11, fmt, 0, 1, 1 << 20)  # the tail is 2 tokens, not 3
    with pytest.raises(ValueError, match="do not hold 10 tokens"):
        chunk_prompt_layer("r1", 0, blocks[:-4], tail, 10, fmt, 0, 1, 1 << 20)
    with pytest.raises(ValueError, match="do not hold 10 tokens"):
        chunk_prompt_layer("r1", 0, blocks, tail, 10, raw_format(torch.float32, 3, 8, block_size=4), 0, 1, 1 << 20)
    with pytest.raises(ValueError, match="sizes alone for fp32 blocks"):
        chunk_prompt_layer("r1", 0, SizeOnly(len(blocks)), tail, 10, fmt, 0, 1, 1 << 20)
    big = raw_format(torch.float32, 3, 64)
    assert num_prompt_chunks(30, 0, big, 1024) == 0
    assert num_prompt_chunks(30, 2048, big, 256 * 1024) == 30 * math.ceil(2048 / 16 / 10)
    assert num_prompt_chunks(30, 15, big, 1) == 30  # a tail alone is one chunk


@pytest.fixture
def kv() -> torch.Tensor:
    return smooth_kv(3, 3, TOKENS, 64)


@pytest.fixture
def chunks(kv: torch.Tensor) -> list[KvChunk]:
    chunks = all_chunks("r1", kv, max_chunk_bytes=ONE_BLOCK)
    assert len(chunks) == 3 * (TOKENS // BLOCK) == 18  # 3 layers x 6 chunks, the tail with the last
    return chunks


def test_a_corrupted_byte_fails_the_checksum_naming_the_chunk(kv: torch.Tensor, chunks: list[KvChunk]) -> None:
    data = bytearray(chunks[3].data)
    data[len(data) // 2] ^= 0x01
    assembly = KvAssembly("r1", len(chunks))
    with pytest.raises(PartError, match=r"request r1: KV chunk 3/18 failed its checksum"):
        assembly.add(dataclasses.replace(chunks[3], data=bytes(data)))
    garbage = b"not lz4 at all"  # a sender bug: the checksum matches, the payload does not decode
    lz4_chunk = all_chunks("r1", torch.zeros_like(kv), ONE_BLOCK)[4]
    assert lz4_chunk.codec == CODEC_LZ4_SHUFFLE
    with pytest.raises(PartError, match=r"chunk 4/18: LZ4 payload does not decode"):
        assembly.add(dataclasses.replace(lz4_chunk, data=garbage, checksum=checksum(garbage)))
    assert assembly.num_received == 0


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"request_id": "r2"}, "chunk 2/18 belongs to request r2"),
        ({"total": 17}, "says 17 chunks, earlier ones said 18"),
        ({"seq": 18}, "seq out of range"),
        ({"seq": -1}, "seq out of range"),
        ({"dtype": "fp8"}, "unknown dtype"),
        ({"kv_format": ""}, "names no KV format"),
        ({"layer_end": 0}, "empty or negative range"),
        ({"token_start": 5, "token_end": 5}, "empty or negative range"),
        ({"raw_size": 0}, "raw size 0"),
        ({"raw_size": 1000}, "after decoding, expected 1000"),
    ],
)
def test_inconsistent_chunks_are_refused(chunks: list[KvChunk], change: dict[str, object], error: str) -> None:
    with pytest.raises(PartError, match=error):
        KvAssembly("r1", 18).add(dataclasses.replace(chunks[2], **change))  # type: ignore[arg-type]


def test_duplicates_identical_ignored_conflicting_refused(kv: torch.Tensor, chunks: list[KvChunk]) -> None:
    assembly = KvAssembly("r1", len(chunks))
    assembly.add(chunks[0])
    wire_bytes, held_bytes = assembly.num_wire_bytes, assembly.num_held_bytes
    assembly.add(chunks[0])
    assert (assembly.num_received, assembly.num_wire_bytes, assembly.num_held_bytes) == (1, wire_bytes, held_bytes)
    with pytest.raises(PartError, match="chunk 0/18 arrived twice with different contents"):
        assembly.add(dataclasses.replace(chunks[1], seq=0))
    bf16 = all_chunks("r1", kv.to(torch.bfloat16), ONE_BLOCK)[17]
    with pytest.raises(PartError, match="chunk 17/18 has dtype 'bf16', the earlier chunks 'fp32'"):
        assembly.add(bf16)
    with pytest.raises(PartError, match="has kv_format 'kvquant-3:abc', the earlier chunks 'fp32'"):
        assembly.add(dataclasses.replace(chunks[5], kv_format="kvquant-3:abc"))
    assert assembly.num_received == 1


def test_missing_chunks_make_assemble_fail(chunks: list[KvChunk]) -> None:
    assembly = KvAssembly("r1", len(chunks))
    for chunk in chunks[:5] + chunks[6:]:
        assembly.add(chunk)
    assert not assembly.is_complete and assembly.missing() == [5]
    with pytest.raises(PartError, match=r"request r1: KV: 1 of 18 chunks missing \(5\)"):
        assemble_prompt(assembly, 3, 3, 64, raw_format(torch.float32, 3, 64))


def test_assemble_checks_layer_coverage_and_shape() -> None:
    kv = smooth_kv(3, 2, 10, 8)
    fmt = raw_format(torch.float32, 2, 8)  # 10 tokens are a tail: one chunk a layer

    def layer(index: int, seq: int, total: int) -> list[KvChunk]:
        blocks, tail = as_blocks(kv[index])
        return chunk_prompt_layer("r1", index, blocks, tail, 10, fmt, seq, total, 10_000)

    twice = layer(0, 0, 2) + layer(0, 1, 2)
    gap = layer(0, 0, 2) + layer(2, 1, 2)
    small_blocks = all_chunks("r1", kv[:1], 1, block_size=4)  # [0, 4), [4, 10): whole blocks of 4, not of 16
    forged = [dataclasses.replace(chunk, block_size=16) for chunk in small_blocks]  # saying 16 all the same
    cases = [  # (chunks, the decode engine's layers, kv heads and format, the error)
        (twice, 1, 2, fmt, "layer 0 has an overlap at token 10"),
        (gap, 3, 2, fmt, r"layer 1 covers tokens \[0, 0\), expected \[0, 10\)"),
        (gap, 2, 2, fmt, "chunk 1/2 holds layer 2, the model has 2"),
        (layer(0, 0, 1), 1, 4, raw_format(torch.float32, 4, 8), r"chunk 0 holds 1280 bytes, .* \[0, 10\) .* 2560"),
        (small_blocks, 1, 2, fmt, r"prefill sent blocks of 4 tokens, this engine pages 16"),
        (forged, 1, 2, fmt, r"chunk 0 covers tokens \[0, 4\), not whole blocks"),
    ]
    for pieces, num_layers, heads, engine_fmt, error in cases:
        with pytest.raises(PartError, match=error):
            assemble_prompt(filled(pieces), num_layers, heads, 8, engine_fmt)
