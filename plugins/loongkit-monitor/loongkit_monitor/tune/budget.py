"""The time budget, the next trial's predicted cost, and the progress bar (stderr).

A trial is only started when the elapsed time plus its predicted cost fits the budget (minus a
small reserve for the report). The prediction is the slowest of the recent trials plus a margin:
a trial's cost varies with the setting and with the machine's load, and overrunning the budget is
worse than running one trial fewer.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import TextIO

RESERVE_S = 10.0  # the report: table, JSON, PNG (matplotlib's import took 4 s on the loaded 2-core machine)
MARGIN = 1.15  # predicted cost = slowest recent trial x MARGIN
RECENT = 6  # how many of the last trials the prediction looks at


class Budget:
    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.seconds = float(seconds)
        self.clock = clock
        self.start = clock()
        self.walls: list[float] = []  # every trial's wall time, in order

    def elapsed(self) -> float:
        return self.clock() - self.start

    def remaining(self) -> float:
        """Seconds left for trials (the report's reserve kept back)."""
        return max(0.0, self.seconds - RESERVE_S - self.elapsed())

    def record(self, wall_s: float) -> None:
        self.walls.append(wall_s)

    def predict(self) -> float:
        """The next trial's cost; 0 before any trial has run (nothing to predict from)."""
        recent: Sequence[float] = self.walls[-RECENT:]
        return max(recent) * MARGIN if recent else 0.0

    def allows(self, cost: float | None = None, keep_trials: int = 0) -> bool:
        """Room for a trial of ``cost`` (default: the prediction) with ``keep_trials`` more kept back."""
        cost = self.predict() if cost is None else cost
        return self.remaining() > 0 and cost + keep_trials * self.predict() <= self.remaining()

    def eta(self, trials_left: int) -> float:
        """Seconds until the planned trials are done, never past the budget."""
        per = self.predict() / MARGIN if self.walls else 0.0
        return min(trials_left * per, self.remaining())


def clock_text(seconds: float) -> str:
    seconds = max(0, round(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"


class Progress:
    """``tune [#####.....] 7/19 trials  2:31 elapsed  ETA 4:02  ALL=2 #2``, redrawn in place on a
    terminal; one line per update otherwise (CI logs)."""

    def __init__(self, budget: Budget, stream: TextIO | None = None, width: int = 24,
                 tty: bool | None = None) -> None:
        self.budget = budget
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.tty = self.stream.isatty() if tty is None else tty
        self._drawn = 0

    def bar(self, done: int, planned: int, label: str) -> str:
        planned = max(planned, done, 1)
        filled = round(self.width * done / planned)
        eta = self.budget.eta(planned - done)
        return (f"tune [{'#' * filled}{'.' * (self.width - filled)}] {done}/{planned} trials  "
                f"{clock_text(self.budget.elapsed())} elapsed  ETA {clock_text(eta)}"
                f"  budget {clock_text(self.budget.seconds)}" + (f"  {label}" if label else ""))

    def update(self, done: int, planned: int, label: str = "") -> None:
        text = self.bar(done, planned, label)
        if self.tty:
            pad = max(0, self._drawn - len(text))
            self.stream.write("\r" + text + " " * pad)
            self._drawn = len(text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def line(self, text: str) -> None:
        """A permanent line (a trial's result) above the bar."""
        if self.tty and self._drawn:
            self.stream.write("\r" + " " * self._drawn + "\r")
            self._drawn = 0
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty and self._drawn:
            self.stream.write("\n")
            self._drawn = 0
        self.stream.flush()
