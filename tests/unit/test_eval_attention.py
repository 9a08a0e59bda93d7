"""DenseCodecAttention: the block visibility rule by hand, fp16 KV matching plain causal attention, queries of block 0
seeing exact keys, agreement with a naive masked-softmax oracle, pre-RoPE keys for kvquant codecs, and the batched
kvquant path equal to its byte interface."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.layer_ops import apply_rotary_ref
from shared.kvcompress import get_codec
from shared.kvcompress.codec import KvCodec
from shared.kvcompress.kvquant import KvQuantCodec
from shared.kvcompress.uniform import Fp16Codec
from shared.model.config import LlamaConfig
from shared.model.llama import AttentionContext, DenseCausalAttention, Llama, RotaryEmbedding
from shared.tools.eval.codec_attention import DenseCodecAttention, block_visibility

HEADS, KV_HEADS, HEAD_DIM = 6, 2, 16
ROTARY = RotaryEmbedding(HEAD_DIM, 1024, 10000.0)


def random_qkv(num_tokens: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q [T, HEADS, D], k (rotated), v, k before RoPE [T, KV_HEADS, D]; fp32, as the model hands them over."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(num_tokens, HEADS, HEAD_DIM, generator=g)
    k_pre = torch.randn(num_tokens, KV_HEADS, HEAD_DIM, generator=g) * 2 + 0.3
    v = torch.randn(num_tokens, KV_HEADS, HEAD_DIM, generator=g)
    cos, sin = ROTARY.cos_sin(torch.arange(num_tokens), torch.float32)
    return q, apply_rotary_ref(q, cos, sin), apply_rotary_ref(k_pre, cos, sin), v, k_pre


def codec_attend(codec: KvCodec, block_size: int, num_tokens: int, seed: int = 0) -> torch.Tensor:
    _, q, k, v, k_pre = random_qkv(num_tokens, seed)
    return DenseCodecAttention([codec], block_size, ROTARY).attend(0, q, k, v, k_pre)


def dense_attend(num_tokens: int, seed: int = 0) -> torch.Tensor:
    _, q, k, v, k_pre = random_qkv(num_tokens, seed)
    return DenseCausalAttention().attend(0, q, k, v, k_pre)


def oracle(codec: KvCodec, block_size: int, num_tokens: int, seed: int = 0) -> torch.Tensor:
    """The semantics spelled out: every full block through the codec's bytes (block 0 starting the sequence), one
    score matrix per head against decoded and exact keys, chosen per pair by the block rule, then one softmax."""
    _, q, k, v, k_pre = random_qkv(num_tokens, seed)
    keys = k_pre if codec.keys_before_rope else k
    k_dec, v_dec = k.clone(), v.clone()
    for b in range(num_tokens // block_size):
        s = slice(b * block_size, (b + 1) * block_size)
        data = codec.encode(keys[s].transpose(0, 1), v[s].transpose(0, 1), starts_sequence=b == 0)
        kb, vb = codec.decode(data, KV_HEADS, block_size, HEAD_DIM, torch.float32, starts_sequence=b == 0)
        k_dec[s], v_dec[s] = kb.transpose(0, 1), vb.transpose(0, 1)
    if codec.keys_before_rope:
        cos, sin = ROTARY.cos_sin(torch.arange(num_tokens), torch.float32)
        k_dec = apply_rotary_ref(k_dec, cos, sin)
    coded, exact = block_visibility(num_tokens, block_size)
    out = torch.empty_like(q)
    for h in range(HEADS):
        kv = h // (HEADS // KV_HEADS)
        scores = torch.where(coded, q[:, h] @ k_dec[:, kv].T, q[:, h] @ k[:, kv].T) / math.sqrt(HEAD_DIM)
        probs = scores.masked_fill(~(coded | exact), float("-inf")).softmax(dim=-1)
        out[:, h] = (probs * coded) @ v_dec[:, kv] + (probs * exact) @ v[:, kv]
    return out


class Recording(Fp16Codec):
    """fp16, lossless for fp16 input, recording what it is asked to encode; optionally a pre-RoPE-keys codec."""

    def __init__(self, keys_before_rope: bool) -> None:
        self.keys_before_rope = keys_before_rope
        self.calls: list[tuple[torch.Tensor, bool]] = []

    def encode(self, k: torch.Tensor, v: torch.Tensor, *, starts_sequence: bool = False) -> bytes:
        self.calls.append((k.clone(), starts_sequence))
        return super().encode(k, v, starts_sequence=starts_sequence)


class ThroughBytes(KvCodec):
    """A codec's byte interface alone, so DenseCodecAttention cannot take a codec-specific shortcut."""

    def __init__(self, inner: KvCodec) -> None:
        self.inner, self.name, self.keys_before_rope = inner, inner.name, inner.keys_before_rope

    def encode(self, k: torch.Tensor, v: torch.Tensor, *, starts_sequence: bool = False) -> bytes:
        return self.inner.encode(k, v, starts_sequence=starts_sequence)

    def decode(self, data: bytes, kv_heads: int, num_tokens: int, head_dim: int, dtype: torch.dtype, *,
               starts_sequence: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner.decode(data, kv_heads, num_tokens, head_dim, dtype, starts_sequence=starts_sequence)

    def num_bytes(self, kv_heads: int, num_tokens: int, head_dim: int, *, starts_sequence: bool = False) -> int:
        return self.inner.num_bytes(kv_heads, num_tokens, head_dim, starts_sequence=starts_sequence)


def kvquant_codec(bits: int = 2, outlier_fraction: float = 0.01) -> KvQuantCodec:
    """A kvquant codec with a plausible hand-made calibration for random_qkv's keys (centre 0.3, spread 2)."""
    levels = torch.linspace(-1, 1, 1 << bits)
    return KvQuantCodec(
        bits, torch.full((KV_HEADS, HEAD_DIM), 0.3), torch.full((KV_HEADS, HEAD_DIM), 6.0), levels, levels,
        outlier_fraction,
    )


# ---- the rule ------------------------------------------------------------------------------------------------------


def test_block_visibility_by_hand() -> None:
    coded, exact = block_visibility(5, 2)  # blocks {0, 1}, {2, 3}, {4}
    assert coded.int().tolist() == [
        [0, 0, 0, 0, 0],
        [0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0],
    ]
    assert exact.int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 1, 0, 0],
        [0, 0, 1, 1, 0],
        [0, 0, 0, 0, 1],
    ]


