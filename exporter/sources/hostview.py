"""What the exporter needs to know about the host's processes and memory.

Two implementations: `exporter.sources.host.LocalHost` reads the real /proc through psutil;
`exporter.sim.host.SimulatedHost` answers for a scenario's made-up processes. Everything
else takes a HostView and never knows which one it has.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypedDict

from ..model import HostMemory
from .cgroup import parse_cgroup

# A process name as psutil gives it: the kernel's comm (15 characters), or where comm is cut, the
# title the process set (vLLM's `VLLM::EngineCore`), bounded: longer is a command line, not a name.
MAX_NAME_CHARS = 64


class HostIdentity(TypedDict):
    """What a ProcessSample takes from the host's view of its process."""
    name: str
    host_rss_bytes: int | None
    start_time: float | None
    container: str  # the container id's first 12 characters, as docker and kubectl print it
    pod_uid: str
    ns_pid: int | None
    ppid: int | None
    parent_name: str


@dataclass(frozen=True)
class ProcessInfo:
    pid: int
    name: str  # as psutil names it, at most MAX_NAME_CHARS
    rss_bytes: int | None
    start_time: float | None  # Unix seconds
    ppid: int | None = None
    parent_name: str = ""  # the parent's name, "" when unknown
    cgroup: str = ""  # raw text of /proc/<pid>/cgroup
    ns_pid: int | None = None  # innermost PID from NSpid
    cmdline: str = ""  # only read when asked for

    def sample_fields(self) -> HostIdentity:
        """The fields a ProcessSample takes from this view (the GPU process's sample, the host's
        largest processes', a vLLM server's own), in one place."""
        container, pod_uid = parse_cgroup(self.cgroup)
        return HostIdentity(name=self.name, host_rss_bytes=self.rss_bytes, start_time=self.start_time,
                            container=container[:12], pod_uid=pod_uid, ns_pid=self.ns_pid, ppid=self.ppid,
                            parent_name=self.parent_name)


class HostView(Protocol):
    def process(self, pid: int, with_cmdline: bool = False) -> ProcessInfo | None:
        """The process's identity, or None when it no longer exists (a normal race)."""

    def parent(self, pid: int) -> int | None:
        """The parent's PID, as `process` last read it (a process is re-parented rarely: an
        implementation may answer from what it read up to 30 s ago); None when gone or unknown."""

    def children(self, pid: int) -> tuple[int, ...]:
        """Every descendant of `pid` (children, theirs, ...); () when it has none or is gone."""

    def cpu_seconds(self, pids: Sequence[int]) -> float | None:
        """The CPU time (user and system) the processes have used, summed; None when one of
        them is gone or unreadable, or when the view cannot tell."""

    def pid_listening_on(self, port: int) -> int | None:
        """The PID of the process with a TCP socket listening on `port`, if any is visible."""

    def memory(self) -> HostMemory | None:
        """Host memory (MemTotal/MemAvailable, PSI, oom_kill count); None if unreadable."""

    def top_processes(self, limit: int) -> tuple[ProcessInfo, ...]:
        """The `limit` processes with the most resident memory, largest first (for unified
        memory, where every host process takes from the GPU). Bounded in cost: an
        implementation may rescan all processes only now and then."""
