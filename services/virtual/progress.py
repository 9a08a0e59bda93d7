"""The progress line of a virtual run, in wall time (the virtual clock would say the run is instant): requests done
of planned, the simulated seconds reached of the trace's span, simulated seconds per wall second, and the ETA.
Redrawn in place on a terminal, a plain line every 10 s otherwise; and, for whoever runs many runs (the experiment's
progress bar), the same figures as a small JSON file rewritten every second."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TextIO

from loadgen.record import RequestRecord
from services.virtual.clock import wall_clock
from services.virtual.replay import Replay

PROGRESS_FILE_EVERY_S = 1.0


class VirtualProgress:
    """Hears each finished request (`done`) and draws the line when enabled; writes `progress_file` when given."""

    def __init__(self, num_planned: int, span_s: float, enabled: bool = True, stream: TextIO | None = None,
                 progress_file: Path | None = None) -> None:
        self.num_planned, self.span_s, self.enabled = num_planned, span_s, enabled
        self.progress_file = progress_file
        self.stream = stream or sys.stderr
        self.is_tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.started = wall_clock()
        self.num_done = self.num_rejected = self.num_failed = 0
        self.simulated_s = 0.0  # how far the replay had got at the last finished request
        self._replay: Replay | None = None
        self._drawn_at = self._written_at = -1e9

    def start(self, replay: Replay) -> None:
        self._replay = replay
        self.started = wall_clock()

    def wall_s(self) -> float:
        return wall_clock() - self.started

    def done(self, record: RequestRecord) -> None:
        self.num_done += 1
        self.num_rejected += record.is_rejected
        self.num_failed += record.is_failed
        if self._replay is not None:
            self.simulated_s = self._replay.elapsed_s()
        now = wall_clock()
        every_s = 0.5 if self.is_tty else 10.0
        if self.enabled and (now - self._drawn_at >= every_s or self.num_done == self.num_planned):
            self._drawn_at = now
            self._draw()
        if self.progress_file is not None and now - self._written_at >= PROGRESS_FILE_EVERY_S:
            self._written_at = now
            self.write_file()

    def write_file(self) -> None:
        """The figures as JSON (`num_done`, `num_planned`, `simulated_s`, `span_s`, `wall_s`), replaced whole so
        that a reader never sees half of it."""
        assert self.progress_file is not None
        figures = {"num_done": self.num_done, "num_planned": self.num_planned,
                   "simulated_s": round(self.simulated_s, 3), "span_s": round(self.span_s, 3),
                   "wall_s": round(self.wall_s(), 3)}
        partial = self.progress_file.with_name(self.progress_file.name + ".part")
        partial.write_text(json.dumps(figures))
        os.replace(partial, self.progress_file)

    def line(self) -> str:
        wall = max(self.wall_s(), 1e-9)
        simulated = self.simulated_s
        rate = simulated / wall
        eta = (self.span_s - simulated) / rate if rate > 0 and simulated < self.span_s else 0.0
        share = self.num_done / self.num_planned if self.num_planned else 1.0
        bar = "#" * int(24 * share)
        return (f"[{bar:<24}] {self.num_done}/{self.num_planned} done ({self.num_rejected} rejected, "
                f"{self.num_failed} failed) | simulated {simulated:.0f}/{self.span_s:.0f} s, {rate:.1f} s per wall s"
                f" | wall {wall:.0f} s, ETA {eta:.0f} s")

    def _draw(self) -> None:
        end = "\r" if self.is_tty else "\n"
        self.stream.write(self.line() + end)
        self.stream.flush()

    def close(self) -> None:
        if self.progress_file is not None and self.num_done:
            self.write_file()
        if self.enabled and self.is_tty and self.num_done:
            self.stream.write("\n")
            self.stream.flush()
