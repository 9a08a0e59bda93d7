"""The GPU check of issue 21, in one run of a few minutes on one CUDA GPU, its figures written as JSON after each part
(a run cut short still leaves what it measured):

1. the machine: GPU, versions, device-to-device copy bandwidth (bytes read and written) and a bf16 matmul's rate;
2. the engine at a dummy model's shape (Llama-3-8B by default, bf16, Triton kernels): decode tok/s at batch
   1/8/32/128 against the roofline of those two measured rates;
3. Triton paged decode attention against PyTorch SDPA over the same K/V made contiguous;
4. the kvquant kernel benchmark (`benchmarks.kvquant_kernels`), a short sweep;
5. `tsukimi up` on the GPU over the dummy model through the real services, driven by `tsukimi-loadgen`.

Not a test. On the device: `bash benchmarks/gpu_check.sh` (prepare here first: `python -m benchmarks.gpu_prepare`).
On a CPU, `--device cpu --quick --shape tiny` runs parts 1, 2 and 5 at a tiny size (parts 3 and 4 need CUDA): what
tests/integration/test_gpu_check.py runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.model.manifest import read_manifest
from shared.tools.bench.roofline import decode_roofline
from shared.tools.cli.bench_engine import measure_tsukimi
from shared.tools.nats_server import free_port

ROOT = Path(__file__).resolve().parents[1]
KV_TOKENS_PER_SEQ = 1024  # pool room per sequence: the prompt, the decoded tokens and slack


def timed(fn: Callable[[], object], device: str, iters: int = 20) -> float:
    """Median seconds of `fn` after three warm-ups (CUDA events on a GPU)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            began = time.perf_counter()
            fn()
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def machine(device: str, quick: bool) -> dict[str, Any]:
    size = (64 if quick else 4096) << 20
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src), device)
    n = 512 if quick else 8192
    a, b = (torch.randn(n, n, dtype=torch.bfloat16, device=device) for _ in range(2))
    mm_s = timed(lambda: a @ b, device, iters=10)
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"
    return {"device": name, "torch": torch.__version__, "python": sys.version.split()[0],
            "triton": _version("triton"), "copy_bytes_per_s": 2 * size / copy_s, "bf16_flop_per_s": 2 * n**3 / mm_s}


def engine_decode(args: argparse.Namespace, rates: dict[str, Any]) -> list[dict[str, Any]]:
    batches = [int(b) for b in args.batch_sizes.split(",")]
    kv_bytes = max(batches) * KV_TOKENS_PER_SEQ * read_manifest(args.model).config.kv_elements_per_token * 2
    config = EngineConfig(device=args.device, dtype="bf16", kv_cache_bytes=kv_bytes, max_num_seqs=max(batches),
                          max_num_batched_tokens=max(2048, max(batches) * args.prompt_len), block_size=16,
                          enable_prefix_caching=False, kernels="triton" if args.device.startswith("cuda") else "torch")
    began = time.perf_counter()
    engine = LLMEngine.from_path(args.model, config)
    load_s = time.perf_counter() - began
    rows = []
    for batch in batches:
        prompts = [[100 + (i * 7 + j) % 1000 for j in range(args.prompt_len)] for i in range(batch)]
        measure_tsukimi(engine, prompts[:1], 2)  # warm-up: kernels compiled and tuned
        result = measure_tsukimi(engine, prompts, args.gen_len)
        bound = decode_roofline(engine.model_config, batch, args.prompt_len + args.gen_len / 2, torch.bfloat16,
                                rates["copy_bytes_per_s"], rates["bf16_flop_per_s"])
        rows.append({"batch": batch, "decode_tok_s": result.decode_tok_s, "prefill_tok_s": result.prefill_tok_s,
                     "step_ms": result.decode_step_s * 1e3, "roofline_step_ms": bound.step_s * 1e3,
                     "step_over_roofline": result.decode_step_s / bound.step_s, "load_s": load_s})
        print(f"  batch {batch}: {result.decode_tok_s:.0f} tok/s, step {result.decode_step_s * 1e3:.2f} ms "
              f"(roofline {bound.step_s * 1e3:.2f} ms)", flush=True)
    return rows


def paged_attention(device: str, quick: bool) -> list[dict[str, Any]]:
    """Llama-3-8B's attention shape (32 query heads over 8 KV heads of 128), bf16, 16-token blocks."""
    return [_attention_row(device, batch, context) for batch in (8, 32)
            for context in ((1024,) if quick else (4096, 16384))]


