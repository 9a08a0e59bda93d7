"""The sim engine's step-time model: hand-worked FLOPs, bytes and all-reduces on a tiny profile, the real 70B profile's
sizes and scaling, and the scheduler's cost models seeded from `prior_samples` predicting what the sim engine sleeps."""

from __future__ import annotations

import dataclasses

import pytest

from services.scheduler.cost_model import DecodeCostModel, PrefillCostModel
from services.scheduler.service import SchedulerService
from shared.config import load_settings
from shared.model.config import LlamaConfig
from shared.sim.cost import StepTime, StepWork, prior_samples, step_bytes, step_flops, step_time
from shared.sim.profiles import PROFILES, SIM_ENV_DEFAULTS, GpuSpec, SimProfile, get_profile

# Round numbers so every figure below can be checked by hand.
# Matmul weights per layer: q,o 2*100*(4*25) = 20000; k,v 2*100*(2*25) = 10000; gate,up,down 3*100*300 = 90000
# -> 120000 a layer, 240000 for 2 layers. Parameters: 2 * (120000 + 2*100 norms) + 2 * 1000*100 embeddings + 100
# final norm = 440500 -> 881000 bytes in bf16. KV a token: 2 (K, V) * 2 layers * 2 kv heads * 25 = 200 -> 400 bytes.
TINY_MODEL = LlamaConfig(
    vocab_size=1000, hidden_size=100, intermediate_size=300, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=25,
    rope_theta=10000.0, rms_norm_eps=1e-5, max_position=4096, tie_word_embeddings=False,
)
TINY_GPU = GpuSpec("tiny", peak_flops=1e9, memory_bandwidth=1e8, memory_bytes=1e7, link_bandwidth=1e5, source="test")
TINY = SimProfile(
    "tiny", TINY_MODEL, TINY_GPU, num_gpus=2, compute_efficiency=0.5, bandwidth_efficiency=0.5,
    allreduce_latency_s=0.001, step_overhead_s=0.01, memory_utilization=0.5,
)
REAL = get_profile("llama3-70b-8xa800")

