"""The `host` source (host memory and each GPU process's identity, from any HostView) and
the real host behind it: processes and memory from /proc, through psutil where it serves.

In a container the exporter needs the host PID namespace (`--pid host`, `hostPID: true`):
NVML reports host PIDs, and only there can they be looked up. Where the host's /proc is
mounted elsewhere, psutil is told so once at start-up (runtime.open_host sets
psutil.PROCFS_PATH, as psutil documents); LocalHost only reads that value, so its own /proc
reads and psutil's always agree.
"""
from __future__ import annotations

import dataclasses
import heapq
import os
import time
from collections.abc import Callable, Sequence

import psutil

from ..boundedio import read_head
from ..model import GpuSample, HostMemory, ProcessSample, Snapshot, SourceError
from .hostview import MAX_NAME_CHARS, HostView, ProcessInfo
from .source import GPUS, HOST_MEMORY, PROCESS_IDENTITY, Reading

_MAX_PROC_FILE = 64 << 10  # /proc files are small; never read more than this
_PROCESS_ERRORS = (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError)
IDENTITY_REFRESH_SECONDS = 30.0  # a process renames itself or is re-parented rarely
FORGET_AFTER_SECONDS = 60.0
MAX_TRACKED = 16384
LISTENER_RESCAN_SECONDS = 5.0
# Unified memory: the largest processes by RSS are found by a walk of every /proc/<pid>/statm
# (about 10 us each) at most this often; in between only those processes' RSS is read again.
TOP_RESCAN_SECONDS = 30.0
MAX_SCANNED = 65536  # PIDs looked at in one walk, whatever the host runs
TOP_PROCESSES = 8  # host processes read per tick where a GPU shares the host's memory
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


# The kernel keeps this many characters of a program's name (TASK_COMM_LEN - 1).
_COMM_CHARS = 15


def _name(proc: psutil.Process) -> str:
    """psutil's name, bounded: where the kernel's 15-character comm is cut, psutil takes the
    name from the command line, which any process sets to what it likes, as long as it likes.
    psutil looks at argv[0] only; a script run through its shebang has its interpreter there
    and itself in argv[1] (`jupyter-noteboo` is /usr/local/bin/jupyter-notebook). Only the
    basename that the cut name begins is taken: never the rest of a command line."""
    name = proc.name()
    if len(name) == _COMM_CHARS:
        try:
            args = proc.cmdline()[1:2]
        except _PROCESS_ERRORS:
            args = []
        script = os.path.basename(args[0]) if args else ""
        if script.startswith(name):
            name = script
    return name[:MAX_NAME_CHARS]


def _name_of(pid: int | None) -> str:
    """A process's name, "" when it is gone or hidden (PID 0: no parent)."""
    if not pid:
        return ""
    try:
        return _name(psutil.Process(pid))
    except _PROCESS_ERRORS:
        return ""


def _read_small(path: str) -> str:
    try:
        return read_head(path, _MAX_PROC_FILE)[0].decode("utf-8", errors="replace")
    except OSError:
        return ""  # vanished or unreadable: a normal race, the field is simply unknown


@dataclasses.dataclass
class _Tracked:
    """A process seen before: its psutil handle and what stays fixed or changes rarely."""
    proc: psutil.Process
    start: float  # Unix seconds
    cgroup: str  # a process keeps its cgroup and PID namespace for life
    ns_pid: int | None
    name: str
    ppid: int | None
    parent_name: str
    named_at: float  # when name, ppid and the parent's name were read
    seen_at: float


