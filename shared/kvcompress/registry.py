"""The codecs by name: what `--kv-codec` and the block-hash namespace refer to.

Owns the name -> codec table and the per-layer codec list an engine or harness uses; each codec's behaviour is in its
own module. Uniform codecs are the same for every layer; `kvquant-*` needs a calibration (per-layer codebooks).
"""

from __future__ import annotations

from types import MappingProxyType

from kernels.kvquant_format import outliers_per_head, section_sizes
from shared.kvcompress.calibration import KvCalibration
from shared.kvcompress.codec import KvCodec
from shared.kvcompress.kvquant import KvQuantCodec
from shared.kvcompress.names import (
    CALIBRATED_CODEC_NAMES,
    CODEC_NAMES,
    KVQUANT_OUTLIER_FRACTION,
    KvCalibrationError,
)
from shared.kvcompress.uniform import Fp16Codec, Int8Codec, KiviCodec

CODECS: MappingProxyType[str, KvCodec] = MappingProxyType(
    {codec.name: codec for codec in (Fp16Codec(), Int8Codec(), KiviCodec(4), KiviCodec(3), KiviCodec(2))}
)


def get_codec(name: str) -> KvCodec:
    """The uncalibrated codec registered under `name`.

    Raises:
        ValueError: no such codec (the message lists the known ones), or one that needs a calibration.
    """
    if name in CALIBRATED_CODEC_NAMES:
        raise ValueError(f"KV codec {name!r} needs a calibration: use layer_codecs(name, ..., calibration)")
    try:
        return CODECS[name]
    except KeyError:
        raise ValueError(f"unknown KV codec {name!r}; known codecs: {', '.join(CODEC_NAMES)}") from None


def codec_block_bytes(
    name: str, kv_heads: int, num_tokens: int, head_dim: int, outlier_fraction: float = KVQUANT_OUTLIER_FRACTION
) -> int:
    """One layer's block of that shape under codec `name`, in bytes (no sink), with no calibration: a kvquant
    block's size depends on its width and outlier share alone (what the sim engine's sizes need).

    Raises:
        ValueError: an unknown name.
    """
    if name in CALIBRATED_CODEC_NAMES:
        bits = int(name.rsplit("-", 1)[1])
        num_outliers = outliers_per_head(outlier_fraction, num_tokens, head_dim)
        return sum(size for _, size in section_sizes(bits, kv_heads, num_tokens, head_dim, num_outliers))
    return get_codec(name).num_bytes(kv_heads, num_tokens, head_dim)


def layer_codecs(
    name: str, num_layers: int, kv_heads: int, head_dim: int, calibration: KvCalibration | None = None
) -> list[KvCodec]:
    """One codec per layer of a model with that shape.

    Raises:
        ValueError: an unknown name.
        KvCalibrationError: a `kvquant-*` codec without a calibration, or with one for another shape or width.
    """
    if name not in CALIBRATED_CODEC_NAMES:
        return [get_codec(name)] * num_layers
    bits = int(name.rsplit("-", 1)[1])
    if calibration is None:
        raise KvCalibrationError(f"KV codec {name} needs a calibration file (`tsukimi calibrate kv --bits {bits}`)")
    calibration.check_fits(num_layers, kv_heads, head_dim, bits)
    return [
        KvQuantCodec(
            bits, calibration.key_center[layer], calibration.key_scale[layer], calibration.key_codebook[layer],
            calibration.value_codebook[layer], calibration.outlier_fraction,
        )
        for layer in range(num_layers)
    ]
