"""The kvquant codec: exact sizes (every byte counted) for odd shapes, dense codes within half a codebook gap of
their block's range, key ranges that follow each block and channel, value outliers and the sink restored, batched
encode equal to one-block encode, the compression the issue asks for at head dim 64, and clear errors for buffers,
shapes and keys that do not fit."""

from __future__ import annotations

import pytest
import torch

from kernels.kvquant_format import key_grid
from shared.kvcompress import KvCalibration, KvCalibrationError, KvCodecError, get_codec, layer_codecs
from shared.kvcompress.kvquant import KvQuantCodec

SHAPES = [(1, 1, 8), (2, 5, 32), (3, 64, 64), (3, 17, 40)]


def make_codec(bits: int, heads: int, dim: int, fraction: float = 0.01, seed: int = 0) -> KvQuantCodec:
    """A codec with a linear codebook over [-1, 1] and random key ranges."""
    g = torch.Generator().manual_seed(seed)
    center = torch.randn(heads, dim, generator=g) * 0.5
    scale = torch.rand(heads, dim, generator=g) + 1.5
    codebook = torch.linspace(-1, 1, 1 << bits)
    return KvQuantCodec(bits, center, scale, codebook, codebook.clone(), fraction)


def random_kv(shape: tuple[int, int, int], seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g) * 0.3 + 0.1


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("sink", [False, True])
def test_encode_length_is_num_bytes_and_decode_restores_shape(bits: int, shape: tuple[int, int, int],
                                                               sink: bool) -> None:
    codec = make_codec(bits, shape[0], shape[2])
    k, v = random_kv(shape)
    data = codec.encode(k, v, starts_sequence=sink)
    assert len(data) == codec.num_bytes(*shape, starts_sequence=sink)
    k2, v2 = codec.decode(data, *shape, torch.float16, starts_sequence=sink)
    assert k2.shape == v2.shape == shape and k2.dtype == torch.float16


def block_half_range(codec: KvQuantCodec, k: torch.Tensor) -> torch.Tensor:
    """[H, 1, D]: the widest half-range a block range can take around k's channels (one grid step each side)."""
    _, step = key_grid(codec.key_center, codec.key_scale)
    return (k.amax(dim=1) - k.amin(dim=1))[:, None, :] / 2 + step[:, None, :]


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_inliers_are_within_half_a_codebook_gap(bits: int) -> None:
    shape = (3, 64, 64)
    codec = make_codec(bits, 3, 64, fraction=0.0)
    g = torch.Generator().manual_seed(3)
    # Keys inside the calibrated range: the error is at most half a gap of the linear codebook over the block range.
    unit = torch.rand(shape, generator=g) * 2 - 1
    k = unit * codec.key_scale[:, None, :] + codec.key_center[:, None, :]
    v = torch.randn(shape, generator=g)
    k2, v2 = codec.decode(codec.encode(k, v), *shape, torch.float32)
    half_gap = 1 / ((1 << bits) - 1)
    assert bool(((k2 - k).abs() <= half_gap * block_half_range(codec, k) * 1.001 + 1e-5).all())
    # Values: per token the range of every head is mapped to [-1, 1] (half-range rounded up to fp16).
    token_half = (v.amax(dim=(0, 2)) - v.amin(dim=(0, 2))) / 2
    bound = half_gap * token_half[None, :, None] * 1.002 + 2e-3 * token_half.abs().max()
    assert bool(((v2 - v).abs() <= bound).all())


def test_key_ranges_follow_each_block_and_channel() -> None:
    shape = (3, 64, 64)
    codec = make_codec(3, 3, 64, fraction=0.0)
    g = torch.Generator().manual_seed(4)
    # Every channel of this block keeps to a narrow band (a tenth of its calibrated range) around its own level.
    level = (torch.rand(3, 1, 64, generator=g) * 2 - 1) * codec.key_scale[:, None, :]
    unit = torch.rand(shape, generator=g) * 0.2 - 0.1
    k = codec.key_center[:, None, :] + level + unit * codec.key_scale[:, None, :]
    k2, _ = codec.decode(codec.encode(k, torch.randn(shape, generator=g)), *shape, torch.float32)
    # A static range would leave errors up to a seventh of the calibrated half-range; the block range, 5 times less.
    assert bool(((k2 - k).abs() <= block_half_range(codec, k) / 7 * 1.001 + 1e-5).all())
    assert bool(((k2 - k).abs() < codec.key_scale[:, None, :] / 7 / 5).all())
    # A large key widens only its own channel's range; keys past the grid (centre +- 2 half-ranges) are clipped to it.
    wide = k.clone()
    wide[1, 10, 5] = codec.key_center[1, 5] + 1.9 * codec.key_scale[1, 5]
    wide[2, 20, 9] = codec.key_center[2, 9] + 50 * codec.key_scale[2, 9]
    k3, _ = codec.decode(codec.encode(wide, torch.randn(shape, generator=g)), *shape, torch.float32)
    others = torch.ones(shape, dtype=torch.bool)
    others[1, :, 5], others[2, :, 9] = False, False
    assert torch.equal(k3[others], k2[others])
    assert k3[1, 10, 5].item() == pytest.approx(wide[1, 10, 5].item(), abs=float(codec.key_scale[1, 5]) / 7)
    grid_end = codec.key_center[2, 9] + 2 * codec.key_scale[2, 9]
    assert k3[2, 20, 9].item() == pytest.approx(grid_end.item(), rel=1e-4)


