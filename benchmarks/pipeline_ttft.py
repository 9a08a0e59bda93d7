"""Chunked pipeline parallelism on this machine (issue 22, point 5): the TTFT of one long prompt at a time on one
prefill instance against a pipeline group of two (`tsukimi up --prefill 2 --cpp-group 2`), the real model and the
real services, and the hidden-state bytes that crossed the stage boundary (from the first stage's log) beside the
prompt KV that went to decode, with what each would take on the virtual cluster's modeled network (800 Gbit/s a
node each way, `services.virtual`). Each engine computes on one thread (a node of its own, as `tsukimi up` gives
each engine its share of the cores), so a group of two uses two cores where one instance uses one; the third setup
gives one instance both, the same cores as the group in one process.

Not a test. Usage (from the repository root):
    python -m benchmarks.pipeline_ttft [--prompt-tokens 4000] [--num-prompts 5] [--json OUT]
Each prompt is a different stretch of the repository's docs (no prefix reuse between them), asked for one token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks._system import REPO_ROOT, Outcome, StartError, SystemSpec, chat_body, send, start_system, stop_system
from shared.engine.config import cpu_native_dtype
from shared.model.checkpoint import load_checkpoint

MODEL = "SmolLM2-135M-Instruct"
MODELED_NETWORK_BYTES_S = 800e9 / 8  # services.virtual's default node interface, each way
SETUPS = {  # name: (prefill instances, pipeline group size, torch threads an engine)
    "one instance": (1, 1, 1),
    "group of 2": (2, 2, 1),
    "one instance on 2 threads": (1, 1, 2),  # the same cores as the group, in one process
}


def prompts(num: int, num_tokens: int) -> list[str]:
    """`num` texts of about `num_tokens` tokens each, from different stretches of the docs."""
    tokenizer = load_checkpoint().tokenizer
    text = "\n".join(p.read_text(encoding="utf-8") for p in sorted((REPO_ROOT / "docs").glob("**/*.md")))
    ids = tokenizer.encode(text)
    if len(ids) < num * num_tokens:
        raise SystemExit(f"the docs hold {len(ids)} tokens, fewer than {num} prompts of {num_tokens}")
    return [tokenizer.decode(ids[i * num_tokens : (i + 1) * num_tokens]) for i in range(num)]


async def run_setup(name: str, texts: list[str], log_root: Path, min_tokens: int) -> dict[str, Any]:
    num_prefill, group, threads = SETUPS[name]
    spec = SystemSpec("conductor", num_prefill=num_prefill, num_decode=1, num_cache_stores=1, cpp_group=group,
                      kv_cache_mb=256, slo_ttft_ms=600_000, slo_tbt_ms=600_000,
                      env={"TSUKIMI_CPP_MIN_TOKENS": str(min_tokens), "TSUKIMI_CPP_KV_MB": "256",
                           "TSUKIMI_NUM_THREADS": str(threads)})
    log_dir = log_root / name.replace(" ", "-")
    system = start_system(spec, log_dir, lambda line: print(f"  {line}", file=sys.stderr))
    outcomes: list[Outcome] = []
    try:
        async with aiohttp.ClientSession() as session:
            url = f"{system.base_url}/v1/chat/completions"
            await send(session, url, chat_body(MODEL, "Say hello.", 1), "warmup", Outcome(-1, -1), 300)
            for index, text in enumerate(texts):  # one at a time: each TTFT is the prompt's own
                outcome = await send(session, url, chat_body(MODEL, text, 1), f"long-{index}", Outcome(index, index),
                                     600)
                outcomes.append(outcome)
                print(f"  {name}: prompt {index}: {outcome.status} TTFT {outcome.ttft_s}", file=sys.stderr)
    finally:
        stop_system(system)
    ttfts = [o.ttft_s for o in outcomes if o.status == "ok" and o.ttft_s is not None]
    rows_bytes = [line["rows_bytes"] for line in _log_events(log_dir / "prefill-0.log", "pipeline stage done")]
    predicted = [line["predicted_ttft_s"] for line in _log_events(log_dir / "scheduler-0.log", "placed")
                 if str(line.get("request_id", "")).startswith("long-")]
    return {"setup": name, "ttft_s": ttfts, "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
            "predicted_ttft_s": predicted,
            "prompt_tokens": [o.prompt_tokens for o in outcomes], "failed": len(outcomes) - len(ttfts),
            "rows_bytes": rows_bytes}


def _log_events(path: Path, event: str) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]
    return [line for line in lines if line.get("event") == event]


def report(results: list[dict[str, Any]], kv_bytes_per_token: int) -> None:
    base = results[0]["ttft_p50_s"]
    print("| setup | TTFT p50 s | vs one instance | the Conductor's prediction, p50 s | runs "
          "| stage-boundary bytes a prompt | prompt KV to decode | boundary / KV |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for result in results:
        p50 = result["ttft_p50_s"]
        tokens = statistics.median(result["prompt_tokens"]) if result["prompt_tokens"] else 0
        kv = tokens * kv_bytes_per_token
        rows = statistics.median(result["rows_bytes"]) if result["rows_bytes"] else 0
        ratio = f"{p50 / base:.2f}x" if p50 and base else "-"
        share = f"{rows / kv:.3f}" if rows and kv else "-"
        predicted = f"{statistics.median(result['predicted_ttft_s']):.3f}" if result["predicted_ttft_s"] else "-"
        print(f"| {result['setup']} | {p50:.3f} | {ratio} | {predicted} | {len(result['ttft_s'])} | {rows:,.0f} "
              f"| {kv:,.0f} | {share} |" if p50 else f"| {result['setup']} | - | - | - | 0 | - | - | - |")
    for result in results:
        rows = statistics.median(result["rows_bytes"]) if result["rows_bytes"] else 0
        if rows:
            print(f"\nOn the modeled network ({MODELED_NETWORK_BYTES_S * 8 / 1e9:.0f} Gbit/s): the boundary's "
                  f"{rows:,.0f} bytes take {rows / MODELED_NETWORK_BYTES_S * 1e3:.3f} ms a prompt, "
                  "spread over its chunks.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=4000, help="tokens a prompt (default %(default)s)")
    parser.add_argument("--num-prompts", type=int, default=5, help="prompts a setup (default %(default)s)")
    parser.add_argument("--min-tokens", type=int, default=1024,
                        help="TSUKIMI_CPP_MIN_TOKENS of the group (default %(default)s)")
    parser.add_argument("--setups", default=",".join(SETUPS),
                        help=f"which setups, comma-separated, the first the baseline (default: {','.join(SETUPS)})")
    parser.add_argument("--json", type=Path, help="write every figure here")
    args = parser.parse_args()
    setups = [name.strip() for name in args.setups.split(",") if name.strip()]
    if not setups or any(name not in SETUPS for name in setups):
        parser.error(f"--setups takes names of {', '.join(SETUPS)}")
    if args.prompt_tokens < args.min_tokens or args.num_prompts < 1:
        parser.error("--prompt-tokens must reach --min-tokens, and --num-prompts be at least 1")
    config = load_checkpoint().config
    dtype = os.environ.get("TSUKIMI_DTYPE") or cpu_native_dtype()  # what `tsukimi up` runs
    kv_bytes_per_token = config.kv_elements_per_token * (4 if dtype == "fp32" else 2)
    texts = prompts(args.num_prompts, args.prompt_tokens)
    results = []
    with tempfile.TemporaryDirectory(prefix="tsukimi-cpp-") as tmp:
        for name in setups:
            print(f"{name}...", file=sys.stderr)
            try:
                results.append(asyncio.run(run_setup(name, texts, Path(tmp), args.min_tokens)))
            except StartError as exc:
                raise SystemExit(f"{name} did not start: {exc}") from None
    report(results, kv_bytes_per_token)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
