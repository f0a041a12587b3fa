"""The `allocator` source: PyTorch's CUDA allocator numbers, written by the probe inside each
serving process (probe/, docs/probe.md), attached to the GPU processes NVML lists.

The probe writes `gpumem-<pid namespace inode>-<pid>.json` into a directory shared with the
exporter. Its pid is the one the process has in its own PID namespace, so a file belongs to
an NVML process (host PID) when
- the file's pid is the process's innermost NSpid (its host PID outside containers),
- its start time is the process's own (so a reused PID never gets a dead process's numbers),
- and where both sides could read it, its PID namespace is the process's.
Only files named for a current GPU process are opened; every read is bounded, never follows a
link or blocks on a FIFO. A bad file is counted under a stable kind and skipped; a file not
rewritten for STALE_INTERVALS of its probe's interval is ignored (a hung or killed process).
"""
from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..boundedio import read_head
from ..model import AllocatorStats, GpuSample, ProcessSample, Snapshot, SourceError
from .source import ALLOCATOR, GPUS, PROCESS_IDENTITY, Reading

SOURCE = "allocator"
SCHEMAS = frozenset({1})  # the probe file versions this reader understands
FILE_NAME = re.compile(r"gpumem-(\d{1,20})-(\d{1,10})\.json")
MAX_FILE_BYTES = 64 << 10  # a probe file is about 1 KiB per device
MAX_ENTRIES = 8192  # directory entries looked at per tick: a flood of files cannot stall a tick
MAX_DEVICES = 64
MAX_TEXT = 512
STALE_INTERVALS = 3
MIN_INTERVAL, MAX_INTERVAL = 0.5, 300.0  # the probe's own bounds
# Start times are btime + ticks/CLK_TCK on both sides; btime is whole seconds and follows clock
# steps, so two readers can differ by up to a second. A reused PID differs by a whole lifetime.
START_TOLERANCE_SECONDS = 1.0
_STAT_FIELDS = ("allocated_bytes", "reserved_bytes", "active_bytes", "inactive_split_bytes",
                "allocated_peak_bytes", "reserved_peak_bytes", "active_peak_bytes", "inactive_split_peak_bytes",
                "alloc_retries", "ooms", "device_allocs", "device_frees", "cumem_bytes")
_ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
_NS_LINK = re.compile(r"pid:\[(\d+)\]")
# The probe's allocation-history dump (probe/gpumem_probe/history.py): a bare name, never a path.
DUMP_NAME = re.compile(r"gpumem-\d{1,20}-\d{1,10}-[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\.pickle")
_HISTORY_STATES = frozenset({"recording", "done", "failed"})
_MAX_COUNT = 1 << 63


class _Invalid(Exception):
    def __init__(self, kind: str, message: str = ""):
        super().__init__(message or kind)
        self.kind = kind


@dataclass(frozen=True)
class ProbeReport:
    """One probe file, validated."""

    pid: int  # in the process's own PID namespace
    pid_ns: int  # that namespace's inode; 0: the probe could not read it
    start_time: float  # Unix s
    written_at: float
    interval: float
    devices: tuple[tuple[str | None, AllocatorStats], ...]  # (normalised uuid, numbers)


def normalise_uuid(uuid: str) -> str:
    """NVML says `GPU-<hex>` / `MIG-<hex>`, torch the bare hex: compare the hex."""
    text = uuid.strip().lower()
    return text[4:] if text.startswith(("gpu-", "mig-")) else text


# `type(x) is int` rather than isinstance: it refuses booleans too, and this runs ~15 times per
# file per tick.
def _count(value: object) -> int:
    if type(value) is int and 0 <= value < _MAX_COUNT:
        return value
    raise _Invalid("bad_schema", f"not a count: {str(value)[:40]!r}")


def _optional_count(value: object) -> int | None:
    return None if value is None else _count(value)


def _seconds(value: Any) -> float:  # Any: a decoded JSON value, checked here
    if type(value) in (int, float) and 0 <= value < math.inf:  # NaN fails every comparison
        return float(value)
    raise _Invalid("bad_schema", f"not a time: {str(value)[:40]!r}")


def _text(value: object, limit: int = MAX_TEXT) -> str:
    if not isinstance(value, str):
        raise _Invalid("bad_schema", "not a string")
    return value[:limit]


