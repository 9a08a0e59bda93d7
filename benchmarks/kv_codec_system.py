"""The KV codec in the running system: for each codec a fresh `tsukimi up --prefill 1 --decode 1 --cache-stores 1
--kv-codec C` on loopback serves the same seeded load-generator workload (shared-prefix groups, so the cache-store
fills), then the gateway's /metrics are read: bytes one KV block costs, tokens the decode pool holds, bytes per block
in the cache-store's DRAM, and prompt KV bytes moved prefill -> decode per token. One table, every figure beside the
first codec's (default fp16) with the ratio.

Not a test: it prints figures and asserts nothing. Run `python benchmarks/kv_codec_system.py` from the repository
root (about 3 minutes per codec with the defaults on 2 cores; the CPU path dequantizes, so decode is slower with a
quantizing codec here: the fused kernels are for GPUs).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

from _system import REPO_ROOT, StartError, SystemSpec, start_system, stop_system

from services.gateway.kv_metrics import parse_kv_samples, total_for_role


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--codecs", default="fp16,kvquant-3", help="comma-separated; the first is the baseline")
    parser.add_argument("--num-requests", type=int, default=24)
    parser.add_argument("--rate", type=float, default=1.0, help="arrivals per second")
    parser.add_argument("--input-len", type=int, default=256, help="prompt tokens after the shared prefix")
    parser.add_argument("--shared-prefix-len", type=int, default=512)
    parser.add_argument("--num-prefix-groups", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--kv-cache-mb", type=int, default=96, help="KV pool of each engine")
    parser.add_argument("--json", metavar="OUT", help="write every figure here")
    return parser.parse_args(argv)


def scrape(base_url: str) -> dict[str, float]:
    """The tsukimi_kv_* samples of /metrics, keyed by `name{labels}`."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback only
    with opener.open(f"{base_url}/metrics", timeout=10) as response:
        return parse_kv_samples(response.read().decode())


def run_codec(codec: str, args: argparse.Namespace, log_root: Path) -> dict[str, float]:
    spec = SystemSpec(policy="conductor", num_prefill=1, num_decode=1, num_cache_stores=1,
                      kv_cache_mb=args.kv_cache_mb, env={"TSUKIMI_KV_CODEC": codec})
    system = start_system(spec, log_root / codec, lambda text: print(f"[{codec}] {text}", file=sys.stderr))
    try:
        out = log_root / f"{codec}-loadgen.json"
        subprocess.run([
            sys.executable, "-m", "loadgen", "--url", system.base_url, "--num-requests", str(args.num_requests),
            "--rate", str(args.rate), "--input-len", str(args.input_len), "--output-len", str(args.output_len),
            "--shared-prefix-len", str(args.shared_prefix_len), "--num-prefix-groups", str(args.num_prefix_groups),
            "--min-token-id", "100", "--vocab-size", "49000", "--json", str(out), "--quiet",
        ], cwd=REPO_ROOT, check=True)
        samples = scrape(system.base_url)
    finally:
        stop_system(system)
    summary = json.loads(out.read_text())["summary"]
    def total(name: str, role: str) -> float:
        return total_for_role(samples, f"tsukimi_kv_{name}", role)

    store_blocks, moved_tokens = total("store_dram_blocks", "cache-store"), total("moved_tokens_total", "decode")
    return {
        "decode_block_bytes": total("block_bytes", "decode"),
        "decode_capacity_tokens": total("capacity_tokens", "decode"),
        "store_bytes_per_block": total("store_dram_bytes", "cache-store") / max(1.0, store_blocks),
        "store_blocks": store_blocks,
        "moved_bytes_per_token": total("moved_bytes_total", "decode") / max(1.0, moved_tokens),
        "ttft_median_ms": summary["ttft"]["median_ms"] or 0.0, "tpot_median_ms": summary["tpot"]["median_ms"] or 0.0,
        "cache_hit_rate": summary["cache_hit_rate"] or 0.0, "completed": summary["num_completed"],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    codecs = args.codecs.split(",")
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="tsukimi-kv-codec-") as tmp:
        for codec in codecs:
            try:
                results[codec] = run_codec(codec, args, Path(tmp))
            except (StartError, subprocess.CalledProcessError) as exc:
                print(f"{codec}: {exc}", file=sys.stderr)
                return 1
    base = results[codecs[0]]
    print(f"{'figure':<24}" + "".join(f"{c:>16}" for c in codecs) + "".join(f"{'x ' + c:>16}" for c in codecs[1:]))
    for name in base:
        row = f"{name:<24}" + "".join(f"{results[c][name]:>16.4g}" for c in codecs)
        row += "".join(f"{results[c][name] / base[name]:>16.3f}" if base[name] else f"{'-':>16}" for c in codecs[1:])
        print(row)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
