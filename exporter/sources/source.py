"""The one interface every source implements, and the one wrapper that runs it.

A tick starts from an empty Snapshot (its timestamp) and hands it to each source in turn; each
returns a Reading: the snapshot with its own part filled in, whether it worked, and the faults
it saw. `collect` times the call and records the source's up/error state in the snapshot, as
node_exporter does for its collectors: no source builds its own status, and a source that
raises is reported down (its error counted) instead of ending the tick.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Protocol

from ..model import Snapshot, SourceError, SourceStatus

log = logging.getLogger("exporter.sources")


@dataclass(frozen=True)
class Reading:
    """What one source made of a tick."""

    snapshot: Snapshot  # the snapshot it was given, with its part filled in
    up: bool = True
    errors: tuple[SourceError, ...] = ()  # faults seen this tick, counted by the daemon
    error: str = ""  # why it is down, where its errors say nothing


class Source(Protocol):
    name: str  # the `source` label: nvml, host, allocator, kubelet, vllm, logs

    def collect(self, snapshot: Snapshot) -> Reading:
        """Fill this source's part of `snapshot`; never raise on outside faults."""

    def close(self) -> None:
        """Release what the source holds (threads, sessions, files)."""


def collect(source: Source, snapshot: Snapshot) -> Snapshot:
    """Run one source, timed; its status and faults go into the snapshot it returns."""
    started = time.perf_counter()
    try:
        reading = source.collect(snapshot)
    except Exception as exc:  # a bug in one source must not cost the others their tick
        log.exception("source %s failed", source.name)
        reading = Reading(snapshot, up=False, errors=(
            SourceError(source.name, "exception", type(exc).__name__),))
    why = "" if reading.up else (
        next((e.message for e in reading.errors if e.message), "") or reading.error)
    status = SourceStatus(source.name, reading.up, time.perf_counter() - started, why)
    filled = reading.snapshot
    return replace(filled, sources=filled.sources + (status,), errors=filled.errors + reading.errors)
