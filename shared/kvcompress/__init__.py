"""KV cache compression: codecs that turn one layer of one KV block into bytes and back (fp16, int8, KIVI, KVQuant),
and the KVQuant calibration they may need."""

from __future__ import annotations

from shared.kvcompress.calibration import KvCalibration, KvCalibrationError, load_calibration
from shared.kvcompress.codec import KvCodec, KvCodecError
from shared.kvcompress.registry import CODEC_NAMES, CODECS, get_codec, layer_codecs, needs_calibration

__all__ = [
    "CODECS", "CODEC_NAMES", "KvCalibration", "KvCalibrationError", "KvCodec", "KvCodecError", "get_codec",
    "layer_codecs", "load_calibration", "needs_calibration",
]
