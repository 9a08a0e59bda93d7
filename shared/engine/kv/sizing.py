"""How large an engine's KV pool is: the bytes `TSUKIMI_KV_CACHE_MB` gives, or, left at auto, a share of the memory
this host (or this container) has available once the weights are loaded, never more than the running batch could
fill with sequences of the model's whole context.

A pool on the CPU is mapped lazily (`lazy_zeros`), so a pool sized for the machine costs resident memory only as
blocks are first written, and an idle engine stays small.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from pathlib import Path

import torch

MIN_AUTO_BYTES = 64 << 20  # auto never sizes a pool below this, however little the host reports free
_MEMINFO = Path("/proc/meminfo")
_CGROUP = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class PoolSize:
    """The pool's bytes and where they came from (for the engine's start-up log)."""

    num_bytes: int
    how: str  # "set" (TSUKIMI_KV_CACHE_MB), "memory" (a share of what is available) or "batch" (all it can fill)
    available_bytes: int | None = None  # what the host or container had available, when auto looked


def pool_size(set_bytes: int, memory_fraction: float, bytes_per_token: int, max_tokens: int,
              device: torch.device) -> PoolSize:
    """`set_bytes` when given (> 0); else `memory_fraction` of the memory available to this process now, capped at
    `max_tokens` tokens of `bytes_per_token` (the most the running batch can hold) and at least `MIN_AUTO_BYTES`."""
    if set_bytes > 0:
        return PoolSize(set_bytes, "set")
    available = _cuda_free_bytes(device) if device.type == "cuda" else host_available_bytes()
    share = int(available * memory_fraction)
    fill = max_tokens * bytes_per_token
    if fill <= share:
        return PoolSize(max(fill, MIN_AUTO_BYTES), "batch", available)
    return PoolSize(max(share, MIN_AUTO_BYTES), "memory", available)


def host_available_bytes(meminfo: Path = _MEMINFO, cgroup: Path = _CGROUP) -> int:
    """Memory this process could still take: the kernel's MemAvailable, or less where a cgroup (a container's memory
    limit, v2 or v1) leaves less room under its limit."""
    available = _meminfo_available(meminfo)
    limit_room = _cgroup_room(cgroup)
    return available if limit_room is None else min(available, limit_room)


def _meminfo_available(meminfo: Path) -> int:
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) << 10  # kB
    raise OSError(f"no MemAvailable in {meminfo}")


def _cgroup_room(root: Path) -> int | None:
    """Limit minus usage of this process's memory cgroup, or None where there is no limit."""
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            raw_limit = (root / limit_file).read_text().strip()
            usage = int((root / usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if raw_limit == "max" or int(raw_limit) >= 1 << 60:  # v1 writes "no limit" as a huge number
            return None
        return max(0, int(raw_limit) - usage)
    return None


def _cuda_free_bytes(device: torch.device) -> int:
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor; on the CPU backed by an anonymous mapping, whose pages the kernel hands out (zeroed) when first
    written, so its resident memory grows with use rather than with its size."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = 1
    for dim in shape:
        numel *= dim
    num_bytes = numel * torch.empty((), dtype=dtype).element_size()
    if num_bytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buffer = mmap.mmap(-1, num_bytes)  # anonymous, private: zero-filled on first touch
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(shape)
