"""Which host processes belong to which vLLM server, and tagging GPU processes with it.

A vLLM server is the process listening on the endpoint's port plus its descendants: V1 runs
the API server, a `VLLM::EngineCore` child and, with tensor parallelism, `VLLM::Worker_TP*`
grandchildren, and it is those children that hold GPU memory. Operators can override the
look-up with a PID file, a container id or a process-name pattern.

Descendants are found from the other end: each GPU process walks up its parents until it meets
a server's root. That reads a few processes per tick instead of the whole process table.
"""
from __future__ import annotations

import ipaddress
import logging
import re
import socket
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

import psutil

from ..boundedio import read_head
from ..model import GpuSample, ProcessSample, VllmSample
from .hostview import HostView, ProcessInfo
from .vllm_endpoint import VllmEndpoint

log = logging.getLogger(__name__)

MAX_PID_FILE_BYTES = 64
MAX_ANCESTOR_DEPTH = 32
MAX_WARNINGS_REMEMBERED = 1000
_PID_MAX = 2 ** 22  # Linux pid_max ceiling


class PidFileError(ValueError):
    pass


def read_pid_file(path: str, max_bytes: int = MAX_PID_FILE_BYTES) -> int:
    """The PID in `path`; PidFileError with a clear reason when it is missing or not a PID."""
    try:
        raw, more = read_head(path, max_bytes)
    except OSError as exc:
        raise PidFileError(f"cannot read PID file {path}: {exc.strerror or exc}") from None
    if more:
        raise PidFileError(f"PID file {path} is longer than {max_bytes} bytes")
    text = raw.decode("ascii", errors="replace").strip()
    if not text.isdigit():
        raise PidFileError(f"PID file {path} does not hold a PID")
    pid = int(text)
    if not 1 <= pid <= _PID_MAX:
        raise PidFileError(f"PID file {path} holds an out-of-range PID {pid}")
    return pid


class ServerPids:
    """server_pids for the sampling loop, which asks every few seconds: each distinct problem
    (a missing PID file, say) is logged once, not every tick."""

    def __init__(self) -> None:
        self._warned: set[tuple[str, str]] = set()

    def __call__(self, endpoint: VllmEndpoint, host: HostView,
                 candidates: Sequence[int] = ()) -> tuple[int, ...]:
        return server_pids(endpoint, host, candidates, warn=self._warn_once)

    def _warn_once(self, label: str, message: str) -> None:
        key = (label, message)
        if key not in self._warned and len(self._warned) < MAX_WARNINGS_REMEMBERED:
            self._warned.add(key)
            log.warning("vLLM endpoint %s: %s", label, message)


def _warn(label: str, message: str) -> None:
    log.warning("vLLM endpoint %s: %s", label, message)


def server_pids(endpoint: VllmEndpoint, host: HostView, candidates: Sequence[int] = (),
                warn: Callable[[str, str], None] = _warn) -> tuple[int, ...]:
    """The server's root PIDs, sorted: their descendants belong to it too (assign_roles).
    The first configured override wins: pid_file, then container_id, then process_pattern
    (the last two pick from `candidates`, usually the PIDs NVML reports); without one, the
    listener on the endpoint's port when it is local. `warn(label, message)` hears problems."""
    if endpoint.pid_file:
        try:
            root = read_pid_file(endpoint.pid_file)
        except PidFileError as exc:
            warn(endpoint.label, str(exc))
            return ()
        return (root,)
    if endpoint.container_id:
        wanted = endpoint.container_id.strip()
        return _sorted(pid for pid in candidates if wanted in _cgroup(host, pid))
    if endpoint.process_pattern:
        pattern = re.compile(endpoint.process_pattern)
        return _sorted(pid for pid in candidates if pattern.search(_name(host, pid)))
    if not is_local_host(endpoint.hostname):
        return ()  # a remote server's processes are not on our GPUs
    listener = host.pid_listening_on(endpoint.port)
    return () if listener is None else (listener,)


def assign_roles(gpus: Iterable[GpuSample], vllm_samples: Iterable[VllmSample],
                 host: HostView) -> tuple[GpuSample, ...]:
    """New GpuSamples whose processes say role="vllm" and endpoint=<label> when they belong
    to a server (they are one of its PIDs, or descend from one), else role="other"."""
    owner: dict[int, str] = {}
    for sample in vllm_samples:
        for pid in sample.pids:
            owner.setdefault(pid, sample.endpoint)
    # The host look-up already gave each GPU process its parent; only ancestors need reading.
    parents: dict[int, int | None] = {p.pid: p.ppid for g in gpus for p in g.processes if p.ppid is not None}
    result = []
    for gpu in gpus:
        processes = []
        for proc in gpu.processes:
            endpoint = _owning_endpoint(proc.pid, owner, host, parents)
            role = "vllm" if endpoint else "other"
            # A copy only where something changes: most processes are what they were (a tick's
            # copies of every GPU process were a third of this function's cost).
            processes.append(proc if (proc.role, proc.endpoint) == (role, endpoint)
                             else replace(proc, role=role, endpoint=endpoint))
        result.append(replace(gpu, processes=tuple(processes)))
    return tuple(result)


