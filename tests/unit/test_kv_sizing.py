"""The KV pool's size: what is set, or a share of the memory available (a container's limit included), never more
than the batch can fill; and a CPU pool that takes memory only as it is written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared.config import ConfigError, load_settings
from shared.engine.kv.sizing import MIN_AUTO_BYTES, host_available_bytes, lazy_zeros, pool_size

CPU = torch.device("cpu")
GIB = 1 << 30


def fake_host(tmp_path: Path, available_kb: int, cgroup: dict[str, str] | None = None) -> tuple[Path, Path]:
    tmp_path.mkdir(parents=True)
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal:       99999999 kB\nMemFree:  1 kB\nMemAvailable:   {available_kb} kB\n")
    root = tmp_path / "cgroup"
    for name, text in (cgroup or {}).items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return meminfo, root


def test_available_memory_is_the_least_of_the_host_and_its_cgroup(tmp_path: Path) -> None:
    none = tmp_path / "no-self-cgroup"
    meminfo, root = fake_host(tmp_path / "a", 8 << 20)  # 8 GiB, no cgroup files
    assert host_available_bytes(meminfo, root, none) == 8 * GIB
    meminfo, root = fake_host(tmp_path / "b", 8 << 20, {"memory.max": str(3 * GIB), "memory.current": str(GIB)})
    assert host_available_bytes(meminfo, root, none) == 2 * GIB  # a container of 3 GiB using 1
    meminfo, root = fake_host(tmp_path / "c", 8 << 20, {"memory.max": "max", "memory.current": str(GIB)})
    assert host_available_bytes(meminfo, root, none) == 8 * GIB
    meminfo, root = fake_host(tmp_path / "d", 8 << 20, {"memory/memory.limit_in_bytes": str(4 * GIB),
                                                        "memory/memory.usage_in_bytes": str(3 * GIB)})
    assert host_available_bytes(meminfo, root, none) == GIB  # cgroup v1
    meminfo, root = fake_host(tmp_path / "e", 8 << 20, {"app.slice/memory.max": str(5 * GIB),
                                                        "app.slice/memory.current": str(GIB)})
    own = tmp_path / "self-cgroup"
    own.write_text("0::/app.slice\n")
    assert host_available_bytes(meminfo, root, own) == 4 * GIB  # this process's own cgroup, as it names it
    meminfo, root = fake_host(tmp_path / "f", 8 << 20, {"memory/box/memory.limit_in_bytes": str(6 * GIB),
                                                        "memory/box/memory.usage_in_bytes": str(3 * GIB)})
    own.write_text("4:memory:/box\n0::/\n")
    assert host_available_bytes(meminfo, root, own) == 3 * GIB  # v1's memory controller, hybrid layout
    assert host_available_bytes(tmp_path / "no-meminfo", root, none) > 0  # half the physical memory


def test_a_set_size_wins_and_auto_takes_its_share_up_to_what_the_batch_fills(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("shared.engine.kv.sizing.host_available_bytes", lambda: 16 * GIB)
    assert pool_size(512 << 20, 0.25, 1000, 10**9, CPU) == 512 << 20
    assert pool_size(0, 0.25, 1000, 10**9, CPU) == 4 * GIB  # a quarter of what is available
    assert pool_size(0, 0.25, 1000, 1_000_000, CPU) == 1_000_000_000  # no more than the batch could ever fill
    monkeypatch.setattr("shared.engine.kv.sizing.host_available_bytes", lambda: 10 << 20)
    assert pool_size(0, 0.25, 1000, 10**9, CPU) == MIN_AUTO_BYTES


def test_the_setting_reads_auto_or_mib() -> None:
    assert load_settings("decode", {}).engine.kv_cache_bytes == 0
    assert load_settings("decode", {"TSUKIMI_KV_CACHE_MB": "AUTO"}).engine.kv_cache_bytes == 0
    assert load_settings("decode", {"TSUKIMI_KV_CACHE_MB": "96"}).engine.kv_cache_bytes == 96 << 20
    for bad in ("0", "lots", "-5"):
        with pytest.raises(ConfigError, match="TSUKIMI_KV_CACHE_MB must be auto or an integer"):
            load_settings("decode", {"TSUKIMI_KV_CACHE_MB": bad})
    with pytest.raises(ConfigError, match="kv_memory_fraction"):
        load_settings("decode", {"TSUKIMI_KV_MEMORY_FRACTION": "1.5"})


def mapping_resident_bytes(tensor: torch.Tensor) -> int:
    """Resident bytes of the memory mapping that holds `tensor` (from /proc/self/smaps): the pool's own pages, not
    the temporaries around it."""
    address, inside = tensor.data_ptr(), False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:
            start, end = (int(x, 16) for x in fields[0].split("-"))
            inside = start <= address < end
        elif inside and fields[0] == "Rss:":
            return int(fields[1]) << 10
    raise AssertionError("no mapping holds the tensor")


def test_a_cpu_pool_takes_memory_as_it_is_written() -> None:
    pool = lazy_zeros((8, 2, 1024, 16384), torch.bfloat16, CPU)  # 512 MiB
    assert pool.shape == (8, 2, 1024, 16384) and pool.dtype == torch.bfloat16
    assert mapping_resident_bytes(pool) == 0
    pool[0, 0, :64] = 1.5  # 2 MiB written
    assert pool[0, 0, :64].float().mean().item() == 1.5 and not pool[5, 1, :64].any()  # zeros where unwritten
    assert mapping_resident_bytes(pool) < 8 << 20  # the pages touched, not the 512 MiB
