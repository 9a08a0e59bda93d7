"""The prepared GPU check (benchmarks/gpu_check.py) runs end to end on this CPU at a tiny shape: the machine's rates,
the engine against its roofline and the real services over a dummy model, each part written to the JSON; the parts
that need CUDA say so instead of failing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_check_runs_at_a_tiny_shape_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--device", "cpu", "--quick", "--model",
                           "dummy:tiny", "--batch-sizes", "1,4", "--prompt-len", "64", "--gen-len", "8", "--out",
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["machine"]["copy_bytes_per_s"] > 0 and result["machine"]["bf16_flop_per_s"] > 0
    assert [row["batch"] for row in result["engine"]] == [1, 4]
    assert all(row["decode_tok_s"] > 0 and row["step_over_roofline"] > 0 for row in result["engine"])
    assert result["paged_attention"] == result["kvquant"] == {"skipped": "needs CUDA"}
    summary = result["system"]["summary"]
    assert summary["num_completed"] == result["system"]["requests"] == 8 and summary["num_failed"] == 0
