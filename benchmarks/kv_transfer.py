"""Streams one prompt's KV prefill -> decode over a real nats-server (embedded, loopback), as
`shared.wire.handoff.prompt` chunks of a raw store's blocks (`BlockFormat` of the dtype, blocks of 16 tokens), with
byte-shuffle + LZ4 and with compression off, and prints end-to-end MB/s, wire MB and the compression ratio.

Not a test. The publisher (this process) cuts each layer into its block form (full blocks' bytes and the partial last
block's tokens, as a paged store's `read_prompt_layer` gives them), chunks, compresses and publishes it layer by layer,
as prefill does, inside a hand-off stream (start, chunks, end); a subscriber in a child process (as decode does,
through `Bus.serve` and `HandoffReceiver`) verifies each
chunk, reassembles the prompt (`assemble_prompt`) and says so. MB/s = raw KV bytes / wall time from the first layer
cut to the reassembled prompt (MB = 10^6 B).
Both ends share this machine's cores; across machines compress and decompress would overlap instead of adding up.
The last lines set the bytes LZ4 saves against the CPU it costs (shuffle, compress, verify, decompress; one core,
best of 3): below that link speed, compression wins.

The KV is synthetic, in SmolLM2-135M's shape (30 layers, 3 kv heads, head dim 64): Gaussian, smoothed along tokens,
a log-normal scale per channel. It is calibrated so that shuffle+LZ4 shrinks it about as much as the real model's KV
of a 1024-token English prompt (wire/raw: fp32 0.93, bf16 0.85, fp16 0.99); real KV may compress differently.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing
import statistics
import time
from dataclasses import dataclass

import torch
from nats.aio.msg import Msg

from shared.engine.kv.paged.store import prompt_layer_of
from shared.engine.kv.store import BlockFormat
from shared.tools.nats_server import EmbeddedNatsServer
from shared.wire.bus import Bus
from shared.wire.handoff.prompt import (
    DTYPE_NAMES,
    WIRE_NAMES,
    KvAssembly,
    assemble_prompt,
    chunk_prompt_layer,
    num_prompt_chunks,
)
from shared.wire.handoff.receiver import HandoffReceiver
from shared.wire.log import configure_logging
from shared.wire.parts import PartError
from shared.wire.payload import Payload, checksum
from shared.wire.protocol import HandoffEnd, HandoffStart, KvChunk, Message, SamplingParams, Subjects

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM = 30, 3, 64  # SmolLM2-135M
BLOCK_SIZE = 16  # the engines' default
SUBJECTS = Subjects("bench")
DECODE_ID = "decode-0"
DONE, VERIFIED, READY, STOP = "bench.done", "bench.verified", "bench.ready", "bench.stop"  # plain-text replies
MODES = {"lz4-shuffle": True, "raw": False}  # mode -> compress_payload


@dataclass
class Transfer:
    dtype: str
    mode: str
    num_chunks: int
    raw_bytes: int
    wire_bytes: int
    wall_s: float
    is_verified: bool


def synthetic_kv(num_tokens: int, seed: int) -> torch.Tensor:
    """[num_layers, 2, num_kv_heads, num_tokens, head_dim] fp32, smooth along tokens, a scale per channel."""
    window = 16
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(NUM_LAYERS, 2, NUM_KV_HEADS, HEAD_DIM, num_tokens + window - 1, generator=g)
    x = x.unfold(-1, window, 1).mean(-1) * math.sqrt(window)  # moving average over tokens, unit variance
    scale = torch.exp(0.5 * torch.randn(NUM_LAYERS, 2, NUM_KV_HEADS, 1, HEAD_DIM, generator=g))
    return (x.transpose(3, 4) * scale).contiguous()


def raw_format(dtype: torch.dtype) -> BlockFormat:
    """A raw store's block form: one layer of one block is [2, kv_heads, block_size, head_dim] of `dtype`."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return BlockFormat(WIRE_NAMES[dtype], BLOCK_SIZE, 2 * NUM_KV_HEADS * BLOCK_SIZE * HEAD_DIM * itemsize, 0, dtype)


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def layer_blocks(kv_layer: torch.Tensor) -> tuple[bytes, torch.Tensor]:
    """One layer [2, heads, tokens, head_dim] in a paged store's block form: full blocks' bytes and the tail."""
    layer = prompt_layer_of(kv_layer, BLOCK_SIZE)
    assert isinstance(layer.blocks, bytes)
    return layer.blocks, layer.tail


