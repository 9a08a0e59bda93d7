"""`python -m services.virtual`'s command line refuses what it cannot run with exit code 2 and a message, before
building anything."""

from __future__ import annotations

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
])
def test_bad_arguments_exit_2_with_a_message(args: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--trace", str(BUNDLED_TRACE), *args])
    assert exited.value.code == 2 and says in capsys.readouterr().err


def test_a_missing_trace_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--trace", str(tmp_path / "none.jsonl")]) == 2
    assert "none.jsonl" in capsys.readouterr().err
