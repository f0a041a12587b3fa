"""The one interface every source implements, and the one wrapper that runs it.

A tick starts from an empty Snapshot (its timestamp) and hands it to each source in turn; each
returns a Reading: the snapshot with its own part filled in, whether it worked, and the faults
it saw. `collect` times the call and records the source's up/error state in the snapshot, as
node_exporter does for its collectors: no source builds its own status, and a source that
raises is reported down (its error counted) instead of ending the tick.

Each source declares the parts of the Snapshot it reads (`needs`) and fills (`gives`), and
`in_order` runs it after every source that gives what it needs: the order is derived from the
declarations, so adding a source never means finding its place by hand.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import Protocol

from ..model import Snapshot, SourceError, SourceStatus

log = logging.getLogger("exporter.sources")

# The stop request of the sampling loop running this thread's tick (daemon.Daemon.run sets it).
# A tick still running when shutdown begins does not announce that something answers again:
# after the daemon's "stopping" line, a recovery reads as if sampling went on.
_loop_stop: ContextVar[threading.Event | None] = ContextVar("sampling_loop_stop", default=None)
# Held while a recovery is announced and while a stop is requested, so that no announcement
# slips in between a stop being requested and its "stopping" line.
_announcing = threading.Lock()


@contextmanager
def ticks_until(stop: threading.Event) -> Iterator[None]:
    """Within: the ticks this thread runs belong to a loop that `stop` ends."""
    token = _loop_stop.set(stop)
    try:
        yield
    finally:
        _loop_stop.reset(token)


def request_stop(stop: threading.Event) -> None:
    """Set `stop`; from its return on, no tick of its loop announces a recovery."""
    with _announcing:
        stop.set()


def announce_recovery(logger: logging.Logger, message: str, *args: object) -> None:
    """Log that something answers again (at INFO), unless this tick's loop is stopping."""
    with _announcing:
        stop = _loop_stop.get()
        if stop is None or not stop.is_set():
            logger.info(message, *args)


# The parts of a Snapshot that sources fill and read (a source's `gives` and `needs`).
GPUS = "gpus"  # each GPU, its memory and the PIDs using it, with their GPU memory: a GPU-memory source
HOST_MEMORY = "host_memory"  # the host's memory (and, on unified memory, its largest processes)
PROCESS_IDENTITY = "process_identity"  # each GPU process's name, start time, parent, cgroup, NSpid
POD_NAMES = "pod_names"  # the pod and namespace of a GPU process in Kubernetes
ALLOCATOR = "allocator"  # PyTorch's allocator numbers of a probed GPU process
VLLM = "vllm"  # each vLLM server's sample, and which GPU processes serve it (their role)
LOG_EVENTS = "log_events"  # the out-of-memory messages read from logs this tick
PARTS = (GPUS, HOST_MEMORY, PROCESS_IDENTITY, POD_NAMES, ALLOCATOR, VLLM, LOG_EVENTS)


@dataclass(frozen=True)
class Reading:
    """What one source made of a tick."""

    snapshot: Snapshot  # the snapshot it was given, with its part filled in
    up: bool = True
    errors: tuple[SourceError, ...] = ()  # faults seen this tick, counted by the daemon
    error: str = ""  # why it is down, where its errors say nothing; up, what is wrong all the same
    dropped: tuple[tuple[str, int], ...] = ()  # (model.BUDGETS entry, count) its budgets kept out


class Source(Protocol):
    name: str  # the `source` label: nvml, host, allocator, kubelet, vllm, logs

    @property
    def needs(self) -> tuple[str, ...]:
        """The PARTS it reads from the snapshot it is given (a class attribute will do)."""

    @property
    def gives(self) -> tuple[str, ...]:
        """The PARTS it fills in."""

    def collect(self, snapshot: Snapshot) -> Reading:
        """Fill this source's part of `snapshot`; never raise on outside faults."""

    def close(self) -> None:
        """Release what the source holds (threads, sessions, files)."""


# Fault kinds kept per source per tick; faults of further kinds are counted under "other".
MAX_ERROR_KINDS = 16


def fold_errors(errors: Iterable[SourceError]) -> tuple[tuple[SourceError, ...], int]:
    """One record per (source, kind): its first message and how many there were, so a tick's
    faults take room by kind, not by number (8,000 bad files are one record). Kinds past
    MAX_ERROR_KINDS for a source are folded into kind "other"; returns the records and how many
    records that folded away (the `source_errors` budget)."""
    folded: dict[tuple[str, str], SourceError] = {}
    kinds: dict[str, int] = {}
    spilled = 0
    for e in errors:
        key = (e.source, e.kind)
        if key not in folded:
            if kinds.get(e.source, 0) >= MAX_ERROR_KINDS:
                key = (e.source, "other")
                spilled += 1
            else:
                kinds[e.source] = kinds.get(e.source, 0) + 1
        have = folded.get(key)
        folded[key] = (replace(e, kind=key[1]) if have is None
                       else replace(have, count=have.count + e.count))
    return tuple(folded.values()), spilled


def collect(source: Source, snapshot: Snapshot) -> Snapshot:
    """Run one source, timed; its status, faults (folded by kind) and what its budgets kept out
    go into the snapshot it returns."""
    started = time.perf_counter()
    try:
        reading = source.collect(snapshot)
    except Exception as exc:  # a bug in one source must not cost the others their tick
        log.exception("source %s failed", source.name)
        reading = Reading(snapshot, up=False, errors=(
            SourceError(source.name, "exception", type(exc).__name__),))
    # Down: why (its first fault, else its own word). Up, a source may still say what is wrong
    # (the GPU library answers, one GPU does not).
    why = reading.error if reading.up else (
        next((e.message for e in reading.errors if e.message), "") or reading.error)
    status = SourceStatus(source.name, reading.up, time.perf_counter() - started, why)
    filled = reading.snapshot
    errors, spilled = fold_errors(reading.errors)
    dropped = reading.dropped + ((("source_errors", spilled),) if spilled else ())
    return replace(filled, sources=filled.sources + (status,), errors=filled.errors + errors,
                   dropped=filled.dropped + dropped)


def in_order(sources: Iterable[Source]) -> tuple[Source, ...]:
    """The order the sources run in: each after every source that gives a part it needs, and
    otherwise as listed. A part nobody gives is simply empty (a host without a kubelet has no
    pod names). Raises ValueError where two sources give the same part, on a part no source
    can declare, or on a cycle."""
    listed = tuple(sources)
    giver: dict[str, Source] = {}
    for source in listed:
        for part in (*source.needs, *source.gives):
            if part not in PARTS:
                raise ValueError(f"source {source.name}: unknown snapshot part {part!r} (known: {', '.join(PARTS)})")
        for part in source.gives:
            if part in giver:
                raise ValueError(f"sources {giver[part].name} and {source.name} both give {part}")
            giver[part] = source
    after = {id(s): {id(giver[p]) for p in s.needs if p in giver and giver[p] is not s} for s in listed}
    ordered: list[Source] = []
    placed: set[int] = set()
    waiting = list(listed)
    while waiting:
        ready = next((s for s in waiting if after[id(s)] <= placed), None)
        if ready is None:
            raise ValueError("sources need each other's parts in a circle: " + ", ".join(s.name for s in waiting))
        ordered.append(ready)
        placed.add(id(ready))
        waiting.remove(ready)
    return tuple(ordered)
