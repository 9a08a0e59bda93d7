"""The C++ CPU prefill attention against the PyTorch references, two ways, each printing both and their ratio:

- `op`: one layer's prefill attention alone (SmolLM2's heads: 3 KV heads x 3 queries, 64 wide, bf16): `--batch-size`
  chunks of `--new` tokens after `--cached` tokens each, in random blocks of a pool, median of 10 calls. The
  reference is what the engine runs without the kernel: SDPA over the step's own k, v for fresh prompts, the pool
  gathered and masked SDPA after a cached prefix.
- `engine` (the default): one engine, `--kernels cpu`; `--batch-size` random prompts of `--prompt-len` tokens
  prefilled (one output token each) in steps of `--max-batched-tokens`, with the kernel and with the references in
  turn, `--rounds` times; median time per prefill.

Not a test. Usage: python benchmarks/cpu_prefill_attention.py [engine|op] [--threads N] [--batch-size 8]
    [--prompt-len 256] [--max-batched-tokens 512] [--new 256] [--cached 0] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import shared.engine.kv.paged.store as paged_store
from kernels.paged_attention import fresh_prefill_attention_ref, paged_prefill_attention_padded_ref
from kernels.paged_attention_cpu import paged_prefill_attention_cpu
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.model.checkpoint import load_checkpoint
from shared.tools.bench.hf_baseline import random_prompts
from shared.tools.bench.roofline import median_seconds
from shared.wire.protocol import SamplingParams

KV_HEADS, GROUPS, HEAD_DIM, BLOCK_SIZE = 3, 3, 64, 16


def bench_op(args: argparse.Namespace) -> None:
    gen = torch.Generator().manual_seed(0)
    context = args.cached + args.new
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = args.batch_size * blocks_per_seq + 8
    k_cache, v_cache = (torch.randn(KV_HEADS, num_blocks, BLOCK_SIZE, HEAD_DIM, generator=gen).bfloat16()
                        for _ in range(2))
    tables = torch.randperm(num_blocks, generator=gen)[: args.batch_size * blocks_per_seq]
    tables = tables.view(args.batch_size, blocks_per_seq)
    fused = torch.randn(args.batch_size * args.new, (GROUPS + 2) * KV_HEADS, HEAD_DIM, generator=gen).bfloat16()
    q, k, v = fused.split([GROUPS * KV_HEADS, KV_HEADS, KV_HEADS], dim=1)
    lens = torch.full((args.batch_size,), context)
    starts = torch.arange(args.batch_size + 1) * args.new
    scale = HEAD_DIM**-0.5

    def kernel() -> torch.Tensor:
        return paged_prefill_attention_cpu(q, k_cache, v_cache, tables, lens, starts, scale)

    def reference() -> torch.Tensor:
        if args.cached == 0:
            return fresh_prefill_attention_ref(q, k, v, args.batch_size, scale)
        num_new, context_lens = [args.new] * args.batch_size, [context] * args.batch_size
        return paged_prefill_attention_padded_ref(q.contiguous(), k_cache, v_cache, tables, num_new, context_lens,
                                                  scale)

    ours, theirs = 1000 * median_seconds(kernel, 10), 1000 * median_seconds(reference, 10)
    print(f"one layer, {args.batch_size} chunks of {args.new} new tokens after {args.cached}, {args.threads} "
          f"thread(s): kernel {ours:.2f} ms, reference {theirs:.2f} ms ({theirs / ours:.2f}x)")


def bench_engine(args: argparse.Namespace) -> None:
    checkpoint = load_checkpoint()
    engine = LLMEngine(checkpoint, EngineConfig(
        device="cpu", dtype="bf16", kernels="cpu", enable_prefix_caching=False,
        max_num_batched_tokens=args.max_batched_tokens,
    ))
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    takes_kernel = paged_store.prefill_takes_cpu_kernel

    def prefill(seed: int) -> float:
        for i, prompt in enumerate(random_prompts(args.batch_size, args.prompt_len, checkpoint.config.vocab_size,
                                                  seed)):
            engine.add_request(f"{seed}-{i}", prompt, params)
        start = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        return time.perf_counter() - start

    prefill(0)
    times: dict[str, list[float]] = {"kernel": [], "reference": []}
    for round_ in range(args.rounds):
        for name, times_of in times.items():
            paged_store.prefill_takes_cpu_kernel = takes_kernel if name == "kernel" else (lambda *_: False)
            times_of.append(prefill(1 + round_))
    paged_store.prefill_takes_cpu_kernel = takes_kernel
    tokens = args.batch_size * args.prompt_len
    ours, theirs = statistics.median(times["kernel"]), statistics.median(times["reference"])
    print(f"prefill of {args.batch_size} x {args.prompt_len} tokens in {args.max_batched_tokens}-token steps, "
          f"{args.threads} thread(s): kernel {tokens / ours:.0f} tok/s, references {tokens / theirs:.0f} tok/s "
          f"({theirs / ours:.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", nargs="?", default="engine", choices=["engine", "op"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-batched-tokens", type=int, default=512)
    parser.add_argument("--new", type=int, default=256, help="op: new tokens per chunk")
    parser.add_argument("--cached", type=int, default=0, help="op: tokens before each chunk, in the pool")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    bench_op(args) if args.mode == "op" else bench_engine(args)


if __name__ == "__main__":
    main()
