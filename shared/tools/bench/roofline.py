"""The machine's roofline for one decode step: measured read bandwidth, matmul peak and weight-streaming rate,
and the bytes and FLOPs a step moves. Measures the machine only; tsukimi's engine is timed elsewhere."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shared.model.config import LlamaConfig

MiB = 1 << 20


def median_seconds(fn: Callable[[], object], repeats: int, warmups: int = 1) -> float:
    """The median of `repeats` timed calls of `fn`, after `warmups` untimed ones (they fault pages in and build
    oneDNN primitives)."""
    for _ in range(warmups):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_memory_bandwidth(num_bytes: int = 512 * MiB, repeats: int = 5) -> float:
    """Main-memory read bandwidth in bytes/s: the median time of `torch.sum` over a float32 buffer.

    A read-only reduction is chosen because a decode step streams its weights in and writes almost nothing
    back; a copy would add write and write-allocate traffic that weight streaming never pays. Runs on
    torch's configured threads. `num_bytes` should be many times the last-level cache.
    """
    buffer = torch.ones(num_bytes // 4, dtype=torch.float32)
    seconds = median_seconds(lambda: torch.sum(buffer), repeats)
    return buffer.numel() * buffer.element_size() / seconds


def measure_matmul_peak(dtype: torch.dtype, repeats: int = 5, size: int = 2048) -> float:
    """Dense matmul throughput in FLOP/s: the median time of one [size, size] x [size, size] `torch.mm`."""
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    seconds = median_seconds(lambda: torch.mm(a, b), repeats)
    return 2 * size**3 / seconds


def _pass_seconds(
    matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    weights: list[torch.Tensor],
    repeats: int,
) -> float:
    return median_seconds(lambda: [matmul(x, weight) for weight in weights], repeats)


def measure_weight_streaming(
    config: LlamaConfig,
    batch_size: int,
    dtype: torch.dtype,
    repeats: int = 5,
    min_total_bytes: int = 256 * MiB,
) -> float:
    """Effective weight bandwidth in bytes/s of the matmul a decode step runs: the weight-streaming rate.

    Times x [batch_size, hidden] times the fused gate/up weight (hidden x 2 * intermediate), rotating among
    enough such weights to total more than `min_total_bytes` so none is still cached when it is read again.
    Both weight layouts are timed, [out, in] via `F.linear` and [in, out] via `torch.mm`, and the faster one
    is returned, since either is open to the engine (at batch 1 in fp32 they differ almost twofold). At small
    batches this is bandwidth-bound; at large ones it also pays the FLOPs, hence the dependence on the batch.
    """
    out_features, in_features = 2 * config.intermediate_size, config.hidden_size
    bytes_per_weight = out_features * in_features * dtype.itemsize
    num_weights = math.ceil(min_total_bytes / bytes_per_weight) + 1
    x = torch.randn(batch_size, in_features, dtype=dtype)  # [batch_size, hidden]
    # [out, in] is how nn.Linear and GGUF store a weight; [in, out] is its transpose, laid out for x @ w
    layouts: list[tuple[tuple[int, int], Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]] = [
        ((out_features, in_features), F.linear),
        ((in_features, out_features), torch.mm),
    ]
    best_s = math.inf
    for shape, matmul in layouts:  # one layout's weights at a time, freed before the next is built
        weights = [torch.randn(shape, dtype=dtype) for _ in range(num_weights)]
        best_s = min(best_s, _pass_seconds(matmul, x, weights, repeats))
        weights.clear()
    return num_weights * bytes_per_weight / best_s


@dataclass(frozen=True)
class DecodeRoofline:
    """What one decode step must move and compute, and the time the machine's roofline allows for it."""

    weight_bytes: int
    kv_bytes: float
    flops: float
    memory_bound_s: float
    compute_bound_s: float
    step_s: float  # max(memory_bound_s, compute_bound_s)
    tok_s: float  # batch_size / step_s


def _matmul_parameters(config: LlamaConfig) -> int:
    return config.num_layer_matmul_parameters + config.vocab_size * config.hidden_size  # the LM head too


def decode_weight_bytes(config: LlamaConfig, dtype: torch.dtype) -> int:
    """Weight bytes one decode step reads: every layer's matmuls and norms, the final norm, and the LM head.

    The LM head (vocab x hidden, the embedding when tied) is read once; embedding lookups read only one row
    per sequence and are left out, so an untied embedding table does not count.
    """
    norms = (2 * config.num_layers + 1) * config.hidden_size
    return (_matmul_parameters(config) + norms) * dtype.itemsize


def decode_roofline(
    config: LlamaConfig,
    batch_size: int,
    context_len: float,
    dtype: torch.dtype,
    bandwidth: float,
    peak_flops: float,
) -> DecodeRoofline:
    """The roofline of one decode step of `batch_size` sequences that each attend to `context_len` tokens.

    Bytes: every weight once (`decode_weight_bytes`) plus K and V of every cached token in every layer, all in
    `dtype`. FLOPs: 2 per matmul parameter per sequence (LM head included) plus attention's QK^T and PV,
    4 x batch x context x num_heads x head_dim per layer. `bandwidth` is in bytes/s, `peak_flops` in FLOP/s.

    Raises:
        ValueError: batch_size < 1, context_len < 0, or a non-positive bandwidth or peak.
    """
    if batch_size < 1 or context_len < 0 or bandwidth <= 0 or peak_flops <= 0:
        raise ValueError(
            f"need batch_size >= 1, context_len >= 0, positive rates; got {batch_size=}, {context_len=}, "
            f"{bandwidth=}, {peak_flops=}"
        )
    weight_bytes = decode_weight_bytes(config, dtype)
    kv_bytes = batch_size * context_len * config.kv_elements_per_token * dtype.itemsize
    attention_flops = 4 * batch_size * context_len * config.num_heads * config.head_dim * config.num_layers
    flops = 2 * batch_size * _matmul_parameters(config) + attention_flops
    memory_bound_s = (weight_bytes + kv_bytes) / bandwidth
    compute_bound_s = flops / peak_flops
    step_s = max(memory_bound_s, compute_bound_s)
    return DecodeRoofline(
        weight_bytes=weight_bytes,
        kv_bytes=kv_bytes,
        flops=flops,
        memory_bound_s=memory_bound_s,
        compute_bound_s=compute_bound_s,
        step_s=step_s,
        tok_s=batch_size / step_s,
    )


def weight_streaming_bound_s(config: LlamaConfig, batch_size: int, dtype: torch.dtype, rate: float) -> float:
    """Seconds one decode step needs just to stream its weights at `rate` bytes/s.

    `rate` is `measure_weight_streaming` at this `batch_size` and `dtype`; the weight bytes themselves do not
    depend on the batch. KV reads are not included (see `decode_roofline` for those).

    Raises:
        ValueError: batch_size < 1 or a non-positive rate.
    """
    if batch_size < 1 or rate <= 0:
        raise ValueError(f"need batch_size >= 1 and a positive rate; got {batch_size=}, {rate=}")
    return decode_weight_bytes(config, dtype) / rate
