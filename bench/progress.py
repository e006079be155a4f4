"""Progress of a long bench run: one line a step on stderr, with the time spent and an estimate of what is left.

stdout carries only the results (a table, CSV, JSON), so `> out.csv` captures them whole while
these lines still reach the terminal; `--quiet` turns them off.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


def clock(seconds: float) -> str:
    """`m:ss`, or `h:mm:ss` past an hour."""
    whole = int(seconds + 0.5)
    hours, rest = divmod(whole, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class Progress:
    """`total` units of work (rounds, runs, operations); `step` says what finished and how much."""

    def __init__(self, total: float, *, quiet: bool = False, stream: TextIO | None = None) -> None:
        self.total = total
        self.done = 0.0
        self.quiet = quiet
        self.stream = stream if stream is not None else sys.stderr
        self.start = time.monotonic()

    def step(self, text: str, units: float = 1.0) -> None:
        """`units` more are done: print `text`, the share done, the time spent and the time left at this pace."""
        self.done += units
        if self.quiet:
            return
        elapsed = time.monotonic() - self.start
        share = min(1.0, self.done / self.total) if self.total else 1.0
        left = elapsed * (1 - share) / share if share else 0.0
        when = f"{clock(elapsed)} elapsed" + (f", ~{clock(left)} left" if 0 < share < 1 else "")
        print(f"[{share:4.0%}] {text}  ({when})", file=self.stream, flush=True)

    def say(self, text: str) -> None:
        """A line that is not a step (starting servers, a phase beginning)."""
        if not self.quiet:
            print(text, file=self.stream, flush=True)
