"""Kernel benchmark on one CUDA GPU: kvquant decode attention (packed 2/3/4-bit KV read directly) against fp16
PyTorch SDPA over a contiguous fp16 cache, measured in the same run, and the quantize-and-pack kernel's cost.

Not a test. Usage (from the repository root; needs only torch, triton, numpy and this repository):
    python -m benchmarks.kvquant_kernels [--bits 2 3 4] [--batch 8 32] [--context 4096 8192 16384 32768]
                                         [--iters 20] [--json PATH]
Shapes are LLaMA-7B-like: 32 query heads, 32 KV heads, head dim 128; block size 64, 1% value outliers (keys have
none: each block's per-channel range is in its row). A context of N tokens is N / 64 - 1 packed blocks, the sink and a
full 64-token fp16 tail. Times are medians of CUDA-graph replays (no launch overhead) with L2 flushed before each;
bytes read count every byte the kernels load from global memory once (the SDPA baseline: q, K and V; kvquant: pool
rows, tail, sink, q, block tables, the layer's key grids and codebooks, RoPE rows and the split partials), GB/s =
bytes / median time, and the fraction is of the H200's HBM bandwidth.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kernels.kvquant_attention_triton import kvquant_decode_attention_triton, split_plan
from kernels.kvquant_layout import KvQuantLayerParams, KvQuantLayout
from kernels.kvquant_pack import select_outliers
from kernels.kvquant_pack_triton import kvquant_pack_triton

H200_HBM_BYTES_PER_S = 4.8e12  # NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200): 141 GB HBM3e, 4.8 TB/s
NUM_HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 32, 128, 64
OUTLIER_FRACTION = 0.01
UNIQUE_BLOCKS = 256  # packed once per width, then copied into distinct pool rows
L2_FLUSH_BYTES = 256 << 20


def time_us(fn: Callable[[], object], iters: int, warmup: int = 3) -> float:
    """Median microseconds of `fn` replayed as a CUDA graph (eagerly if capture fails), L2 flushed before each."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    run = fn
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        run = graph.replay
    except RuntimeError as error:
        print(f"  (CUDA graph capture failed, timing eagerly: {error})")
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(iters):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


def synthetic_params(bits: int, max_position: int, device: torch.device) -> KvQuantLayerParams:
    """A layer's params from a random calibration (ascending codebooks) and the LLaMA RoPE tables (theta 1e4)."""
    g = torch.Generator().manual_seed(bits)
    center = torch.randn(KV_HEADS, HEAD_DIM, generator=g) * 0.5
    scale = torch.rand(KV_HEADS, HEAD_DIM, generator=g) + 1.0
    key_cb, value_cb = (torch.sort(torch.rand(1 << bits, generator=g) * 2 - 1).values for _ in range(2))
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
    angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq).to(device)
    n = math.ceil(OUTLIER_FRACTION * BLOCK_SIZE * HEAD_DIM - 1e-9)  # KvQuantCodec.outliers_per_head
    layout = KvQuantLayout(bits, BLOCK_SIZE, KV_HEADS, HEAD_DIM, n)
    return KvQuantLayerParams.build(layout, OUTLIER_FRACTION, (center, scale, key_cb, value_cb), angles.cos(),
                                    angles.sin())


