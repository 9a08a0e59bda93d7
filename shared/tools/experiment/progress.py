"""The progress bar of an experiment on the virtual clock: runs done of planned and the requests every running run
has replayed (each run's `--progress-file`), in wall time, with an ETA. Redrawn in place on a terminal, a plain line
a minute otherwise. It reads files; it starts nothing."""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

BAR_WIDTH = 24


class RunsProgress:
    """Tracks runs of `num_requests` requests each, from the figures each writes to its progress file.

    Args:
        progress_files: one per run, in run order (`python -m services.virtual --progress-file`).
        num_requests: the requests each run replays.
        say: prints a line of the caller's (on `stream`); `say` here prints it above the bar.
        every_s: how often the line is redrawn on a terminal (a plain line goes out every 60 s otherwise).
    """

    def __init__(self, progress_files: list[Path], num_requests: int, say: Callable[[str], None],
                 stream: TextIO | None = None, every_s: float = 1.0) -> None:
        self.progress_files, self.num_requests, self._say = progress_files, num_requests, say
        self.stream = stream or sys.stderr
        self.is_tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every_s = every_s if self.is_tty else 60.0
        self.started = time.monotonic()
        self._running: set[int] = set()
        self._num_done = 0
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.started = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="runs-progress", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        if self.is_tty:
            self.stream.write("\r\033[K")
            self.stream.flush()

    def run_started(self, index: int) -> None:
        with self._lock:
            self._running.add(index)

    def run_done(self, index: int) -> None:
        with self._lock:
            self._running.discard(index)
            self._num_done += 1

    def say(self, line: str) -> None:
        """A line above the bar (the bar is redrawn below it)."""
        with self._lock:
            if self.is_tty:
                self.stream.write("\r\033[K")
            self._say(line)

    def line(self) -> str:
        with self._lock:
            running, num_done = sorted(self._running), self._num_done
        replayed = [self._replayed(i) for i in running]
        total = len(self.progress_files) * self.num_requests
        done = num_done * self.num_requests + sum(replayed)
        wall = time.monotonic() - self.started
        eta = f"ETA {_minutes(wall * (total - done) / done)}" if done else "ETA ?"
        bar = "#" * int(BAR_WIDTH * done / total) if total else ""
        now = ", ".join(f"run {i + 1} {n * 100 // max(1, self.num_requests)}%" for i, n in zip(running, replayed,
                                                                                                strict=True))
        return (f"[{bar:<{BAR_WIDTH}}] {num_done}/{len(self.progress_files)} runs done"
                + (f" | running: {now}" if now else "") + f" | wall {_minutes(wall)}, {eta}")

    def _replayed(self, index: int) -> int:
        try:
            return int(json.loads(self.progress_files[index].read_text())["num_done"])
        except (OSError, ValueError, KeyError, TypeError):  # not written yet
            return 0

    def _loop(self) -> None:
        while not self._stopped.wait(self.every_s):
            line = self.line()
            with self._lock:
                self.stream.write(f"\r\033[K{line}" if self.is_tty else f"{line}\n")
                self.stream.flush()


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"