def parse(data: bytes) -> ProbeReport:
    """A probe file's bytes, validated. Raises _Invalid with a stable kind."""
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise _Invalid("bad_json", str(exc)[:200]) from None
    if not isinstance(doc, dict):
        raise _Invalid("bad_schema", "not an object")
    if doc.get("schema") not in SCHEMAS:
        raise _Invalid("unsupported_schema", f"schema {str(doc.get('schema'))[:20]!r}")
    try:
        devices = doc["devices"]
        if not isinstance(devices, list) or len(devices) > MAX_DEVICES:
            raise _Invalid("bad_schema", "devices: not a short list")
        conf = doc.get("alloc_conf") or {}
        errors = doc.get("errors") or {}
        if not isinstance(conf, dict) or not isinstance(errors, dict) or len(errors) > 64:
            raise _Invalid("bad_schema", "alloc_conf/errors: not small objects")
        common: dict[str, Any] = dict(
            backend=_text(doc.get("backend", ""), 32),
            alloc_conf=tuple((name, _text(conf[name])) for name in _ALLOC_CONF_VARS if name in conf),
            probe_errors=sum(_count(n) for n in errors.values()),
            written_at=_seconds(doc["written_at"]),
            probe_pid=_count(doc["pid"]), probe_pid_ns=_count(doc.get("pid_ns") or 0),
            **_history(doc.get("history")))
        return ProbeReport(
            pid=common["probe_pid"], pid_ns=common["probe_pid_ns"],
            start_time=_seconds(doc["start_time"]), written_at=common["written_at"],
            interval=min(max(_seconds(doc["interval"]), MIN_INTERVAL), MAX_INTERVAL),
            devices=tuple(_device(d, common) for d in devices))
    except (KeyError, TypeError) as exc:
        raise _Invalid("bad_schema", f"missing or mistyped {str(exc)[:60]}") from None


def _history(value: object) -> dict[str, Any]:
    """The probe's `history` object (absent or null: never asked). A value of an unknown
    state or a file name that is not a dump's is dropped, never passed on."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _Invalid("bad_schema", "history: not an object")
    request, state, name = value.get("request_id"), value.get("state"), value.get("file")
    out: dict[str, Any] = {
        "history_request": _text(request, 64) if request is not None else "",
        "history_state": state if isinstance(state, str) and state in _HISTORY_STATES else ""}
    if out["history_state"] == "done" and isinstance(name, str) and DUMP_NAME.fullmatch(name):
        out["history_file"] = name
        out["history_bytes"] = _optional_count(value.get("bytes"))
    return out


def _device(entry: object, common: dict[str, Any]) -> tuple[str | None, AllocatorStats]:
    if not isinstance(entry, dict):
        raise _Invalid("bad_schema", "device: not an object")
    uuid = entry.get("uuid")
    uuid = None if uuid is None else normalise_uuid(_text(uuid, 64))
    counts: dict[str, Any] = {name: _optional_count(entry.get(name)) for name in _STAT_FIELDS}
    stats = AllocatorStats(**counts, **common)
    return uuid, stats


def _error_kind(exc: OSError) -> str:
    if exc.errno == errno.ELOOP:
        return "symlink"  # O_NOFOLLOW refused a link planted at a probe file's name
    if isinstance(exc, IsADirectoryError) or exc.errno == errno.EINVAL:
        return "not_regular"
    return "unreadable"


def read_pid_namespace(proc_root: str, pid: int) -> int | None:
    """The inode of a host process's PID namespace; None where it cannot be read (another
    user's process without CAP_SYS_PTRACE, or gone)."""
    try:
        match = _NS_LINK.fullmatch(os.readlink(f"{proc_root}/{pid}/ns/pid"))
    except OSError:
        return None
    return int(match.group(1)) if match else None


