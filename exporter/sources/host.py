"""The real host: processes and memory from /proc, through psutil where it serves.

In a container the exporter needs the host PID namespace (`--pid host`, `hostPID: true`):
NVML reports host PIDs, and only there can they be looked up.
"""
from __future__ import annotations

import dataclasses
import time

import psutil

from ..boundedio import read_head
from ..model import GpuSample, HostMemory
from .cgroup import parse_cgroup
from .hostview import HostView, ProcessInfo

_MAX_PROC_FILE = 64 << 10  # /proc files are small; never read more than this
_PROCESS_ERRORS = (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError)
TREE_CACHE_SECONDS = 10.0


def _read_small(path: str) -> str:
    try:
        return read_head(path, _MAX_PROC_FILE)[0].decode("utf-8", errors="replace")
    except OSError:
        return ""  # vanished or unreadable: a normal race, the field is simply unknown


class LocalHost(HostView):
    def __init__(self, proc_root: str = "/proc", listener_cache_seconds: float = 30.0, pods=None):
        self.proc_root = proc_root
        self.pods = pods  # a kubelet.KubeletPods in Kubernetes, else None: enrich() uses it
        if proc_root != "/proc":
            psutil.PROCFS_PATH = proc_root  # e.g. the host's /proc mounted at /host/proc
        self._listener_ttl = listener_cache_seconds
        self._listeners: dict[int, int] = {}
        self._listeners_at = float("-inf")
        self._children: dict[int, list[int]] = {}  # ppid -> pids, the whole process table
        self._fixed: dict[int, tuple[float, str, int | None]] = {}  # pid -> (start, cgroup, NSpid)
        self._children_at = float("-inf")

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
        # A process keeps its cgroup and PID namespace for life: read them once per process
        # (pid + start time, so a reused PID is read afresh), not on every tick.
        fixed = self._fixed.get(pid)
        if fixed is None or fixed[0] != start:
            if len(self._fixed) >= 16384:  # bounded under any churn; refilled on the next ticks
                self._fixed.clear()
            base = f"{self.proc_root}/{pid}"
            fixed = self._fixed[pid] = (start, _read_small(f"{base}/cgroup"),
                                        _innermost_nspid(_read_small(f"{base}/status")))
        return ProcessInfo(pid=pid, name=name, rss_bytes=rss, start_time=start, ppid=ppid,
                           cgroup=fixed[1], ns_pid=fixed[2], cmdline=cmdline)

    def descendants(self, pid: int) -> list[int]:
        # Walking the process tree reads every /proc/<pid>/stat: do it once for all servers,
        # and reuse it a few seconds (serving processes fork their workers at start-up).
        age = time.monotonic() - self._children_at
        if age > TREE_CACHE_SECONDS or (pid not in self._children and age > 1.0):
            children: dict[int, list[int]] = {}
            for proc in psutil.process_iter(["ppid"]):
                ppid = proc.info.get("ppid")
                if ppid is not None and ppid != proc.pid:  # pid 0 is its own parent on some kernels
                    children.setdefault(ppid, []).append(proc.pid)
            self._children, self._children_at = children, time.monotonic()
        out, todo, seen = [], list(self._children.get(pid, ())), {pid}
        while todo:
            child = todo.pop()
            if child not in seen:
                seen.add(child)
                out.append(child)
                todo.extend(self._children.get(child, ()))
        return out

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


def enrich(gpus: tuple[GpuSample, ...], host: HostView, with_cmdline: bool = False,
           pods=None) -> tuple[GpuSample, ...]:
    """Fill each GPU process's host identity: name, RSS, start time, container, pod UID, NSpid,
    and in Kubernetes the pod's name and namespace. Each PID is looked up once per tick (a
    tensor-parallel process can span GPUs).

    `pods` (a kubelet.KubeletPods, anything with lookup(uid) -> Pod | None) defaults to the
    host's own `pods` attribute, so a LocalHost built for Kubernetes carries it."""
    if pods is None:
        pods = getattr(host, "pods", None)
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
            container, pod_uid, pod, namespace = pod_identity(info.cgroup, pods)
            procs.append(dataclasses.replace(
                p, name=info.name, host_rss_bytes=info.rss_bytes, start_time=info.start_time,
                container=container[:12], pod_uid=pod_uid, pod=pod, namespace=namespace,
                ns_pid=info.ns_pid, cmdline=info.cmdline if with_cmdline else ""))
        out.append(dataclasses.replace(gpu, processes=tuple(procs)))
    return tuple(out)


def pod_identity(cgroup_text: str, pods=None) -> tuple[str, str, str, str]:
    """(container id, pod UID, pod name, namespace) of a process from its /proc/<pid>/cgroup
    text; names are '' outside Kubernetes or while the kubelet does not know the UID."""
    container, pod_uid = parse_cgroup(cgroup_text)
    if not pod_uid or pods is None:
        return container, pod_uid, "", ""
    try:
        pod = pods.lookup(pod_uid)
    except Exception:  # lookup promises not to raise; a broken one must still not stop sampling
        pod = None
    if pod is None:
        return container, pod_uid, "", ""
    return container, pod_uid, pod.name, pod.namespace
