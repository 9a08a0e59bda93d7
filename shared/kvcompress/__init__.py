"""KV cache compression: codecs that turn one layer of one KV block into bytes and back (fp16, int8, KIVI, KVQuant),
and the KVQuant calibration they may need.

Names are imported lazily, so `shared.kvcompress.kvquant` and its kernels load with torch and numpy alone (the
calibration reader needs safetensors, which a bare GPU machine running the kernel benchmark may lack).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "KvCalibration": "calibration", "KvCalibrationError": "names", "load_calibration": "calibration",
    "KvCodec": "codec", "KvCodecError": "codec",
    "CODECS": "registry", "CODEC_NAMES": "names", "get_codec": "registry", "layer_codecs": "registry",
    "needs_calibration": "names",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
