"""FastGen's lane records (`LaneCodec`) with the shipped SmolLM2 calibrations: the record size is the layout's, real
keys and values come back closer the more bits, outlier channels exactly to fp16, encoding is deterministic and per
entry, bad input and codecs raise; and the harness's served K/V (`ServedKv`): the full cache's blocks before the
step's own decoded, FastGen's records of the pool's values beside the newest W whole, the sink in fp16."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kernels.bitpack import packed_num_bytes
from kernels.layer_ops import apply_rotary_ref
from shared.fastgen.lane_codec import LaneCodec
from shared.kvcompress.kvquant import KvQuantCodec
from shared.model.config import LlamaConfig
from shared.model.llama import RotaryEmbedding
from shared.tools.eval.fastgen_codecs import KvServing, ServedKv, build_kv_serving
from shared.tools.eval.text_spans import read_tokens

# SmolLM2-135M's shape, which the shipped calibrations are for.
SMOLLM2 = LlamaConfig(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
    rope_theta=100000.0, rms_norm_eps=1e-5, max_position=8192, tie_word_embeddings=True,
)
TEXT = Path(__file__).parents[2] / "README.md"  # English prose that travels with the repository
LAYER = 7


@pytest.fixture(scope="module", params=[4, 3, 2], ids=lambda bits: f"kvquant-{bits}")
def codec(request: pytest.FixtureRequest) -> LaneCodec:
    return build_kv_serving(f"kvquant-{request.param}", SMOLLM2).lanes


def calibrated_kv(codec: LaneCodec, count: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """heads long [count], keys around the calibrated centre (std half the calibrated half-range), values ~ N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    heads = torch.randint(0, SMOLLM2.num_kv_heads, (count,), generator=g)
    noise = torch.randn(count, codec.head_dim, generator=g)
    k = codec.key_center[LAYER, heads] + 0.5 * codec.key_scale[LAYER, heads] * noise
    return heads, k, torch.randn(count, codec.head_dim, generator=g)


def test_the_record_size_is_the_layouts(codec: LaneCodec) -> None:
    dim, n = codec.head_dim, codec.num_outliers
    assert n == math.ceil(0.01 * dim) == 1  # the shipped calibrations keep 1% outliers per vector
    # V centre and half-range (fp16), n fp16 outliers each of K and V, D codes each of K and V, 2n uint8 channels
    layout = 2 * 2 + 2 * n * 2 + 2 * packed_num_bytes(dim, codec.bits) + 2 * n
    assert codec.entry_bytes == layout == {4: 74, 3: 58, 2: 42}[codec.bits]
    heads, k, v = calibrated_kv(codec, 5)
    records = codec.encode(LAYER, heads, k, v)
    assert records.dtype == torch.uint8 and records.shape == (5, layout)