def test_one_block_is_plain_causal_and_nothing_is_coded() -> None:
    coded, exact = block_visibility(4, 4)
    assert not coded.any()
    assert torch.equal(exact, torch.ones(4, 4, dtype=torch.bool).tril())


# ---- the attention -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_tokens, block_size", [(150, 32), (128, 32), (7, 3), (20, 64)])
def test_fp16_codec_matches_dense_attention_within_fp16_rounding(num_tokens: int, block_size: int) -> None:
    out = codec_attend(get_codec("fp16"), block_size, num_tokens)
    dense = dense_attend(num_tokens)
    assert out.shape == dense.shape == (num_tokens, HEADS, HEAD_DIM)
    # Keys of |x| ~ 5 rounded to fp16 move scores by ~5 * 2**-11 * |q| ~ 1e-2 at most; outputs by less.
    torch.testing.assert_close(out, dense, rtol=0, atol=4e-3)


@pytest.mark.parametrize("name", ["kivi-2", "int8"])
def test_queries_of_block_zero_see_exact_keys_and_later_ones_do_not(name: str) -> None:
    out, dense = codec_attend(get_codec(name), 32, 100), dense_attend(100)
    torch.testing.assert_close(out[:32], dense[:32], rtol=0, atol=1e-5)
    # Block 1's first query sees block 0 decoded: a lossy codec moves it.
    assert float((out[32] - dense[32]).abs().max()) > 1e-3


@pytest.mark.parametrize("name", ["fp16", "int8", "kivi-4", "kivi-2"])
@pytest.mark.parametrize("num_tokens, block_size", [(150, 32), (96, 32), (9, 4)])
def test_matches_the_naive_oracle(name: str, num_tokens: int, block_size: int) -> None:
    out = codec_attend(get_codec(name), block_size, num_tokens, seed=3)
    torch.testing.assert_close(out, oracle(get_codec(name), block_size, num_tokens, seed=3), rtol=0, atol=1e-5)