def prompt_checksum(layers: list[Payload], tail: torch.Tensor) -> int:
    """Of every layer's blocks and the tails: equal at both ends when the prompt arrived bit for bit (-1 for sizes
    alone, which match nothing)."""
    data = [layer for layer in layers if isinstance(layer, bytes)]
    return checksum(b"".join(data) + tensor_bytes(tail)) if len(data) == len(layers) else -1


def kv_checksum(kv: torch.Tensor) -> int:
    """`prompt_checksum` of `kv` [layers, 2, heads, tokens, head_dim] in the block form."""
    cut = [layer_blocks(kv[layer]) for layer in range(kv.shape[0])]
    layers: list[Payload] = [blocks for blocks, _ in cut]
    return prompt_checksum(layers, torch.stack([tail for _, tail in cut]))


# ---- decode side (child process) ------------------------------------------------------------------------------


def receiver_main(url: str) -> None:
    configure_logging("bench", "kv-decode", "error", "console")  # quiet: drain reports a disconnect
    asyncio.run(receive(url))


async def receive(url: str) -> None:
    """Verify and assemble every request's chunks; publish `<request_id>` on DONE, then its checksum on VERIFIED."""
    bus = await Bus.connect(url, "bench-decode", SUBJECTS)
    receiver = HandoffReceiver(deadline_s=60.0)
    stop = asyncio.Event()

    async def on_message(msg: Message) -> None:
        if isinstance(msg, HandoffStart):
            error = receiver.start(msg)
        elif isinstance(msg, KvChunk):
            error = receiver.add(msg)
        else:
            assert isinstance(msg, HandoffEnd)
            stream, error = receiver.end(msg)
        if error is not None:
            await bus.client.publish(DONE, f"{msg.request_id} {error}".encode())
            return
        if not isinstance(msg, HandoffEnd) or stream is None:
            return
        # A decode engine assembles in its own format; this one takes each stream's (every dtype is measured).
        fmt = raw_format(DTYPE_NAMES[stream.kv.pieces()[0][0].kv_format])
        try:
            layers, tail, _ = assemble_prompt(stream.kv, NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, fmt)
        except PartError as exc:
            await bus.client.publish(DONE, f"{msg.request_id} {exc}".encode())
            return
        await bus.client.publish(DONE, msg.request_id.encode())
        await bus.client.flush()  # the clock stops at DONE; the checksum below is not timed
        await bus.client.publish(VERIFIED, f"{msg.request_id} {prompt_checksum(layers, tail)}".encode())

    async def on_stop(_: Msg) -> None:
        stop.set()

    await bus.serve(SUBJECTS.decode_handoff(DECODE_ID), on_message)
    await bus.client.subscribe(STOP, cb=on_stop)
    await bus.client.flush()
    await bus.client.publish(READY, b"")
    await stop.wait()
    await bus.drain()


# ---- prefill side (this process) ------------------------------------------------------------------------------


