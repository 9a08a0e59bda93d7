"""Engine settings: one frozen dataclass, validated once, built by the CLI or a service's config."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from shared.env_vars import default, default_float, default_int
from shared.fastgen.policies import FastGenSettings
from shared.kvcompress import CODEC_NAMES, KvCalibrationError
from shared.kvcompress.bundled import calibration_digest, resolve_calibration
from shared.model.stages import LayerRange

if TYPE_CHECKING:
    import torch

DTYPES = ("fp32", "bf16", "fp16")  # torch.float32, torch.bfloat16, torch.float16 (`torch_dtype`)
KV_POLICIES = ("full", "fastgen")
AUTO_KV_CACHE_BYTES = 0  # kv_cache_bytes: size the pool from the memory available (TSUKIMI_KV_CACHE_MB=auto)
CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # instructions that compute bf16 natively (oneDNN's fast paths)


def cpu_native_dtype(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """"bf16" where this machine's CPU computes bf16 natively (Intel AMX, AVX-512 BF16), else "fp32" (bf16 weights
    would then be widened for every matmul). Read from /proc/cpuinfo, without torch; "fp32" where there is none."""
    try:
        flags = next((line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")), "").split()
    except OSError:
        return "fp32"
    return "bf16" if any(flag in flags for flag in CPU_BF16_FLAGS) else "fp32"


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs; each default is its `TSUKIMI_*` variable's (`shared.env_vars`).

    Args:
        device: "cpu", "cuda", "cuda:1", or "auto" (CUDA when present).
        dtype: "fp32", "bf16" or "fp16"; weights and KV cache use it, logits and norms compute in fp32.
        block_size: tokens per KV block (the unit of paging and prefix reuse).
        kv_cache_bytes: bytes of the paged KV pool (all layers, K and V); 0 sizes it from the memory available
            (`kv_memory_fraction` of it; shared.engine.kv.sizing).
        kv_memory_fraction: the share of the available memory an auto-sized pool takes.
        max_num_seqs: most sequences in the running batch.
        max_num_batched_tokens: tokens per forward step (decode tokens plus prefill chunks): the chunk size.
        kernels: "auto", "torch", "triton" or "cpu" (see kernels.backend).
        num_threads: CPU threads for torch; 0 keeps torch's default.
        enable_prefix_caching: reuse full KV blocks of earlier requests by chained hash.
        kv_codec: "none" (the pool holds K/V tensors of `dtype`) or a codec of `shared.kvcompress` (full blocks are
            stored as the codec's bytes, each sequence's last, partial block in `dtype`).
        kv_calib: the calibration file of a `kvquant-*` codec (default: the one shipped for SmolLM2).
        kv_policy: "full" (every token's KV stays) or "fastgen" (each KV head keeps what its profiled policy keeps:
            `shared.fastgen`), with `fastgen`'s T, r_l, r_f and profiled rows.
        prompt_only: a prefill instance's engine, whose requests leave after their first token: FastGen profiles
            each prompt for decode (`LLMEngine.take_profile`) instead of moving it into lanes.
        stage: the layers this engine computes, as a stage of a chunked pipeline (None: the whole model); it holds
            those layers' weights and KV only (`LLMEngine.add_stage_input`). Raw KV only, for now.
    Raises:
        ValueError: an unknown dtype or codec, a setting out of range, or a codec without the calibration it needs.
    """

    device: str = default("TSUKIMI_DEVICE")
    dtype: str = default("TSUKIMI_DTYPE")
    block_size: int = default_int("TSUKIMI_BLOCK_SIZE")
    kv_cache_bytes: int = AUTO_KV_CACHE_BYTES
    kv_memory_fraction: float = default_float("TSUKIMI_KV_MEMORY_FRACTION")
    max_num_seqs: int = default_int("TSUKIMI_MAX_NUM_SEQS")
    max_num_batched_tokens: int = default_int("TSUKIMI_MAX_BATCHED_TOKENS")
    kernels: str = default("TSUKIMI_KERNELS")
    num_threads: int = default_int("TSUKIMI_NUM_THREADS")
    enable_prefix_caching: bool = True
    kv_codec: str = default("TSUKIMI_KV_CODEC")
    kv_calib: str | None = None
    kv_policy: str = default("TSUKIMI_KV_POLICY")
    fastgen: FastGenSettings = field(default_factory=FastGenSettings)
    prompt_only: bool = False
    stage: LayerRange | None = None

    def __post_init__(self) -> None:
        if self.stage is not None and (self.kv_codec != "none" or self.kv_policy != "full"):
            raise ValueError("a pipeline stage keeps raw KV (TSUKIMI_KV_CODEC=none, TSUKIMI_KV_POLICY=full) for now")
        if self.kv_policy not in KV_POLICIES:
            raise ValueError(f"unknown KV policy {self.kv_policy!r}: choose one of {', '.join(KV_POLICIES)}")
        if self.kv_policy == "fastgen" and self.kv_codec != "none" and not self.kv_codec.startswith("kvquant-"):
            raise ValueError(f"FastGen runs over the raw pool or a kvquant codec, not {self.kv_codec}")
        if self.kv_codec != "none" and self.kv_codec not in CODEC_NAMES:
            raise ValueError(f"unknown KV codec {self.kv_codec!r}: choose none or one of {', '.join(CODEC_NAMES)}")
        if self.kv_codec != "none":
            self.kv_calibration_path  # noqa: B018 -- resolve now: a missing calibration is a settings error
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}: choose one of {', '.join(DTYPES)}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.kv_cache_bytes < 0:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive, kv_cache_bytes not negative")
        if not 0.0 < self.kv_memory_fraction <= 1.0:
            raise ValueError(f"kv_memory_fraction must be in (0, 1], got {self.kv_memory_fraction}")

    @cached_property
    def kv_calibration_path(self) -> str | None:
        """The calibration file the codec uses (None when it needs none). Raises ValueError when it is missing."""
        if self.kv_codec == "none":
            return None
        try:
            path = resolve_calibration(self.kv_codec, self.kv_calib)
        except KvCalibrationError as exc:
            raise ValueError(str(exc)) from None
        if path is not None and not path.is_file():
            raise ValueError(f"KV calibration file {path} does not exist (make one with `tsukimi calibrate kv`)")
        return None if path is None else str(path)

    @cached_property
    def kv_format(self) -> str:
        """How this engine's KV blocks are stored: raw tensors of the dtype, or a codec (with its calibration's
        digest). Part of the block-hash namespace, so engines (and cache-store copies) with different KV formats
        never share block ids."""
        if self.kv_codec == "none":
            return self.dtype
        path = self.kv_calibration_path
        return self.kv_codec if path is None else f"{self.kv_codec}:{calibration_digest(Path(path))}"

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch  # here, not at the top: the control plane reads these settings and never loads torch

        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.dtype]

    @property
    def torch_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)
