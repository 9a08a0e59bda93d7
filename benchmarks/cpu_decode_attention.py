"""The C++ CPU decode attention against the PyTorch reference, two ways, each printing both and their ratio:

- `op`: one layer's decode attention alone (SmolLM2's heads unless told: 3 KV heads x 3 queries, bf16), context in
  random blocks of a 2,000-block pool, median of 50 calls; the reference gathers into a resident workspace as the
  engine's does. With `--layers N`, N pools (one a layer) attended in turn as a step's layers are, so that each
  call finds its KV out of the caches as in the engine: the median of 50 // N such passes, per layer; with
  `--contiguous`, each sequence's blocks one after another, as the engine's block allocator mostly hands them out.
- `engine` (the default): two engines in one process, `--kernels cpu` and `--kernels torch`, the same prompts; their
  decode steps interleaved (8 of one, then 8 of the other, `--rounds` times) so that both see the same machine noise;
  median step.

Not a test. Usage: python benchmarks/cpu_decode_attention.py [engine|op] [--threads N] [--batch-size 32]
    [--context 280] [--head-dim 64] [--layers 1] [--contiguous] [--rounds 10]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable

import torch

from kernels.paged_attention import paged_decode_attention_ref
from kernels.paged_attention_cpu import paged_decode_attention_cpu
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.model.checkpoint import load_checkpoint
from shared.tools.bench.hf_baseline import random_prompts
from shared.tools.bench.roofline import median_seconds
from shared.wire.protocol import SamplingParams

STEPS_PER_TURN = 8


def bench_op(args: argparse.Namespace) -> None:
    kv_heads, groups, block_size, num_blocks, dtype = 3, 3, 16, 2000, torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    shape = (kv_heads, num_blocks, block_size, args.head_dim)
    pools = [(torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype))
             for _ in range(args.layers)]
    max_blocks = -(-args.context // block_size)
    if args.contiguous:
        starts = torch.randperm(num_blocks // max_blocks, generator=gen)[: args.batch_size] * max_blocks
        tables = (starts[:, None] + torch.arange(max_blocks)[None, :]).to(torch.int32)
    else:
        tables = torch.randint(0, num_blocks, (args.batch_size, max_blocks), generator=gen, dtype=torch.int32)
    lens = torch.full((args.batch_size,), args.context, dtype=torch.int32)
    q = torch.randn(args.batch_size, kv_heads * groups, args.head_dim, generator=gen).to(dtype)
    size = kv_heads * args.batch_size * max_blocks * block_size * args.head_dim
    workspace = (torch.empty(size, dtype=dtype), torch.empty(size, dtype=dtype))

    def every_layer(attend: Callable[[torch.Tensor, torch.Tensor], object]) -> Callable[[], None]:
        def run() -> None:
            for k_cache, v_cache in pools:
                attend(k_cache, v_cache)
        return run

    calls = max(1, 50 // args.layers)
    ours = 1000 * median_seconds(every_layer(
        lambda k, v: paged_decode_attention_cpu(q, k, v, tables, lens, 0.125)), calls, 3) / args.layers
    ref = 1000 * median_seconds(every_layer(
        lambda k, v: paged_decode_attention_ref(q, k, v, tables, lens, 0.125, workspace)), calls, 3) / args.layers
    print(f"a layer of {args.layers}, batch {args.batch_size}, context {args.context}, head dim {args.head_dim}, "
          f"{'contiguous' if args.contiguous else 'random'} blocks, {torch.get_num_threads()} threads: "
          f"C++ {ours:.3f} ms, reference {ref:.3f} ms ({ours / ref:.2f}x)")


def bench_engine(args: argparse.Namespace) -> None:
    checkpoint = load_checkpoint()
    config = EngineConfig(device="cpu", dtype="bf16", enable_prefix_caching=False, num_threads=args.threads,
                          max_num_seqs=args.batch_size, max_num_batched_tokens=max(2048, args.batch_size * 256))
    engines = {k: LLMEngine(checkpoint, dataclasses.replace(config, kernels=k)) for k in ("cpu", "torch")}
    params = SamplingParams(max_tokens=args.rounds * (STEPS_PER_TURN + 1) + 2, temperature=0.0, ignore_eos=True)
    for engine in engines.values():
        for i, prompt in enumerate(random_prompts(args.batch_size, 256, checkpoint.config.vocab_size, 1)):
            engine.add_request(str(i), prompt, params)
        while any(s.num_uncomputed_tokens > 1 for s in [*engine.scheduler.running, *engine.scheduler.waiting]):
            engine.step()  # the prompts
    steps: dict[str, list[float]] = {kernels: [] for kernels in engines}
    for _ in range(args.rounds):
        for kernels, engine in engines.items():
            engine.step()  # not timed: the first step after the other engine's turn
            for _ in range(STEPS_PER_TURN):
                start = time.perf_counter()
                engine.step()
                steps[kernels].append(time.perf_counter() - start)
    ours, ref = (1000 * statistics.median(steps[k]) for k in ("cpu", "torch"))
    print(f"decode step, batch {args.batch_size}, 256-token prompts, bf16, {torch.get_num_threads()} threads: "
          f"cpu {ours:.2f} ms, torch {ref:.2f} ms ({ours / ref:.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", nargs="?", choices=["engine", "op"], default="engine")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--context", type=int, default=280, help="op: tokens each query attends to")
    parser.add_argument("--head-dim", type=int, default=64, help="op: head size")
    parser.add_argument("--layers", type=int, default=1, help="op: pools attended in turn, one a layer")
    parser.add_argument("--contiguous", action="store_true", help="op: each sequence's blocks one after another")
    parser.add_argument("--rounds", type=int, default=10, help="engine: turns of each engine")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    (bench_op if args.what == "op" else bench_engine)(args)


if __name__ == "__main__":
    main()
