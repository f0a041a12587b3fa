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
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gpumem_probe import schema

from ..boundedio import read_head
from ..model import AllocatorStats, GpuSample, ProcessSample, Snapshot, SourceError
from .source import ALLOCATOR, GPUS, PROCESS_IDENTITY, Reading

SOURCE = "allocator"
MAX_FILE_BYTES = 64 << 10  # a probe file is about 1 KiB per device
MAX_ENTRIES = 8192  # directory entries looked at per tick: a flood of files cannot stall a tick
STALE_INTERVALS = 3
# Start times are btime + ticks/CLK_TCK on both sides; btime is whole seconds and follows clock
# steps, so two readers can differ by up to a second. A reused PID differs by a whole lifetime.
START_TOLERANCE_SECONDS = 1.0
_NS_LINK = re.compile(r"pid:\[(\d+)\]")


@dataclass(frozen=True)
class ProbeReport:
    """One probe file, validated, with its devices' numbers as the Snapshot carries them."""

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


def parse(data: bytes) -> ProbeReport:
    """A probe file's bytes, validated by the probe's own schema (gpumem_probe.schema). Raises
    schema.Invalid with a stable kind."""
    report = schema.parse(data)
    history = report.history
    common: dict[str, Any] = dict(
        backend=report.backend, alloc_conf=report.alloc_conf, probe_errors=report.errors_total,
        written_at=report.written_at, probe_pid=report.pid, probe_pid_ns=report.pid_ns)
    if history is not None:
        common.update(history_request=history.request_id, history_state=history.state,
                      history_file=history.file, history_bytes=history.bytes)
    devices = []
    for d in report.devices:
        counts: dict[str, Any] = d.counts
        devices.append((None if d.uuid is None else normalise_uuid(d.uuid), AllocatorStats(**counts, **common)))
    return ProbeReport(pid=report.pid, pid_ns=report.pid_ns, start_time=report.start_time,
                       written_at=report.written_at, interval=report.interval, devices=tuple(devices))


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
                    match = schema.FILE_NAME.fullmatch(entry.name)
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
        except schema.Invalid as exc:
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
