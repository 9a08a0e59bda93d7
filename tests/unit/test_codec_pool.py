"""The codec KV pool and its attention: the step layout by hand, block rows that round-trip as the codec's bytes,
tails taken and released, and attention over several steps (chunked prefill, then decode, two sequences) equal to
plain causal attention over the same K/V with the packed blocks rounded as the codec rounds them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.layer_ops import apply_rotary_ref
from shared.engine.batching import ScheduledChunk
from shared.engine.kv.codec.attention import CodecAttention, CodecStepLayout
from shared.engine.kv.codec.pool import CodecKvPool, OutOfTails
from shared.engine.sequence import Sequence
from shared.kvcompress import get_codec
from shared.kvcompress.kvquant import KvQuantCodec
from shared.model.config import LlamaConfig
from shared.model.llama import RotaryEmbedding
from shared.wire.protocol import SamplingParams

BLOCK = 4
HEADS, KV_HEADS, DIM = 4, 2, 8


def tiny_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=32, hidden_size=HEADS * DIM, intermediate_size=16, num_layers=1, num_heads=HEADS,
        num_kv_heads=KV_HEADS, head_dim=DIM, rms_norm_eps=1e-5, rope_theta=10000.0, max_position=128,
        tie_word_embeddings=True,
    )


def kvquant_codec(bits: int = 4) -> KvQuantCodec:
    codebook = torch.linspace(-1, 1, 1 << bits)
    return KvQuantCodec(bits, torch.zeros(KV_HEADS, DIM), torch.full((KV_HEADS, DIM), 3.0), codebook, codebook,
                        0.05)


def make_pool(codec_name: str = "fp16", num_tails: int = 3) -> CodecKvPool:
    codec = kvquant_codec() if codec_name == "kvquant" else get_codec(codec_name)
    return CodecKvPool(tiny_config(), [codec], 16, BLOCK, num_tails, torch.float32, torch.device("cpu"))


def seq(request_id: str, num_tokens: int, computed: int) -> Sequence:
    s = Sequence(request_id, list(range(num_tokens)), num_tokens, SamplingParams())
    s.num_computed_tokens = computed
    return s


def test_layout_of_a_decode_token_and_a_prefill_chunk() -> None:
    pool = make_pool()
    chunks = [ScheduledChunk(seq("a", 7, 6), 1), ScheduledChunk(seq("b", 10, 2), 7)]
    layout = CodecStepLayout.build(chunks, {"a": [5, 6], "b": [1, 2, 3]}, pool, torch.device("cpu"))
    # a: position 6 is offset 2 of its second block (row 0, a tail prefix); b: positions 2..8 span blocks 0..2.
    assert layout.num_rows == 4
    assert layout.token_index.tolist() == [2, 1 * 4 + 2, 7, 8, 9, 10, 11, 12]
    assert layout.prefix_rows.tolist() == [0, 1]
    assert layout.complete_rows == [1, 2] and layout.complete_ids == [1, 2] and layout.complete_first == [True, False]
    assert layout.partial_rows.tolist() == [0, 3]
    a, b = layout.chunks
    assert a.packed_ids == [5] and a.context_len == 7 and (a.first_row, a.num_rows) == (0, 1)
    assert b.packed_ids == [] and b.context_len == 9 and (b.first_query, b.first_row, b.num_rows) == (1, 1, 3)


def test_tails_are_taken_once_per_sequence_and_released() -> None:
    pool = make_pool(num_tails=2)
    assert pool.tail("a") == pool.tail("a")
    pool.tail("b")
    with pytest.raises(OutOfTails):
        pool.tail("c")
    pool.release("a")
    pool.tail("c")
    pool.release("unknown")


@pytest.mark.parametrize("codec_name", ["fp16", "kivi-4", "kvquant"])
def test_block_rows_are_the_codec_bytes(codec_name: str) -> None:
    pool = make_pool(codec_name)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, KV_HEADS, BLOCK, DIM, generator=g), torch.randn(2, KV_HEADS, BLOCK, DIM, generator=g)
    pool.encode_blocks(0, [3, 7], k, v, [True, False])
    codec = pool.codecs[0]
    assert pool.read_block_bytes(0, 3, True) == codec.encode(k[0], v[0], starts_sequence=True)
    assert pool.read_block_bytes(0, 7, False) == codec.encode(k[1], v[1])
    decoded_k, decoded_v = pool.decode_blocks(0, [3, 7], [True, False])
    expected = codec.decode(codec.encode(k[1], v[1]), KV_HEADS, BLOCK, DIM, torch.float32)
    assert torch.equal(decoded_k[1], expected[0]) and torch.equal(decoded_v[1], expected[1])
    pool.write_block_bytes(0, 9, pool.read_block_bytes(0, 3, True), True)
    assert torch.equal(pool.decode_blocks(0, [9], [True])[0], decoded_k[:1])
    with pytest.raises(ValueError, match="bytes here"):
        pool.write_block_bytes(0, 9, b"\0" * 3, False)


@pytest.mark.parametrize("codec_name", ["fp16", "kvquant"])
def test_attention_over_steps_matches_causal_attention_on_codec_rounded_kv(codec_name: str) -> None:
    """Two sequences: 'a' prefills 9 tokens in chunks of 6 and 3 while 'b' prefills 5, then both decode 4 tokens."""
    pool = make_pool(codec_name)
    rotary = RotaryEmbedding(DIM, 128, 10000.0)
    g = torch.Generator().manual_seed(1)
    total = {"a": 13, "b": 9}
    q_all = {r: torch.randn(n, HEADS, DIM, generator=g) for r, n in total.items()}
    k_all = {r: torch.randn(n, KV_HEADS, DIM, generator=g) for r, n in total.items()}
    v_all = {r: torch.randn(n, KV_HEADS, DIM, generator=g) for r, n in total.items()}
    tables = {"a": [0, 1, 2, 3], "b": [4, 5, 6]}
    seqs = {r: seq(r, n, 0) for r, n in total.items()}
    steps = [{"a": 6, "b": 5}, {"a": 3}, {"a": 1, "b": 1}, {"a": 1, "b": 1}, {"a": 1, "b": 1}, {"a": 1, "b": 1}]
    outputs: dict[str, list[torch.Tensor]] = {"a": [], "b": []}
    chunk_start: dict[str, list[int]] = {"a": [], "b": []}  # per token: where its step's chunk began
    for step in steps:
        order = sorted(step, key=lambda r: step[r] > 1)  # decode-shaped chunks first, as the scheduler orders them
        chunks = [ScheduledChunk(seqs[r], step[r]) for r in order]
        layout = CodecStepLayout.build(chunks, tables, pool, torch.device("cpu"))
        spans = {r: slice(seqs[r].num_computed_tokens, seqs[r].num_computed_tokens + step[r]) for r in order}
        positions = torch.cat([torch.arange(spans[r].start, spans[r].stop) for r in order])
        cos, sin = rotary.cos_sin(positions, torch.float32)
        q = apply_rotary_ref(torch.cat([q_all[r][spans[r]] for r in order]), cos, sin)
        k_pre = torch.cat([k_all[r][spans[r]] for r in order])
        v = torch.cat([v_all[r][spans[r]] for r in order])
        ctx = CodecAttention(pool, layout, DIM**-0.5, rotary)
        out = ctx.attend(0, q, apply_rotary_ref(k_pre, cos, sin), v, k_pre)
        start = 0
        for r in order:
            outputs[r].append(out[start : start + step[r]])
            chunk_start[r].extend([seqs[r].num_computed_tokens] * step[r])
            start += step[r]
            seqs[r].num_computed_tokens += step[r]
    codec = pool.codecs[0]
    for r, n in total.items():
        cos_all, sin_all = rotary.cos_sin(torch.arange(n), torch.float32)
        # The codec sees keys before RoPE (kvquant) or after (uniform codecs), as the pool stores them.
        k_stored = k_all[r] if codec.keys_before_rope else apply_rotary_ref(k_all[r], cos_all, sin_all)
        got = torch.cat(outputs[r])
        expected = []
        for i in range(n):
            # Token i sees the blocks finished before its step through the codec, the blocks its step touches exact.
            k_ctx, v_ctx = k_stored[: i + 1].clone(), v_all[r][: i + 1].clone()
            for block in range(chunk_start[r][i] // BLOCK):
                span = slice(block * BLOCK, (block + 1) * BLOCK)
                data = codec.encode(k_stored[span].transpose(0, 1), v_all[r][span].transpose(0, 1),
                                    starts_sequence=block == 0)
                kd, vd = codec.decode(data, KV_HEADS, BLOCK, DIM, torch.float32, starts_sequence=block == 0)
                k_ctx[span], v_ctx[span] = kd.transpose(0, 1), vd.transpose(0, 1)
            cos, sin = cos_all[: i + 1], sin_all[: i + 1]
            keys = apply_rotary_ref(k_ctx, cos, sin) if codec.keys_before_rope else k_ctx
            query = apply_rotary_ref(q_all[r][i : i + 1], cos[i : i + 1], sin[i : i + 1])
            attended = F.scaled_dot_product_attention(
                query.transpose(0, 1), keys.transpose(0, 1), v_ctx.transpose(0, 1), enable_gqa=True
            )
            expected.append(attended.transpose(0, 1))
        assert torch.allclose(got, torch.cat(expected), atol=1e-5)
    assert len(pool._free_tails) == 1  # both sequences hold a tail (13 and 9 tokens end mid-block)