def test_value_outliers_are_restored_and_cost_their_share() -> None:
    shape = (3, 64, 64)
    codec = make_codec(3, 3, 64)
    k, v = random_kv(shape)
    v[2, 3, 7] = -55.0
    _, v2 = codec.decode(codec.encode(k, v), *shape, torch.float32)
    assert v2[2, 3, 7].item() == pytest.approx(-55.0, rel=1e-3)
    # The outlier does not widen its token's value range: the other values of token 3 keep fine resolution.
    others = torch.ones(shape, dtype=torch.bool)
    others[2, 3, 7] = False
    assert (v2 - v)[:, 3][others[:, 3]].abs().max() < 0.2
    assert codec.outliers_per_head(64, 64) == 41  # ceil(1% of 4096)


def test_the_sink_token_is_kept_in_fp16_and_out_of_the_key_ranges() -> None:
    shape = (3, 64, 64)
    codec = make_codec(2, 3, 64)
    k, v = random_kv(shape)
    k = k * 0.3 + codec.key_center[:, None, :]
    k[:, 0] += 30 * codec.key_scale  # a sink with huge keys, as real sinks have (beyond the grid)
    k2, v2 = codec.decode(codec.encode(k, v, starts_sequence=True), *shape, torch.float32, starts_sequence=True)
    assert torch.allclose(k2[:, 0], k[:, 0].half().float()) and torch.allclose(v2[:, 0], v[:, 0].half().float())
    rest = k[:, 1:]
    assert bool(((k2[:, 1:] - rest).abs() <= block_half_range(codec, rest) / 3 * 1.001 + 1e-5).all())
    without = codec.decode(codec.encode(k, v), *shape, torch.float32)[0]
    assert (without[:, 0] - k[:, 0]).abs().max() > 1.0  # without the sink flag token 0 is coded like the rest
    assert (without[:, 1:] - rest).abs().max() > 2 * (k2[:, 1:] - rest).abs().max()  # and widens every range
    sizes = codec.num_bytes(*shape, starts_sequence=True) - codec.num_bytes(*shape)
    assert sizes == 2 * 3 * 64 * 2


def test_constant_channels_and_non_finite_keys() -> None:
    shape = (2, 16, 32)
    codec = make_codec(4, 2, 32)
    k, v = random_kv(shape)
    k[0, :, 3] = 0.25  # a constant channel still gets a range one grid step wide, and decodes within it
    k2, _ = codec.decode(codec.encode(k, v), *shape, torch.float32)
    step = key_grid(codec.key_center, codec.key_scale)[1]
    assert (k2[0, :, 3] - 0.25).abs().max() <= step[0, 3]
    k[1, 2, 4] = float("nan")
    with pytest.raises(ValueError, match="keys hold NaN"):
        codec.encode(k, v)


def test_batched_encode_matches_one_block_at_a_time() -> None:
    codec = make_codec(3, 2, 32)
    g = torch.Generator().manual_seed(5)
    k, v = torch.randn(4, 2, 16, 32, generator=g), torch.randn(4, 2, 16, 32, generator=g)
    batched = codec.encode_blocks(k, v)
    k_all, v_all = codec.decode_blocks(batched, 2, 16, 32)
    for i in range(4):
        k1, v1 = codec.decode(codec.encode(k[i], v[i]), 2, 16, 32, torch.float32)
        assert torch.equal(k1, k_all[i]) and torch.equal(v1, v_all[i])


@pytest.mark.parametrize(("bits", "ratio"), [(4, 3.5), (3, 4.5), (2, 6.5)])
def test_compression_at_head_dim_64_meets_the_issue(bits: int, ratio: float) -> None:
    """SmolLM2's KV shape (3 heads x 64), 64-token blocks, over a 1024-token sequence whose first block has the sink."""
    codec = make_codec(bits, 3, 64)
    fp16 = get_codec("fp16")
    blocks = [codec.num_bytes(3, 64, 64, starts_sequence=i == 0) for i in range(16)]
    assert 16 * fp16.num_bytes(3, 64, 64) / sum(blocks) >= ratio


def test_wrong_buffers_and_shapes_are_refused() -> None:
    codec = make_codec(3, 3, 64)
    k, v = random_kv((3, 64, 64))
    data = codec.encode(k, v)
    with pytest.raises(KvCodecError):
        codec.decode(data[:-1], 3, 64, 64, torch.float32)
    with pytest.raises(KvCodecError):
        codec.decode(data, 3, 64, 64, torch.float32, starts_sequence=True)
    with pytest.raises(ValueError, match="calibrated for 3 KV heads"):
        codec.encode(k[:2], v[:2])
    with pytest.raises(ValueError, match="bits"):
        KvQuantCodec(5, codec.key_center, codec.key_scale, torch.zeros(32), torch.zeros(32), 0.01)


def test_the_registry_builds_per_layer_codecs_from_a_fitting_calibration() -> None:
    layers, heads, dim = 2, 3, 64
    codebooks = torch.linspace(-1, 1, 8).repeat(layers, 1)
    calibration = KvCalibration(
        bits=3, outlier_fraction=0.01, key_center=torch.zeros(layers, heads, dim),
        key_scale=torch.ones(layers, heads, dim), key_codebook=codebooks, value_codebook=codebooks * 0.5,
    )
    codecs = layer_codecs("kvquant-3", layers, heads, dim, calibration)
    assert [c.name for c in codecs] == ["kvquant-3", "kvquant-3"]
    assert torch.equal(codecs[1].value_codebook, codebooks[1] * 0.5)
    with pytest.raises(KvCalibrationError, match="calibrate kv"):
        layer_codecs("kvquant-3", layers, heads, dim)
    with pytest.raises(KvCalibrationError, match="not 2 x 3 x 64 at 4 bits"):
        layer_codecs("kvquant-4", layers, heads, dim, calibration)
    with pytest.raises(ValueError, match="needs a calibration"):
        get_codec("kvquant-3")
    assert layer_codecs("kivi-2", layers, heads, dim)[0].name == "kivi-2"
