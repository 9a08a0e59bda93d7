"""`python -m services.virtual`'s command line refuses what it cannot run with exit code 2 and a message, before
building anything."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loadgen.trace import BUNDLED_TRACE
from services.virtual.cli import main


@pytest.mark.parametrize(("args", "says"), [
    (["--cache-stores", "0"], "--cache-stores at least 1"),
    (["--colocated", "-1"], "--colocated must be at least 0"),
    (["--prefill", "0"], "--prefill and --decode must be at least 1"),
    (["--num-requests", "0"], "--num-requests must be at least 1"),
    (["--time-scale", "0"], "--time-scale and --bandwidth-gbps must be positive"),
    (["--env", "POLICY=random"], "--env takes TSUKIMI_NAME=VALUE"),
    (["--prefill", "3", "--cpp-group", "2"], "--cpp-group must divide --prefill into groups, got 2 for 3"),
    (["--colocated", "2", "--cpp-group", "2"], "a colocated cluster has no prefill pool"),
])
def test_bad_arguments_exit_2_with_a_message(args: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--trace", str(BUNDLED_TRACE), *args])
    assert exited.value.code == 2 and says in capsys.readouterr().err


def test_a_missing_trace_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--trace", str(tmp_path / "none.jsonl")]) == 2
    assert "none.jsonl" in capsys.readouterr().err



def test_a_setting_a_role_refuses_exits_2_and_stops_what_started() -> None:
    done = subprocess.run([sys.executable, "-m", "services.virtual", "--trace", str(BUNDLED_TRACE), "--num-requests",
                           "2", "--colocated", "2", "--quiet", "--env", "TSUKIMI_POLICY=conductor"],
                          cwd=Path(__file__).parents[2], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "TSUKIMI_POLICY=conductor needs a prefill pool" in done.stderr
    assert "Task was destroyed" not in done.stderr  # the instances it started were stopped


def test_a_run_keeps_its_progress_in_the_file_it_is_given(tmp_path: Path) -> None:
    progress = tmp_path / "progress.json"
    done = subprocess.run([sys.executable, "-m", "services.virtual", "--trace", str(BUNDLED_TRACE), "--num-requests",
                           "3", "--quiet", "--progress-file", str(progress)],
                          cwd=Path(__file__).parents[2], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(progress.read_text())
    assert figures["num_done"] == figures["num_planned"] == 3 and figures["simulated_s"] > 0
