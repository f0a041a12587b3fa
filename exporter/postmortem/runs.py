"""Which run of the exporter wrote a trace, and the rule that keeps `analyze` from merging
traces of different runs into one replay.

A trace written by this version says, on the first GPU-level row of each tick, the host's name,
its boot (the kernel's boot id) and the exporter process that wrote it (a random id chosen once
per process). Merged into one replay, traces of different runs tell a story that never
happened: the README's recipe run twice gives "exited 3 min ago and 20.0 GiB of the 1.6 GiB it
held is still in use", and two traces months apart become one replay of a thousand hours. So
`analyze` refuses, unless asked to (`--merge-runs`), to merge traces
- written on different hosts, or in different boots of one host;
- written by different runs of the exporter (say, one restarted during the incident);
- with a gap between them longer than the flight recorder's window (old traces, which do not
  name their run, and Prometheus files are held to this rule only).
"""
from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cache

from ..units import format_duration, format_time
from .tracerow import TraceError, clean_text

# The flight recorder's default window (recorder.window_seconds): traces of one incident that
# are further apart than this do not show one stretch of time.
MAX_GAP_SECONDS = 3600.0
BOOT_ID_FILE = "/proc/sys/kernel/random/boot_id"
MAX_ID_CHARS = 255


@dataclass(frozen=True)
class RunIdentity:
    """The host, its boot, and the exporter process that wrote a trace; "" where unknown."""

    hostname: str = ""
    boot_id: str = ""
    exporter_run: str = ""

    def __bool__(self) -> bool:
        return bool(self.hostname or self.boot_id or self.exporter_run)


@cache
def local_identity() -> RunIdentity:
    """This process's identity, the same on every call (the run id is chosen on the first)."""
    return RunIdentity(hostname=clean_text(socket.gethostname())[:MAX_ID_CHARS],
                       boot_id=_boot_id(), exporter_run=uuid.uuid4().hex[:16])


def _boot_id() -> str:
    try:  # a small kernel file; O_NONBLOCK and a bounded read whatever is planted there
        fd = os.open(BOOT_ID_FILE, os.O_RDONLY | os.O_NONBLOCK)
        try:
            return clean_text(os.read(fd, 64).decode("ascii", "replace").strip())
        finally:
            os.close(fd)
    except OSError:
        return ""  # not Linux, or no /proc: the trace then names its host only


@dataclass
class FileSpan:
    """What one trace file covers: its time span and the runs that wrote it."""

    path: str
    start: float = float("inf")
    end: float = float("-inf")
    runs: set[RunIdentity] = field(default_factory=set)

    def add(self, timestamp: float, run: RunIdentity) -> None:
        self.start = min(self.start, timestamp)
        self.end = max(self.end, timestamp)
        if run:
            self.runs.add(run)


def check_one_run(spans: Sequence[FileSpan], max_gap: float = MAX_GAP_SECONDS) -> None:
    """TraceError naming the files when they are not of one run (see the module's doc)."""
    problem = _different_runs(spans) or _gap(spans, max_gap)
    if problem:
        raise TraceError(f"{problem}; these traces are not of one run, and a replay of them "
                         "together would mix two stories. Analyze them one at a time, or give "
                         "--merge-runs to merge them anyway.")


def _different_runs(spans: Sequence[FileSpan]) -> str:
    seen: list[tuple[RunIdentity, str]] = []  # (run, the first file that names it)
    for span in spans:
        for run in sorted(span.runs, key=lambda r: (r.hostname, r.boot_id, r.exporter_run)):
            for other, where in seen:
                why = _how_they_differ(other, run)
                if why:
                    files = where if where == span.path else f"{where} and {span.path}"
                    return f"{files}: written {why}"
            seen.append((run, span.path))
    return ""


def _how_they_differ(a: RunIdentity, b: RunIdentity) -> str:
    if a.hostname and b.hostname and a.hostname != b.hostname:
        return f"on different hosts ({a.hostname!r} and {b.hostname!r})"
    if a.boot_id and b.boot_id and a.boot_id != b.boot_id:
        return f"in different boots of {a.hostname or b.hostname or 'the host'!r}"
    if a.exporter_run and b.exporter_run and a.exporter_run != b.exporter_run:
        return (f"by different runs of the exporter ({a.exporter_run} and {b.exporter_run}; "
                "restarted, or a simulation run twice)")
    return ""


def _gap(spans: Iterable[FileSpan], max_gap: float) -> str:
    ordered = sorted((s for s in spans if s.start <= s.end), key=lambda s: s.start)
    if not ordered:
        return ""
    last = ordered[0]
    for span in ordered[1:]:
        if span.start - last.end > max_gap:
            return (f"{span.path} starts {format_duration(span.start - last.end)} after {last.path} ends "
                    f"({format_time(last.end)} to {format_time(span.start)}), more than the "
                    f"{format_duration(max_gap)} the flight recorder keeps before a trigger")
        if span.end > last.end:
            last = span
    return ""


__all__ = ["MAX_GAP_SECONDS", "FileSpan", "RunIdentity", "check_one_run", "local_identity"]
