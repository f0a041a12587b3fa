"""The scenario's host as the exporter sees it through the HostView interface.

Processes, their parents, cgroups and RSS, listening ports and host memory all come from the
scenario's state at the clock's time, so a process that a scenario stops disappears here at the
same moment it disappears from the fake NVML module.

A scenario server listens only on the socket its fake vLLM server really holds (alias_port),
never on the port number the scenario file gives it: a real vLLM configured beside a simulation
(`run --simulate steady --vllm-endpoint http://127.0.0.1:8000/metrics`, with the scenario's
server on 8000 too) is never taken for the simulated one, and never given its processes.
"""
from __future__ import annotations

from collections.abc import Sequence

from ..model import HostMemory
from ..sources.hostview import ProcessInfo
from .scenario import Scenario, ScenarioClock
from .scenario.state import ProcessState, State


def cgroup_text(proc: ProcessState) -> str:
    """/proc/<pid>/cgroup in the cgroup v2 shape a real host of that kind shows."""
    if proc.pod_uid:
        qos = proc.qos
        uid = proc.pod_uid.replace("-", "_")
        if qos == "guaranteed":  # guaranteed pods sit directly under kubepods.slice
            slice_ = f"kubepods.slice/kubepods-pod{uid}.slice"
        else:
            slice_ = f"kubepods.slice/kubepods-{qos}.slice/kubepods-{qos}-pod{uid}.slice"
        return f"0::/{slice_}/cri-containerd-{proc.container}.scope\n"
    if proc.container:
        return f"0::/system.slice/docker-{proc.container}.scope\n"
    return "0::/user.slice/user-1000.slice/session-2.scope\n"


class SimulatedHost:
    """HostView over a scenario: process(pid), pid_listening_on(port), memory()."""

    def __init__(self, scenario: Scenario, clock: ScenarioClock):
        self.scenario = scenario
        self.clock = clock
        self._ports: dict[int, int] = {}  # port a fake vLLM server really bound -> the scenario's port

    def alias_port(self, bound: int, scenario_port: int) -> None:
        """A fake vLLM server of this simulation holds the socket on `bound` and serves the
        scenario's server(s) on `scenario_port`: the only port where this host says a scenario
        server listens."""
        self._ports[bound] = scenario_port

    def _state(self) -> State:
        return self.scenario.state_for(self.clock)

    def process(self, pid: int, with_cmdline: bool = False) -> ProcessInfo | None:
        proc = self._state().process(pid)
        return None if proc is None else self._info(proc, with_cmdline)

    def top_processes(self, limit: int) -> tuple[ProcessInfo, ...]:
        largest = sorted(self._state().processes, key=lambda p: (-p.rss_bytes, p.pid))[:limit]
        return tuple(self._info(p) for p in largest)

    def _info(self, proc: ProcessState, with_cmdline: bool = False) -> ProcessInfo:
        return ProcessInfo(
            pid=proc.pid,
            name=proc.name,
            rss_bytes=proc.rss_bytes,
            start_time=self.clock.start + proc.start,
            ppid=proc.ppid,
            parent_name=self._name_of(proc.ppid),
            cgroup=cgroup_text(proc),
            ns_pid=proc.ns_pid if proc.ns_pid is not None else proc.pid,
            cmdline=(proc.cmdline or proc.name) if with_cmdline else "",
        )

    def _name_of(self, pid: int) -> str:
        parent = self._state().process(pid)
        return parent.name if parent is not None else ""

    def parent(self, pid: int) -> int | None:
        info = self.process(pid)
        return info.ppid if info is not None else None

    def children(self, pid: int) -> tuple[int, ...]:
        kids: dict[int | None, list[int]] = {}
        for proc in self._state().processes:
            kids.setdefault(proc.ppid, []).append(proc.pid)
        out: list[int] = []
        todo = list(kids.get(pid, ()))
        while todo and len(out) < 4096:
            child = todo.pop()
            out.append(child)
            todo += kids.get(child, ())
        return tuple(sorted(out))

    def cpu_seconds(self, pids: Sequence[int]) -> float | None:
        return None  # a scenario plays no CPU time: its servers' pages are read every tick

    def pid_listening_on(self, port: int) -> int | None:
        scenario_port = self._ports.get(port)
        if scenario_port is None:  # no socket of ours: a real server's port, or nobody's
            return None
        for server in self._state().vllm:
            if server.port == scenario_port and server.up:
                return server.pid
        return None

    def memory(self) -> HostMemory | None:
        h = self._state().host
        return HostMemory(
            total_bytes=h.total_bytes,
            available_bytes=h.available_bytes,
            psi_some_avg10=h.psi_some_avg10,
            psi_full_avg10=h.psi_full_avg10,
            oom_kills=h.oom_kills,
        )
