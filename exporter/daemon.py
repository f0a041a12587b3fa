"""The sampling loop: sources → Snapshot → analysis → a published, immutable State.

Sampling runs on its own clock so the detectors get evenly spaced samples whatever the scrape
interval; scrapes only read the last published State (a reference swap, no lock needed).
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Mapping

from .analysis.budget import memory_budgets
from .model import Analysis, Snapshot, SourceError, SourceStatus
from .sources.host import enrich
from .sources.hostview import HostView
from .sources.nvml import NvmlSource

log = logging.getLogger("exporter.daemon")

# Bounds on the error counters' label sets: a flood of novel error kinds must not grow memory.
MAX_COUNTER_SERIES = 1000


@dataclass(frozen=True)
class State:
    """What a scrape renders. Replaced whole after every tick."""

    snapshot: Snapshot | None = None
    analysis: Analysis | None = None
    errors_total: Mapping[tuple[str, str], int] = field(default_factory=dict)  # (source, kind)
    vllm_errors_total: Mapping[tuple[str, str], int] = field(default_factory=dict)  # (endpoint, kind)
    oom_events_total: Mapping[tuple[str, str], int] = field(default_factory=dict)  # (kind, class)
    budgets: tuple = ()  # analysis.budget.Budget per (vLLM server, GPU)
    recorder: object = None  # recorder.RecorderStats when the flight recorder is on
    samples_total: int = 0
    last_sample_at: float | None = None  # clock time the last tick completed
    sample_duration_seconds: float = 0.0


class Sampler:
    """One tick of every source, assembled into a Snapshot."""

    def __init__(self, nvml: NvmlSource, host: HostView, now: Callable[[], float] = time.time,
                 read_cmdline: bool = False, vllm=None, logs=None,
                 assign_roles: Callable | None = None, profiles=None):
        self.nvml = nvml
        self.host = host
        self.now = now
        self.read_cmdline = read_cmdline
        self.vllm = vllm  # has .sample() -> tuple[VllmSample, ...]
        self.logs = logs  # has .sample() -> (tuple[OomEvent, ...], tuple[SourceError, ...])
        self.assign_roles = assign_roles  # (gpus, vllm_samples, host) -> gpus
        self.profiles = profiles  # has .attach(vllm_samples) -> vllm_samples with memory_profile
        self._roles: dict[tuple, tuple[str, str]] = {}  # process identity -> (role, endpoint)

    def _sticky_roles(self, gpus):
        """A process serves its server for life. When a server shuts down, its listener goes
        first and its workers free their GPU memory a moment later: keep their role meanwhile,
        so the exit is seen as a serving process's exit."""
        roles, out = {}, []
        for gpu in gpus:
            procs = []
            for p in gpu.processes:
                if p.role == "other" and p.start_time is not None and p.identity in self._roles:
                    role, endpoint = self._roles[p.identity]
                    p = dataclasses.replace(p, role=role, endpoint=endpoint)
                if p.role != "other" and p.start_time is not None:
                    roles[p.identity] = (p.role, p.endpoint)
                procs.append(p)
            out.append(dataclasses.replace(gpu, processes=tuple(procs)))
        self._roles = roles  # only processes alive now: bounded by the process table
        return tuple(out)

    def close(self) -> None:
        self.nvml.close()
        for source in (self.vllm, self.logs):
            if source is not None:
                source.close()

    def sample(self) -> Snapshot:
        timestamp = self.now()
        reading = self.nvml.sample()
        errors: list[SourceError] = list(reading.errors)
        sources = [reading.status]

        started = time.perf_counter()
        host_memory = self.host.memory()
        gpus = enrich(reading.gpus, self.host, self.read_cmdline)
        sources.append(SourceStatus("host", host_memory is not None, time.perf_counter() - started,
                                    "" if host_memory else "host memory unreadable"))
        if host_memory is None:
            errors.append(SourceError("host", "memory_unreadable"))
        pods = getattr(self.host, "pods", None)  # the kubelet's pod list, in Kubernetes
        if pods is not None:
            errors.extend(pods.take_errors())
            sources.append(SourceStatus("kubelet", pods.up))

        vllm = ()
        if self.vllm is not None:
            started = time.perf_counter()
            vllm = self.vllm.sample(candidates=[p.pid for g in gpus for p in g.processes])
            if self.profiles is not None:
                vllm = self.profiles.attach(vllm)
            if self.assign_roles is not None:
                gpus = self._sticky_roles(self.assign_roles(gpus, vllm, self.host))
            sources.append(SourceStatus("vllm", all(v.up for v in vllm), time.perf_counter() - started))

        events = ()
        if self.logs is not None:
            started = time.perf_counter()
            events, log_errors = self.logs.sample(now=timestamp)
            errors.extend(log_errors)
            sources.append(SourceStatus("logs", not log_errors, time.perf_counter() - started))

        return Snapshot(timestamp=timestamp, gpus=gpus, host=host_memory, vllm=tuple(vllm),
                        sources=tuple(sources), errors=tuple(errors),
                        driver_version=reading.driver_version, log_events=tuple(events))


