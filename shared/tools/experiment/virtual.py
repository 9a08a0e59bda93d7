"""The experiment's runs on the virtual clock: each run is one `python -m services.virtual` process (the whole
cluster in one process, nothing sleeping), several at once on a machine with cores to spare; its JSON gives the
records, its log the scheduler's placements.

It only builds command lines and reads what the runs wrote; the cluster is `services.virtual`'s.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from loadgen.record import RequestRecord
from shared.tools.experiment.progress import RunsProgress
from shared.tools.experiment.system import REPO_ROOT, placement_counts

VIRTUAL_LOG = "virtual.log"


@dataclass(frozen=True)
class VirtualRun:
    """One run: the trace's first `num_requests` (None: all) at `time_scale`; `colocated` instances, or `prefill` +
    `decode` with `cache_stores` shards (prefill in pipeline groups of `cpp_group`); `env` for every instance;
    outputs in `log_dir`; every output at most `max_output_tokens` (None: the trace's)."""

    trace: Path
    num_requests: int | None
    time_scale: float
    profile: str
    prefill: int
    decode: int
    cache_stores: int
    colocated: int
    env: dict[str, str]
    log_dir: Path
    max_output_tokens: int | None = None
    cpp_group: int = 1

    @property
    def json_path(self) -> Path:
        return self.log_dir / "virtual.json"

    @property
    def progress_path(self) -> Path:
        return self.log_dir / "progress.json"

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "services.virtual", "--trace", str(self.trace), "--time-scale",
               f"{self.time_scale:g}", "--profile", self.profile, "--json", str(self.json_path), "--log-file",
               str(self.log_dir / VIRTUAL_LOG), "--quiet", "--progress-file", str(self.progress_path)]
        if self.num_requests:
            cmd += ["--num-requests", str(self.num_requests)]
        if self.max_output_tokens:
            cmd += ["--max-output-tokens", str(self.max_output_tokens)]
        if self.colocated:
            cmd += ["--colocated", str(self.colocated), "--cache-stores", str(self.cache_stores)]
        else:
            cmd += ["--prefill", str(self.prefill), "--decode", str(self.decode), "--cache-stores",
                    str(self.cache_stores), "--cpp-group", str(self.cpp_group)]
        for name, value in self.env.items():
            cmd += ["--env", f"{name}={value}"]
        return cmd


@dataclass
class VirtualOutcome:
    records: list[RequestRecord] = field(default_factory=list)
    placements: dict[str, int] = field(default_factory=dict)
    error: str | None = None
    wall_s: float = 0.0
    virtual_s: float = 0.0
    load_over_time: dict[str, list[float]] = field(default_factory=dict)


def run_virtual_runs(runs: list[VirtualRun], parallel: int, on_done: Callable[[int, VirtualOutcome], None],
                     progress: RunsProgress | None = None) -> list[VirtualOutcome]:
    """Every run, `parallel` at a time (each is one process on one core); `on_done(index, outcome)` hears each, and
    `progress` which run starts and ends."""

    def one(index: int) -> VirtualOutcome:
        run, outcome = runs[index], VirtualOutcome()
        run.log_dir.mkdir(parents=True, exist_ok=True)
        if progress is not None:
            progress.run_started(index)
        started = time.monotonic()
        with open(run.log_dir / "virtual-stderr.log", "wb") as stderr:
            code = subprocess.run(run.command(), cwd=REPO_ROOT, stdin=subprocess.DEVNULL, stdout=stderr,
                                  stderr=stderr).returncode
        outcome.wall_s = time.monotonic() - started
        if code == 0 and run.json_path.is_file():
            result = json.loads(run.json_path.read_text())
            outcome.records = [RequestRecord(**r) for r in result["records"]]
            outcome.virtual_s = float(result["virtual_s"])
            outcome.load_over_time = result.get("load_over_time", {})
        else:
            outcome.error = f"python -m services.virtual exited {code}: see {run.log_dir / 'virtual-stderr.log'}"
        outcome.placements = placement_counts(run.log_dir, pattern=VIRTUAL_LOG)
        if progress is not None:
            progress.run_done(index)
        on_done(index, outcome)
        return outcome

    with ThreadPoolExecutor(max(1, parallel)) as pool:
        return list(pool.map(one, range(len(runs))))
