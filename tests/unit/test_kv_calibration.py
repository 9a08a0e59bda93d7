"""KVQuant calibration: weighted k-means (exact on separated clusters, pulled by weight, deterministic), key ranges,
window choice by seed, the calibration file (round trip, clear errors, older layouts refused), and on the real model
a calibration that is deterministic for a seed and codes the model's own K/V better than a uniform codebook."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from shared.kvcompress import KvCalibration, KvCalibrationError, load_calibration
from shared.tools.calibrate.kmeans import weighted_error, weighted_kmeans_1d
from shared.tools.calibrate.kvquant import CalibrationSettings, calibrate, key_ranges, pick_windows


def test_kmeans_finds_separated_clusters() -> None:
    g = torch.Generator().manual_seed(0)
    centers = torch.tensor([-0.8, -0.1, 0.3, 0.9])
    values = (centers[:, None] + torch.randn(4, 500, generator=g) * 0.01).reshape(-1)
    found = weighted_kmeans_1d(values, torch.ones_like(values), 4)
    assert torch.allclose(found, centers, atol=5e-3)


def test_kmeans_weights_pull_centroids_and_lower_weighted_error() -> None:
    g = torch.Generator().manual_seed(1)
    values = torch.rand(20000, generator=g) * 2 - 1
    heavy_near_one = torch.where(values > 0.8, 50.0, 1.0)
    plain = weighted_kmeans_1d(values, torch.ones_like(values), 4)
    weighted = weighted_kmeans_1d(values, heavy_near_one, 4)
    assert int((weighted > 0.8).sum()) > int((plain > 0.8).sum())
    assert weighted_error(values, heavy_near_one, weighted) < weighted_error(values, heavy_near_one, plain)
    assert torch.equal(weighted, weighted_kmeans_1d(values, heavy_near_one, 4))


def test_kmeans_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        weighted_kmeans_1d(torch.zeros(0), torch.zeros(0), 4)
    with pytest.raises(ValueError):
        weighted_kmeans_1d(torch.ones(3), torch.zeros(3), 2)


def test_key_ranges_cover_the_central_share_per_channel() -> None:
    g = torch.Generator().manual_seed(2)
    keys = torch.randn(10000, 2, 3, generator=g) * torch.tensor([1.0, 5.0, 0.2]) + 3.0
    center, half = key_ranges(keys, 0.01)
    normalized = (keys - center) / half
    inside = (normalized.abs() <= 1).float().mean().item()
    assert 0.985 < inside < 0.995
    assert bool(((center - 3.0).abs() < 0.05 * half).all())  # the extreme quantiles are noisy: a loose centre
    assert half[0, 1] > 20 * half[0, 2]


def test_windows_are_chosen_by_seed() -> None:
    tokens = list(range(100 * 64))
    settings = CalibrationSettings(bits=3, num_tokens=5 * 64, window=64, block_size=64, seed=0)
    first = pick_windows(tokens, settings)
    assert first == pick_windows(tokens, settings) and len(first) == 5
    assert first != pick_windows(tokens, CalibrationSettings(bits=3, num_tokens=5 * 64, window=64, seed=1))
    with pytest.raises(ValueError, match="fewer than --tokens"):
        pick_windows(tokens[: 3 * 64], settings)


def test_settings_refuse_what_cannot_work() -> None:
    with pytest.raises(ValueError, match="bits"):
        CalibrationSettings(bits=5)
    with pytest.raises(ValueError, match="multiple of the block size"):
        CalibrationSettings(bits=3, window=100)


def test_calibration_file_round_trip_and_errors(tmp_path: Path) -> None:
    codebook = torch.linspace(-1, 1, 4).repeat(2, 1)
    original = KvCalibration(
        bits=2, outlier_fraction=0.01, key_center=torch.randn(2, 3, 8), key_scale=torch.rand(2, 3, 8) + 0.1,
        key_codebook=codebook, value_codebook=codebook * 0.9, info={"model": "m", "tokens": 7},
    )
    path = tmp_path / "cal.safetensors"
    original.save(path)
    loaded = load_calibration(path)
    assert loaded.bits == 2 and loaded.info == {"model": "m", "tokens": 7}
    assert torch.equal(loaded.key_center, original.key_center)
    assert torch.equal(loaded.value_codebook, original.value_codebook)
    again = tmp_path / "again.safetensors"
    for _ in range(3):  # equal calibrations, equal bytes: the file's digest is part of the block-hash namespace
        original.save(again)
        assert again.read_bytes() == path.read_bytes()
    with pytest.raises(KvCalibrationError, match="does not exist"):
        load_calibration(tmp_path / "missing.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(KvCalibrationError, match="not a readable"):
        load_calibration(tmp_path / "junk.safetensors")
    older = tmp_path / "older.safetensors"  # a file of the layout before per-block key ranges
    save_file({name: getattr(original, name) for name in ("key_center", "key_scale", "key_codebook", "value_codebook")},
              str(older), metadata={"tsukimi": json.dumps({"format": "tsukimi-kv-calibration/2", "bits": 2})})
    with pytest.raises(KvCalibrationError, match="older kvquant layout.*recalibrate"):
        load_calibration(older)
    with pytest.raises(KvCalibrationError, match="must be"):
        KvCalibration(bits=3, outlier_fraction=0.01, key_center=original.key_center, key_scale=original.key_scale,
                      key_codebook=codebook, value_codebook=codebook)


@pytest.mark.slow
def test_calibration_on_the_model_is_deterministic_and_beats_a_uniform_codebook(checkpoint) -> None:
    from shared.kvcompress.kvquant import KvQuantCodec
    from shared.model.llama import build_model
    from shared.tools.calibrate.kvquant import collect_activations

    tokens = checkpoint.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 40)[:256]
    settings = CalibrationSettings(bits=2, num_tokens=128, window=128, block_size=64, seed=3)
    first = calibrate(checkpoint, tokens, settings)
    second = calibrate(checkpoint, tokens, settings)
    assert torch.equal(first.key_codebook, second.key_codebook)
    assert torch.equal(first.key_scale, second.key_scale)
    # The learned codebooks reconstruct layer 5's K and V (second block, no sink) better than a uniform grid.
    model = build_model(checkpoint.config, checkpoint.state_dict, torch.float32, torch.device("cpu"), False)
    layer = collect_activations(model, [tokens[128:256]])[5]
    k = layer.keys[0][64:128].transpose(0, 1).contiguous()
    v = layer.values[0][64:128].transpose(0, 1).contiguous()
    uniform = torch.linspace(-1, 1, 4)
    errors = {}
    for name, (key_book, value_book) in {
        "learned": (first.key_codebook[5], first.value_codebook[5]), "uniform": (uniform, uniform),
    }.items():
        codec = KvQuantCodec(2, first.key_center[5], first.key_scale[5], key_book, value_book, 0.01)
        k2, v2 = codec.decode(codec.encode(k, v), *k.shape, torch.float32)
        errors[name] = ((k2 - k).square().mean() + (v2 - v).square().mean()).item()
    assert errors["learned"] < errors["uniform"]
