"""Runs child processes from `ProcessSpec`s: one log file each, restart with exponential backoff, bounded stop.

It knows nothing of tsukimi's services (that is `shared.tools.topology`) and never reads their output; it polls, so the
caller owns the loop (`poll()` every ~0.1 s) and the signals. Single-threaded: call it from the main thread only.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_START_MARKER = "--- supervisor: "  # opens each run of a child in its log file


@dataclass(frozen=True)
class ProcessSpec:
    """One child: `name` is unique (also its log file's stem); `env` overlays the supervisor's base environment."""

    name: str
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Backoff:
    """Restart delays: `initial_s`, doubling per consecutive failure up to `max_s`; a child that stayed up for
    `reset_after_s` counts as healthy again, so its next failure waits `initial_s`."""

    initial_s: float = 0.5
    max_s: float = 10.0
    reset_after_s: float = 30.0

    def after_exit(self, failures: int, uptime_s: float) -> tuple[int, float]:
        """The consecutive-failure count including this exit, and how long to wait before the restart.

        Args:
            failures: consecutive failures before this exit.
            uptime_s: how long the child ran this time.
        """
        failures = 1 if uptime_s >= self.reset_after_s else failures + 1
        return failures, min(self.initial_s * 2 ** (failures - 1), self.max_s)


@dataclass
class _Child:
    spec: ProcessSpec
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    failures: int = 0
    restarts: int = 0
    restart_at: float = 0.0


def _die_with_parent(parent_pid: int) -> Callable[[], None] | None:
    """A `preexec_fn` that makes the kernel SIGKILL the child when the supervisor dies, even by SIGKILL (Linux only).

    SIGKILL rather than SIGTERM: a supervisor that was killed cannot escalate later, so the first signal must be sure.
    Linux sends it when the *thread* that forked exits: another reason to spawn from the main thread only.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # loaded before fork: nothing to look up in the child
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


def log_tail(path: Path, num_lines: int = 3, max_bytes: int = 4096) -> list[str]:
    """The last lines of a log file (empty when there is none), for messages about a child that died."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - max_bytes))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return []
    return [line for line in text.splitlines() if line.strip()][-num_lines:]


def _last_run_tail(path: Path, num_lines: int = 3) -> list[str]:
    """The last lines the latest run of a child wrote (none from an earlier run)."""
    lines = log_tail(path, num_lines=50)
    starts = [i for i, line in enumerate(lines) if line.startswith(_START_MARKER)]
    return lines[starts[-1] + 1 if starts else 0 :][-num_lines:]


def _exit_reason(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with code {returncode}"


class Supervisor:
    """Starts every spec, restarts a child that exits (with `Backoff`), and stops them all within a bound.

    Args:
        specs: the children, started in this order.
        log_dir: each child's stdout and stderr are appended to `<log_dir>/<name>.log`.
        say: receives one line per event worth a person's attention (a child died); default: stderr.
        backoff: the restart delays.
        base_env: the environment each spec's `env` overlays (default: this process's).
    """

    def __init__(
        self, specs: Sequence[ProcessSpec], log_dir: Path, say: Callable[[str], None] | None = None,
        backoff: Backoff | None = None, base_env: Mapping[str, str] | None = None,
    ) -> None:
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"process names must be unique, got {names}")
        self.log_dir = log_dir
        self.backoff = backoff or Backoff()
        self._say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        self._base_env = dict(os.environ if base_env is None else base_env)
        self._children = [_Child(s, log_dir / f"{s.name}.log") for s in specs]
        self._running = False  # between start() and stop(): only then does poll() restart children

    def start(self) -> None:
        """Start every child. Raises OSError when one cannot be executed at all (a missing binary)."""
        if self._running:
            raise RuntimeError("already started")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._running = True
        for child in self._children:
            self._spawn(child)

    def _spawn(self, child: _Child) -> None:
        env = {**self._base_env, **child.spec.env}
        with open(child.log_path, "ab") as log:
            when = time.strftime("%Y-%m-%d %H:%M:%S")
            _write_marker(log, f"{_START_MARKER}{when} starting {' '.join(child.spec.argv)}\n")
            # Own session: a terminal's Ctrl-C reaches the supervisor only, which then stops children in order.
            child.process = subprocess.Popen(
                child.spec.argv, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=_die_with_parent(os.getpid()),
            )
        child.started_at = time.monotonic()

    def poll(self) -> None:
        """Notice children that exited (schedule their restart) and restart those whose delay has passed."""
        if not self._running:
            return
        now = time.monotonic()
        for child in self._children:
            if child.process is not None and child.process.poll() is not None:
                self._on_exit(child, child.process.returncode, now)
            elif child.process is None and now >= child.restart_at:
                child.restarts += 1
                self._spawn(child)

    def _on_exit(self, child: _Child, returncode: int, now: float) -> None:
        uptime_s = now - child.started_at
        child.failures, delay_s = self.backoff.after_exit(child.failures, uptime_s)
        child.restart_at = now + delay_s
        child.process = None
        tail = "".join(f"\n    | {line}" for line in _last_run_tail(child.log_path))
        self._say(
            f"{child.spec.name} {_exit_reason(returncode)} after {uptime_s:.1f} s; restarting in {delay_s:g} s "
            f"(log: {child.log_path}){tail}"
        )

    def pids(self) -> dict[str, int]:
        """The pid of every child now running, by name."""
        return {c.spec.name: c.process.pid for c in self._children if c.process and c.process.poll() is None}

    def restarts(self) -> dict[str, int]:
        """How many times each child has been restarted."""
        return {c.spec.name: c.restarts for c in self._children}

    def stop(self, grace_s: float = 8.0) -> None:
        """SIGTERM every child's process group, wait up to `grace_s` for all of them, then SIGKILL the rest.

        Returns once every child has been reaped; no restart happens after this is called.
        """
        self._running = False
        running = [c.process for c in self._children if c.process is not None]
        for process in running:
            _signal_group(process, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while not all(_has_exited(p) for p in running) and time.monotonic() < deadline:
            time.sleep(0.02)
        for process in running:
            # Every leader is still unreaped here, so its pid (the group id) cannot have been reused: the SIGKILL
            # reaches only our processes, including grandchildren left behind by a leader that did exit.
            _signal_group(process, signal.SIGKILL)
        for process in running:
            process.wait()
        for child in self._children:
            child.process = None


def _has_exited(process: subprocess.Popen[bytes]) -> bool:
    """Whether the child has exited, without reaping it (so its pid stays ours until `wait`)."""
    if process.returncode is not None:
        return True
    if not hasattr(os, "waitid"):
        return process.poll() is not None
    try:
        info = os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True
    return info is not None


def _write_marker(log: IO[bytes], line: str) -> None:
    log.write(line.encode())
    log.flush()


def _signal_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    """Signal the child's process group (its pid: it leads its own session) unless the child was already reaped."""
    if process.returncode is not None:
        return
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass
