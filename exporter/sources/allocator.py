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

The directory is writable by the serving processes' users, so anyone among them can plant files
named for another process. What one process can cost per tick is bounded (docs/memory.md): where
its PID namespace is known only the two names it can have are opened (its namespace's, and 0,
"unreadable"), and a file in its own namespace wins over one saying 0; where it is not known,
files owned by another user than the process's are never opened, and at most
MAX_FILES_PER_PROCESS of the rest are, the others counted (budget `probe_files`).
"""
from __future__ import annotations

import dataclasses
import errno
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from gpumem_probe import schema

from ..boundedio import read_head
from ..model import AllocatorStats, GpuSample, ProcessSample, Snapshot, SourceError
from .source import ALLOCATOR, GPUS, PROCESS_IDENTITY, Reading

SOURCE = "allocator"
MAX_FILE_BYTES = 64 << 10  # a probe file is about 1 KiB per device
MAX_ENTRIES = 8192  # directory entries looked at per tick: a flood of files cannot stall a tick
MAX_FILES_PER_PROCESS = 4  # files opened per process per tick where its PID namespace is unknown
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


def read_process_owner(proc_root: str, pid: int) -> int | None:
    """The user a host process runs as (its /proc directory's owner); None when gone."""
    try:
        return os.stat(f"{proc_root}/{pid}").st_uid
    except OSError:
        return None


class _Candidate(NamedTuple):
    """A directory entry named like a probe file of a current GPU process's pid."""

    pid_ns: int  # from its name
    name: str
    entry: os.DirEntry[str]


class AllocatorSource:
    """The `allocator` source: it needs the GPU processes and the identity (start time, NSpid)
    the host source gave them."""

    name = SOURCE
    needs = (GPUS, PROCESS_IDENTITY)
    gives = (ALLOCATOR,)

    def __init__(self, directory: str, proc_root: str = "/proc",
                 pid_namespace: Callable[[int], int | None] | None = None,
                 max_entries: int = MAX_ENTRIES, max_file_bytes: int = MAX_FILE_BYTES,
                 process_owner: Callable[[int], int | None] | None = None,
                 max_files_per_process: int = MAX_FILES_PER_PROCESS):
        self.directory = directory
        self.max_entries = max_entries
        self.max_file_bytes = max_file_bytes
        self.max_files_per_process = max(1, max_files_per_process)
        self._pid_namespace = pid_namespace or (lambda pid: read_pid_namespace(proc_root, pid))
        self._process_owner = process_owner or (lambda pid: read_process_owner(proc_root, pid))
        self._namespaces: dict[tuple[int, float | None], int | None] = {}  # process identity -> its PID namespace

    def close(self) -> None:
        pass  # nothing held between ticks

    def collect(self, snapshot: Snapshot) -> Reading:
        """The snapshot with each probed process's `allocator` filled in. Staleness is judged
        against the snapshot's time (the simulator's clock when simulated)."""
        tick = _Tick(snapshot.timestamp)
        gpus = snapshot.gpus
        wanted = {_own_pid(p) for g in gpus for p in g.processes}
        try:
            dir_fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:  # the directory itself: the source is down, the processes untouched
            kind = "dir_missing" if isinstance(exc, FileNotFoundError) else "dir_unreadable"
            tick.errors.append(SourceError(SOURCE, kind, f"{self.directory}: {exc.strerror}"))
            return Reading(snapshot, up=False, errors=tuple(tick.errors))
        namespaces: dict[tuple[int, float | None], int | None] = {}
        out = []
        try:
            candidates = self._scan(dir_fd, wanted, tick)
            for gpu in gpus:
                procs = []
                for p in gpu.processes:
                    report = self._match(p, candidates.get(_own_pid(p), ()), namespaces, dir_fd, tick)
                    stats = _device_stats(report, gpu, p, gpus) if report is not None else None
                    procs.append(dataclasses.replace(p, allocator=stats) if stats is not None else p)
                out.append(dataclasses.replace(gpu, processes=tuple(procs)))
        except OSError as exc:  # listing the directory failed
            tick.errors.append(SourceError(SOURCE, "dir_unreadable", f"{self.directory}: {exc.strerror}"))
            return Reading(snapshot, up=False, errors=tuple(tick.errors))
        finally:
            os.close(dir_fd)
        self._namespaces = namespaces  # only live processes: bounded by the process table
        return Reading(dataclasses.replace(snapshot, gpus=tuple(out)), errors=tuple(tick.errors),
                       dropped=(("probe_files", tick.dropped),) if tick.dropped else ())

    def _scan(self, dir_fd: int, wanted: set[int], tick: _Tick) -> dict[int, list[_Candidate]]:
        """The entries named for a wanted pid, by pid (none opened yet)."""
        found: dict[int, list[_Candidate]] = {}
        with os.scandir(dir_fd) as entries:
            for seen, entry in enumerate(entries):
                if seen >= self.max_entries:
                    tick.errors.append(SourceError(SOURCE, "too_many_files",
                                                   f"{self.directory}: more than {self.max_entries} entries"))
                    break
                match = schema.FILE_NAME.fullmatch(entry.name)
                if match is None or int(match.group(2)) not in wanted:
                    continue  # not a probe file, or no GPU process of that pid: never opened
                found.setdefault(int(match.group(2)), []).append(_Candidate(int(match.group(1)), entry.name, entry))
        return found

    def _load(self, candidate: _Candidate, pid: int, dir_fd: int, tick: _Tick) -> ProbeReport | None:
        """The candidate's report (read once per tick), or None."""
        if candidate.name in tick.loaded:
            return tick.loaded[candidate.name]
        report = self._read(candidate.name, dir_fd, tick.now, tick.errors)
        if report is not None and (report.pid, report.pid_ns) != (pid, candidate.pid_ns):
            tick.errors.append(SourceError(SOURCE, "bad_schema", f"{candidate.name}: names another process"))
            report = None
        tick.loaded[candidate.name] = report
        return report

    def _read(self, name: str, dir_fd: int, now: float, errors: list[SourceError]) -> ProbeReport | None:
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

    def _namespace(self, p: ProcessSample, namespaces: dict[tuple[int, float | None], int | None]) -> int | None:
        if p.identity not in namespaces:
            namespaces[p.identity] = (self._namespaces[p.identity] if p.identity in self._namespaces
                                      else self._pid_namespace(p.pid))
        return namespaces[p.identity]

    def _opened(self, p: ProcessSample, candidates: Sequence[_Candidate],
                namespaces: dict[tuple[int, float | None], int | None], tick: _Tick) -> list[_Candidate]:
        """The candidates worth opening for this process, within its budget."""
        ns = self._namespace(p, namespaces) if any(c.pid_ns for c in candidates) else None
        if ns is not None:
            return [c for c in candidates if c.pid_ns in (0, ns)]  # at most two names
        owner = self._process_owner(p.pid) if len(candidates) > 1 else None
        if owner is not None:  # planted by another user: never opened
            candidates = [c for c in candidates if _owner(c) == owner]
        if len(candidates) > self.max_files_per_process:
            tick.dropped += len(candidates) - self.max_files_per_process
            candidates = sorted(candidates)[:self.max_files_per_process]
        return list(candidates)

    def _match(self, p: ProcessSample, candidates: Sequence[_Candidate],
               namespaces: dict[tuple[int, float | None], int | None], dir_fd: int,
               tick: _Tick) -> ProbeReport | None:
        """The one report that is this process's, or None."""
        if p.start_time is None or not candidates:
            return None
        if p.identity not in tick.opened:  # a process on several GPUs is looked at once
            tick.opened[p.identity] = self._opened(p, candidates, namespaces, tick)
        reports = [r for c in tick.opened[p.identity]
                   if (r := self._load(c, _own_pid(p), dir_fd, tick)) is not None]
        same_start = [r for r in reports if abs(r.start_time - p.start_time) <= START_TOLERANCE_SECONDS]
        if not same_start:
            return None  # no probe, or the file of a dead process that had this PID
        ns = namespaces.get(p.identity)
        if ns is not None:  # its own namespace's file wins over one that could not say ("0")
            same_start = [r for r in same_start if r.pid_ns == ns] or same_start
        if len(same_start) > 1:
            tick.errors.append(SourceError(SOURCE, "ambiguous", f"pid {p.pid}: {len(same_start)} probe files "
                                                                "match (PID namespace unreadable)"))
            return None
        return same_start[0]


class _Tick:
    """What one collect() gathers: faults, files read (each once), files kept out."""

    def __init__(self, now: float):
        self.now = now
        self.errors: list[SourceError] = []
        self.loaded: dict[str, ProbeReport | None] = {}
        self.opened: dict[tuple[int, float | None], list[_Candidate]] = {}  # process identity -> files
        self.dropped = 0


def _owner(candidate: _Candidate) -> int | None:
    try:
        return candidate.entry.stat(follow_symlinks=False).st_uid
    except OSError:
        return None


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