def _bounded_add(counter: Counter, key, n: int = 1) -> None:
    if key in counter or len(counter) < MAX_COUNTER_SERIES:
        counter[key] += n
    else:
        counter[("overflow", "overflow")] += n


class Daemon:
    def __init__(self, sampler: Sampler, clock, interval_seconds: float, analyzer=None,
                 recorder=None):
        self.sampler = sampler
        self.clock = clock
        self.interval = interval_seconds
        self.analyzer = analyzer  # has .update(snapshot) -> Analysis and .detector_errors
        self.recorder = recorder  # recorder.FlightRecorder: writes traces in its own thread
        self.state = State()
        self._errors: Counter = Counter()
        self._vllm_errors: Counter = Counter()
        self._ooms: Counter = Counter()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pending: Sampler | None = None

    def replace_sampler(self, sampler: Sampler) -> None:
        """Use `sampler` from the next tick on (a configuration reload). The swap happens on the
        sampling thread between ticks, so no tick ever runs on sources being closed."""
        self._pending = sampler

    def _swap_sampler(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            old, self.sampler = self.sampler, pending
            old.close()

    def tick(self) -> State:
        self._swap_sampler()
        started = time.perf_counter()
        try:
            snapshot = self.sampler.sample()
        except Exception:  # a bug in a source must not stop sampling; it shows in the counters
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
            _bounded_add(self._errors, (e.source, e.kind))
        for v in snapshot.vllm:
            if not v.up:
                _bounded_add(self._vllm_errors, (v.endpoint, v.error_kind or "unknown"))
        for ev in snapshot.log_events:
            _bounded_add(self._ooms, (ev.kind, ev.klass))
        self.state = State(
            snapshot=snapshot, analysis=analysis, budgets=memory_budgets(snapshot),
            errors_total=MappingProxyType(dict(self._errors)),
            vllm_errors_total=MappingProxyType(dict(self._vllm_errors)),
            oom_events_total=MappingProxyType(dict(self._ooms)),
            samples_total=self.state.samples_total + 1,
            last_sample_at=self.clock.now(),
            sample_duration_seconds=time.perf_counter() - started,
            recorder=self.recorder.stats() if self.recorder is not None else None)
        if self.recorder is not None and self.analyzer is not None:
            self.recorder.observe(self.state, self.analyzer.history)  # never blocks on the disk
        return self.state

    def run(self) -> None:
        """Tick every interval (clock time) until stop(); a slow tick delays, never overlaps."""
        while not self._stop.is_set():
            began = self.clock.now()
            self.tick()
            if self.clock.wait(self.interval - (self.clock.now() - began), self._stop):
                break

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="sampler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._pending is not None:  # a reload that no tick picked up
            self._pending.close()
            self._pending = None
        if self.recorder is not None:
            self.recorder.close()  # finishes a pending write