class LocalHost(HostView):
    def __init__(self, listener_cache_seconds: float = 30.0, monotonic: Callable[[], float] = time.monotonic):
        self.proc_root = psutil.PROCFS_PATH  # e.g. /host/proc: read, never set here
        self._monotonic = monotonic  # the caches' clock; the overhead benchmark plays it fast
        self._listener_ttl = listener_cache_seconds
        self._listeners: dict[int, int] = {}  # port -> pid, from the last whole-table scan
        self._listeners_at = float("-inf")
        self._listener_checked: dict[int, float] = {}  # port -> when its pid was last confirmed
        # port -> (pid, its listening socket's /proc/<pid>/fd/<n> and what that link read): a
        # confirmation is then one readlink, not a parse of the host's socket tables.
        self._listener_sockets: dict[int, tuple[int, str, str]] = {}
        self._tracked: dict[int, _Tracked] = {}
        self._swept_at = monotonic()
        self._top: tuple[int, ...] = ()  # PIDs of the largest processes at the last walk
        self._top_at = float("-inf")

    def process(self, pid: int, with_cmdline: bool = False) -> ProcessInfo | None:
        # Every tick looks up the same GPU processes: keep their psutil handles, so a tick
        # costs two small reads per process (stat for liveness and PID reuse, statm for RSS)
        # instead of five. Name and parent are re-read every IDENTITY_REFRESH_SECONDS.
        now = self._monotonic()
        self._sweep(now)
        tracked = self._tracked.get(pid)
        try:
            # is_running() is False when the PID is gone or now belongs to a new process.
            if tracked is None or not tracked.proc.is_running():
                tracked = self._tracked[pid] = self._track(pid, now)
            elif now - tracked.named_at >= IDENTITY_REFRESH_SECONDS:
                with tracked.proc.oneshot():
                    tracked.name, tracked.ppid = _name(tracked.proc), tracked.proc.ppid()
                tracked.parent_name = _name_of(tracked.ppid)
                tracked.named_at = now
            try:
                rss = tracked.proc.memory_info().rss
            except _PROCESS_ERRORS:
                rss = None
            cmdline = ""
            if with_cmdline:
                try:
                    cmdline = " ".join(tracked.proc.cmdline())[:4096]
                except _PROCESS_ERRORS:
                    pass
        except _PROCESS_ERRORS:
            self._tracked.pop(pid, None)
            return None
        tracked.seen_at = now
        return ProcessInfo(pid=pid, name=tracked.name, rss_bytes=rss, start_time=tracked.start,
                           ppid=tracked.ppid, parent_name=tracked.parent_name, cgroup=tracked.cgroup,
                           ns_pid=tracked.ns_pid, cmdline=cmdline)

    def _track(self, pid: int, now: float) -> _Tracked:
        proc = psutil.Process(pid)
        with proc.oneshot():
            name, start, ppid = _name(proc), proc.create_time(), proc.ppid()
        base = f"{self.proc_root}/{pid}"
        return _Tracked(proc=proc, start=start, cgroup=_read_small(f"{base}/cgroup"),
                        ns_pid=_innermost_nspid(_read_small(f"{base}/status")),
                        name=name, ppid=ppid, parent_name=_name_of(ppid), named_at=now, seen_at=now)

    def _sweep(self, now: float) -> None:
        """Forget processes not asked about for a while: bounded under any churn."""
        if now - self._swept_at < FORGET_AFTER_SECONDS and len(self._tracked) < MAX_TRACKED:
            return
        self._swept_at = now
        self._tracked = {pid: t for pid, t in self._tracked.items() if now - t.seen_at < FORGET_AFTER_SECONDS}
        if len(self._tracked) >= MAX_TRACKED:
            self._tracked.clear()

    def top_processes(self, limit: int) -> tuple[ProcessInfo, ...]:
        now = self._monotonic()
        if now - self._top_at >= TOP_RESCAN_SECONDS or len(self._top) < limit:
            self._top = _largest_rss(self.proc_root, limit)
            self._top_at = now
        found = [info for info in map(self.process, self._top) if info is not None and info.rss_bytes]
        return tuple(sorted(found, key=lambda i: -(i.rss_bytes or 0)))
    def children(self, pid: int) -> tuple[int, ...]:
        # psutil reads every process's parent to find them: the caller caches the answer.
        try:
            return tuple(sorted(c.pid for c in psutil.Process(pid).children(recursive=True)))
        except _PROCESS_ERRORS:
            return ()

    def parent(self, pid: int) -> int | None:
        # The ancestors of every GPU process are asked for each tick (vllm_procs.assign_roles):
        # a known one's answer costs no read until its identity is read again.
        tracked = self._tracked.get(pid)
        now = self._monotonic()
        if tracked is not None and now - tracked.named_at < IDENTITY_REFRESH_SECONDS:
            tracked.seen_at = now
            return tracked.ppid
        info = self.process(pid)
        return info.ppid if info is not None else None

    def cpu_seconds(self, pids: Sequence[int]) -> float | None:
        # The processes' kept handles (process()): one read of stat each. A PID reused meanwhile
        # reads another process's time, which the caller sees as a change.
        now = self._monotonic()
        total = 0.0
        for pid in pids:
            tracked = self._tracked.get(pid)
            if tracked is None:
                if self.process(pid) is None:
                    return None
                tracked = self._tracked[pid]
            try:
                times = tracked.proc.cpu_times()
            except _PROCESS_ERRORS:
                self._tracked.pop(pid, None)
                return None
            tracked.seen_at = now
            total += times.user + times.system
        return total

    def pid_listening_on(self, port: int) -> int | None:
        # Listing every socket walks every process's fds (5 us each; a GPU host has tens of
        # thousands). A known listener is confirmed from its own sockets once a TTL; the whole
        # table is walked again only when it went away (a restart: within LISTENER_RESCAN_SECONDS) or,
        # for a port nobody listened on, once a TTL.
        now = self._monotonic()
        pid = self._listeners.get(port)
        if pid is not None and psutil.pid_exists(pid):
            if now - self._listener_checked.get(port, self._listeners_at) < self._listener_ttl:
                return pid
            if self._same_socket(port, pid) or self._listens(pid, port):
                self._listener_checked[port] = now
                return pid
        wait = LISTENER_RESCAN_SECONDS if pid is not None else self._listener_ttl
        if now - self._listeners_at < wait:
            return None
        self._listeners, self._listeners_at, self._listener_checked = _listening_ports(), now, {}
        return self._listeners.get(port)

    def _same_socket(self, port: int, pid: int) -> bool:
        """The socket the last full check found still open at the same descriptor: still listening
        (a listening socket is never reconnected; a closed one frees its inode)."""
        known = self._listener_sockets.get(port)
        if known is None or known[0] != pid:
            return False
        try:
            return os.readlink(known[1]) == known[2]
        except OSError:
            return False

    def _listens(self, pid: int, port: int) -> bool:
        fd = _listening_fd(pid, port)
        if fd is None:
            self._listener_sockets.pop(port, None)
            return False
        path = f"{self.proc_root}/{pid}/fd/{fd}"
        try:
            self._listener_sockets[port] = (pid, path, os.readlink(path))
        except OSError:
            self._listener_sockets.pop(port, None)
        return True

    def memory(self) -> HostMemory | None:
        try:
            vm = psutil.virtual_memory()
        except OSError:
            return None
        some = full = None
        for line in _read_small(f"{self.proc_root}/pressure/memory").splitlines():
            fields = dict(f.split("=", 1) for f in line.split()[1:] if "=" in f)
            try:
                if line.startswith("some"):
                    some = float(fields["avg10"])
                elif line.startswith("full"):
                    full = float(fields["avg10"])
            except (KeyError, ValueError):
                pass
        oom_kills = None
        for line in _read_small(f"{self.proc_root}/vmstat").splitlines():
            if line.startswith("oom_kill "):
                try:
                    oom_kills = int(line.split()[1])
                except (IndexError, ValueError):
                    pass
        return HostMemory(total_bytes=vm.total, available_bytes=vm.available,
                          psi_some_avg10=some, psi_full_avg10=full, oom_kills=oom_kills)


