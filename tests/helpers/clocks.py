"""Clocks for tests whose fake servers take time: the server moves the clock instead of sleeping,
so a deadline is reached after the same amount of work however fast or loaded the machine is."""
from __future__ import annotations

import threading


class ServerClock:
    """A monotonic clock (call it, or `now()`) that stands still until moved: `advance` moves it
    at once (like FixedClock); `pass_time` is what a slow fake server calls in place of sleeping:
    it moves the clock, then waits (bounded) until the client has read the clock again, so the
    client sees every step and a starved client cannot miss its deadline by more than one step."""

    def __init__(self, start: float = 0.0):
        self.t = start
        self.reads = 0
        self._changed = threading.Condition()

    def __call__(self) -> float:
        with self._changed:
            self.reads += 1
            self._changed.notify_all()
            return self.t

    now = __call__

    def advance(self, seconds: float) -> None:
        with self._changed:
            self.t += seconds

    def pass_time(self, seconds: float, bound: float = 10.0) -> None:
        with self._changed:
            seen = self.reads
            self.t += seconds
            # Bounded: a client that hung up never reads again.
            self._changed.wait_for(lambda: self.reads > seen, timeout=bound)
