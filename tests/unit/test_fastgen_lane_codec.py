"""FastGen's lane records (`LaneCodec`) with the shipped SmolLM2 calibrations: the record size is the layout's, real
keys and values come back closer the more bits, outlier channels exactly to fp16, encoding is deterministic and per
entry, bad input and codecs raise; and the harness's round trip (`LaneRoundTrip`) keeps the sink exact and rotates the
decoded pre-RoPE keys."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from shared.fastgen.codec_variants import LaneRoundTrip, build_lane_codec
from shared.fastgen.lane_codec import LaneCodec
from shared.kvcompress.bitpack import packed_num_bytes
from shared.kvcompress.kvquant import KvQuantCodec
from shared.kvcompress.text_spans import evaluation_span, read_tokens
from shared.model.config import LlamaConfig
from shared.model.llama import RotaryEmbedding, apply_rotary

# SmolLM2-135M's shape, which the shipped calibrations are for.
SMOLLM2 = LlamaConfig(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
    rope_theta=100000.0, rms_norm_eps=1e-5, max_position=8192, tie_word_embeddings=True,
)
TEXT = Path(__file__).parents[3] / "shared" / "data" / "text" / "lee_background.txt"  # the evaluation text
LAYER = 7


@pytest.fixture(scope="module", params=[4, 3, 2], ids=lambda bits: f"kvquant-{bits}")
def codec(request: pytest.FixtureRequest) -> LaneCodec:
    return build_lane_codec(f"kvquant-{request.param}", SMOLLM2)


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
    """Per layer, the keys before RoPE and the values of 64 tokens of the evaluation text, [64, kv_heads, D]."""
    from shared.model.llama import build_model

    if not TEXT.is_file():
        pytest.skip(f"the evaluation text {TEXT} is not here")

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

    tokens = evaluation_span(read_tokens(TEXT, checkpoint.tokenizer))[:64]
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
    errors = {bits: relative_errors(build_lane_codec(f"kvquant-{bits}", SMOLLM2), *real_kv) for bits in (4, 3, 2)}
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
        build_lane_codec("kivi-4", SMOLLM2)


def test_the_round_trip_keeps_the_sink_exact_and_rotates_decoded_keys(codec: LaneCodec) -> None:
    rotary = RotaryEmbedding(codec.head_dim, 64, SMOLLM2.rope_theta)
    round_trip = LaneRoundTrip(codec, rotary)
    g = torch.Generator().manual_seed(5)
    shape = (6, SMOLLM2.num_kv_heads, codec.head_dim)
    k = codec.key_center[LAYER] + 0.5 * codec.key_scale[LAYER] * torch.randn(shape, generator=g)
    v = torch.randn(shape, generator=g)
    positions = torch.tensor([0, 1, 2, 3, 40, 41])
    k_out, v_out = round_trip(LAYER, k, v, positions)
    cos, sin = rotary.cos_sin(positions, torch.float32)
    assert torch.equal(k_out[0], apply_rotary(k, cos, sin)[0]) and torch.equal(v_out[0], v[0])
    heads = torch.arange(shape[1]).repeat(5)
    k2, v2 = codec.decode(LAYER, heads, codec.encode(LAYER, heads, k[1:].reshape(-1, 64), v[1:].reshape(-1, 64)))
    assert torch.equal(v_out[1:], v2.view(5, *shape[1:]))
    assert torch.allclose(k_out[1:], apply_rotary(k2.view(5, *shape[1:]), cos[1:], sin[1:]))
    assert not torch.equal(v_out[1:], v[1:])
