"""How long one engine step of a sim profile takes: a roofline (FLOPs against peak compute, bytes against memory
bandwidth, whichever is slower) plus tensor-parallel all-reduces and a fixed per-step cost.

Pure arithmetic over a step's work; which requests make up a step is the engine's batching.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.sim.profiles import SimProfile


@dataclass(frozen=True)
class StepWork:
    """What one forward step computes.

    Attributes:
        num_new_tokens: tokens through the model (decode tokens plus prefill chunks).
        num_sampled: rows that go through the LM head (sequences that produce a token this step).
        attention_work: keys attended, summed over the new tokens (causal: a prefill chunk of n new tokens after c
            cached ones attends n*c + n(n+1)/2).
        num_kv_tokens_read: KV tokens read, summed over the step's sequences (each reads its whole context once).
    """

    num_new_tokens: int
    num_sampled: int
    attention_work: int
    num_kv_tokens_read: int


@dataclass(frozen=True)
class StepTime:
    """The parts of a step's predicted time, in seconds; `total` is what the sim engine sleeps."""

    compute_s: float
    memory_s: float
    allreduce_s: float
    overhead_s: float

    @property
    def total(self) -> float:
        return max(self.compute_s, self.memory_s) + self.allreduce_s + self.overhead_s


def step_flops(profile: SimProfile, work: StepWork) -> float:
    """2 FLOPs per matmul weight per token, the LM head per sampled row, and 4 per attended key per query head and
    head dimension per layer (QK^T and PV): the prefill FLOPs per layer `a*n^2*d + b*n*d^2` of DESIGN section 6."""
    m = profile.model
    matmuls = 2 * m.num_layer_matmul_parameters * work.num_new_tokens
    lm_head = 2 * m.vocab_size * m.hidden_size * work.num_sampled
    attention = 4 * m.num_layers * m.num_heads * m.head_dim * work.attention_work
    return float(matmuls + lm_head + attention)


def step_bytes(profile: SimProfile, work: StepWork) -> float:
    """Every weight read once, the KV read for attention, and the new tokens' KV written."""
    kv = profile.kv_bytes_per_token * (work.num_kv_tokens_read + work.num_new_tokens)
    return float(profile.weight_bytes + kv)


def step_time(profile: SimProfile, work: StepWork) -> StepTime:
    """The predicted time of one step of `work` on `profile` (a step with no tokens takes no time).

    All-reduces: two per layer (after attention and after the MLP) of [num_new_tokens, hidden] activations, as a
    ring over the GPUs: each GPU sends and receives 2(n-1)/n of the bytes over its link, plus a fixed latency.
    """
    if work.num_new_tokens <= 0:
        return StepTime(0.0, 0.0, 0.0, 0.0)
    gpu, n = profile.gpu, profile.num_gpus
    compute_s = step_flops(profile, work) / (n * gpu.peak_flops * profile.compute_efficiency)
    memory_s = step_bytes(profile, work) / (n * gpu.memory_bandwidth * profile.bandwidth_efficiency)
    allreduce_s = 0.0
    if n > 1:
        activation_bytes = work.num_new_tokens * profile.model.hidden_size * profile.dtype_bytes
        one = profile.allreduce_latency_s + 2 * (n - 1) / n * activation_bytes / gpu.link_bandwidth
        allreduce_s = 2 * profile.model.num_layers * one
    return StepTime(compute_s, memory_s, allreduce_s, profile.step_overhead_s)


def prior_samples(profile: SimProfile) -> tuple[list[tuple[float, float, float]], list[tuple[float, float, float]]]:
    """Step timings the profile predicts over a grid of step shapes, as instances report them in heartbeats:
    prefill `(new tokens, attention work, seconds)` and decode `(batch size, total context tokens, seconds)`. A
    scheduler of a sim system starts its cost models from these instead of guessing."""
    prefill = []
    for num_new in (256, 512, 1024, 2048, 4096):
        for num_cached in (0, 4096, 16384, 65536):
            work = num_new * num_cached + num_new * (num_new + 1) // 2
            seconds = step_time(profile, StepWork(num_new, 1, work, num_cached + num_new)).total
            prefill.append((float(num_new), float(work), seconds))
    decode = []
    for batch in (1, 8, 32, 64, 128, 256):
        for context_len in (1024, 8192, 32768):
            total = batch * context_len
            decode.append((float(batch), float(total), step_time(profile, StepWork(batch, batch, total, total)).total))
    return prefill, decode