class Publisher:
    """Sends transfers and waits for the receiver's DONE / VERIFIED replies."""

    def __init__(self, bus: Bus, chunk_bytes: int, timeout_s: float) -> None:
        self.bus, self.chunk_bytes, self.timeout_s = bus, chunk_bytes, timeout_s
        self.replies: dict[tuple[str, str], asyncio.Future[str]] = {}

    async def listen(self) -> None:
        async def on_reply(msg: Msg) -> None:
            request_id, _, rest = msg.data.decode().partition(" ")
            future = self.replies.get((msg.subject, request_id))
            if future is not None and not future.done():
                future.set_result(rest)

        for subject in (DONE, VERIFIED):
            await self.bus.client.subscribe(subject, cb=on_reply)
        await self.bus.client.flush()

    def expect(self, subject: str, request_id: str) -> asyncio.Future[str]:
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.replies[(subject, request_id)] = future
        return future

    async def transfer(self, request_id: str, kv: torch.Tensor, mode: str, expected_checksum: int) -> Transfer:
        """Stream `kv` [layers, 2, heads, tokens, head_dim] layer by layer; time it until the receiver assembled it."""
        num_layers, _, _, num_tokens, _ = kv.shape
        fmt = raw_format(kv.dtype)
        total = num_prompt_chunks(num_layers, num_tokens, fmt, self.chunk_bytes)
        done, verified = self.expect(DONE, request_id), self.expect(VERIFIED, request_id)
        subject = SUBJECTS.decode_handoff(DECODE_ID)
        wire_bytes = seq = 0
        start = time.perf_counter()
        await self.bus.publish(subject, HandoffStart(request_id, [0] * num_tokens, SamplingParams(), "bench", total))
        for layer in range(num_layers):
            blocks, tail = layer_blocks(kv[layer])
            chunks = chunk_prompt_layer(
                request_id, layer, blocks, tail, num_tokens, fmt, seq, total, self.chunk_bytes,
                compress_payload=MODES[mode],
            )
            for chunk in chunks:
                await self.bus.publish(subject, chunk)
                wire_bytes += len(chunk.data)
            seq += len(chunks)
            await asyncio.sleep(0)  # let the client's flusher send this layer, as prefill would between layers
        await self.bus.publish(subject, HandoffEnd(request_id, 0, "", 0))
        await self.bus.client.flush()
        try:
            error = await asyncio.wait_for(done, self.timeout_s)
        except TimeoutError:
            error = f"not assembled within {self.timeout_s} s (did the subscriber drop chunks as a slow consumer?)"
        wall_s = time.perf_counter() - start
        if error:
            raise RuntimeError(f"{request_id}: {error}")
        is_verified = int(await asyncio.wait_for(verified, self.timeout_s)) == expected_checksum
        return Transfer(fmt.kv_format, mode, total, kv.numel() * kv.element_size(), wire_bytes, wall_s, is_verified)


async def start_receiver(bus: Bus, url: str) -> multiprocessing.process.BaseProcess:
    """The decode side in a child process, once it listens."""
    ready = asyncio.Event()

    async def on_ready(_: Msg) -> None:
        ready.set()

    await bus.client.subscribe(READY, cb=on_ready)
    child = multiprocessing.get_context("spawn").Process(target=receiver_main, args=(url,), daemon=True)
    child.start()
    while not ready.is_set():
        if not child.is_alive():
            raise RuntimeError(f"the receiver process exited with code {child.exitcode}")
        await asyncio.sleep(0.1)
    return child


async def run(args: argparse.Namespace, url: str) -> tuple[list[Transfer], dict[str, float]]:
    """Every timed transfer, and per dtype the CPU seconds that LZ4 adds (see `codec_cost_s`)."""
    bus = await Bus.connect(url, "bench-prefill", SUBJECTS)
    publisher = Publisher(bus, args.chunk_kb << 10, args.timeout_s)
    await publisher.listen()
    child = await start_receiver(bus, url)
    try:
        base = synthetic_kv(args.tokens, seed=0)
        results, costs = [], {}
        for dtype in args.dtype:
            kv = base.to(DTYPE_NAMES[dtype])
            expected = kv_checksum(kv)
            for i in range(args.repeats + 1):  # the first round warms up and is not counted
                for mode in MODES:
                    result = await publisher.transfer(f"{dtype}-{mode}-{i}", kv, mode, expected)
                    if args.verbose:
                        print(f"{dtype} {mode} round {i}: {1000 * result.wall_s:.0f} ms", flush=True)
                    if i > 0:
                        results.append(result)
            costs[dtype] = codec_cost_s(kv, args.chunk_kb << 10, True) - codec_cost_s(kv, args.chunk_kb << 10, False)
        return results, costs
    finally:
        await bus.client.publish(STOP, b"")
        await bus.drain()
        child.join(10)
        if child.is_alive():
            child.terminate()


