"""Static speed estimate of the fused kvquant decode-attention kernel (`kernels.kvquant_attention_triton`) on an H200,
for machines without a GPU: it compiles the kernel for sm_90 and counts its machine code; nothing is launched.

This is an estimate, not a measurement. The kernel is compiled through its real launcher (the arguments it would pass
are captured, not launched; PREFETCH on as on a GPU), the cubin disassembled with the nvdisasm and cuobjdump that ship
inside the triton package (triton/backends/nvidia/bin), and the per-block loop found (the longest backward branch
around the key scoring). Its SASS instructions are counted per warp per block-head iteration (one packed block of one
KV head) and sorted into categories by the `nvdisasm -gi` line info, mapped to the kernel source's functions; the
rescale of the value tile, run only when the running max moves, is shown apart and left out of the total.
Registers per thread come from `cuobjdump -res-usage`, shared memory from Triton's metadata.

Assumptions (H200, sm_90): 132 SMs at 1.98 GHz, each with 4 schedulers issuing 1 instruction per cycle, every issue
slot filled (no stalls on memory or dependencies: a lower bound on the kernel's time). The kvquant time is
batch * KV heads * (packed blocks + 1) iterations (the fp16 tail counted as one more) * instructions * warps / issue
rate; the prologue, the sink, the epilogue and the split-merge kernel are left out. The fp16 SDPA baseline is
memory-bound: the bytes it reads (q [batch, heads, D] and K, V [batch, KV heads, context, D], fp16) at 80% of the
H200's 4.8 TB/s HBM. Shapes as `benchmarks.kvquant_kernels`: head dim 128, block 64 tokens (a context of N tokens is
N / 64 - 1 packed blocks and a full fp16 tail), 1% value outliers, the launcher's split plan for 132 SMs.

Not a test. Usage (from the repository root; needs torch, triton and this repository, no GPU):
    python -m benchmarks.kvquant_sass_estimate [--batch 8] [--bits 3] [--context 32768] [--heads 32] [--kv-heads 32]
                                               [--json OUT]
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import math
import re
import subprocess
import sys
import tempfile
import warnings
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
KERNEL_DIR = REPO_ROOT / "kernels"
KERNEL_SOURCES = (KERNEL_DIR / "kvquant_attention_triton.py", KERNEL_DIR / "kvquant_rows_triton.py")
NUM_SMS, CLOCK_HZ, ISSUE_PER_SM_CYCLE = 132, 1.98e9, 4  # H200 (sm_90): 4 schedulers x 1 instruction per cycle
HBM_BYTES_PER_S, SDPA_HBM_FRACTION = 4.8e12, 0.8  # NVIDIA H200 datasheet: 4.8 TB/s HBM3e
REGISTERS_PER_SM, WARPS_PER_SM, SHARED_PER_SM = 65536, 64, 228 * 1024
HEAD_DIM, BLOCK_SIZE, OUTLIER_FRACTION = 128, 64, 0.01
RARE = {"tile rescale (rare)"}  # only when the running max moves: shown, not in the total
LABEL = re.compile(r"^(\.L_x_\d+):")
INSTRUCTION = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
FRAME = re.compile(r'File "([^"]+)", line (\d+)')
BACK_BRANCH = re.compile(r"BRA `?\(?(\.L_x_\d+)")


@dataclass(frozen=True)
class Shape:
    batch: int
    bits: int
    context: int
    heads: int
    kv_heads: int

    @property
    def num_packed(self) -> int:
        return self.context // BLOCK_SIZE - 1


@dataclass(frozen=True)
class Frame:
    function: str  # "?" outside the kernel sources (triton.language's own functions)
    text: str  # the source line, stripped


@dataclass(frozen=True)
class Instruction:
    address: int
    text: str
    frames: tuple[Frame, ...]  # innermost first


@dataclass(frozen=True)
class Compiled:
    grid: tuple[int, ...]
    cubin: bytes
    shared_bytes: int
    num_warps: int


def fail(message: str) -> NoReturn:
    print(f"kvquant_sass_estimate: {message}", file=sys.stderr)
    sys.exit(2)


def nvidia_tools() -> Path:
    """triton/backends/nvidia/bin, holding nvdisasm and cuobjdump; exits 2 if triton or either tool is missing."""
    spec = importlib.util.find_spec("triton")
    if spec is None or spec.origin is None:
        fail("the triton package is not installed (pip install -e '.[test]' installs it)")
    tools = Path(spec.origin).parent / "backends" / "nvidia" / "bin"
    for name in ("nvdisasm", "cuobjdump"):
        if not (tools / name).is_file():
            fail(f"triton's bundled {name} is missing: expected {tools / name}")
    return tools


def capture_launch(shape: Shape) -> tuple[Any, tuple[int, ...], tuple[Any, ...], dict[str, Any]]:
    """(kernel, grid, args, kwargs) the launcher passes the decode kernel for `shape` on CPU tensors, split for 132
    SMs (`split_plan`'s rule); the kernels' module is checked to be this checkout's."""
    from kernels import kvquant_attention_triton as attention
    from kernels.kvquant_layout import KvQuantLayerParams, KvQuantLayout

    if Path(attention.__file__).resolve() != KERNEL_SOURCES[0]:
        fail(f"kernels imported from {attention.__file__}, not {REPO_ROOT}: run from the repository root with -m")
    num_outliers = math.ceil(OUTLIER_FRACTION * BLOCK_SIZE * HEAD_DIM - 1e-9)  # KvQuantCodec.outliers_per_head
    layout = KvQuantLayout(shape.bits, BLOCK_SIZE, shape.kv_heads, HEAD_DIM, num_outliers)
    codebook = torch.linspace(-1, 1, 1 << shape.bits)
    rope = torch.zeros(shape.context, HEAD_DIM // 2)
    calibration = (torch.zeros(shape.kv_heads, HEAD_DIM), torch.ones(shape.kv_heads, HEAD_DIM), codebook, codebook)
    params = KvQuantLayerParams.build(layout, OUTLIER_FRACTION, calibration, rope, rope)
    counts = torch.full((shape.batch,), shape.num_packed, dtype=torch.int32)
    tail = torch.zeros(shape.batch, shape.kv_heads, BLOCK_SIZE, HEAD_DIM, dtype=torch.float16)
    sink = torch.zeros(shape.batch, shape.kv_heads, HEAD_DIM, dtype=torch.float16)
    splits = max(1, -(-attention._PROGRAMS_PER_SM * NUM_SMS // (shape.batch * shape.kv_heads)))
    per_split = max(attention._MIN_UNITS_PER_SPLIT, -(-(shape.num_packed + 1) // splits))
    captured = []
    launcher_on_grid = attention.on_grid
    attention.on_grid = lambda kernel, grid: lambda *a, **kw: captured.append((kernel, grid, a, kw))
    try:
        attention.kvquant_decode_attention_triton(
            torch.zeros(shape.batch, shape.heads, HEAD_DIM, dtype=torch.float16),
            torch.zeros(4, layout.bytes_per_block, dtype=torch.uint8),
            torch.zeros(shape.batch, shape.num_packed, dtype=torch.int32), counts, tail, tail, counts, sink, sink,
            params, HEAD_DIM**-0.5, units_per_split=per_split,
        )
    finally:
        attention.on_grid = launcher_on_grid
    kernel, grid, args, kwargs = captured[0]  # the decode kernel; the merge kernel's launch follows
    return kernel, grid, args, {**kwargs, "PREFETCH": True, "DOT_F32": False}  # as on the GPU with fp16 q


def compile_sm90(shape: Shape) -> Compiled:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    kernel, grid, args, kwargs = capture_launch(shape)
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    with warnings.catch_warnings():  # fp fusion stays at its default (on), as in a real launch
        warnings.filterwarnings("ignore", message=".*TRITON_DEFAULT_FP_FUSION")
        binder = create_function_from_signature(kernel.signature, kernel.params, backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
        compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                                  options=options.__dict__)
    return Compiled(tuple(grid), compiled.asm["cubin"], compiled.metadata.shared, compiled.metadata.num_warps)


def run_tool(tool: Path, flags: list[str], cubin: bytes) -> str:
    with tempfile.TemporaryDirectory(prefix="kvquant-sass-") as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        return subprocess.run([str(tool), *flags, str(path)], capture_output=True, text=True, check=True).stdout


def source_map() -> dict[tuple[str, int], Frame]:
    """(file, line) -> the kernel-source function holding it and the line's text."""
    frames = {}
    for path in KERNEL_SOURCES:
        source = path.read_text()
        lines = source.splitlines()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef):
                for line in range(node.lineno, (node.end_lineno or node.lineno) + 1):
                    frames[(str(path), line)] = Frame(node.name, lines[line - 1].strip())
    return frames


def parse_sass(sass: str, frames: dict[tuple[str, int], Frame]) -> tuple[list[Instruction], dict[str, int]]:
    """Instructions with their inlining chains, and each label's address. `-gi` writes one comment line per frame
    (innermost first) before an instruction whose location changed; a frame's own location is its first File."""
    instructions: list[Instruction] = []
    labels: dict[str, int] = {}
    pending_labels: list[str] = []
    comments: list[str] = []
    chain: tuple[Frame, ...] = ()
    for line in sass.splitlines():
        if line.startswith("\t//## File"):
            comments.append(line)
        elif match := LABEL.match(line):
            pending_labels.append(match.group(1))
        elif match := INSTRUCTION.match(line):
            if comments:
                located = [FRAME.findall(comment)[0] for comment in comments]
                chain = tuple(frames.get((str(Path(f).resolve()), int(n)), Frame("?", "")) for f, n in located)
                comments = []
            address = int(match.group(1), 16)
            labels.update(dict.fromkeys(pending_labels, address))
            pending_labels = []
            instructions.append(Instruction(address, match.group(2), chain))
    return instructions, labels


def block_loop(instructions: list[Instruction], labels: dict[str, int]) -> tuple[tuple[int, int], int]:
    """(first, last address) of the per-block loop: the longest backward branch around `_packed_scores` code; and
    how many loops nest inside it."""
    loops = []
    for ins in instructions:
        match = BACK_BRANCH.search(ins.text)
        if match and labels.get(match.group(1), ins.address) < ins.address:
            loops.append((labels[match.group(1)], ins.address))
    scoring = [ins.address for ins in instructions if any(f.function == "_packed_scores" for f in ins.frames)]
    around = [(lo, hi) for lo, hi in loops if any(lo <= a <= hi for a in scoring)]
    if not around:
        fail("no loop around the key scoring (_packed_scores) in the SASS: has the kernel changed shape?")
    outer = max(around, key=lambda loop: loop[1] - loop[0])
    return outer, sum(1 for lo, hi in loops if outer[0] <= lo and hi <= outer[1] and (lo, hi) != outer)


def _text_in(frames: tuple[Frame, ...], function: str) -> str:
    return next(f.text for f in frames if f.function == function)


def _key_category(names: set[str]) -> str:
    if "load_words" in names:
        return "K code loads"
    if names & {"decode_groups", "_pair"}:
        return "K unpack + codebook"
    return "K range" if "key_range" in names else "K range apply"


def _value_category(names: set[str], text: str) -> str:
    if names & {"_dot", "_weighted"}:
        return "PV (dot/sum)"
    if "acc_tile * alpha" in text:
        return "tile rescale (rare)"
    if "load_words" in names:
        return "V code loads"
    if names & {"decode_groups", "_pair"}:
        return "V unpack + codebook"
    if "outlier" in text or "HAS_OUTLIERS" in text:
        return "V outliers"
    return "V centre/scale loads" if "v_center =" in text or "v_scale =" in text else "PV (dot/sum)"


def _score_category(names: set[str], text: str) -> str:
    if names & {"_dot", "_scores"}:
        return "QK (dot/sum)"
    if "c0" in text or "s0" in text or "qb1" in text:
        return "RoPE query"
    if "kr1" in text:
        return "RoPE keys"
    return "QK mask" if "scores" in text else "scores other"


def category(frames: tuple[Frame, ...]) -> str:
    names = {f.function for f in frames}
    if "prefetch_block" in names:
        return "prefetch"
    if "_value_outliers" in names:
        return "V outliers"
    if "dense_keys" in names:
        return _key_category(names)
    if "_softmax_step" in names:
        return "softmax"
    if "_packed_values" in names:
        return _value_category(names, _text_in(frames, "_packed_values"))
    if "_packed_scores" in names:
        return _score_category(names, _text_in(frames, "_packed_scores"))
    if "_dot" in names:
        return "dot (caller not in line info)"
    text = next((f.text for f in frames if f.function != "?"), "")
    if "acc" in text:
        return "acc rescale"
    return "block table / row ptr" if "block_id" in text or "row_ptr" in text else "other / loop control"


def count_loop(instructions: list[Instruction], loop: tuple[int, int]) -> dict[str, Counter[str]]:
    """Category -> opcode -> instructions per warp in one pass of the loop (nested loops counted once)."""
    by_category: dict[str, Counter[str]] = defaultdict(Counter)
    for ins in instructions:
        if loop[0] <= ins.address <= loop[1]:
            opcode = re.sub(r"^@!?U?P\w+\s+", "", ins.text).split()[0].split(".")[0]  # no predicate or modifiers
            by_category[category(ins.frames)][opcode] += 1
    return by_category


def register_count(tools: Path, cubin: bytes) -> int:
    usage = run_tool(tools / "cuobjdump", ["-res-usage"], cubin)
    match = re.search(r"REG:(\d+)", usage)
    if match is None:
        fail(f"no register count in the output of cuobjdump -res-usage: {usage!r}")
    return int(match.group(1))


def programs_per_sm(registers: int, compiled: Compiled) -> int:
    per_warp = math.ceil(registers / 8) * 8 * 32  # allocated in 8-register steps per thread
    return min(REGISTERS_PER_SM // (per_warp * compiled.num_warps), WARPS_PER_SM // compiled.num_warps,
               SHARED_PER_SM // max(compiled.shared_bytes, 1))


def estimate(shape: Shape) -> dict[str, Any]:
    tools = nvidia_tools()
    compiled = compile_sm90(shape)
    registers = register_count(tools, compiled.cubin)
    instructions, labels = parse_sass(run_tool(tools / "nvdisasm", ["-c", "-gi"], compiled.cubin), source_map())
    loop, nested = block_loop(instructions, labels)
    by_category = count_loop(instructions, loop)
    ranked = sorted(by_category.items(), key=lambda c: (c[0] in RARE, -sum(c[1].values())))  # rare ones last
    sass = {name: sum(ops.values()) for name, ops in ranked}
    total = sum(n for name, n in sass.items() if name not in RARE)
    iterations = shape.batch * shape.kv_heads * (shape.num_packed + 1)
    kvquant_us = iterations * total * compiled.num_warps / (NUM_SMS * ISSUE_PER_SM_CYCLE * CLOCK_HZ) * 1e6
    sdpa_bytes = 2 * shape.batch * HEAD_DIM * (shape.heads + 2 * shape.kv_heads * shape.context)
    sdpa_us = sdpa_bytes / (SDPA_HBM_FRACTION * HBM_BYTES_PER_S) * 1e6
    return {
        "shape": {**vars(shape), "head_dim": HEAD_DIM, "block_size": BLOCK_SIZE, "outlier_fraction": OUTLIER_FRACTION},
        "triton": importlib.import_module("triton").__version__, "grid": list(compiled.grid),
        "num_warps": compiled.num_warps, "registers_per_thread": registers,
        "programs_per_sm": programs_per_sm(registers, compiled), "shared_bytes": compiled.shared_bytes,
        "block_loop": [hex(loop[0]), hex(loop[1])], "nested_loops_counted_once": nested,
        "sass_per_iteration": sass, "sass_per_iteration_total": total, "not_in_total": sorted(RARE & set(sass)),
        "opcodes": {name: dict(ops.most_common()) for name, ops in by_category.items()},
        "kvquant_us": kvquant_us, "fp16_sdpa_us": sdpa_us, "fp16_sdpa_bytes": sdpa_bytes,
        "speedup_vs_fp16": sdpa_us / kvquant_us,
        "assumptions": {"num_sms": NUM_SMS, "clock_hz": CLOCK_HZ, "issue_per_sm_cycle": ISSUE_PER_SM_CYCLE,
                        "hbm_bytes_per_s": HBM_BYTES_PER_S, "sdpa_hbm_fraction": SDPA_HBM_FRACTION},
    }


def print_report(report: dict[str, Any]) -> None:
    shape, total = report["shape"], report["sass_per_iteration_total"]
    print(f"kvquant-{shape['bits']} decode attention, sm_90 SASS (triton {report['triton']}; static estimate, nothing"
          f" run): batch {shape['batch']}, context {shape['context']}, {shape['heads']} query heads,"
          f" {shape['kv_heads']} KV heads, head dim {HEAD_DIM}, block {BLOCK_SIZE}")
    grid = report["grid"]
    print(f"grid {tuple(grid)} = {math.prod(grid)} programs of {report['num_warps']} warps;"
          f" block loop {report['block_loop'][0]}-{report['block_loop'][1]}")
    print(f"{'registers / thread':<34} {report['registers_per_thread']:>7}")
    print(f"{'programs / SM':<34} {report['programs_per_sm']:>7}")
    print(f"{'shared memory / program (bytes)':<34} {report['shared_bytes']:>7}")
    print("SASS per warp per block-head iteration:")
    for name, n in report["sass_per_iteration"].items():
        ops = ", ".join(f"{op} {k}" for op, k in list(report["opcodes"][name].items())[:4])
        share = "not in total" if name in RARE else f"{n / total:.1%}"
        print(f"  {name:<32} {n:>7} {share:>12}  {ops}")
    print(f"  {'total':<32} {total:>7}")
    if report["nested_loops_counted_once"]:
        print(f"  ({report['nested_loops_counted_once']} loop(s) inside the block loop counted once a block)")
    print(f"{'kvquant estimate (us, issue-bound)':<34} {report['kvquant_us']:>7.0f}")
    print(f"{'fp16 SDPA estimate (us, 80% HBM)':<34} {report['fp16_sdpa_us']:>7.0f}"
          f"   ({report['fp16_sdpa_bytes'] / 1e6:.0f} MB)")
    print(f"{'kvquant vs fp16 SDPA':<34} {report['speedup_vs_fp16']:>6.2f}x   (fp16 time / kvquant time;"
          " an upper bound: every issue slot filled)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8, help="sequences decoded together")
    parser.add_argument("--bits", type=int, default=3, choices=[2, 3, 4], help="kvquant code width")
    parser.add_argument("--context", type=int, default=32768, help="tokens per sequence")
    parser.add_argument("--heads", type=int, default=32, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=32, help="KV heads (fewer than --heads: GQA)")
    parser.add_argument("--json", metavar="OUT", help="also write every figure to this file")
    args = parser.parse_args(argv)
    if args.context < 2 * BLOCK_SIZE:
        parser.error(f"--context must be at least {2 * BLOCK_SIZE} tokens")
    if min(args.batch, args.heads, args.kv_heads) < 1 or args.heads % args.kv_heads:
        parser.error("--batch, --heads and --kv-heads must be positive, --heads a multiple of --kv-heads")
    report = estimate(Shape(args.batch, args.bits, args.context, args.heads, args.kv_heads))
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
