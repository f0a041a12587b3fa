"""The real host: processes and memory from /proc, through psutil where it serves.

In a container the exporter needs the host PID namespace (`--pid host`, `hostPID: true`):
NVML reports host PIDs, and only there can they be looked up.
"""
from __future__ import annotations

import dataclasses
import os
import time

import psutil

from ..model import GpuSample, HostMemory
from .cgroup import parse_cgroup
from .hostview import HostView, ProcessInfo

_MAX_PROC_FILE = 64 << 10  # /proc files are small; never read more than this
_PROCESS_ERRORS = (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError)


def _read_small(path: str) -> str:
    try:
        with open(path, "rb") as fh:
            return fh.read(_MAX_PROC_FILE).decode("utf-8", errors="replace")
    except OSError:
        return ""  # vanished or unreadable: a normal race, the field is simply unknown


class LocalHost(HostView):
    def __init__(self, proc_root: str = "/proc", listener_cache_seconds: float = 30.0):
        self.proc_root = proc_root
        if proc_root != "/proc":
            psutil.PROCFS_PATH = proc_root  # e.g. the host's /proc mounted at /host/proc
        self._listener_ttl = listener_cache_seconds
        self._listeners: dict[int, int] = {}
        self._listeners_at = float("-inf")

    def process(self, pid: int, with_cmdline: bool = False) -> ProcessInfo | None:
        try:
            proc = psutil.Process(pid)
            with proc.oneshot():
                name = proc.name()
                start = proc.create_time()
                ppid = proc.ppid()
                try:
                    rss = proc.memory_info().rss
                except _PROCESS_ERRORS:
                    rss = None
                cmdline = ""
                if with_cmdline:
                    try:
                        cmdline = " ".join(proc.cmdline())[:4096]
                    except _PROCESS_ERRORS:
                        pass
        except _PROCESS_ERRORS:
            return None
        base = f"{self.proc_root}/{pid}"
        return ProcessInfo(pid=pid, name=name, rss_bytes=rss, start_time=start, ppid=ppid,
                           cgroup=_read_small(f"{base}/cgroup"),
                           ns_pid=_innermost_nspid(_read_small(f"{base}/status")), cmdline=cmdline)

    def descendants(self, pid: int) -> list[int]:
        try:
            return [c.pid for c in psutil.Process(pid).children(recursive=True)]
        except _PROCESS_ERRORS:
            return []

    def pid_listening_on(self, port: int) -> int | None:
        # Listing every socket walks every process's fds: cache it, servers rarely move.
        age = time.monotonic() - self._listeners_at
        if age > self._listener_ttl or (port not in self._listeners and age > 5.0):
            self._listeners = _listening_ports()
            self._listeners_at = time.monotonic()
        return self._listeners.get(port)

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


def _listening_ports() -> dict[int, int]:
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.AccessDenied, OSError):
        return {}
    return {c.laddr.port: c.pid for c in conns
            if c.status == psutil.CONN_LISTEN and c.pid and c.laddr}


def _innermost_nspid(status: str) -> int | None:
    for line in status.splitlines():
        if line.startswith("NSpid:"):
            parts = line.split()[1:]
            try:
                return int(parts[-1]) if parts else None
            except ValueError:
                return None
    return None


def enrich(gpus: tuple[GpuSample, ...], host: HostView, with_cmdline: bool = False) -> tuple[GpuSample, ...]:
    """Fill each GPU process's host identity: name, RSS, start time, container, pod UID, NSpid.
    Each PID is looked up once per tick (a tensor-parallel process can span GPUs)."""
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
            container, pod_uid = parse_cgroup(info.cgroup)
            procs.append(dataclasses.replace(
                p, name=info.name, host_rss_bytes=info.rss_bytes, start_time=info.start_time,
                container=container[:12], pod_uid=pod_uid, ns_pid=info.ns_pid,
                cmdline=info.cmdline if with_cmdline else ""))
        out.append(dataclasses.replace(gpu, processes=tuple(procs)))
    return tuple(out)
