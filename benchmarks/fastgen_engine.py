"""FastGen in the engine against the full cache, in the same run: a batch of prompts cut from an English text, each
decoded greedily for a fixed number of tokens by one engine per setting (CPU, fp32, plain PyTorch attention), for each
KV codec of `--codecs` (none: fp32 tensors; kvquant-4: kvquant blocks, and kvquant records in FastGen's lanes). For
each: the prompt step's time (FastGen profiles there), the median decode step, the most blocks held while decoding
(prefix-cache blocks nobody holds not counted), the most KV bytes held (those blocks, plus a codec pool's
full-precision tails in use), and the share of (token, layer, KV head) entries kept at the end; every figure beside
the fp32 full cache's, with the ratio. The settings take turns, `--rounds` times, and each time is the
median over every round's steps (this machine is shared: a setting measured only while it is busy would look slow).

Not a test: it prints figures and asserts nothing. Run `python benchmarks/fastgen_engine.py` from the repository root
(about 6 minutes with the defaults on 2 cores).
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
from shared.fastgen.policies import FastGenSettings
from shared.model.checkpoint import load_checkpoint
from shared.tools.eval.text_spans import evaluation_span, read_tokens
from shared.wire.protocol import SamplingParams

TEXT = "../shared/data/text/lee_background.txt"


@dataclass(frozen=True)
class Figures:
    prompt_step_s: float
    decode_step_s: float  # median
    peak_blocks: int
    peak_bytes: int
    kept_share: float


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--thresholds", default="1.0,0.95", help="FastGen's T values, comma-separated")
    parser.add_argument("--codecs", default="none,kvquant-4", help="KV codecs, comma-separated (none: fp32 tensors)")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--gen-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="times each setting runs, the settings in turn")
    parser.add_argument("--text", default=TEXT)
    parser.add_argument("--json", metavar="OUT", help="write every figure here")
    return parser.parse_args(argv)


@dataclass(frozen=True)
class Run:
    prompt_step_s: float
    decode_steps_s: list[float]
    peak_blocks: int
    peak_bytes: int
    kept_share: float


def run(engine: LLMEngine, prompts: list[list[int]], gen_len: int) -> Run:
    params = SamplingParams(max_tokens=gen_len, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, params)
    manager, steps, peak, peak_bytes, kept = engine.block_manager, [], 0, 0, 1.0
    started = time.perf_counter()
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
        peak_bytes = max(peak_bytes, engine.store.num_bytes_held)
    return Run(prompt_step_s, steps, peak, peak_bytes, kept)


def summarize(runs: list[Run]) -> Figures:
    """Medians over the rounds (the decode step's over every step of every round)."""
    return Figures(
        statistics.median(r.prompt_step_s for r in runs), statistics.median(s for r in runs for s in r.decode_steps_s),
        max(r.peak_blocks for r in runs), max(r.peak_bytes for r in runs), runs[-1].kept_share,
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    checkpoint = load_checkpoint()
    tokens = evaluation_span(read_tokens(args.text, checkpoint.tokenizer))
    prompts = [tokens[i * args.prompt_len : (i + 1) * args.prompt_len] for i in range(args.num_prompts)]
    budget = (args.prompt_len + args.gen_len) * args.num_prompts
    base = dict(device="cpu", kv_cache_bytes=256 << 20, max_num_batched_tokens=max(2048, budget), kernels="torch")
    configs: dict[str, EngineConfig] = {}
    for codec in args.codecs.split(","):
        suffix = "" if codec == "none" else f" {codec}"
        configs[f"full{suffix}"] = EngineConfig(**base, kv_codec=codec)  # type: ignore[arg-type]
        for threshold in (float(t) for t in args.thresholds.split(",")):
            configs[f"fastgen T={threshold}{suffix}"] = EngineConfig(  # type: ignore[arg-type]
                **base, kv_codec=codec, kv_policy="fastgen", fastgen=FastGenSettings(threshold=threshold))
    runs: dict[str, list[Run]] = {name: [] for name in configs}
    for _ in range(args.rounds):
        for name, config in configs.items():
            runs[name].append(run(LLMEngine(checkpoint, config), prompts, args.gen_len))
    results = {name: summarize(r) for name, r in runs.items()}
    baseline = next(iter(results.values()))  # the first codec's full cache
    print(f"{args.num_prompts} prompts x {args.prompt_len} tokens, {args.gen_len} generated, greedy, CPU fp32, "
          f"{args.rounds} rounds; ratios against {next(iter(results))}")
    print(f"{'setting':28} {'prompt step s':>20} {'decode step ms':>20} {'peak blocks':>8} {'peak KV MB':>20} "
          f"{'kept':>7}")
    for name, f in results.items():
        print(f"{name:28} {f.prompt_step_s:10.2f} ({f.prompt_step_s / baseline.prompt_step_s:5.2f}x)  "
              f"{f.decode_step_s * 1e3:10.1f} ({f.decode_step_s / baseline.decode_step_s:5.2f}x)  {f.peak_blocks:8d}  "
              f"{f.peak_bytes / 2**20:10.2f} ({f.peak_bytes / baseline.peak_bytes:5.3f}x)  {f.kept_share:6.1%}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump({name: vars(f) for name, f in results.items()} | {"args": vars(args)}, out, indent=2)


if __name__ == "__main__":
    main()
