"""FastGen in the engine against the full cache, in the same run: a batch of prompts cut from an English text, each
decoded greedily for a fixed number of tokens by one engine per setting (CPU, fp32, plain PyTorch attention). For
each: the prompt step's time (FastGen profiles there), the median decode step, the most blocks held while decoding
(prefix-cache blocks nobody holds not counted), and the share of (token, layer, KV head) entries kept at the end;
every figure beside the full cache's, with the ratio.

Not a test: it prints figures and asserts nothing. Run `python benchmarks/fastgen_engine.py` from the repository root
(about a minute with the defaults on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass

import torch

from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.sampling import SamplingParams
from shared.fastgen.policies import FastGenSettings
from shared.kvcompress.text_spans import evaluation_span, read_tokens
from shared.model.checkpoint import load_checkpoint

TEXT = "../shared/data/text/lee_background.txt"


@dataclass(frozen=True)
class Figures:
    prompt_step_s: float
    decode_step_s: float  # median
    peak_blocks: int
    kept_share: float


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--thresholds", default="1.0,0.95,0.9", help="FastGen's T values, comma-separated")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--gen-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--text", default=TEXT)
    parser.add_argument("--json", metavar="OUT", help="write every figure here")
    return parser.parse_args(argv)


def run(engine: LLMEngine, prompts: list[list[int]], gen_len: int) -> Figures:
    params = SamplingParams(max_tokens=gen_len, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, params)
    manager, steps, peak, kept, started = engine.block_manager, [], 0, 1.0, time.perf_counter()
    engine.step()  # every prompt in one step (the token budget holds them)
    prompt_step_s = time.perf_counter() - started
    while engine.has_unfinished():
        fastgen = engine.fastgen
        if fastgen is not None and fastgen.sequences:
            held = sum(s.num_entries for s in fastgen.sequences.values())
            full = sum(s.length for s in fastgen.sequences.values()) * fastgen.num_layers * fastgen.num_kv_heads
            kept = held / full
        started = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - started)
        peak = max(peak, manager.num_blocks - manager.num_free_blocks)
    return Figures(prompt_step_s, statistics.median(steps), peak, kept)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    checkpoint = load_checkpoint()
    tokens = evaluation_span(read_tokens(args.text, checkpoint.tokenizer))
    prompts = [tokens[i * args.prompt_len : (i + 1) * args.prompt_len] for i in range(args.num_prompts)]
    budget = (args.prompt_len + args.gen_len) * args.num_prompts
    base = dict(device="cpu", kv_cache_bytes=256 << 20, max_num_batched_tokens=max(2048, budget), kernels="torch")
    results = {"full": run(LLMEngine(checkpoint, EngineConfig(**base)), prompts, args.gen_len)}  # type: ignore[arg-type]
    for threshold in (float(t) for t in args.thresholds.split(",")):
        config = EngineConfig(**base, kv_policy="fastgen", fastgen=FastGenSettings(threshold=threshold))  # type: ignore[arg-type]
        results[f"fastgen T={threshold}"] = run(LLMEngine(checkpoint, config), prompts, args.gen_len)
    baseline = results["full"]
    print(f"{args.num_prompts} prompts x {args.prompt_len} tokens, {args.gen_len} generated, greedy, CPU fp32")
    print(f"{'setting':18} {'prompt step s':>22} {'decode step ms':>22} {'peak blocks':>18} {'kept':>7}")
    for name, f in results.items():
        print(f"{name:18} {f.prompt_step_s:10.2f} ({f.prompt_step_s / baseline.prompt_step_s:5.2f}x)    "
              f"{f.decode_step_s * 1e3:10.1f} ({f.decode_step_s / baseline.decode_step_s:5.2f}x)    "
              f"{f.peak_blocks:6d} ({f.peak_blocks / baseline.peak_blocks:5.2f}x)  {f.kept_share:6.1%}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump({name: vars(f) for name, f in results.items()} | {"args": vars(args)}, out, indent=2)


if __name__ == "__main__":
    main()
