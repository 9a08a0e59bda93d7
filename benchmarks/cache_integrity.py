"""What signing the cache-store's KV blocks costs: put and get blocks of SmolLM2-135M's size (64 tokens, 30 layers,
fp32: 2.95 MB) through a real cache-store and nats-server (embedded, loopback), with the block key and without, in
alternating rounds, and print the median time per block of each and their ratio.

Not a test. Both sides run in this process on this machine's cores (the store's event loop, the client's), as in a
`tsukimi up` with one cache-store; the HMAC-SHA256 pass over each part is the whole difference between the two runs.
Also prints the raw HMAC and xxh3 rates of this CPU on one part, for reference.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import os
import statistics
import time
import uuid

import xxhash

from services.cache_store.service import CacheStoreService
from shared.config import load_settings
from shared.tools.nats_server import EmbeddedNatsServer
from shared.wire.block_integrity import BlockSigner
from shared.wire.bus import Bus
from shared.wire.cache_client import CacheClient
from shared.wire.log import configure_logging
from shared.wire.protocol import Subjects

BLOCK_BYTES = 64 * 30 * 2 * 3 * 64 * 4  # SmolLM2-135M, fp32, a 64-token block of every layer
LAYER_BYTES = BLOCK_BYTES // 30
KEY = b"benchmark-block-key-0123456789abcdef"


async def one_round(client: CacheClient, blocks: dict[int, bytes]) -> tuple[float, float]:
    """Seconds per block to put every block, then to get every block back (checked)."""
    started = time.perf_counter()
    for block_hash, data in blocks.items():
        assert await client.put_block(block_hash, data, align_bytes=LAYER_BYTES)
    put_s = (time.perf_counter() - started) / len(blocks)
    started = time.perf_counter()
    for block_hash, data in blocks.items():
        assert await client.get_block(block_hash) == data
    return put_s, (time.perf_counter() - started) / len(blocks)


async def run(url: str, num_blocks: int, rounds: int) -> dict[str, list[tuple[float, float]]]:
    prefix = f"bench{uuid.uuid4().hex[:8]}"
    settings = load_settings("cache-store", environ={
        "TSUKIMI_NATS_URL": url, "TSUKIMI_SUBJECT_PREFIX": prefix, "TSUKIMI_INSTANCE_ID": "cache-0",
        "TSUKIMI_CACHE_DRAM_MB": str(4 * num_blocks * BLOCK_BYTES >> 20)})
    store = CacheStoreService(settings, await Bus.connect(url, "store", Subjects(prefix)))
    await store.start()
    bus = await Bus.connect(url, "client", Subjects(prefix))
    clients = {"unsigned": CacheClient(bus, 1, hot_gets=0), "signed": CacheClient(bus, 1, hot_gets=0,
                                                                                  signer=BlockSigner(KEY))}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in clients}
    for i in range(rounds + 1):  # round 0 warms up; the order alternates, so neither always runs first
        for name, client in sorted(clients.items(), reverse=bool(i % 2)):
            blocks = {(i << 32) + (j << 1) + (name == "signed"): os.urandom(BLOCK_BYTES) for j in range(num_blocks)}
            result = await one_round(client, blocks)
            if i:
                times[name].append(result)
    await store.stop()
    for b in (store.bus, bus):
        await b.drain()
    return times


def raw_rates() -> tuple[float, float]:
    part = os.urandom(256 << 10)
    rates = []
    for digest in (lambda: hmac.new(KEY, part, hashlib.sha256).digest(), lambda: xxhash.xxh3_64_intdigest(part)):
        started = time.perf_counter()
        for _ in range(200):
            digest()
        rates.append(200 * len(part) / (time.perf_counter() - started) / 1e9)
    return rates[0], rates[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=16, help="blocks per round (default 16)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds of each (default 5)")
    args = parser.parse_args()
    configure_logging("bench", "cache-integrity", "error", "console")
    with EmbeddedNatsServer() as server:
        times = asyncio.run(run(server.url, args.blocks, args.rounds))
    hmac_rate, xxh3_rate = raw_rates()
    print(f"{args.blocks} blocks of {BLOCK_BYTES / 1e6:.2f} MB per round, median of {args.rounds} rounds")
    print(f"{'':<10}{'put ms/block':>14}{'get ms/block':>14}")
    medians = {}
    for name, results in times.items():
        medians[name] = tuple(statistics.median(r[k] for r in results) for k in (0, 1))
        print(f"{name:<10}{1000 * medians[name][0]:>14.2f}{1000 * medians[name][1]:>14.2f}")
    put_ratio, get_ratio = (medians["signed"][k] / medians["unsigned"][k] for k in (0, 1))
    print(f"signed / unsigned: put {put_ratio:.2f}x, get {get_ratio:.2f}x")
    print(f"this CPU, one core, a 256 KiB part: HMAC-SHA256 {hmac_rate:.2f} GB/s, xxh3-64 {xxh3_rate:.1f} GB/s")


if __name__ == "__main__":
    main()