DECODE_LIKE = StepWork(num_new_tokens=10, num_sampled=2, attention_work=55, num_kv_tokens_read=10)
PREFILL_1000 = StepWork(num_new_tokens=1000, num_sampled=1, attention_work=1000 * 1001 // 2, num_kv_tokens_read=1000)


def prefill_s(profile: SimProfile, num_tokens: int, chunk: int) -> float:
    """A whole prompt's predicted prefill: one step per `chunk` tokens, the last one sampled."""
    total, done = 0.0, 0
    while done < num_tokens:
        n = min(chunk, num_tokens - done)
        work = StepWork(n, int(done + n == num_tokens), n * done + n * (n + 1) // 2, done + n)
        total += step_time(profile, work).total
        done += n
    return total


def test_tiny_profile_sizes() -> None:
    assert TINY_MODEL.num_layer_matmul_parameters == 240_000
    assert TINY.weight_bytes == 881_000
    assert TINY.kv_bytes_per_token == 400


def test_step_flops_by_hand() -> None:
    matmuls = 2 * 240_000 * 10  # 2 FLOPs per weight per token
    lm_head = 2 * 1000 * 100 * 2  # per sampled row
    attention = 4 * 2 * 4 * 25 * 55  # 4 per attended key, per layer, query head and head dimension
    assert matmuls + lm_head + attention == 5_244_000
    assert step_flops(TINY, DECODE_LIKE) == pytest.approx(5_244_000)


def test_step_bytes_by_hand() -> None:
    assert step_bytes(TINY, DECODE_LIKE) == pytest.approx(881_000 + 400 * (10 + 10))  # weights, KV read and written


def test_a_small_step_is_memory_bound_by_hand() -> None:
    t = step_time(TINY, DECODE_LIKE)
    assert t.compute_s == pytest.approx(5_244_000 / (2 * 1e9 * 0.5))
    assert t.memory_s == pytest.approx(889_000 / (2 * 1e8 * 0.5))  # 8.89 ms
    # Two all-reduces a layer of 10 tokens x 100 x 2 bytes, as a ring over 2 GPUs: 2*(2-1)/2 of 2000 bytes a link.
    assert t.allreduce_s == pytest.approx(2 * 2 * (0.001 + 2000 / 1e5))
    assert t.overhead_s == 0.01
    assert t.memory_s > t.compute_s
    assert t.total == pytest.approx(0.00889 + 0.084 + 0.01)


def test_a_big_prefill_is_compute_bound_by_hand() -> None:
    t = step_time(TINY, PREFILL_1000)
    flops = 2 * 240_000 * 1000 + 2 * 1000 * 100 + 4 * 2 * 4 * 25 * 500_500
    assert flops == 880_600_000
    assert t.compute_s == pytest.approx(0.8806)
    assert t.memory_s == pytest.approx((881_000 + 400 * 2000) / 1e8)
    assert t.compute_s > 10 * t.memory_s
    assert t.total == pytest.approx(t.compute_s + t.allreduce_s + t.overhead_s)


def test_one_gpu_has_no_all_reduce_and_half_the_throughput() -> None:
    one = dataclasses.replace(TINY, num_gpus=1)
    t1, t2 = step_time(one, PREFILL_1000), step_time(TINY, PREFILL_1000)
    assert t1.allreduce_s == 0.0
    assert t1.compute_s == pytest.approx(2 * t2.compute_s) and t1.memory_s == pytest.approx(2 * t2.memory_s)
    assert t1.total == pytest.approx(t1.compute_s + 0.01)


def test_an_empty_step_takes_no_time() -> None:
    assert step_time(TINY, StepWork(0, 0, 0, 0)) == StepTime(0.0, 0.0, 0.0, 0.0)
    assert step_time(REAL, StepWork(0, 0, 0, 0)).total == 0.0


def test_kv_capacity_is_what_fits_beside_the_weights() -> None:
    assert TINY.kv_capacity_tokens == 22_797  # (2 GPUs x 1e7 bytes x 0.5 - 881000 bytes of weights) // 400
    assert dataclasses.replace(TINY, num_gpus=1).kv_capacity_tokens == 10_297  # (5e6 - 881000) // 400
    assert dataclasses.replace(TINY, memory_utilization=0.01).kv_capacity_tokens == 0  # weights do not even fit


def test_real_profile_sizes() -> None:
    assert REAL.weight_bytes == pytest.approx(141e9, rel=0.01)
    assert REAL.kv_bytes_per_token == 80 * 2 * 8 * 128 * 2
    assert REAL.kv_capacity_tokens > 1_000_000
    assert REAL.kv_capacity_tokens == int((8 * 80e9 * 0.9 - REAL.weight_bytes) // REAL.kv_bytes_per_token)


def test_real_decode_grows_with_batch_and_context() -> None:
    def decode_s(batch: int, context_len: int) -> float:
        total = batch * context_len
        return step_time(REAL, StepWork(batch, batch, total, total)).total

    by_batch = [decode_s(b, 4096) for b in (1, 16, 64, 256)]
    by_context = [decode_s(32, c) for c in (1024, 8192, 32768, 131072)]
    assert by_batch == sorted(by_batch) and len(set(by_batch)) == len(by_batch)
    assert by_context == sorted(by_context) and len(set(by_context)) == len(by_context)
    small = step_time(REAL, StepWork(1, 1, 1024, 1024))
    assert small.memory_s > small.compute_s  # a decode step streams the weights


def test_real_prefill_grows_superlinearly_with_context() -> None:
    def whole_prompt_s(num_tokens: int) -> float:
        return step_time(REAL, StepWork(num_tokens, 1, num_tokens * (num_tokens + 1) // 2, num_tokens)).total

    per_token = [whole_prompt_s(n) / n for n in (8192, 32768, 131072)]
    assert per_token == sorted(per_token) and per_token[-1] > 1.5 * per_token[0]  # attention is quadratic
    assert whole_prompt_s(131072) > 16 * whole_prompt_s(8192)
    assert prefill_s(REAL, 65536, 2048) > 2 * prefill_s(REAL, 32768, 2048)  # chunked too: later chunks attend more
    big = step_time(REAL, StepWork(2048, 1, 2048 * 2049 // 2, 2048))
    assert big.compute_s > big.memory_s


def test_prior_samples_are_the_profile_s_own_step_times() -> None:
    prefill, decode = prior_samples(TINY)
    assert len(prefill) == 20 and len(decode) == 18
    for num_new, work, seconds in prefill:
        n = int(num_new)
        num_cached, rest = divmod(int(work) - n * (n + 1) // 2, n)  # work = n * cached + n(n+1)/2
        assert rest == 0 and num_cached in (0, 4096, 16384, 65536)
        assert seconds == step_time(TINY, StepWork(n, 1, int(work), num_cached + n)).total
    for batch, context, seconds in decode:
        b, c = int(batch), int(context)
        assert seconds == step_time(TINY, StepWork(b, b, c, c)).total
    grid = {(b, c) for b in (1, 8, 32, 64, 128, 256) for c in (1024, 8192, 32768)}
    assert {(b, c // b) for b, c, _ in decode} == grid


def test_cost_models_seeded_from_prior_samples_predict_the_sim_engine() -> None:
    prefill, decode = prior_samples(REAL)
    prefill_model, decode_model = PrefillCostModel(), DecodeCostModel()
    for sample in prefill:
        prefill_model.add_step(*sample)
    for sample in decode:
        decode_model.add_step(*sample)
    assert prefill_model.predict(12000, 0) == pytest.approx(prefill_s(REAL, 12000, 2048), rel=0.1)
    for batch, context_len in [(1, 1024), (16, 4000), (100, 20000)]:
        truth = step_time(REAL, StepWork(batch, batch, batch * context_len, batch * context_len)).total
        assert decode_model.predict(batch, batch * context_len) == pytest.approx(truth, rel=0.1)


def test_a_sim_scheduler_starts_from_the_profile_s_priors() -> None:
    env = {"TSUKIMI_ENGINE": "sim", "TSUKIMI_SIM_PROFILE": "llama2-70b-8xa800", **SIM_ENV_DEFAULTS}
    sim = SchedulerService(load_settings("scheduler", env), bus=None)  # type: ignore[arg-type]
    real = SchedulerService(load_settings("scheduler", {}), bus=None)  # type: ignore[arg-type]
    truth = prefill_s(PROFILES["llama2-70b-8xa800"], 12000, 2048)
    assert sim.prefill_cost.predict(12000, 0) == pytest.approx(truth, rel=0.1)
    assert real.prefill_cost.predict(12000, 0) != pytest.approx(truth, rel=0.5)  # the CPU prior is far off


def test_profiles_by_name() -> None:
    assert set(PROFILES) == {"llama2-70b-8xa800", "llama3-70b-8xa800"}
    assert get_profile("llama2-70b-8xa800").model.vocab_size == 32000
    with pytest.raises(ValueError, match="llama3-70b-8xa800"):
        get_profile("gpt-5")
    assert load_settings("decode", dict(SIM_ENV_DEFAULTS)).engine.block_size == 512
