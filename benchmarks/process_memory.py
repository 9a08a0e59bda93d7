"""Every process's memory under `tsukimi up --prefill 2 --decode 2 --cache-stores 2`, idle after start-up, for this
tree and (with `--baseline DIR`) another checkout of tsukimi in the same run, side by side with the ratio.

Not a test. Each tree gets a fresh system on the real model (one torch thread per engine); RSS is read from
/proc/<pid>/status once /health answers and a few heartbeats have passed, for the processes `tsukimi up` started
(found as its descendants). Loopback only.

    python benchmarks/process_memory.py --baseline /tmp/old-checkout
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from shared.tools.nats_server import free_port

ROOT = Path(__file__).parents[1]
COUNTS = ["--prefill", "2", "--decode", "2", "--cache-stores", "2"]
SETTLE_S = 5.0


def measure(tree: Path, log_dir: Path, kv_cache_mb: str) -> dict[str, float]:
    """instance id -> RSS in MB, for a fresh system run from `tree` (`kv_cache_mb` "": each tree's default)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TSUKIMI_")}
    env |= {"PYTHONPATH": str(tree), "TSUKIMI_NUM_THREADS": "1"}
    if kv_cache_mb:
        env["TSUKIMI_KV_CACHE_MB"] = kv_cache_mb
    cmd = [sys.executable, "-m", "shared", "up", *COUNTS, "--port", str(port), "--log-dir", str(log_dir)]
    process = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        _wait_healthy(port, process)
        time.sleep(SETTLE_S)
        return {_instance_of(pid): _rss_mb(pid) for pid in _descendants(process.pid)}
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(60)


def _wait_healthy(port: int, process: subprocess.Popen[bytes], timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"tsukimi up exited with {process.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise SystemExit(f"tsukimi up was not healthy after {timeout_s:.0f} s")


def _descendants(root: int) -> list[int]:
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = [], [root]
    while frontier:
        children = [pid for pid, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def _instance_of(pid: int) -> str:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return f"pid-{pid}"
    ids = [e.split(b"=", 1)[1].decode() for e in environ if e.startswith(b"TSUKIMI_INSTANCE_ID=")]
    return ids[0] if ids else "nats-server" if b"nats" in Path(f"/proc/{pid}/cmdline").read_bytes() else f"pid-{pid}"


def _rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", type=Path, metavar="DIR", help="another checkout to measure first")
    parser.add_argument("--kv-cache-mb", default="256", metavar="MIB",
                        help="TSUKIMI_KV_CACHE_MB of every engine (default 256; \"\": each tree's own default)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tsukimi-memory-") as tmp:
        before = measure(args.baseline.resolve(), Path(tmp) / "baseline", args.kv_cache_mb) if args.baseline else {}
        after = measure(ROOT, Path(tmp) / "this", args.kv_cache_mb)
    print(f"{'process':<16}{'baseline MB':>12}{'this tree MB':>14}{'ratio':>8}")
    for name in sorted(set(before) | set(after)):
        old, new = before.get(name), after.get(name)
        ratio = f"{new / old:.2f}x" if old and new else "-"
        print(f"{name:<16}{old or 0:>12.0f}{new or 0:>14.0f}{ratio:>8}")
    print(f"{'total':<16}{sum(before.values()):>12.0f}{sum(after.values()):>14.0f}")


if __name__ == "__main__":
    main()
