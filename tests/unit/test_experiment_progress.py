"""The experiment's progress bar on the virtual clock: runs done, what each running run has replayed (from the
progress file `python -m services.virtual --progress-file` keeps), an ETA; and lines said above the bar."""

from __future__ import annotations

import io
import json
from pathlib import Path

from loadgen.record import RequestRecord
from services.virtual.progress import VirtualProgress
from shared.tools.experiment.progress import RunsProgress


def test_a_virtual_run_keeps_its_figures_in_its_progress_file(tmp_path: Path) -> None:
    path = tmp_path / "progress.json"
    progress = VirtualProgress(3, 60.0, enabled=False, progress_file=path)
    progress.done(RequestRecord(0, 0.0, 10, 1))
    assert json.loads(path.read_text())["num_done"] == 1  # the first one is written at once
    progress.done(RequestRecord(1, 0.0, 10, 1))
    progress.close()  # the last figures, whatever the interval
    figures = json.loads(path.read_text())
    assert figures["num_done"] == 2 and figures["num_planned"] == 3 and figures["span_s"] == 60.0
    assert not list(tmp_path.glob("*.part"))


def test_the_bar_counts_finished_runs_and_the_running_runs_requests(tmp_path: Path) -> None:
    files = [tmp_path / f"run-{i}.json" for i in range(4)]
    said: list[str] = []
    bar = RunsProgress(files, 100, said.append, stream=io.StringIO())
    assert "0/4 runs done" in bar.line() and "ETA ?" in bar.line()
    bar.run_started(0)
    bar.run_started(1)
    files[0].write_text(json.dumps({"num_done": 50}))  # run 2 has written nothing yet
    assert "running: run 1 50%, run 2 0%" in bar.line()
    bar.run_done(0)
    bar.run_started(2)
    files[2].write_text(json.dumps({"num_done": 100}))
    line = bar.line()
    assert line.startswith("[" + "#" * 12 + " " * 12 + "]") and "1/4 runs done" in line and "ETA" in line
    bar.say("run 1 done")
    assert said == ["run 1 done"]