class AllocatorSource:
    """The `allocator` source: it needs the GPU processes and the identity (start time, NSpid)
    the host source gave them."""

    name = SOURCE
    needs = (GPUS, PROCESS_IDENTITY)
    gives = (ALLOCATOR,)

    def __init__(self, directory: str, proc_root: str = "/proc",
                 pid_namespace: Callable[[int], int | None] | None = None,
                 max_entries: int = MAX_ENTRIES, max_file_bytes: int = MAX_FILE_BYTES):
        self.directory = directory
        self.max_entries = max_entries
        self.max_file_bytes = max_file_bytes
        self._pid_namespace = pid_namespace or (lambda pid: read_pid_namespace(proc_root, pid))
        self._namespaces: dict[tuple[int, float | None], int | None] = {}  # process identity -> its PID namespace

    def close(self) -> None:
        pass  # nothing held between ticks

    def collect(self, snapshot: Snapshot) -> Reading:
        """The snapshot with each probed process's `allocator` filled in. Staleness is judged
        against the snapshot's time (the simulator's clock when simulated)."""
        errors: list[SourceError] = []
        gpus = snapshot.gpus
        wanted = {_own_pid(p) for g in gpus for p in g.processes}
        try:
            reports = self._read(wanted, snapshot.timestamp, errors)
        except OSError as exc:  # the directory itself: the source is down, the processes untouched
            kind = "dir_missing" if isinstance(exc, FileNotFoundError) else "dir_unreadable"
            errors.append(SourceError(SOURCE, kind, f"{self.directory}: {exc.strerror}"))
            return Reading(snapshot, up=False, errors=tuple(errors))
        namespaces: dict[tuple[int, float | None], int | None] = {}
        out = []
        for gpu in gpus:
            procs = []
            for p in gpu.processes:
                report = self._match(p, reports.get(_own_pid(p), ()), namespaces, errors)
                stats = _device_stats(report, gpu, p, gpus) if report is not None else None
                procs.append(dataclasses.replace(p, allocator=stats) if stats is not None else p)
            out.append(dataclasses.replace(gpu, processes=tuple(procs)))
        self._namespaces = namespaces  # only live processes: bounded by the process table
        return Reading(dataclasses.replace(snapshot, gpus=tuple(out)), errors=tuple(errors))

    def _read(self, wanted: set[int], now: float, errors: list[SourceError]) -> dict[int, list[ProbeReport]]:
        reports: dict[int, list[ProbeReport]] = {}
        dir_fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
        try:
            with os.scandir(dir_fd) as entries:
                for seen, entry in enumerate(entries):
                    if seen >= self.max_entries:
                        errors.append(SourceError(SOURCE, "too_many_files",
                                                  f"{self.directory}: more than {self.max_entries} entries"))
                        break
                    match = FILE_NAME.fullmatch(entry.name)
                    if match is None or int(match.group(2)) not in wanted:
                        continue  # not a probe file, or no GPU process of that pid: never opened
                    report = self._load(entry.name, dir_fd, now, errors)
                    if report is not None:
                        if (report.pid, report.pid_ns) != (int(match.group(2)), int(match.group(1))):
                            errors.append(SourceError(SOURCE, "bad_schema", f"{entry.name}: names another process"))
                            continue
                        reports.setdefault(report.pid, []).append(report)
        finally:
            os.close(dir_fd)
        return reports

    def _load(self, name: str, dir_fd: int, now: float, errors: list[SourceError]) -> ProbeReport | None:
        try:
            data, more = read_head(name, self.max_file_bytes, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return None  # its process exited between the listing and the read
        except OSError as exc:
            errors.append(SourceError(SOURCE, _error_kind(exc), f"{name}: {exc.strerror}"))
            return None
        if more:
            errors.append(SourceError(SOURCE, "too_large", f"{name}: over {self.max_file_bytes} bytes"))
            return None
        try:
            report = parse(data)
        except _Invalid as exc:
            errors.append(SourceError(SOURCE, exc.kind, f"{name}: {exc}"))
            return None
        window = STALE_INTERVALS * report.interval
        if now - report.written_at > window:
            errors.append(SourceError(SOURCE, "stale", f"{name}: not rewritten for {now - report.written_at:.0f} s"))
            return None
        if report.written_at - now > window:
            errors.append(SourceError(SOURCE, "clock_skew", f"{name}: written {report.written_at - now:.0f} s ahead"))
            return None
        return report

    def _match(self, p: ProcessSample, candidates: Sequence[ProbeReport],
               namespaces: dict[tuple[int, float | None], int | None],
               errors: list[SourceError]) -> ProbeReport | None:
        """The one report that is this process's, or None."""
        if p.start_time is None:
            return None
        same_start = [r for r in candidates if abs(r.start_time - p.start_time) <= START_TOLERANCE_SECONDS]
        if not same_start:
            return None  # no probe, or the file of a dead process that had this PID
        if any(r.pid_ns for r in same_start):
            if p.identity not in namespaces:
                namespaces[p.identity] = (self._namespaces[p.identity] if p.identity in self._namespaces
                                          else self._pid_namespace(p.pid))
            ns = namespaces[p.identity]
            if ns is not None:
                same_start = [r for r in same_start if r.pid_ns in (0, ns)]
        if len(same_start) > 1:
            errors.append(SourceError(SOURCE, "ambiguous", f"pid {p.pid}: {len(same_start)} probe files match "
                                                           "(PID namespace unreadable)"))
            return None
        return same_start[0] if same_start else None


def _own_pid(p: ProcessSample) -> int:
    """The PID the process sees for itself: what the probe names its file by."""
    return p.ns_pid if p.ns_pid is not None else p.pid


def _device_stats(report: ProbeReport, gpu: GpuSample, p: ProcessSample,
                  gpus: tuple[GpuSample, ...]) -> AllocatorStats | None:
    uuid = normalise_uuid(gpu.uuid)
    for device_uuid, stats in report.devices:
        if device_uuid == uuid:
            return stats
    # A torch too old to report UUIDs: unambiguous only for a process on one GPU using one device.
    if (len(report.devices) == 1 and report.devices[0][0] is None
            and sum(any(q.pid == p.pid for q in g.processes) for g in gpus) == 1):
        return report.devices[0][1]
    return None
