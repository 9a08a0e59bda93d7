"""How large an engine's KV pool is: the bytes `TSUKIMI_KV_CACHE_MB` gives, or, left at auto, a share of the memory
this host (or this container) has available once the weights are loaded, never more than the running batch could
fill with sequences of the model's whole context.

A pool on the CPU is mapped lazily (`lazy_zeros`), so a pool sized for the machine costs resident memory only as
blocks are first written, and an idle engine stays small.
"""

from __future__ import annotations

import math
import mmap
import os
from pathlib import Path

import torch

MIN_AUTO_BYTES = 64 << 20  # auto never sizes a pool below this, however little the host reports free
_MEMINFO = Path("/proc/meminfo")
_CGROUP = Path("/sys/fs/cgroup")
_SELF_CGROUP = Path("/proc/self/cgroup")


def pool_size(set_bytes: int, memory_fraction: float, bytes_per_token: int, max_tokens: int,
              device: torch.device) -> int:
    """`set_bytes` when given (> 0); else `memory_fraction` of the memory available to this process now, capped at
    `max_tokens` tokens of `bytes_per_token` (the most the running batch can hold) and at least `MIN_AUTO_BYTES`."""
    if set_bytes > 0:
        return set_bytes
    available = _cuda_free_bytes(device) if device.type == "cuda" else host_available_bytes()
    return max(MIN_AUTO_BYTES, min(int(available * memory_fraction), max_tokens * bytes_per_token))


def host_available_bytes(meminfo: Path = _MEMINFO, cgroup: Path = _CGROUP, self_cgroup: Path = _SELF_CGROUP) -> int:
    """Memory this process could still take: the kernel's MemAvailable (half the physical memory where there is no
    /proc/meminfo), or less where its memory cgroup (a container's limit, v2 or v1) leaves less room."""
    available = _meminfo_available(meminfo)
    limit_room = _cgroup_room(cgroup, self_cgroup)
    return available if limit_room is None else min(available, limit_room)


def _meminfo_available(meminfo: Path) -> int:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) << 10  # kB
    except OSError:
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2


def _cgroup_room(root: Path, self_cgroup: Path) -> int | None:
    """Limit minus usage of this process's memory cgroup (its own folder, as /proc/self/cgroup names it, else the
    mount's root: a container's own), or None where there is no limit."""
    v2, v1 = "", ""
    try:
        for line in self_cgroup.read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if not controllers:
                v2 = path.strip("/")
            elif "memory" in controllers.split(","):
                v1 = path.strip("/")
    except (OSError, ValueError):
        pass
    candidates = [(root / v2, "memory.max", "memory.current"),
                  (root / "memory" / v1, "memory.limit_in_bytes", "memory.usage_in_bytes")]
    if v2 or v1:  # also the mount's root: inside a container, its own cgroup
        candidates += [(root, "memory.max", "memory.current"),
                       (root / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes")]
    for folder, limit_file, usage_file in candidates:
        try:
            raw_limit = (folder / limit_file).read_text().strip()
            usage = int((folder / usage_file).read_text().strip())
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
    num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if num_bytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buffer = mmap.mmap(-1, num_bytes)  # anonymous, private: zero-filled on first touch
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(shape)