@pytest.fixture(scope="module")
def real_kv(checkpoint) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer, the keys before RoPE and the values of 64 tokens of English prose, [64, kv_heads, D]."""
    from shared.model.llama import build_model

    class Capture:
        def __init__(self) -> None:
            self.keys: list[torch.Tensor] = []
            self.values: list[torch.Tensor] = []

        def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   k_pre_rope: torch.Tensor) -> torch.Tensor:
            self.keys.append(k_pre_rope.clone())
            self.values.append(v.clone())
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
            )
            return out.transpose(0, 1)

    tokens = read_tokens(TEXT, checkpoint.tokenizer)[200:264]
    model = build_model(checkpoint.config, checkpoint.state_dict, torch.float32, torch.device("cpu"))
    capture = Capture()
    with torch.inference_mode():
        model(torch.tensor(tokens), torch.arange(64), capture)
    return capture.keys, capture.values


def relative_errors(codec: LaneCodec, keys: list[torch.Tensor], values: list[torch.Tensor]) -> tuple[float, float]:
    """||decoded - x|| / ||x|| over every entry of every layer, for keys and for values."""
    k_error = k_norm = v_error = v_norm = 0.0
    for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
        heads = torch.arange(k.shape[1]).repeat(k.shape[0])
        k, v = k.reshape(-1, codec.head_dim), v.reshape(-1, codec.head_dim)
        k2, v2 = codec.decode(layer, heads, codec.encode(layer, heads, k, v))
        k_error, k_norm = k_error + float((k2 - k).square().sum()), k_norm + float(k.square().sum())
        v_error, v_norm = v_error + float((v2 - v).square().sum()), v_norm + float(v.square().sum())
    return math.sqrt(k_error / k_norm), math.sqrt(v_error / v_norm)


@pytest.mark.slow
def test_real_keys_and_values_come_back_closer_the_more_bits(real_kv) -> None:
    errors = {bits: relative_errors(build_kv_serving(f"kvquant-{bits}", SMOLLM2).lanes, *real_kv) for bits in (4, 3, 2)}
    # Measured on these 64 tokens: keys 5.6% / 9.9% / 18.7%, values 8.1% / 16.1% / 31.7% at 4 / 3 / 2 bits.
    for bits, (k_bound, v_bound) in {4: (0.07, 0.11), 3: (0.13, 0.21), 2: (0.24, 0.40)}.items():
        assert errors[bits][0] < k_bound and errors[bits][1] < v_bound, errors
    assert errors[4][0] < errors[3][0] < errors[2][0] and errors[4][1] < errors[3][1] < errors[2][1]


def test_outlier_channels_come_back_exact_to_fp16(codec: LaneCodec) -> None:
    heads, k, v = calibrated_kv(codec, 32, seed=1)
    channels = torch.randint(0, codec.head_dim, (32, 1), generator=torch.Generator().manual_seed(2))
    far = codec.key_center[LAYER, heads] + 40 * codec.key_scale[LAYER, heads]  # 40 half-ranges out
    k.scatter_(1, channels, far.gather(1, channels) + 0.123)
    v.scatter_(1, channels, 57.3)
    k2, v2 = codec.decode(LAYER, heads, codec.encode(LAYER, heads, k, v))
    assert torch.equal(k2.gather(1, channels), k.gather(1, channels).half().float())
    assert torch.equal(v2.gather(1, channels), v.gather(1, channels).half().float())
    # The value outlier is left out of its token's range: the other channels stay within the codebook's worst error
    # (half its widest gap, or its distance to +-1) times the range of the token's inliers alone.
    inlier = torch.ones_like(v, dtype=torch.bool).scatter(1, channels, False)
    rest = v[inlier].view(32, -1)
    half_range = (rest.amax(dim=1) - rest.amin(dim=1)) / 2  # [32], about 2.5 against 57.3 with the outlier
    book = codec.value_codebook[LAYER]
    worst = max(float((book[1:] - book[:-1]).max()) / 2, 1 - float(book[-1]), float(book[0]) + 1)
    assert bool(((v2 - v)[inlier].view(32, -1).abs() <= worst * half_range[:, None] * 1.01 + 1e-3).all())


def test_encoding_is_deterministic_and_per_entry(codec: LaneCodec) -> None:
    heads, k, v = calibrated_kv(codec, 40, seed=3)
    records = codec.encode(LAYER, heads, k, v)
    assert torch.equal(records, codec.encode(LAYER, heads, k.clone(), v.clone()))
    subset = torch.tensor([31, 0, 7, 7, 12])
    assert torch.equal(codec.encode(LAYER, heads[subset], k[subset], v[subset]), records[subset])
    k2, v2 = codec.decode(LAYER, heads, records)
    k3, v3 = codec.decode(LAYER, heads[subset], records[subset])
    assert torch.equal(k3, k2[subset]) and torch.equal(v3, v2[subset])
    # A record read as another head's (another calibrated range) decodes to other keys.
    assert not torch.equal(codec.decode(LAYER, (heads + 1) % SMOLLM2.num_kv_heads, records)[0], k2)


@pytest.mark.parametrize("bad", ["k_nan", "v_inf", "v_huge"])
def test_non_finite_input_raises(codec: LaneCodec, bad: str) -> None:
    heads, k, v = calibrated_kv(codec, 4)
    if bad == "k_nan":
        k[2, 5] = math.nan
    elif bad == "v_inf":
        v[0, 0] = math.inf
    else:
        v[1] = torch.linspace(-1e6, 1e6, codec.head_dim)  # a range past fp16's
    with pytest.raises(ValueError, match="NaN|fp16"):
        codec.encode(LAYER, heads, k, v)


def synthetic_codec(bits: int, dim: int) -> KvQuantCodec:
    codebook = torch.linspace(-1, 1, 1 << bits)
    return KvQuantCodec(bits, torch.zeros(2, dim), torch.ones(2, dim), codebook, codebook.clone(), 0.01)


def test_bad_codec_sets_raise() -> None:
    assert LaneCodec([synthetic_codec(4, 256)]).head_dim == 256
    with pytest.raises(ValueError, match="head dim 264"):
        LaneCodec([synthetic_codec(4, 264)])
    with pytest.raises(ValueError, match="same width"):
        LaneCodec([synthetic_codec(4, 64), synthetic_codec(3, 64)])
    with pytest.raises(ValueError, match="same width"):
        LaneCodec([])
    with pytest.raises(ValueError, match="kvquant"):
        build_kv_serving("kivi-4", SMOLLM2)


# ---- the harness's served K/V (`ServedKv`), in blocks of 4 --------------------------------------------------------

W = 4


@pytest.fixture(scope="module")
def serving() -> KvServing:
    return build_kv_serving("kvquant-4", SMOLLM2, block_size=W)


def exact_kv(serving: KvServing, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys before RoPE around the calibrated centre and values ~ N(0, 1), [kv_heads, num_tokens, D] each."""
    g = torch.Generator().manual_seed(3)
    shape = (SMOLLM2.num_kv_heads, num_tokens, SMOLLM2.head_dim)
    center, scale = serving.lanes.key_center[LAYER][:, None], serving.lanes.key_scale[LAYER][:, None]
    return center + 0.5 * scale * torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def rotated(k: torch.Tensor, start: int = 0) -> torch.Tensor:
    """[H, n, D] keys before RoPE at positions start.. -> after."""
    cos, sin = RotaryEmbedding(SMOLLM2.head_dim, 64, SMOLLM2.rope_theta).cos_sin(
        torch.arange(start, start + k.shape[1]), torch.float32
    )
    return apply_rotary_ref(k, cos.transpose(0, 1), sin.transpose(0, 1))


