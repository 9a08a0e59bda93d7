"""KV codecs: every codec round-trips one block's K and V at its promised size, stays within the error its quantizer
allows element by element, decodes constants exactly, is deterministic, refuses wrong-length buffers, and KIVI's
per-channel keys beat per-token keys when a few channels carry outliers."""

from __future__ import annotations

import pytest
import torch

from shared.kvcompress import CODECS, KvCodecError, get_codec
from shared.kvcompress.uniform import KiviCodec

NAMES = list(CODECS)
SHAPES = [(heads, tokens, dim) for heads in (1, 2, 3) for tokens in (1, 5, 64) for dim in (8, 40, 64)]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def gaussian_kv(shape: tuple[int, int, int], dtype: torch.dtype = torch.float16, seed: int = 0,
                outlier_channels: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """Random K and V [kv_heads, num_tokens, head_dim]; K's outlier channels are multiplied by 20."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(shape, generator=g) * 2 + 0.5
    v = torch.randn(shape, generator=g)
    for channel in outlier_channels:
        k[:, :, channel] *= 20
    return k.to(dtype), v.to(dtype)


def asymmetric_bound(x: torch.Tensor, bits: int, dim: int, slack: float) -> torch.Tensor:
    """Largest error round-to-nearest may make on each element: scale / 2, the scale rounded up to fp16 (one ulp,
    2**-10 relative), where scale = (max - min) / (2**bits - 1) over `dim`; `slack` covers fp32 arithmetic."""
    x64 = x.double()
    scale = (x64.amax(dim=dim, keepdim=True) - x64.amin(dim=dim, keepdim=True)) / (2**bits - 1)
    return (scale / 2 * (1 + 2**-10) + slack).expand_as(x64)


def value_bound(v: torch.Tensor, bits: int, group_size: int, slack: float) -> torch.Tensor:
    """`asymmetric_bound` per token over groups of `group_size` channels (the last group may be shorter)."""
    parts = [asymmetric_bound(v[:, :, i:i + group_size], bits, -1, slack) for i in range(0, v.shape[2], group_size)]
    return torch.cat(parts, dim=2)


def round_trip(name: str, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    codec = get_codec(name)
    return codec.decode(codec.encode(k, v), *k.shape, dtype=dtype)


# ---- the interface -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_keeps_shape_and_dtype(name: str, dtype: torch.dtype) -> None:
    k, v = gaussian_kv((3, 5, 40), dtype)
    k_out, v_out = round_trip(name, k, v, dtype)
    for out in (k_out, v_out):
        assert out.shape == (3, 5, 40)
        assert out.dtype == dtype
        assert bool(torch.isfinite(out).all())


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("shape", SHAPES)
def test_encoded_length_is_num_bytes(name: str, shape: tuple[int, int, int]) -> None:
    codec = get_codec(name)
    assert len(codec.encode(*gaussian_kv(shape))) == codec.num_bytes(*shape)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("fp16", 16.0),
        # per head and layer, 64 tokens x 64 channels: codes 2 * 4096 bytes, absmax 2 * 64 fp16 = 256 bytes;
        # 8448 bytes * 8 / 8192 elements
        ("int8", 8.25),
        # codes 2 * 4096 * 4 / 8 = 4096 bytes; key min + scale per channel 2 * 64 * 2 = 256 bytes; value min + scale
        # per token per 32-channel group 64 * 2 * 2 * 2 = 512 bytes; 4864 bytes * 8 / 8192 elements
        ("kivi-4", 4.75),
        # codes 2 * 4096 * 2 / 8 = 2048 bytes; metadata as kivi-4, 768 bytes; 2816 bytes * 8 / 8192 elements
        ("kivi-2", 2.75),
    ],
)
@pytest.mark.parametrize("kv_heads", [1, 3])
def test_bits_per_element_at_head_dim_64_and_64_token_blocks(name: str, expected: float, kv_heads: int) -> None:
    assert get_codec(name).bits_per_element(kv_heads, 64, 64) == expected


@pytest.mark.parametrize("name", NAMES)
def test_encoding_is_deterministic_and_ignores_memory_layout(name: str) -> None:
    k, v = gaussian_kv((2, 64, 64))
    codec = get_codec(name)
    strided_k = k.transpose(0, 1).contiguous().transpose(0, 1)  # same values, not contiguous
    assert codec.encode(k, v) == codec.encode(k.clone(), v.clone()) == codec.encode(strided_k, v)


@pytest.mark.parametrize("name", NAMES)
def test_wrong_length_buffers_raise_codec_error(name: str) -> None:
    codec = get_codec(name)
    data = codec.encode(*gaussian_kv((2, 5, 8)))
    for bad in (data[:-1], data + b"\x00", b""):
        with pytest.raises(KvCodecError, match=f"{name} buffer holds {len(bad)} bytes"):
            codec.decode(bad, 2, 5, 8, torch.float16)
    with pytest.raises(KvCodecError):
        codec.decode(data, 2, 6, 8, torch.float16)  # the shape it claims is not what was encoded
    assert issubclass(KvCodecError, ValueError)


@pytest.mark.parametrize("name", NAMES)
def test_invalid_inputs_are_refused(name: str) -> None:
    codec = get_codec(name)
    k, v = gaussian_kv((2, 5, 8))
    with pytest.raises(ValueError, match="kv_heads, num_tokens, head_dim"):
        codec.encode(k, v[:, :4])
    with pytest.raises(ValueError, match="kv_heads, num_tokens, head_dim"):
        codec.encode(k[0], v[0])
    with pytest.raises(ValueError, match="floating point"):
        codec.encode(k.to(torch.int32), v.to(torch.int32))
    with pytest.raises(ValueError, match=">= 1"):
        codec.num_bytes(2, 0, 8)
    with pytest.raises(ValueError, match=">= 1"):
        codec.decode(b"", 2, 0, 8, torch.float16)


@pytest.mark.parametrize("name", ["int8", "kivi-4", "kivi-2"])
def test_non_finite_input_is_refused(name: str) -> None:
    k, v = gaussian_kv((2, 5, 8), torch.float32)
    k[1, 2, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        get_codec(name).encode(k, v)


def test_registry_names_and_unknown_name() -> None:
    assert set(CODECS) == {"fp16", "int8", "kivi-4", "kivi-3", "kivi-2"}
    assert all(get_codec(name).name == name for name in CODECS)
    with pytest.raises(ValueError, match="'kivi-5'.*fp16, int8, kivi-4, kivi-3, kivi-2, kvquant-2"):
        get_codec("kivi-5")
    with pytest.raises(ValueError, match="unsupported code width"):
        KiviCodec(5)


# ---- accuracy ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(3, 5, 40), (2, 64, 64), (1, 1, 8)])
def test_fp16_is_exact_on_fp16_input(shape: tuple[int, int, int]) -> None:
    k, v = gaussian_kv(shape, outlier_channels=(0,))
    k_out, v_out = round_trip("fp16", k, v, torch.float16)
    assert torch.equal(k_out, k) and torch.equal(v_out, v)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(3, 5, 40), (2, 64, 64), (1, 1, 8)])
def test_int8_error_is_within_half_a_step_per_token(shape: tuple[int, int, int], dtype: torch.dtype) -> None:
    k, v = gaussian_kv(shape, dtype, outlier_channels=(0,))
    for x, x_hat in zip((k, v), round_trip("int8", k, v, torch.float32), strict=True):
        absmax = x.double().abs().amax(dim=-1, keepdim=True)
        # step = absmax / 127, rounded up to fp16 (2**-9 covers an input absmax that is not an fp16 value)
        bound = absmax / 254 * (1 + 2**-9) + 1e-6 * absmax
        assert bool(((x.double() - x_hat.double()).abs() <= bound).all())


def test_int8_relative_error_on_gaussian_kv() -> None:
    k, v = gaussian_kv((2, 64, 64), torch.float32)
    for x, x_hat in zip((k, v), round_trip("int8", k, v, torch.float32), strict=True):
        # step absmax / 127 ~ 2.5 sigma / 127; rms error step / sqrt(12) ~ 0.6% of sigma
        assert float((x - x_hat).norm() / x.norm()) < 0.01


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("shape", [(3, 5, 40), (2, 64, 64), (1, 1, 8), (2, 7, 64)])
def test_kivi_error_is_within_half_a_step_of_its_group(bits: int, shape: tuple[int, int, int]) -> None:
    k, v = gaussian_kv(shape, outlier_channels=(1,))
    k_hat, v_hat = round_trip(f"kivi-{bits}", k, v, torch.float32)
    slack = 2**-20 * float(k.abs().max())
    k_bound = asymmetric_bound(k, bits, dim=1, slack=slack)  # per (head, channel), over the block's tokens
    v_bound = value_bound(v, bits, group_size=32, slack=slack)  # per (head, token), over 32-channel groups
    assert bool(((k.double() - k_hat.double()).abs() <= k_bound).all())
    assert bool(((v.double() - v_hat.double()).abs() <= v_bound).all())


@pytest.mark.parametrize("bits", [4, 2])
def test_kivi_error_bound_holds_for_fp32_input(bits: int) -> None:
    k, v = gaussian_kv((2, 64, 64), torch.float32, seed=3, outlier_channels=(5,))
    k_hat, v_hat = round_trip(f"kivi-{bits}", k, v, torch.float32)
    # fp32 input: the minimum is rounded down to fp16 too, widening the range by up to |min| * 2**-10.
    slack = 2**-20 * float(k.abs().max())
    k_bound = asymmetric_bound(k, bits, 1, slack) + k.double().abs().amax(1, keepdim=True) * 2**-10 / (2**bits - 1)
    v_bound = value_bound(v, bits, 32, slack) + v.double().abs().amax(-1, keepdim=True) * 2**-10 / (2**bits - 1)
    assert bool(((k.double() - k_hat.double()).abs() <= k_bound).all())
    assert bool(((v.double() - v_hat.double()).abs() <= v_bound).all())


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("value", [0.0, -1.375, 3.0])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_constant_blocks_decode_exactly(name: str, value: float, dtype: torch.dtype) -> None:
    k = torch.full((2, 5, 40), value, dtype=dtype)
    v = torch.full((2, 5, 40), -value / 2, dtype=dtype)
    k_out, v_out = round_trip(name, k, v, dtype)
    assert torch.equal(k_out, k) and torch.equal(v_out, v)


@pytest.mark.parametrize("name", ["kivi-4", "kivi-2"])
def test_constant_key_channel_and_value_token_decode_exactly_without_nan(name: str) -> None:
    k, v = gaussian_kv((2, 64, 64))
    k[:, :, 7] = 0.625
    v[:, 9, :] = -2.5
    k_out, v_out = round_trip(name, k, v, torch.float16)
    assert bool(torch.isfinite(k_out).all()) and bool(torch.isfinite(v_out).all())
    assert torch.equal(k_out[:, :, 7], k[:, :, 7])
    assert torch.equal(v_out[:, 9, :], v[:, 9, :])


def test_int8_constant_token_decodes_exactly() -> None:
    k, v = gaussian_kv((2, 64, 64))
    k[:, 3, :] = 0.0
    v[:, 9, :] = -2.5
    k_out, v_out = round_trip("int8", k, v, torch.float16)
    assert torch.equal(k_out[:, 3], k[:, 3]) and torch.equal(v_out[:, 9], v[:, 9])


def test_fewer_bits_lose_more() -> None:
    k, v = gaussian_kv((2, 64, 64), torch.float32, seed=1)
    errors = []
    for name in ("fp16", "int8", "kivi-4", "kivi-2"):
        k_hat, v_hat = round_trip(name, k, v, torch.float32)
        errors.append(float((k - k_hat).pow(2).mean() + (v - v_hat).pow(2).mean()))
    assert errors == sorted(errors) and errors[0] < errors[-1]


def test_per_channel_keys_beat_per_token_keys_with_outlier_channels() -> None:
    """KIVI's reason for quantizing keys per channel: a few outlier channels blow up every token's range."""
    k, v = gaussian_kv((4, 64, 64), torch.float32, seed=2, outlier_channels=(3, 17))
    k_kivi, _ = round_trip("kivi-4", k, v, torch.float32)
    # per-token 4-bit asymmetric at the same bits: min and scale per (head, token) over the channels (kept in
    # fp32, which only flatters it)
    low, high = k.amin(dim=-1, keepdim=True), k.amax(dim=-1, keepdim=True)
    scale = (high - low) / 15
    k_token = low + ((k - low) / scale).round().clamp(0, 15) * scale
    mse_kivi = float((k - k_kivi).pow(2).mean())
    mse_token = float((k - k_token).pow(2).mean())
    assert mse_kivi * 3 < mse_token


def test_the_names_settings_read_are_the_codecs_registered() -> None:
    from shared.kvcompress import names, registry

    assert tuple(registry.CODECS) == names.UNIFORM_CODEC_NAMES
    for name in names.CALIBRATED_CODEC_NAMES:
        assert names.needs_calibration(name)
        with pytest.raises(ValueError, match="needs a calibration"):
            registry.get_codec(name)
