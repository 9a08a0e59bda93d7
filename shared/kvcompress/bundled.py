"""The KVQuant calibrations shipped for the default model, and resolving which calibration file a codec uses.

Owns the lookup only; the files are made by `tsukimi calibrate kv` on the first 30% of the bundled evaluation text
(`make calibrations` rebuilds them) and their content is `calibration`'s business.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from shared.kvcompress.names import KvCalibrationError, needs_calibration

CALIBRATION_DIR = Path(__file__).parent / "calibrations"
DEFAULT_MODEL_STEM = "smollm2-135m"


def bundled_calibration(codec_name: str) -> Path | None:
    """The shipped calibration of `codec_name` for the default model, if there is one."""
    path = CALIBRATION_DIR / f"{DEFAULT_MODEL_STEM}-{codec_name}.safetensors"
    return path if path.is_file() else None


def resolve_calibration(codec_name: str, kv_calib: str | Path | None) -> Path | None:
    """The calibration file a codec will use: `kv_calib` when given, else the bundled one; None for codecs that need
    none.

    Raises:
        KvCalibrationError: a calibrated codec with neither, or a calibration given to a codec that takes none.
    """
    if not needs_calibration(codec_name):
        if kv_calib:
            raise KvCalibrationError(f"KV codec {codec_name} takes no calibration file")
        return None
    if kv_calib:
        return Path(kv_calib)
    bundled = bundled_calibration(codec_name)
    if bundled is None:
        raise KvCalibrationError(
            f"KV codec {codec_name} needs a calibration: make one with `tsukimi calibrate kv` and pass --kv-calib"
        )
    return bundled


def calibration_digest(path: Path) -> str:
    """A short content hash of a calibration file (part of the block-hash namespace: new file, new block ids).

    Raises:
        KvCalibrationError: the file cannot be read.
    """
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    except OSError as exc:
        raise KvCalibrationError(f"cannot read KV calibration {path}: {exc}") from None