def test_each_full_block_read_through_the_codec_is_coded_once_the_first_as_starting_the_sequence() -> None:
    codec = Recording(keys_before_rope=False)
    _, q, k, v, k_pre = random_qkv(128)
    DenseCodecAttention([codec], 32, ROTARY).attend(0, q, k, v, k_pre)
    # Blocks 0-2; block 3 is the last query's own block and never read decoded.
    assert [flag for _, flag in codec.calls] == [True, False, False]
    for b, (keys, _) in enumerate(codec.calls):
        assert torch.equal(keys, k[32 * b : 32 * (b + 1)].transpose(0, 1))  # rotated keys, [H, T, D]


def test_a_pre_rope_codec_gets_keys_before_rope_and_they_are_rotated_after_decoding() -> None:
    codec = Recording(keys_before_rope=True)
    _, q, k, v, k_pre = random_qkv(100)
    out = DenseCodecAttention([codec], 32, ROTARY).attend(0, q, k, v, k_pre)
    assert len(codec.calls) == 3
    for b, (keys, _) in enumerate(codec.calls):
        assert torch.equal(keys, k_pre[32 * b : 32 * (b + 1)].transpose(0, 1))
    torch.testing.assert_close(out, dense_attend(100), rtol=0, atol=4e-3)  # unrotated keys would be far off


def test_a_pre_rope_codec_left_unrotated_would_be_caught() -> None:
    """The check above can fail: the same lossless codec fed rotated keys as if pre-RoPE rotates twice."""
    codec = Recording(keys_before_rope=True)
    _, q, k, v, _ = random_qkv(100)
    out = DenseCodecAttention([codec], 32, ROTARY).attend(0, q, k, v, k)
    assert float((out - dense_attend(100)).abs().max()) > 0.05


@pytest.mark.parametrize("num_tokens", [100, 33])
def test_kvquant_batched_path_equals_its_byte_interface(num_tokens: int) -> None:
    codec = kvquant_codec()
    batched = codec_attend(codec, 32, num_tokens, seed=5)
    through_bytes = codec_attend(ThroughBytes(codec), 32, num_tokens, seed=5)
    torch.testing.assert_close(batched, through_bytes, rtol=0, atol=1e-6)
    torch.testing.assert_close(batched, oracle(codec, 32, num_tokens, seed=5), rtol=0, atol=1e-5)
    assert float((batched - dense_attend(num_tokens, seed=5)).abs().max()) > 1e-3  # 2-bit codes do lose


def test_each_layer_uses_its_own_codec() -> None:
    _, q, k, v, k_pre = random_qkv(64)
    codecs = [Recording(keys_before_rope=False), Recording(keys_before_rope=False)]
    ctx = DenseCodecAttention(codecs, 16, ROTARY)
    ctx.attend(1, q, k, v, k_pre)
    assert len(codecs[0].calls) == 0 and len(codecs[1].calls) == 3


def test_tiny_model_with_fp16_kv_matches_dense_logits() -> None:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=97, hidden_size=48, intermediate_size=96, num_layers=3, num_heads=6, num_kv_heads=2, head_dim=8,
        rope_theta=10000.0, rms_norm_eps=1e-5, max_position=256, tie_word_embeddings=True,
    )
    model = Llama(config).eval()
    ids, positions = torch.randint(0, 97, (70,)), torch.arange(70)

    def logits(ctx: AttentionContext) -> torch.Tensor:
        with torch.inference_mode():
            return model.compute_logits(model(ids, positions, ctx))

    dense = logits(DenseCausalAttention())
    fp16 = logits(DenseCodecAttention([get_codec("fp16")] * 3, 16, model.rotary))
    kivi = logits(DenseCodecAttention([get_codec("kivi-2")] * 3, 16, model.rotary))
    torch.testing.assert_close(fp16, dense, rtol=0, atol=2e-3)
    torch.testing.assert_close(kivi[:16], dense[:16], rtol=0, atol=1e-5)  # block 0 sees no decoded key
    assert float((kivi[16:] - dense[16:]).abs().max()) > 1e-3
