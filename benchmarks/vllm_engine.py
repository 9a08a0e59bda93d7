"""vLLM's offline engine alone (`vllm.LLM`, its defaults), measured as `tsukimi bench engine` measures tsukimi's: per
batch size, random prompts, greedy, EOS ignored; decode time = a run of gen-len+1 tokens minus a run of 1 (medians),
divided by gen-len: the step. Prefix caching off, so that repeated runs compute the same prompts again.

Runs in vLLM's own venv (made by benchmarks/peers.py), so it imports nothing of tsukimi. Prints one JSON object.
Usage: .peers/vllm/bin/python benchmarks/vllm_engine.py MODEL_DIR [--batch-sizes 1,8,32] [--prompt-len 256]
    [--gen-len 128] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--gen-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=args.model_dir, dtype="bfloat16", max_model_len=4096, enable_prefix_caching=False, seed=0)
    rng = random.Random(0)
    rows = []
    for batch_size in (int(b) for b in args.batch_sizes.split(",")):
        prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(1000, 40000) for _ in range(args.prompt_len)])
                   for _ in range(batch_size)]

        def timed(max_tokens: int, batch: list[TokensPrompt]) -> float:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            start = time.perf_counter()
            llm.generate(batch, params, use_tqdm=False)
            return time.perf_counter() - start

        timed(2, prompts)  # warm this batch size
        one = statistics.median(timed(1, prompts) for _ in range(args.repeats))
        full = statistics.median(timed(args.gen_len + 1, prompts) for _ in range(args.repeats))
        step_s = (full - one) / args.gen_len
        rows.append({"batch_size": batch_size, "prefill_tok_s": batch_size * args.prompt_len / one,
                     "decode_tok_s": batch_size / step_s, "decode_step_ms": 1000 * step_s})
    print(json.dumps({"engine": "vllm", "torch_threads_here": torch.get_num_threads(), "prompt_len": args.prompt_len,
                      "gen_len": args.gen_len, "results": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