def codec_cost_s(kv: torch.Tensor, chunk_bytes: int, compress_payload: bool) -> float:
    """CPU seconds, best of 3 on one core, to cut `kv` into blocks and chunks and verify + decompress the chunks (no
    network, no msgpack)."""
    num_layers, _, _, num_tokens, _ = kv.shape
    fmt = raw_format(kv.dtype)
    total = num_prompt_chunks(num_layers, num_tokens, fmt, chunk_bytes)
    best = math.inf
    for _ in range(3):
        start = time.process_time()
        assembly = KvAssembly("cost", total)
        for layer in range(num_layers):
            first_seq = assembly.num_received
            blocks, tail = layer_blocks(kv[layer])
            for chunk in chunk_prompt_layer("cost", layer, blocks, tail, num_tokens, fmt, first_seq, total,
                                            chunk_bytes, compress_payload=compress_payload):
                assembly.add(chunk)
        best = min(best, time.process_time() - start)
    return best


def median_speed(results: list[Transfer], dtype: str, mode: str) -> tuple[Transfer, float]:
    """One transfer of this kind (sizes are the same in all) and the median MB/s over them."""
    runs = [r for r in results if (r.dtype, r.mode) == (dtype, mode)]
    wall_s = statistics.median(r.wall_s for r in runs)
    return runs[0], runs[0].raw_bytes / wall_s / 1e6


def report(results: list[Transfer], costs: dict[str, float], args: argparse.Namespace) -> None:
    print(f"KV of {args.tokens} tokens, {NUM_LAYERS} layers x {NUM_KV_HEADS} kv heads x head dim {HEAD_DIM} "
          f"(synthetic), chunks of {BLOCK_SIZE}-token blocks <= {args.chunk_kb} KiB raw, median of {args.repeats}")
    print(f"{'dtype':<6}{'mode':<13}{'chunks':>7}{'raw MB':>9}{'wire MB':>9}{'ratio':>7}{'ms':>8}{'MB/s':>8}  verified")
    for dtype in args.dtype:
        for mode in MODES:
            one, speed = median_speed(results, dtype, mode)
            is_verified = all(r.is_verified for r in results if (r.dtype, r.mode) == (dtype, mode))
            print(
                f"{dtype:<6}{mode:<13}{one.num_chunks:>7}{one.raw_bytes / 1e6:>9.1f}{one.wire_bytes / 1e6:>9.1f}"
                f"{one.wire_bytes / one.raw_bytes:>7.3f}{one.raw_bytes / speed / 1e3:>8.0f}{speed:>8.0f}  {is_verified}"
            )
    for dtype in args.dtype:
        packed, lz4 = median_speed(results, dtype, "lz4-shuffle")
        plain, raw = median_speed(results, dtype, "raw")
        saved_mb, extra_s = (plain.wire_bytes - packed.wire_bytes) / 1e6, costs[dtype]
        line = f"{dtype}: lz4-shuffle / raw speed = {lz4 / raw:.2f}x; "
        line += f"saves {saved_mb:.1f} MB for {1000 * extra_s:.0f} ms CPU"
        if saved_mb > 0 and extra_s > 0:  # rough: on a link that is the bottleneck, LZ4 pays if it saves more time
            line += f", pays on links under ~{saved_mb / extra_s:.0f} MB/s"
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048, help="prompt length (default 2048)")
    parser.add_argument("--dtype", nargs="+", default=["fp32", "bf16"], choices=list(DTYPE_NAMES),
                        help="raw KV formats (dtypes) to measure (default: fp32 bf16)")
    parser.add_argument("--chunk-kb", type=int, default=256,
                        help="raw payload per chunk, KiB: as many whole blocks as fit, at least one; a layer's last "
                             "chunk also carries the partial last block (default 256)")
    parser.add_argument("--repeats", type=int, default=5, help="timed transfers per dtype and mode (default 5)")
    parser.add_argument("--timeout-s", type=float, default=60.0,
                        help="give up on a transfer after this long, s (default 60)")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every transfer's time (round 0 warms up)")
    args = parser.parse_args()
    if args.tokens < 1 or args.chunk_kb < 1 or args.repeats < 1:
        parser.error("--tokens, --chunk-kb and --repeats must be >= 1")
    configure_logging("bench", "kv-prefill", "error", "console")
    with EmbeddedNatsServer() as server:
        results, costs = asyncio.run(run(args, server.url))
    report(results, costs, args)


if __name__ == "__main__":
    main()
