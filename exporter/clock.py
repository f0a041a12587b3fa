"""Time sources. The daemon and the simulator share one clock so a scenario can run faster
than real time: every interval, age and timestamp is in *clock* seconds."""
from __future__ import annotations

import threading
import time
from typing import Protocol


class Clock(Protocol):
    speed: float

    def now(self) -> float:
        """Clock time, Unix seconds."""

    def wait(self, seconds: float, stop: threading.Event) -> bool:
        """Sleep `seconds` of clock time; return True when `stop` was set meanwhile."""


class SystemClock:
    speed = 1.0

    def now(self) -> float:
        return time.time()

    def wait(self, seconds: float, stop: threading.Event) -> bool:
        """Sleep `seconds` of clock time; return True when `stop` was set meanwhile."""
        return stop.wait(max(0.0, seconds))


class VirtualClock:
    """Clock time runs `speed` times faster than real time, starting at `start` (Unix s)."""

    def __init__(self, start: float | None = None, speed: float = 1.0):
        if speed <= 0:
            raise ValueError("speed must be positive")
        self.start = time.time() if start is None else start
        self.speed = speed
        self._t0 = time.monotonic()

    def now(self) -> float:
        return self.start + (time.monotonic() - self._t0) * self.speed

    def elapsed(self) -> float:
        """Clock seconds since `start`: the scenario's time."""
        return self.now() - self.start

    def wait(self, seconds: float, stop: threading.Event) -> bool:
        return stop.wait(max(0.0, seconds) / self.speed)


class FixedClock:
    """A clock that stands still at one moment (for `snapshot --at` and tests)."""

    speed = 1.0

    def __init__(self, start: float, at: float = 0.0):
        self.start = start
        self.at = at

    def now(self) -> float:
        return self.start + self.at

    def elapsed(self) -> float:
        return self.at

    def advance(self, seconds: float) -> None:
        self.at += seconds

    def wait(self, seconds: float, stop: threading.Event) -> bool:
        self.advance(seconds)
        return stop.is_set()
