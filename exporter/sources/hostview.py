"""What the exporter needs to know about the host's processes and memory.

Two implementations: `exporter.sources.host.LocalHost` reads the real /proc through psutil;
`exporter.sim.host.SimulatedHost` answers for a scenario's made-up processes. Everything
else takes a HostView and never knows which one it has.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ..model import HostMemory

# A process name as psutil gives it: the kernel's comm (15 characters), or where comm is cut, the
# title the process set (vLLM's `VLLM::EngineCore`), bounded: longer is a command line, not a name.
MAX_NAME_CHARS = 64


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


class HostView(Protocol):
    def process(self, pid: int, with_cmdline: bool = False) -> ProcessInfo | None:
        """The process's identity, or None when it no longer exists (a normal race)."""

    def children(self, pid: int) -> tuple[int, ...]:
        """Every descendant of `pid` (children, theirs, ...); () when it has none or is gone."""

    def pid_listening_on(self, port: int) -> int | None:
        """The PID of the process with a TCP socket listening on `port`, if any is visible."""

    def memory(self) -> HostMemory | None:
        """Host memory (MemTotal/MemAvailable, PSI, oom_kill count); None if unreadable."""

    def top_processes(self, limit: int) -> tuple[ProcessInfo, ...]:
        """The `limit` processes with the most resident memory, largest first (for unified
        memory, where every host process takes from the GPU). Bounded in cost: an
        implementation may rescan all processes only now and then."""
