"""The codecs' names, which of them need a calibration, and the calibration error: what settings and the block-hash
namespace refer to, without loading a codec (no torch; the codecs themselves are `registry`'s)."""

from __future__ import annotations

UNIFORM_CODEC_NAMES = ("fp16", "int8", "kivi-4", "kivi-3", "kivi-2")  # the same codec for every layer
KVQUANT_BITS = (2, 3, 4)
CALIBRATED_CODEC_NAMES = tuple(f"kvquant-{bits}" for bits in KVQUANT_BITS)  # per-layer codebooks from a file
CODEC_NAMES = (*UNIFORM_CODEC_NAMES, *CALIBRATED_CODEC_NAMES)
KVQUANT_OUTLIER_FRACTION = 0.01  # the share of values a kvquant calibration keeps as fp16 outliers unless told


class KvCalibrationError(ValueError):
    """A calibration file is missing, unreadable, or does not fit the model or codec it is used with."""


def needs_calibration(name: str) -> bool:
    return name in CALIBRATED_CODEC_NAMES
