"""What `tsukimi calibrate kv` learns for a KVQuant codec, and its file: one safetensors file with JSON metadata.

Owns the `KvCalibration` record (per layer: the pre-RoPE key channels' centre and half-range, and the non-uniform
key and value codebooks) and its save/load with validation. How it is computed is `shared.tools.calibrate.kvquant`;
how it is used, `kvquant`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from shared.kvcompress.names import KvCalibrationError

FORMAT = "tsukimi-kv-calibration/3"  # 3: the key centres and half-ranges place grids of block ranges
# All metadata sits under this one key, as sorted JSON: safetensors writes metadata keys in no fixed order, and the
# file's digest is part of the block-hash namespace, so equal calibrations must be equal bytes.
_METADATA_KEY = "tsukimi"
_TENSORS = ("key_center", "key_scale", "key_codebook", "value_codebook")


@dataclass(frozen=True)
class KvCalibration:
    """A KVQuant calibration for one model at one code width.

    Tensors (fp32): key_center, key_scale [num_layers, kv_heads, head_dim] (a key channel x is coded as
    (x - centre) / scale, the calibrated range mapped to [-1, 1]); key_codebook, value_codebook
    [num_layers, 2**bits], ascending, in those normalised units.
    """

    bits: int
    outlier_fraction: float
    key_center: torch.Tensor
    key_scale: torch.Tensor
    key_codebook: torch.Tensor
    value_codebook: torch.Tensor
    info: dict[str, object] = field(default_factory=dict)  # provenance: model, text, tokens, seed

    def __post_init__(self) -> None:
        num_layers = self.key_center.shape[0]
        levels = 1 << self.bits
        if self.key_center.dim() != 3 or self.key_scale.shape != self.key_center.shape:
            raise KvCalibrationError("key_center and key_scale must both be [num_layers, kv_heads, head_dim]")
        for name in ("key_codebook", "value_codebook"):
            if tuple(getattr(self, name).shape) != (num_layers, levels):
                raise KvCalibrationError(f"{name} must be [{num_layers}, {levels}] for {self.bits}-bit codes")
        if not bool((self.key_scale > 0).all()):
            raise KvCalibrationError("key_scale must be positive")
        if not 0 <= self.outlier_fraction < 0.5:
            raise KvCalibrationError(f"outlier_fraction must be in [0, 0.5), got {self.outlier_fraction}")

    @property
    def num_layers(self) -> int:
        return self.key_center.shape[0]

    @property
    def kv_heads(self) -> int:
        return self.key_center.shape[1]

    @property
    def head_dim(self) -> int:
        return self.key_center.shape[2]

    def check_fits(self, num_layers: int, kv_heads: int, head_dim: int, bits: int) -> None:
        """Raises KvCalibrationError unless this calibration is for that model shape and code width."""
        ours = (self.num_layers, self.kv_heads, self.head_dim, self.bits)
        if ours != (num_layers, kv_heads, head_dim, bits):
            raise KvCalibrationError(
                f"calibration is for {self.num_layers} layers x {self.kv_heads} KV heads x head dim {self.head_dim} at"
                f" {self.bits} bits, not {num_layers} x {kv_heads} x {head_dim} at {bits} bits"
            )

    def save(self, path: str | Path) -> None:
        """Write the calibration as a safetensors file (tensors fp32, the rest as JSON metadata); equal calibrations
        give equal bytes."""
        tensors = {name: getattr(self, name).float().contiguous() for name in _TENSORS}
        fields = {"format": FORMAT, "bits": self.bits, "outlier_fraction": self.outlier_fraction, "info": self.info}
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path), metadata={_METADATA_KEY: json.dumps(fields, sort_keys=True)})


def load_calibration(path: str | Path) -> KvCalibration:
    """Read a file written by `KvCalibration.save`.

    Raises:
        KvCalibrationError: the file is missing, not a safetensors file, or not a tsukimi KV calibration.
    """
    path = Path(path)
    if not path.is_file():
        raise KvCalibrationError(f"KV calibration file {path} does not exist (make one with `tsukimi calibrate kv`)")
    try:
        tensors = load_file(str(path))
        with open(path, "rb") as handle:
            header_len = int.from_bytes(handle.read(8), "little")
            metadata = json.loads(handle.read(header_len)).get("__metadata__", {})
        fields = json.loads(metadata.get(_METADATA_KEY, "{}"))
    except (SafetensorError, ValueError, OSError) as exc:
        raise KvCalibrationError(f"{path} is not a readable safetensors file: {exc}") from None
    found = fields.get("format")
    if isinstance(found, str) and found.startswith(FORMAT.split("/")[0]) and found != FORMAT:
        raise KvCalibrationError(
            f"{path} is a {found} calibration, for an older kvquant layout; this tsukimi reads {FORMAT}: recalibrate"
            " with `tsukimi calibrate kv`"
        )
    if found != FORMAT or any(name not in tensors for name in _TENSORS):
        raise KvCalibrationError(f"{path} is not a tsukimi KV calibration (format {FORMAT})")
    return KvCalibration(
        bits=int(fields["bits"]), outlier_fraction=float(fields["outlier_fraction"]), info=fields.get("info", {}),
        **{name: tensors[name] for name in _TENSORS},
    )
