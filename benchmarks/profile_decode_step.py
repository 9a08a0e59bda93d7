"""Where one decode step of the engine goes: times steps at a batch size, then prints the torch profiler's top ops.

Not a test. Usage: python benchmarks/profile_decode_step.py [--dtype fp32|bf16] [--batch-size 32] [--prompt-len 128]
"""

from __future__ import annotations

import argparse
import statistics
import time

from torch.profiler import profile

from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.model.checkpoint import load_checkpoint
from shared.tools.bench.hf_baseline import random_prompts
from shared.wire.protocol import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10, help="timed decode steps before the profiled ones")
    args = parser.parse_args()
    checkpoint = load_checkpoint()
    tokens = args.batch_size * args.prompt_len
    engine = LLMEngine(checkpoint, EngineConfig(
        device="cpu", dtype=args.dtype, max_num_batched_tokens=max(2048, tokens), enable_prefix_caching=False,
    ))
    params = SamplingParams(max_tokens=args.steps + 10, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(args.batch_size, args.prompt_len, checkpoint.config.vocab_size, 0)):
        engine.add_request(str(i), prompt, params)
    engine.step()  # the whole prefill
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    print(f"decode step, batch {args.batch_size}, {args.dtype}: median {1000 * statistics.median(times):.1f} ms")
    with profile() as profiler:
        for _ in range(5):
            engine.step()
    print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
