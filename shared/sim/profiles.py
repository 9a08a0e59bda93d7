"""The named hardware-and-model profiles the sim engine stands for, with every constant and where it comes from.

Only numbers; the step-time arithmetic is `shared.sim.cost`.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.model.config import LlamaConfig


@dataclass(frozen=True)
class GpuSpec:
    """One accelerator's datasheet figures."""

    name: str
    peak_flops: float  # dense bf16 tensor-core FLOP/s
    memory_bandwidth: float  # HBM bytes/s
    memory_bytes: float
    link_bandwidth: float  # GPU-to-GPU (NVLink) bytes/s, each direction
    source: str


@dataclass(frozen=True)
class SimProfile:
    """A serving instance the sim engine stands for: a model, tensor-parallel over `num_gpus` GPUs.

    Attributes:
        compute_efficiency, bandwidth_efficiency: the share of peak FLOP/s and of HBM bandwidth a step achieves.
        allreduce_latency_s: fixed cost of one tensor-parallel all-reduce (two per layer per step).
        step_overhead_s: fixed cost per step: kernel launches, batch scheduling, sampling.
        memory_utilization: the share of GPU memory the engine may use (weights + KV), as vLLM's
            `gpu_memory_utilization` (default 0.9).
    """

    name: str
    model: LlamaConfig
    gpu: GpuSpec
    num_gpus: int
    compute_efficiency: float = 0.6
    bandwidth_efficiency: float = 0.8
    allreduce_latency_s: float = 10e-6
    step_overhead_s: float = 0.004
    memory_utilization: float = 0.9
    dtype_bytes: int = 2  # bf16 weights and KV

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model.kv_elements_per_token * self.dtype_bytes

    @property
    def weight_bytes(self) -> int:
        return self.model.num_parameters * self.dtype_bytes

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens of KV that fit beside the weights in the usable GPU memory."""
        usable = self.num_gpus * self.gpu.memory_bytes * self.memory_utilization - self.weight_bytes
        return max(0, int(usable // self.kv_bytes_per_token))


# NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB): 312 TFLOPS dense BF16, 2,039 GB/s HBM2e, 80 GB; NVLink 600 GB/s.
# The A800 is the export variant with the same compute and memory and NVLink capped at 400 GB/s (200 GB/s a direction).
A800_SXM4_80GB = GpuSpec(
    name="A800-SXM4-80GB", peak_flops=312e12, memory_bandwidth=2.039e12, memory_bytes=80e9, link_bandwidth=200e9,
    source="NVIDIA A100 datasheet (SXM4 80GB); A800 = A100 with NVLink limited to 400 GB/s",
)

# Llama 2 70B (Touvron et al. 2023, "Llama 2", table 1; Hugging Face meta-llama/Llama-2-70b-hf config.json): 80 layers,
# hidden 8192, 64 heads with 8 KV heads (GQA), SwiGLU 28672, vocabulary 32000. Its native context is 4k; the profile
# allows 128k, since the Mooncake trace's prompts reach ~128k tokens and the paper's dummy models served them.
LLAMA2_70B = LlamaConfig(
    vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64, num_kv_heads=8,
    head_dim=128, rope_theta=10000.0, rms_norm_eps=1e-5, max_position=131072, tie_word_embeddings=False,
)
# Llama 3 70B (Meta's model card; meta-llama/Meta-Llama-3-70B config.json): the same shape with a 128,256-token
# vocabulary and rope theta 500000; 128k context as Llama 3.1 70B.
LLAMA3_70B = LlamaConfig(
    vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64, num_kv_heads=8,
    head_dim=128, rope_theta=500000.0, rms_norm_eps=1e-5, max_position=131072, tie_word_embeddings=False,
)

# The efficiencies and fixed costs are this team's assumptions for tensor-parallel inference on one 8-GPU node (large
# GEMMs reach roughly 60% of peak; streaming weights and KV roughly 80% of HBM bandwidth); they are not measured.
PROFILES: dict[str, SimProfile] = {
    p.name: p
    for p in [
        SimProfile("llama2-70b-8xa800", LLAMA2_70B, A800_SXM4_80GB, num_gpus=8),
        SimProfile("llama3-70b-8xa800", LLAMA3_70B, A800_SXM4_80GB, num_gpus=8),
    ]
}


# What a sim system runs with unless the environment says otherwise: Mooncake's 512-token KV blocks (also the trace's
# hash granularity), vLLM's default batch limit of 256 sequences, and a cache-store with a DRAM tier of 1 TiB a shard
# (an A800 node's memory; size-only blocks allocate nothing).
SIM_ENV_DEFAULTS = {"TSUKIMI_BLOCK_SIZE": "512", "TSUKIMI_MAX_NUM_SEQS": "256", "TSUKIMI_CACHE_DRAM_MB": str(1 << 20),
                    "TSUKIMI_MAX_BATCHED_TOKENS": "2048"}  # GPU nodes: the chunk Mooncake's and vLLM's setups use


def get_profile(name: str) -> SimProfile:
    """Raises ValueError naming the known profiles for an unknown name."""
    if name not in PROFILES:
        raise ValueError(f"unknown sim profile {name!r}; known: {', '.join(PROFILES)}")
    return PROFILES[name]