def _attention_row(device: str, batch: int, context: int) -> dict[str, Any]:
    from kernels.paged_attention_triton import paged_decode_attention_triton

    heads, kv_heads, dim, block = 32, 8, 128, 16
    blocks_per_seq = context // block
    k_cache = torch.randn(kv_heads, batch * blocks_per_seq, block, dim, dtype=torch.bfloat16, device=device)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(batch * blocks_per_seq, device=device).view(batch, blocks_per_seq).int()
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, heads, dim, dtype=torch.bfloat16, device=device)
    scale = dim**-0.5
    triton_s = timed(lambda: paged_decode_attention_triton(q, k_cache, v_cache, tables, lens, scale), device)
    # SDPA's best case: K/V already contiguous per sequence, the KV heads repeated for their query heads
    k, v = (cache[:, tables.long()].permute(1, 0, 2, 3, 4).reshape(batch, kv_heads, context, dim)
            .repeat_interleave(heads // kv_heads, dim=1) for cache in (k_cache, v_cache))
    sdpa_s = timed(lambda: F.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale), device)
    kv_bytes = 2 * batch * context * kv_heads * dim * 2
    print(f"  batch {batch} context {context}: triton {triton_s * 1e6:.0f} us, sdpa {sdpa_s * 1e6:.0f} us", flush=True)
    return {"batch": batch, "context": context, "triton_us": triton_s * 1e6, "sdpa_us": sdpa_s * 1e6,
            "triton_over_sdpa": triton_s / sdpa_s, "triton_kv_bytes_per_s": kv_bytes / triton_s}


def kvquant(out: Path) -> Any:
    path = out.with_name("kvquant.json")
    subprocess.run([sys.executable, "-m", "benchmarks.kvquant_kernels", "--bits", "3", "4", "--batch", "8", "32",
                    "--context", "4096", "32768", "--iters", "10", "--json", str(path)], cwd=ROOT, check=True,
                   timeout=240)
    return json.loads(path.read_text())


def system(args: argparse.Namespace) -> dict[str, Any]:
    """`tsukimi up` (1 prefill, 1 decode) over the dummy model, and one loadgen run against it."""
    port, logs = free_port(), Path(args.out).with_name("system-logs")
    env = {**os.environ, "TSUKIMI_DEVICE": args.device, "TSUKIMI_DTYPE": "bf16", "TSUKIMI_BLOCK_SIZE": "16",
           "TSUKIMI_KV_CACHE_MB": str(64 if args.quick else 16384), "TSUKIMI_WARMUP": "off"}
    up = subprocess.Popen([sys.executable, "-m", "shared", "up", "--model", args.model, "--port", str(port),
                           "--log-dir", str(logs), "--startup-timeout", "240"], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        began = time.perf_counter()
        assert up.stdout is not None
        for line in up.stdout:
            if "tsukimi is up" in line:
                break
        else:
            raise RuntimeError(f"tsukimi up exited with {up.wait()}; logs in {logs}")
        startup_s = time.perf_counter() - began
        run = Path(args.out).with_name("loadgen.json")
        num, conc = (8, 4) if args.quick else (64, 16)
        subprocess.run([sys.executable, "-m", "loadgen", "--url", f"http://127.0.0.1:{port}", "--num-requests",
                        str(num), "--concurrency", str(conc), "--input-len", str(args.prompt_len), "--output-len",
                        "32" if args.quick else "128", "--json", str(run), "--quiet"], cwd=ROOT, check=True,
                       timeout=300)
        summary = json.loads(run.read_text())["summary"]
        return {"startup_s": startup_s, "requests": num, "concurrency": conc, "summary": summary}
    finally:
        up.send_signal(2)
        try:
            up.wait(timeout=30)
        except subprocess.TimeoutExpired:
            up.kill()


def _version(module: str) -> str | None:
    try:
        return str(__import__(module).__version__)
    except ImportError:
        return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu_check.json", help="the JSON written after each part")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default=None, help="default: dummy:.gpu/llama-3-8b, else dummy:llama-3-8b")
    parser.add_argument("--shape", default="llama-3-8b", help="the shape when --model is not given")
    parser.add_argument("--batch-sizes", default="1,8,32,128")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--gen-len", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, to check the script on a CPU")
    args = parser.parse_args()
    prepared = ROOT / ".gpu" / args.shape
    args.model = args.model or (f"dummy:{prepared}" if prepared.is_dir() else f"dummy:{args.shape}")
    out: dict[str, Any] = {"model": args.model, "device": args.device, "quick": args.quick}
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    is_cuda = args.device.startswith("cuda")
    parts: list[tuple[str, Callable[[], Any], bool]] = [  # (name, what it measures, whether it needs CUDA)
        ("machine", lambda: machine(args.device, args.quick), False),
        ("engine", lambda: engine_decode(args, out["machine"]), False),
        ("paged_attention", lambda: paged_attention(args.device, args.quick), True),
        ("kvquant", lambda: kvquant(path), True),
        ("system", lambda: system(args), False),
    ]
    for name, part, needs_cuda in parts:
        print(f"{name}...", flush=True)
        began = time.perf_counter()
        try:
            out[name] = {"skipped": "needs CUDA"} if needs_cuda and not is_cuda else part()
        except Exception as exc:  # one part's failure is reported, the rest still runs
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
        out.setdefault("seconds", {})[name] = round(time.perf_counter() - began, 1)
        path.write_text(json.dumps(out, indent=1, default=str))
    print(f"wrote {path}")
    return 0 if all("error" not in (v if isinstance(v, dict) else {}) for v in out.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
