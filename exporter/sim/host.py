"""The scenario's host as the exporter sees it through the HostView interface.

Processes, their parents, cgroups and RSS, listening ports and host memory all come from the
scenario's state at the clock's time, so a process that a scenario stops disappears here at the
same moment it disappears from the fake NVML module.
"""
from __future__ import annotations

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
        """The fake vLLM server binds a free port; answer for it as for the scenario's port."""
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
            cgroup=cgroup_text(proc),
            ns_pid=proc.ns_pid if proc.ns_pid is not None else proc.pid,
            cmdline=(proc.cmdline or proc.name) if with_cmdline else "",
        )

    def pid_listening_on(self, port: int) -> int | None:
        port = self._ports.get(port, port)
        for server in self._state().vllm:
            if server.port == port and server.up:
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
