"""Arithmetic of the decode roofline on a tiny config whose byte and FLOP counts are worked out by hand."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shared.model.config import LlamaConfig
from shared.tools.bench.roofline import decode_roofline, decode_weight_bytes, weight_streaming_bound_s

# Per layer: q and o 2 x 4 x (2 x 2) = 32, k and v 2 x 4 x (1 x 2) = 16, MLP 3 x 4 x 6 = 72 -> 120 matmul
# parameters; 2 layers -> 240; LM head 10 x 4 = 40 -> 280. Norms: (2 x 2 + 1) x 4 = 20. Weights read: 300.
TINY = LlamaConfig(
    vocab_size=10,
    hidden_size=4,
    intermediate_size=6,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=2,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    max_position=64,
    tie_word_embeddings=True,
)
SMOLLM2_135M = LlamaConfig(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    max_position=8192,
    tie_word_embeddings=True,
)


def test_weight_bytes_count_every_weight_once_in_the_dtype() -> None:
    assert decode_weight_bytes(TINY, torch.float32) == 300 * 4
    assert decode_weight_bytes(TINY, torch.bfloat16) == 300 * 2


def test_weight_bytes_match_the_parameter_count_when_tied() -> None:
    assert decode_weight_bytes(SMOLLM2_135M, torch.float32) == SMOLLM2_135M.num_parameters * 4


def test_untied_embedding_table_is_not_streamed() -> None:
    untied = dataclasses.replace(TINY, tie_word_embeddings=False)
    assert untied.num_parameters == 340  # the embedding table counts as parameters ...
    assert decode_weight_bytes(untied, torch.float32) == 300 * 4  # ... but a step reads only its rows


def test_decode_roofline_fp32_is_compute_bound() -> None:
    # KV: 3 sequences x 5.5 tokens x (2 x 2 layers x 1 head x 2) = 8 elements x 4 bytes = 528 bytes.
    # FLOPs: 2 x 3 x 280 = 1680 matmul + 4 x 3 x 5.5 x 2 heads x 2 x 2 layers = 528 attention = 2208.
    roofline = decode_roofline(TINY, 3, 5.5, torch.float32, bandwidth=1728.0, peak_flops=1104.0)
    assert roofline.weight_bytes == 1200
    assert roofline.kv_bytes == pytest.approx(528.0)
    assert roofline.flops == pytest.approx(2208.0)
    assert roofline.memory_bound_s == pytest.approx(1.0)  # (1200 + 528) / 1728
    assert roofline.compute_bound_s == pytest.approx(2.0)  # 2208 / 1104
    assert roofline.step_s == pytest.approx(2.0)
    assert roofline.tok_s == pytest.approx(1.5)  # 3 tokens per 2 s step


def test_decode_roofline_bf16_halves_the_bytes_not_the_flops() -> None:
    roofline = decode_roofline(TINY, 3, 5.5, torch.bfloat16, bandwidth=432.0, peak_flops=1e9)
    assert roofline.weight_bytes == 600
    assert roofline.kv_bytes == pytest.approx(264.0)
    assert roofline.flops == pytest.approx(2208.0)
    assert roofline.step_s == pytest.approx(roofline.memory_bound_s) == pytest.approx(2.0)  # 864 / 432


def test_empty_context_has_no_kv_or_attention() -> None:
    roofline = decode_roofline(TINY, 1, 0.0, torch.float32, bandwidth=1200.0, peak_flops=560.0)
    assert roofline.kv_bytes == 0
    assert roofline.flops == pytest.approx(560.0)  # 2 x 280
    assert roofline.step_s == pytest.approx(1.0)


def test_weight_streaming_bound_is_weight_bytes_over_rate() -> None:
    assert weight_streaming_bound_s(TINY, 3, torch.float32, rate=600.0) == pytest.approx(2.0)
    assert weight_streaming_bound_s(TINY, 3, torch.bfloat16, rate=600.0) == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("batch_size", "context_len", "bandwidth", "peak_flops"),
    [(0, 1.0, 1.0, 1.0), (1, -1.0, 1.0, 1.0), (1, 1.0, 0.0, 1.0), (1, 1.0, 1.0, -1.0)],
)
def test_decode_roofline_rejects_nonsense(
    batch_size: int, context_len: float, bandwidth: float, peak_flops: float
) -> None:
    with pytest.raises(ValueError):
        decode_roofline(TINY, batch_size, context_len, torch.float32, bandwidth, peak_flops)


def test_weight_streaming_bound_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        weight_streaming_bound_s(TINY, 1, torch.float32, rate=0.0)
    with pytest.raises(ValueError):
        weight_streaming_bound_s(TINY, 0, torch.float32, rate=1.0)