def blocks_decoded(serving: KvServing, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[H, n, D] with n a multiple of W, each block encoded alone, block 0 starting the sequence."""
    codec, parts = serving.blocks[LAYER], []
    for block in range(k.shape[1] // W):
        cut = slice(block * W, (block + 1) * W)
        packed = codec.encode_blocks(k[None, :, cut], v[None, :, cut], starts_sequence=block == 0)
        parts.append(codec.decode_blocks(packed, k.shape[0], W, k.shape[2]))
    return torch.cat([pk[0] for pk, _ in parts], dim=1), torch.cat([pv[0] for _, pv in parts], dim=1)


def records_decoded(serving: KvServing, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[H, n, D] through lane records, one entry at a time."""
    lanes, k_out, v_out = serving.lanes, torch.empty_like(k), torch.empty_like(v)
    for head, position in itertools.product(range(k.shape[0]), range(k.shape[1])):
        heads = torch.tensor([head])
        records = lanes.encode(LAYER, heads, k[head, position][None], v[head, position][None])
        k_out[head, position], v_out[head, position] = (x[0] for x in lanes.decode(LAYER, heads, records))
    return k_out, v_out


def serve(
    serving: KvServing, lanes: bool, k: torch.Tensor, v: torch.Tensor, prompt_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Begin with k, v's first prompt_len tokens and step through the rest, as `DecodeAttention` does: each
    step's exact K/V go into the caches, then `step`. Returns the caches, [H, n, D] each (keys rotated)."""
    rotary = RotaryEmbedding(SMOLLM2.head_dim, 64, SMOLLM2.rope_theta)
    served = ServedKv(serving, rotary, 0, lanes=lanes)
    k_cache, v_cache = torch.zeros_like(k), torch.zeros_like(v)
    k_cache[:, :prompt_len], v_cache[:, :prompt_len] = rotated(k[:, :prompt_len]), v[:, :prompt_len]
    served.begin(LAYER, k_cache, v_cache, k[:, :prompt_len].transpose(0, 1))
    for position in range(prompt_len, k.shape[1]):
        k_cache[:, position] = rotated(k[:, position : position + 1], position)[:, 0]
        v_cache[:, position] = v[:, position]
        served.step(LAYER, k_cache, v_cache, k[:, position], position + 1)
    return k_cache, v_cache


def test_the_full_cache_reads_every_block_before_the_steps_own_decoded_and_the_sink_in_fp16(
    serving: KvServing,
) -> None:
    k, v = exact_kv(serving, 13)
    k_cache, v_cache = serve(serving, False, k[:, :10], v[:, :10], 10)  # L = 11 reads blocks 0 and 1 decoded
    k_blocks, v_blocks = blocks_decoded(serving, k[:, :8], v[:, :8])
    assert torch.allclose(k_cache[:, :8], rotated(k_blocks), atol=1e-5) and torch.equal(v_cache[:, :8], v_blocks)
    assert torch.equal(v_cache[:, 8:10], v[:, 8:10])  # the step's own block, exact
    assert torch.equal(v_blocks[:, 0], v[:, 0].half().float()) and torch.equal(k_blocks[:, 0], k[:, 0].half().float())
    assert not torch.allclose(v_blocks[:, 1:], v[:, 1:8], atol=1e-3)
    # L = 13: the token at 12 starts block 3, so block 2 (positions 8..11, two of them generated) reads decoded
    k_cache, v_cache = serve(serving, False, k, v, 10)
    k_blocks, v_blocks = blocks_decoded(serving, k[:, :12], v[:, :12])
    assert torch.allclose(k_cache[:, :12], rotated(k_blocks), atol=1e-5)
    assert torch.equal(v_cache[:, :12], v_blocks) and torch.equal(v_cache[:, 12], v[:, 12])


def test_fastgen_reads_records_of_the_pools_values_but_the_newest_w_whole(serving: KvServing) -> None:
    k, v = exact_kv(serving, 15)
    k_cache, v_cache = serve(serving, True, k, v, 10)
    # the pool after prefill: blocks 0 and 1 decoded, the prompt's last 2 tokens exact; generated tokens exact
    k_pool, v_pool = blocks_decoded(serving, k[:, :8], v[:, :8])
    k_pool, v_pool = torch.cat([k_pool, k[:, 8:]], dim=1), torch.cat([v_pool, v[:, 8:]], dim=1)
    # the last step (L = 15): positions 1..10 from records, the ring 11..14 whole, the sink the pool's (fp16)
    k_records, v_records = records_decoded(serving, k_pool[:, 1:11], v_pool[:, 1:11])
    assert torch.allclose(k_cache[:, 1:11], rotated(k_records, 1), atol=1e-5)
    assert torch.equal(v_cache[:, 1:11], v_records)
    assert torch.equal(v_cache[:, 11:], v[:, 11:]) and torch.equal(v_cache[:, 0], v_pool[:, 0])
    assert torch.allclose(k_cache[:, 11:], rotated(k[:, 11:], 11), atol=1e-5)
    # position 7 was coded twice (block, then record): neither its block value nor a record of its exact value
    assert not torch.equal(v_records[:, 6], v_pool[:, 7])
    assert not torch.equal(v_records[:, 6], records_decoded(serving, k[:, 7:8], v[:, 7:8])[1][:, 0])


def test_a_block_size_below_one_raises(serving: KvServing) -> None:
    with pytest.raises(ValueError, match="block size"):
        KvServing.of(serving.blocks, 0)