def _largest_rss(proc_root: str, limit: int) -> tuple[int, ...]:
    """The PIDs of the `limit` processes with the largest RSS (statm's resident pages), from one
    walk of at most MAX_SCANNED entries of /proc."""
    sizes: list[tuple[int, int]] = []
    try:
        root = os.open(proc_root, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return ()
    try:
        with os.scandir(root) as entries:
            for count, entry in enumerate(entries):
                if count >= MAX_SCANNED:
                    break
                if not entry.name.isdigit():
                    continue
                try:
                    fd = os.open(f"{entry.name}/statm", os.O_RDONLY, dir_fd=root)
                    try:
                        fields = os.read(fd, 256).split()
                    finally:
                        os.close(fd)
                    resident = int(fields[1])
                except (OSError, IndexError, ValueError):
                    continue  # exited meanwhile, or a statm we cannot read
                if resident:  # kernel threads have none
                    sizes.append((resident, int(entry.name)))
    finally:
        os.close(root)
    return tuple(pid for _, pid in heapq.nlargest(limit, sizes))


def _listening_ports() -> dict[int, int]:
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.AccessDenied, OSError):
        return {}
    return {c.laddr.port: c.pid for c in conns
            if c.status == psutil.CONN_LISTEN and c.pid and c.laddr}