def _owning_endpoint(pid: int, owner: dict[int, str], host: HostView,
                     parents: dict[int, int | None]) -> str:
    # Walk up the parents: a worker spawned after the PIDs were listed still belongs.
    if not owner:
        return ""
    current: int | None = pid
    for _ in range(MAX_ANCESTOR_DEPTH):
        if current is None or current <= 1:
            return ""
        if current in owner:
            return owner[current]
        if current not in parents:
            try:
                parents[current] = host.parent(current)
            except Exception as exc:
                log.debug("parent of %d: %s", current, exc)
                parents[current] = None
        current = parents[current]
    return ""


class StickyRoles:
    """A process serves its server for life. When a server shuts down, its listener goes first
    and its workers free their GPU memory a moment later: keep their role meanwhile, so the
    exit is seen as a serving process's exit."""

    def __init__(self) -> None:
        self._roles: dict[tuple[int, float | None], tuple[str, str]] = {}  # process identity -> (role, endpoint)

    def apply(self, gpus: Iterable[GpuSample]) -> tuple[GpuSample, ...]:
        roles: dict[tuple[int, float | None], tuple[str, str]] = {}
        out: list[GpuSample] = []
        for gpu in gpus:
            procs = []
            for p in gpu.processes:
                if p.role == "other" and p.start_time is not None and p.identity in self._roles:
                    role, endpoint = self._roles[p.identity]
                    p = replace(p, role=role, endpoint=endpoint)
                if p.role != "other" and p.start_time is not None:
                    roles[p.identity] = (p.role, p.endpoint)
                procs.append(p)
            out.append(replace(gpu, processes=tuple(procs)))
        self._roles = roles  # only processes alive now: bounded by the process table
        return tuple(out)


MAX_SERVER_PROCESSES = 64  # per server: an API server, engine cores, workers (TP x PP), helpers
DESCENDANTS_REFRESH_SECONDS = 30.0


def server_role(pid: int, root: int, name: str) -> str:
    """Which of a vLLM server's processes this is, from vLLM's own process titles (V1:
    `VLLM::EngineCore`, `VLLM::Worker`, `VLLM::Worker_TP1`; the kernel keeps 15 characters)."""
    if pid == root:
        return "api_server"
    if name.startswith("VLLM::EngineCor"):
        return "engine_core"
    if name.startswith("VLLM::Worker"):
        return "worker"
    return ""


class ServerProcesses:
    """Each server's own processes (its root and the root's descendants) with their host memory:
    what a server on vLLM's CPU backend holds, where no GPU lists its processes. The descendants
    are looked up again every DESCENDANTS_REFRESH_SECONDS (a walk of the process table) or as
    soon as one of them is gone; each tick reads only the known processes."""

    def __init__(self, monotonic: Callable[[], float]):
        self._monotonic = monotonic
        self._descendants: dict[int, tuple[float, tuple[int, ...]]] = {}  # root -> (when, pids)

    def __call__(self, sample: VllmSample, host: HostView) -> tuple[ProcessSample, ...]:
        now = self._monotonic()
        out: list[ProcessSample] = []
        for root in sample.pids:
            pids = (root, *self._children(root, host, now))
            infos = [(pid, _safe_process(host, pid)) for pid in pids[:MAX_SERVER_PROCESSES]]
            if any(info is None for pid, info in infos if pid != root):
                self._descendants.pop(root, None)  # one is gone: look again next tick
            out += [_server_process(info, root, sample.endpoint) for _, info in infos if info is not None]
        roots = set(sample.pids)
        for root in [r for r in self._descendants if r not in roots and now - self._descendants[r][0] > 600]:
            del self._descendants[root]  # a server restarted under another root long ago
        return tuple(out)

    def _children(self, root: int, host: HostView, now: float) -> tuple[int, ...]:
        cached = self._descendants.get(root)
        if cached is None or now - cached[0] >= DESCENDANTS_REFRESH_SECONDS:
            try:
                cached = (now, tuple(host.children(root))[:MAX_SERVER_PROCESSES])
            except Exception as exc:  # a HostView without it, or a failure: the root alone
                log.debug("descendants of %d: %s", root, exc)
                cached = (now, ())
            self._descendants[root] = cached
        return cached[1]


def _server_process(info: ProcessInfo, root: int, endpoint: str) -> ProcessSample:
    return ProcessSample(pid=info.pid, used_bytes=None, **info.sample_fields(), role="vllm", endpoint=endpoint,
                         server_role=server_role(info.pid, root, info.name))


def is_local_host(hostname: str) -> bool:
    """True when `hostname` names this machine: loopback, its hostname, or one of its
    interface addresses. Names are not resolved (no DNS in the sampling path)."""
    name = hostname.strip("[]").lower()
    if name in ("localhost", "localhost.localdomain", ""):
        return True
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return name == socket.gethostname().lower()
    if address.is_loopback or address.is_unspecified:
        return True
    try:
        local = {a.address.split("%")[0].lower() for addrs in psutil.net_if_addrs().values() for a in addrs}
    except (OSError, psutil.Error):
        return False
    return str(address) in local


def _safe_process(host: HostView, pid: int) -> ProcessInfo | None:
    try:
        return host.process(pid)
    except Exception as exc:
        log.debug("process %d: %s", pid, exc)
        return None


def _cgroup(host: HostView, pid: int) -> str:
    info = _safe_process(host, pid)
    return info.cgroup if info else ""


def _name(host: HostView, pid: int) -> str:
    info = _safe_process(host, pid)
    return info.name if info else ""


def _sorted(pids: Iterable[int]) -> tuple[int, ...]:
    return tuple(sorted(set(pids)))

