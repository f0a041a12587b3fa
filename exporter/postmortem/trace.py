"""Trace files for replay: read each (CSV or Prometheus range-query JSON, told apart by their
first byte), and group the rows of all of them by timestamp into Snapshots, so several files
(say, one per GPU, or process and GPU series exported separately) merge into one replay.

One job per module: tracerow.py (the row both formats become, TraceError), tracecsv.py (the
trace CSV, read and written; its columns are described there), promtrace.py (Prometheus JSON to
rows), runs.py (which run wrote a trace: files of different runs are not merged unless asked),
and this one (rows to snapshots). Every problem in the input is a TraceError naming file:line
(or the JSON result) and what is wrong; nothing is silently guessed.

Bounded: the files together give at most MAX_ROWS rows and MAX_TICKS distinct times, the
limits the trace writer keeps too (what `analyze` costs at these limits is measured by
bench/trace_cost.py, and quoted in bench/README.md). Rows are grouped as they are read; a
file's rows are never all held as rows.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..boundedio import read_head
from ..model import GpuSample, HostMemory, OomMessage, ProcessSample, Snapshot, VllmSample
from .promtrace import PROMETHEUS_METRICS, VLLM_PROMETHEUS_METRICS, read_prometheus_rows
from .runs import FileSpan, RunIdentity, check_one_run
from .tracecsv import CSV_COLUMNS, read_csv_rows, write_csv
from .tracerow import MAX_ROWS, MAX_TICKS, TraceError, TraceRow


@dataclass(frozen=True)
class Trace:
    """Trace files read for replay.

    snapshots: time-ordered. triggers: the flight recorder's ((tick time, `+`-joined
    triggers), oldest first) where the files mark them. runs: the runs that wrote the files,
    where they say (runs.py). dropped: (tick time, cell, count) of what the writer left out
    because it did not fit (tracecsv.py)."""

    snapshots: list[Snapshot]
    triggers: list[tuple[float, str]] = field(default_factory=list)
    runs: list[RunIdentity] = field(default_factory=list)
    dropped: list[tuple[float, str, int]] = field(default_factory=list)


def iter_rows(path: str) -> Iterator[TraceRow]:
    """The rows of one trace file, CSV or Prometheus JSON (told apart by their first byte)."""
    try:  # a regular file only: a FIFO or device would hang or never end
        head = read_head(path, 64)[0].lstrip(b"\xef\xbb\xbf \t\r\n")
    except OSError as exc:
        raise TraceError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if head[:1] in (b"{", b"["):
        return iter(read_prometheus_rows(path))
    return read_csv_rows(path)


def read_rows(path: str) -> list[TraceRow]:
    """The rows of one trace file, as a list."""
    return list(iter_rows(path))


def load_traces(paths: Iterable[str], merge_runs: bool = False) -> Trace:
    """Trace files merged into one Trace (rows at the same time join). Files of different runs
    (runs.py) are a TraceError unless `merge_runs`."""
    grouper = _Grouper()
    spans = []
    for path in paths:
        span = FileSpan(path)
        for row in iter_rows(path):
            span.add(row.timestamp, RunIdentity(row.hostname, row.boot_id, row.exporter_run)
                     if row.hostname or row.boot_id or row.exporter_run else _NO_RUN)
            grouper.add(row, path)
        spans.append(span)
    if not merge_runs:
        check_one_run(spans)
    return grouper.finish()


_NO_RUN = RunIdentity()


def read_trace(path: str) -> list[Snapshot]:
    """One trace file as a time-ordered list of Snapshots."""
    return load_traces([path]).snapshots


def read_traces(paths: Iterable[str], merge_runs: bool = False) -> list[Snapshot]:
    """Several trace files merged into one time-ordered list of Snapshots."""
    return load_traces(paths, merge_runs).snapshots


def snapshots_from_rows(rows: Iterable[TraceRow]) -> list[Snapshot]:
    """Group rows by timestamp into Snapshots. Conflicting duplicates are a TraceError."""
    grouper = _Grouper()
    for row in rows:
        grouper.add(row, row.origin)
    return grouper.finish().snapshots


_GPU_FIELDS = ("uuid", "total_bytes", "unified")


@dataclass
class _GpuEntry:
    """One GPU at one timestamp while rows are grouped."""

    gpu: dict[str, Any] = field(default_factory=dict)  # uuid, total_bytes, unified, used_bytes, ...
    origins: dict[str, str] = field(default_factory=dict)  # field -> the row that gave it
    # (pid, start_time) -> (the row that gave it, the process)
    procs: dict[tuple[int, float | None], tuple[str, ProcessSample]] = field(default_factory=dict)


class _Grouper:
    """Rows in any order, grouped by timestamp and GPU as they come (each process row becomes
    its ProcessSample at once), then Snapshots."""

    def __init__(self) -> None:
        self.max_rows, self.max_ticks = MAX_ROWS, MAX_TICKS
        self.rows = 0
        self.grouped: dict[float, dict[str, _GpuEntry]] = {}
        self.hosts: dict[float, HostMemory] = {}
        self.vllm: dict[float, tuple[VllmSample, ...]] = {}
        self.events: dict[float, list[OomMessage]] = {}
        self.triggers: dict[float, list[str]] = {}
        self.runs: dict[RunIdentity, None] = {}
        self.dropped: list[tuple[float, str, int]] = []

    def add(self, row: TraceRow, where: str) -> None:
        self.rows += 1
        if self.rows > self.max_rows:
            raise TraceError(f"{where}: the traces hold more than {self.max_rows} rows together; "
                             "split them")
        gpus = self.grouped.get(row.timestamp)
        if gpus is None:
            if len(self.grouped) >= self.max_ticks:
                raise TraceError(f"{row.origin}: the traces hold more than {self.max_ticks} "
                                 "sampling times together; split them")
            gpus = self.grouped[row.timestamp] = {}
        entry = gpus.get(row.gpu)
        if entry is None:
            entry = gpus[row.gpu] = _GpuEntry()
        self._tick(row)
        for name in _GPU_FIELDS:
            _merge_field(entry, name, getattr(row, name), row.origin)
        if row.pid is None:
            _merge_field(entry, "used_bytes", row.used_bytes, row.origin)
            _merge_field(entry, "gpu_error", row.gpu_error, row.origin)
            return
        key = (row.pid, row.start_time)
        if key in entry.procs:
            raise TraceError(f"{row.origin}: pid {row.pid} on gpu {row.gpu} at {row.timestamp!r} "
                             f"already given at {entry.procs[key][0]}")
        entry.procs[key] = (row.origin, ProcessSample(
            pid=row.pid, used_bytes=row.used_bytes, name=row.process,
            host_rss_bytes=row.host_rss_bytes, start_time=row.start_time,
            container=row.container, pod=row.pod, namespace=row.namespace,
            role=row.role or "other", endpoint=row.endpoint, allocator=row.allocator))

    def _tick(self, row: TraceRow) -> None:
        """What a row says about its whole tick."""
        ts = row.timestamp
        if row.host is not None:
            self.hosts.setdefault(ts, row.host)
        if row.vllm is not None:
            self.vllm.setdefault(ts, row.vllm)
        if row.oom_events:
            self.events.setdefault(ts, []).extend(row.oom_events)
        for t in row.trigger.split("+") if row.trigger else ():
            have = self.triggers.setdefault(ts, [])
            if t not in have:
                have.append(t)
        if row.hostname or row.boot_id or row.exporter_run:
            self.runs.setdefault(RunIdentity(row.hostname, row.boot_id, row.exporter_run))
        self.dropped.extend((ts, name, count) for name, count in row.dropped if count)

    def finish(self) -> Trace:
        snapshots = []
        for ts in sorted(self.grouped):
            gpus = self.grouped.pop(ts)
            snapshots.append(Snapshot(
                timestamp=ts, host=self.hosts.get(ts), vllm=self.vllm.get(ts, ()),
                log_events=tuple(self.events.get(ts, ())),
                gpus=tuple(_gpu_sample(index, gpus[index]) for index in sorted(gpus, key=_gpu_order))))
        return Trace(snapshots, [(ts, "+".join(self.triggers[ts])) for ts in sorted(self.triggers)],
                     list(self.runs), sorted(self.dropped))


def _merge_field(entry: _GpuEntry, name: str, value: object, origin: str) -> None:
    if value is None or value == "":
        return
    have = entry.gpu.get(name)
    if have is None:
        entry.gpu[name] = value
        entry.origins[name] = origin
    elif have != value:
        raise TraceError(f"{origin}: {name} {value!r} contradicts {have!r} given at "
                         f"{entry.origins[name]}")


def _gpu_order(index: str) -> tuple[tuple[int, int, str], ...]:
    """"10" after "9"; MIG "0/1" after "0"."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in index.split("/"))


def _gpu_sample(index: str, entry: _GpuEntry) -> GpuSample:
    info = entry.gpu
    total, used = info.get("total_bytes"), info.get("used_bytes")
    free = total - used if total is not None and used is not None and used <= total else None
    procs = tuple(p for _, (_, p) in sorted(entry.procs.items(),
                                            key=lambda kv: (kv[0][0], kv[0][1] or 0.0)))
    error = info.get("gpu_error") or ""
    return GpuSample(index=index, uuid=info.get("uuid") or f"trace-gpu-{index}",
                     up=not error, error="" if error == "down" else error,
                     total_bytes=total, used_bytes=used, free_bytes=free,
                     unified=bool(info.get("unified", False)),
                     mig="/" in index, processes=procs)


__all__ = [
    "CSV_COLUMNS",
    "MAX_ROWS",
    "MAX_TICKS",
    "PROMETHEUS_METRICS",
    "VLLM_PROMETHEUS_METRICS",
    "Trace",
    "TraceError",
    "TraceRow",
    "iter_rows",
    "load_traces",
    "read_csv_rows",
    "read_prometheus_rows",
    "read_rows",
    "read_trace",
    "read_traces",
    "snapshots_from_rows",
    "write_csv",
]
