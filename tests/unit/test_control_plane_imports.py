"""The control plane loads no torch: a fresh interpreter per role imports the role's entry module (what `python -m
services.<role>` runs before it reads a setting) and reports what came with it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
CONTROL_PLANE = ("services.gateway.__main__", "services.scheduler.__main__", "services.cache_store.__main__")
PROBE = """
import importlib, json, sys
importlib.import_module(sys.argv[1])
print(json.dumps(sorted(name for name in sys.modules if name.split(".")[0] in ("torch", "triton", "transformers"))))
"""


@pytest.mark.parametrize("module", CONTROL_PLANE)
def test_a_control_plane_role_loads_no_torch(module: str) -> None:
    done = subprocess.run([sys.executable, "-c", PROBE, module], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [], f"{module} loads {json.loads(done.stdout)[:5]}"


def test_the_probe_sees_torch_where_it_is_loaded() -> None:
    done = subprocess.run([sys.executable, "-c", PROBE, "services.decode.__main__"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "torch" in json.loads(done.stdout)
