"""The sampling loop: sources → Snapshot → analysis → a published, immutable State.

Sampling runs on its own clock so the detectors get evenly spaced samples whatever the scrape
interval; scrapes only read the last published State (a reference swap, no lock needed).
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING

from .clock import Clock
from .model import BUDGETS, Snapshot, State
from .sources.source import Source, collect, in_order, request_stop, ticks_until

if TYPE_CHECKING:
    from .analysis.engine import Analyzer
    from .reactions.alloc_history import HistoryRequester
    from .reactions.recorder import FlightRecorder

log = logging.getLogger("exporter.daemon")

# Bounds on the error counters' label sets: a flood of novel error kinds must not grow memory.
MAX_COUNTER_SERIES = 1000


class Sampler:
    """One tick: every source in turn, each filling its part of one Snapshot. The order comes
    from what each source declares it needs and gives (sources/source.py: in_order), so a
    source reads what the ones before it filled in. Raises ValueError on declarations that
    cannot be ordered."""

    def __init__(self, sources: Sequence[Source], now: Callable[[], float] = time.time):
        self.sources = in_order(sources)
        self.now = now

    def sample(self) -> Snapshot:
        snapshot = Snapshot(timestamp=self.now())
        for source in self.sources:
            snapshot = collect(source, snapshot)
        return snapshot

    def close(self) -> None:
        for source in self.sources:
            try:
                source.close()
            except Exception:  # closing one must not leave the others open
                log.exception("closing source %s failed", source.name)


def _bounded_add(counter: Counter[tuple[str, str]], key: tuple[str, str], n: int = 1) -> None:
    if key in counter or len(counter) < MAX_COUNTER_SERIES:
        counter[key] += n
    else:
        counter[("overflow", "overflow")] += n


class Daemon:
    def __init__(self, sampler: Sampler, clock: Clock, interval_seconds: float,
                 analyzer: Analyzer | None = None, recorder: FlightRecorder | None = None,
                 alloc_history: HistoryRequester | None = None):
        self.sampler = sampler
        self.clock = clock
        self.interval = interval_seconds
        self.analyzer = analyzer  # analysis.engine.Analyzer: update(snapshot) -> Analysis
        self.recorder = recorder  # reactions.recorder.FlightRecorder: writes on its own thread
        self.alloc_history = alloc_history  # reactions.alloc_history: asks probes to record
        self.state = State()
        self._errors: Counter[tuple[str, str]] = Counter()
        self._vllm_errors: Counter[tuple[str, str]] = Counter()
        self._ooms: Counter[tuple[str, str]] = Counter()
        self._dropped: Counter[str] = Counter()  # model.BUDGETS entry -> items kept out
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pending: Sampler | None = None
        self._swap_lock = threading.Lock()  # replace_sampler runs on the reloading thread

    def replace_sampler(self, sampler: Sampler) -> None:
        """Use `sampler` from the next tick on (a configuration reload). The swap happens on the
        sampling thread between ticks, so no tick ever runs on sources being closed."""
        with self._swap_lock:
            superseded, self._pending = self._pending, sampler
        if superseded is not None:  # two reloads within one interval: the first never ran
            superseded.close()

    def _swap_sampler(self) -> None:
        with self._swap_lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            old, self.sampler = self.sampler, pending
            old.close()

    def tick(self) -> State:
        self._swap_sampler()
        started = time.perf_counter()
        try:
            snapshot = self.sampler.sample()
        except Exception:  # sources cannot raise (see sources/source.py); a bug around them
            log.exception("sampling failed")
            _bounded_add(self._errors, ("sampler", "exception"))
            return self.state
        analysis = None
        if self.analyzer is not None:
            try:
                analysis = self.analyzer.update(snapshot)
            except Exception:
                log.exception("analysis failed")
                _bounded_add(self._errors, ("analysis", "exception"))
            for detector, n in self.analyzer.detector_errors.items():
                self._errors[("analysis", detector)] = n  # the analyzer keeps the running count
        for e in snapshot.errors:
            _bounded_add(self._errors, (e.source, e.kind), e.count)
        for budget, n in snapshot.dropped:
            if budget in BUDGETS:
                self._dropped[budget] += n
        history = getattr(self.analyzer, "history", None)  # test doubles may have none
        if history is not None:  # the history keeps its own running count
            self._dropped["history_log_events"] = history.dropped_log_events
        for v in snapshot.vllm:
            if not v.up:
                _bounded_add(self._vllm_errors, (v.endpoint, v.error_kind or "unknown"))
            if v.rejected_metrics:  # values vLLM cannot have sent (negative, NaN, usage > 1): dropped
                _bounded_add(self._vllm_errors, (v.endpoint, "out_of_range"))
        if analysis is not None:
            for event in analysis.oom_events:
                _bounded_add(self._ooms, (event.kind, event.klass))
        else:  # counted even when the analysis failed, of unknown class
            for message in snapshot.log_events:
                _bounded_add(self._ooms, (message.kind, "unknown"))
        self.state = State(
            snapshot=snapshot, analysis=analysis,
            errors_total=MappingProxyType(dict(self._errors)),
            vllm_errors_total=MappingProxyType(dict(self._vllm_errors)),
            oom_events_total=MappingProxyType(dict(self._ooms)),
            budget_dropped_total=MappingProxyType(dict(self._dropped)),
            samples_total=self.state.samples_total + 1,
            last_sample_at=self.clock.now(),
            sample_duration_seconds=time.perf_counter() - started,
            recorder=self.recorder.stats() if self.recorder is not None else None,
            alloc_history=self.alloc_history.stats() if self.alloc_history is not None else None)
        if self.recorder is not None and self.analyzer is not None:
            # Reacts to the transitions the analysis found; never blocks on the disk.
            self.recorder.observe(self.state, self.analyzer.history.recent)
        if self.alloc_history is not None:
            # Reacts to findings first raised for a probed process; never raises.
            self.alloc_history.observe(self.state)
        return self.state

    def run(self) -> None:
        """Tick every interval (clock time) until stop(); a slow tick delays, never overlaps."""
        with ticks_until(self._stop):
            while not self._stop.is_set():
                began = self.clock.now()
                self.tick()
                if self.clock.wait(self.interval - (self.clock.now() - began), self._stop):
                    break

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="sampler", daemon=True)
        self._thread.start()

    def request_stop(self) -> None:
        """Start no tick from now on, and let the one running announce no recovery."""
        request_stop(self._stop)

    def stop(self, timeout: float = 10.0) -> None:
        self.request_stop()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._pending is not None:  # a reload that no tick picked up
            self._pending.close()
            self._pending = None
        if self.recorder is not None:
            self.recorder.close()  # finishes a pending write
