"""The live progress line on stderr: sent/done/rejected/failed, elapsed time and ETA. Redrawn in place on a
terminal, a plain line every few seconds otherwise. Knows nothing about HTTP.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import TextIO

from loadgen.record import RequestRecord

_BAR_WIDTH = 24


class Progress:
    """Counts requests as they go and draws them.

    Args:
        num_planned: requests that will be sent at most (None: unknown).
        duration_s: the run stops sending after this long (None: no limit).
        last_arrival_s: when the last planned request is due (open loop), for the ETA.
        stream: where to draw (stderr by default).
        is_enabled: False draws nothing (`--quiet`).
    """

    def __init__(
        self,
        num_planned: int | None,
        duration_s: float | None = None,
        last_arrival_s: float = 0.0,
        stream: TextIO | None = None,
        is_enabled: bool = True,
    ) -> None:
        self.num_planned = num_planned
        self.duration_s = duration_s
        self.last_arrival_s = last_arrival_s
        self.stream = stream if stream is not None else sys.stderr
        self.is_enabled = is_enabled
        self.is_tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.num_sent = self.num_completed = self.num_rejected = self.num_failed = 0
        self._t0 = time.perf_counter()

    @property
    def num_finished(self) -> int:
        return self.num_completed + self.num_rejected + self.num_failed

    def on_sent(self) -> None:
        self.num_sent += 1

    def on_finished(self, record: RequestRecord) -> None:
        if record.is_completed:
            self.num_completed += 1
        elif record.is_rejected:
            self.num_rejected += 1
        else:
            self.num_failed += 1

    def eta_s(self, elapsed_s: float) -> float | None:
        """Seconds left: the duration limit if any, else the larger of the rate so far and the last arrival."""
        if self.duration_s is not None:
            return max(0.0, self.duration_s - elapsed_s)
        if not self.num_planned or not self.num_finished:
            return None
        by_rate = elapsed_s / self.num_finished * (self.num_planned - self.num_finished)
        return max(by_rate, self.last_arrival_s - elapsed_s, 0.0)

    def line(self, elapsed_s: float) -> str:
        counts = (
            f"sent {self.num_sent} | done {self.num_completed} rejected {self.num_rejected} "
            f"failed {self.num_failed} | {_clock(elapsed_s)}"
        )
        eta = self.eta_s(elapsed_s)
        if eta is not None:
            counts += f" ETA {_clock(eta)}"
        if not self.num_planned:
            return counts
        filled = min(_BAR_WIDTH, _BAR_WIDTH * self.num_finished // self.num_planned)
        bar = "#" * filled + "." * (_BAR_WIDTH - filled)
        return f"[{bar}] {self.num_finished}/{self.num_planned} {counts}"

    def draw(self) -> None:
        if not self.is_enabled:
            return
        text = self.line(time.perf_counter() - self._t0)
        if self.is_tty:
            self.stream.write("\r\x1b[2K" + text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    async def run(self) -> None:
        """Redraw until cancelled: 10 times a second on a terminal, every 10 s otherwise."""
        self._t0 = time.perf_counter()
        interval_s = 0.1 if self.is_tty else 10.0
        while True:
            await asyncio.sleep(interval_s)
            self.draw()

    def close(self) -> None:
        """The final line (and the newline a terminal needs)."""
        self.draw()
        if self.is_enabled and self.is_tty:
            self.stream.write("\n")
            self.stream.flush()


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"