def random_blocks(num_blocks: int, params: KvQuantLayerParams, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pre-RoPE K around the calibrated centres and V, fp16 [num_blocks, H, T, D]."""
    g = torch.Generator(device=params.cos.device).manual_seed(seed)
    shape = (num_blocks, KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    k = torch.randn(shape, generator=g, device=g.device) * 1.2 + params.key_center[:, None, :]
    return k.half(), torch.randn(shape, generator=g, device=g.device).half()


def pack_blocks(k: torch.Tensor, v: torch.Tensor, params: KvQuantLayerParams) -> torch.Tensor:
    return kvquant_pack_triton(k, v, select_outliers(v, params), params)


def kvquant_inputs(params: KvQuantLayerParams, unique_rows: torch.Tensor, batch: int, context: int) -> dict[str, Any]:
    """Decode arguments for `batch` sequences of `context` tokens; every packed block its own pool row."""
    device = unique_rows.device
    num_packed = context // BLOCK_SIZE - 1
    total = batch * num_packed
    pool = unique_rows[torch.arange(total, device=device) % unique_rows.shape[0]]
    tables = torch.randperm(total, device=device).view(batch, num_packed).to(torch.int32)  # paged, not in order
    fp16 = {"dtype": torch.float16, "device": device}
    return {
        "q": torch.randn(batch, NUM_HEADS, HEAD_DIM, **fp16), "packed_pool": pool, "block_tables": tables,
        "num_packed_blocks": torch.full((batch,), num_packed, dtype=torch.int32, device=device),
        "tail_k": torch.randn(batch, KV_HEADS, BLOCK_SIZE, HEAD_DIM, **fp16),
        "tail_v": torch.randn(batch, KV_HEADS, BLOCK_SIZE, HEAD_DIM, **fp16),
        "tail_lens": torch.full((batch,), BLOCK_SIZE, dtype=torch.int32, device=device),
        "sink_k": torch.randn(batch, KV_HEADS, HEAD_DIM, **fp16),
        "sink_v": torch.randn(batch, KV_HEADS, HEAD_DIM, **fp16),
        "params": params, "scale": HEAD_DIM**-0.5,
    }


def kvquant_bytes_read(layout: KvQuantLayout, batch: int, context: int, device: torch.device) -> int:
    num_packed = context // BLOCK_SIZE - 1
    _, num_splits = split_plan(batch, KV_HEADS, num_packed, device)
    rows = batch * num_packed * layout.bytes_per_block
    dense = batch * KV_HEADS * (2 * BLOCK_SIZE + 2) * HEAD_DIM * 2  # tail K and V, sink K and V (fp16)
    q_and_tables = batch * (NUM_HEADS * HEAD_DIM * 2 + num_packed * 4 + 8)
    calibration = 2 * KV_HEADS * HEAD_DIM * 4 + 2 * (1 << layout.bits) * 4  # key grid base and step, codebooks
    rope = (num_packed + BLOCK_SIZE) * HEAD_DIM * 4  # cos and sin rows: each block's base, the in-block offsets
    partials = batch * NUM_HEADS * num_splits * (HEAD_DIM + 2) * 4  # read back by the merge kernel
    return rows + dense + q_and_tables + calibration + rope + partials


def fp16_baseline(batch: int, context: int, iters: int) -> dict[str, Any]:
    """fp16 SDPA of one query token per sequence over a contiguous [batch, heads, context, D] cache."""
    fp16 = {"dtype": torch.float16, "device": "cuda"}
    q = torch.randn(batch, NUM_HEADS, 1, HEAD_DIM, **fp16)
    k = torch.randn(batch, KV_HEADS, context, HEAD_DIM, **fp16)
    v = torch.randn(batch, KV_HEADS, context, HEAD_DIM, **fp16)
    us = time_us(lambda: F.scaled_dot_product_attention(q, k, v, scale=HEAD_DIM**-0.5), iters)
    return {"us": us, "bytes": q.nbytes + k.nbytes + v.nbytes}


def check_against_reference(params: KvQuantLayerParams, unique_rows: torch.Tensor) -> float:
    """Max |kernel - reference| over 2 sequences of 1k tokens (fp16 outputs of unit-scale data)."""
    from kernels.kvquant_attention import kvquant_decode_attention_ref

    args = kvquant_inputs(params, unique_rows, 2, 1024)
    out = kvquant_decode_attention_triton(**args)
    return float((out.float() - kvquant_decode_attention_ref(**args).float()).abs().max())


def bench_width(bits: int, contexts: list[int], batches: list[int], iters: int,
                baselines: dict[tuple[int, int], dict[str, Any]]) -> list[dict[str, Any]]:
    device = torch.device("cuda")
    params = synthetic_params(bits, max(contexts), device)
    unique_rows = pack_blocks(*random_blocks(UNIQUE_BLOCKS, params, seed=bits), params)
    error = check_against_reference(params, unique_rows)
    print(f"kvquant-{bits}: {params.layout.bytes_per_block} B per block; max |kernel - ref| = {error:.2e}")
    for num_blocks in (32, 512):  # a decode step's appends at batch 32; a 32k-token prompt's blocks
        k, v = random_blocks(num_blocks, params, seed=7)
        pack_us = time_us(lambda k=k, v=v: pack_blocks(k, v, params), iters)
        print(f"  pack {num_blocks} blocks (value outlier top-k + kernel): {pack_us:9.1f} us")
    records = []
    for batch in batches:
        for context in contexts:
            if (batch, context) not in baselines:
                continue
            args = kvquant_inputs(params, unique_rows, batch, context)
            us = time_us(lambda args=args: kvquant_decode_attention_triton(**args), iters)
            num_bytes = kvquant_bytes_read(params.layout, batch, context, device)
            base = baselines[(batch, context)]
            records.append({"kernel": f"kvquant-{bits}", "bits": bits, "batch": batch, "context": context, "us": us,
                            "bytes": num_bytes, "fp16_us": base["us"], "speedup": base["us"] / us,
                            "max_abs_error_vs_ref": error})
            del args
    return records


def fits(batch: int, context: int) -> bool:
    """Whether the fp16 cache (the largest tensors of a combination) fits with room to spare."""
    free, _ = torch.cuda.mem_get_info()
    return 2 * batch * KV_HEADS * context * HEAD_DIM * 2 < 0.7 * free


def print_table(baselines: dict[tuple[int, int], dict[str, Any]], records: list[dict[str, Any]]) -> None:
    print(f"\n{'kernel':<10} {'batch':>5} {'context':>7} {'us':>9} {'MB read':>9} {'GB/s':>7} {'of HBM':>7}"
          f" {'vs fp16':>8}")
    for (batch, context), base in sorted(baselines.items()):
        rows = [{"kernel": "fp16 sdpa", **base, "speedup": 1.0}]
        rows += [r for r in records if (r["batch"], r["context"]) == (batch, context)]
        for row in rows:
            gb_per_s = row["bytes"] / row["us"] / 1e3
            print(f"{row['kernel']:<10} {batch:>5} {context:>7} {row['us']:>9.1f} {row['bytes'] / 1e6:>9.1f}"
                  f" {gb_per_s:>7.0f} {gb_per_s * 1e9 / H200_HBM_BYTES_PER_S:>7.1%} {row['speedup']:>7.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bits", type=int, nargs="+", default=[2, 3, 4], choices=[2, 3, 4])
    parser.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--context", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--iters", type=int, default=20, help="timed replays per figure (the median is printed)")
    parser.add_argument("--json", type=Path, help="also write every figure to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("kvquant_kernels: no CUDA device; this benchmark times GPU kernels (an H200 for the issue's figures)")
    if min(args.context) < 2 * BLOCK_SIZE:
        sys.exit(f"kvquant_kernels: contexts must be at least {2 * BLOCK_SIZE} tokens")
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; {NUM_HEADS} query heads, {KV_HEADS} KV heads,"
          f" head dim {HEAD_DIM}, block {BLOCK_SIZE}; HBM reference {H200_HBM_BYTES_PER_S / 1e12:.1f} TB/s (H200)")
    baselines: dict[tuple[int, int], dict[str, Any]] = {}
    for batch in args.batch:
        for context in args.context:
            if fits(batch, context):
                baselines[(batch, context)] = fp16_baseline(batch, context, args.iters)
            else:
                print(f"skipping batch {batch} x context {context}: the fp16 cache does not fit")
    records: list[dict[str, Any]] = []
    errors: dict[str, str] = {}
    for bits in args.bits:
        try:
            records += bench_width(bits, args.context, args.batch, args.iters, baselines)
        except Exception as error:  # report the others; a kernel that fails to build on this GPU says why here
            errors[f"kvquant-{bits}"] = f"{type(error).__name__}: {error}"
            print(f"kvquant-{bits} failed: {errors[f'kvquant-{bits}']}")
        torch.cuda.empty_cache()
    print_table(baselines, records)
    if args.json:
        fp16 = [{"kernel": "fp16 sdpa", "batch": b, "context": c, **base} for (b, c), base in baselines.items()]
        report = {
            "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": importlib.import_module("triton").__version__, "hbm_bytes_per_s": H200_HBM_BYTES_PER_S,
            "shape": {"num_heads": NUM_HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "block_size": BLOCK_SIZE,
                      "outlier_fraction": OUTLIER_FRACTION},
            "results": fp16 + records, "errors": errors,
        }
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