def _listening_fd(pid: int, port: int) -> int | None:
    """The descriptor of `pid`'s socket listening on `port` (-1 when psutil cannot say), or None."""
    try:
        conns = psutil.Process(pid).net_connections(kind="tcp")
    except _PROCESS_ERRORS:
        return None
    for c in conns:
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port:
            return c.fd
    return None


def _innermost_nspid(status: str) -> int | None:
    for line in status.splitlines():
        if line.startswith("NSpid:"):
            parts = line.split()[1:]
            try:
                return int(parts[-1]) if parts else None
            except ValueError:
                return None
    return None


class HostSource:
    """The `host` source: host memory, then each GPU process's host identity (enrich)."""

    name = "host"
    needs = (GPUS,)
    gives = (HOST_MEMORY, PROCESS_IDENTITY)

    def __init__(self, view: HostView, read_cmdline: bool = False):
        self.view = view
        self.read_cmdline = read_cmdline

    def collect(self, snapshot: Snapshot) -> Reading:
        memory = self.view.memory()
        gpus = enrich(snapshot.gpus, self.view, self.read_cmdline)
        # Where a GPU's memory is the host's, or no GPU is listed at all (vLLM's CPU backend keeps
        # the model in host memory), any process can take it: the largest are named.
        top = host_processes(self.view) if not gpus or any(g.unified for g in gpus) else ()
        if memory is None:
            return Reading(dataclasses.replace(snapshot, gpus=gpus, host_processes=top), up=False,
                           errors=(SourceError("host", "memory_unreadable"),),
                           error="host memory unreadable")
        return Reading(dataclasses.replace(snapshot, host=memory, gpus=gpus, host_processes=top))

    def close(self) -> None:
        pass


def host_processes(host: HostView, limit: int = TOP_PROCESSES) -> tuple[ProcessSample, ...]:
    """The host's largest processes by RSS as samples without GPU memory (used_bytes None)."""
    out = []
    for info in host.top_processes(limit):
        out.append(ProcessSample(pid=info.pid, used_bytes=None, **info.sample_fields()))
    return tuple(out)


def enrich(gpus: tuple[GpuSample, ...], host: HostView,
           with_cmdline: bool = False) -> tuple[GpuSample, ...]:
    """Fill each GPU process's host identity: name, RSS, start time, container, pod UID, NSpid
    (pod names are the kubelet source's). Each PID is looked up once per tick (a
    tensor-parallel process can span GPUs)."""
    cache: dict[int, ProcessInfo | None] = {}
    out = []
    for gpu in gpus:
        procs = []
        for p in gpu.processes:
            if p.pid not in cache:
                cache[p.pid] = host.process(p.pid, with_cmdline)
            info = cache[p.pid]
            if info is None:
                procs.append(p)  # exited between NVML's list and our look: keep what NVML said
                continue
            procs.append(dataclasses.replace(p, **info.sample_fields(), cmdline=info.cmdline if with_cmdline else ""))
        out.append(dataclasses.replace(gpu, processes=tuple(procs)))
    return tuple(out)
