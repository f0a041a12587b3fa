"""The allocator probes of a scenario's processes: the files the real probe (probe/, docs/probe.md)
would write, built by its own schema module (gpumem_probe.schema), into a private directory the
`allocator` source reads.

The real probe rewrites its file every GPUMEM_PROBE_INTERVAL seconds on its own thread; a
simulated clock may run hundreds of times faster than that thread could keep up with, so here
the files are brought up to the clock's moment just before each read (`ProbedSource`), the way
the fake vLLM server answers with the state at the moment it is asked. What the source reads
is exactly what a probe at that moment would have written: same names, same keys, written
atomically (temporary file, then rename); a process that stopped has its file removed, as the
probe's exit handler does.

The simulated processes' PID namespace is written as 0 ("the probe could not read it"): they
have no real namespace to compare with, so the source matches them by PID and start time alone.
"""
from __future__ import annotations

import math
import os

import gpumem_probe
from gpumem_probe import schema

from ..model import Snapshot
from ..sources.source import Reading, Source
from .scenario import Scenario, ScenarioClock
from .scenario.state import ProcessState

TORCH_VERSION = "2.6.0+cu124"
PID_NAMESPACE = 0  # unreadable, as far as the reader is concerned (see the module docstring)


def file_name(pid: int) -> str:
    return schema.file_name(PID_NAMESPACE, pid)


def _uuid(uuid: str) -> str:
    """CUDA's device UUID: NVML's without its GPU-/MIG- prefix."""
    return uuid.split("-", 1)[1] if uuid.startswith(("GPU-", "MIG-")) else uuid


class SimulatedProbes:
    def __init__(self, scenario: Scenario, clock: ScenarioClock, directory: str):
        self.scenario = scenario
        self.clock = clock
        self.directory = directory
        self._written: set[str] = set()
        self._seq: dict[str, int] = {}

    def write(self) -> None:
        """Every probed process's file as of the clock's moment; files of processes gone removed."""
        state = self.scenario.state_for(self.clock)
        uuids = {str(g.index): g.uuid for g in state.gpus}
        uuids.update({f"{g.index}/{m.index}": m.uuid for g in state.gpus for m in g.mig})
        now = self.clock.now()
        current = set()
        for proc in state.processes:
            if proc.probe is None:
                continue
            own_pid = proc.ns_pid if proc.ns_pid is not None else proc.pid
            name = file_name(own_pid)
            current.add(name)
            self._seq[name] = self._seq.get(name, 0) + 1
            self._write(name, self.document(proc, own_pid, now, uuids, self._seq[name]))
        for name in self._written - current:
            self._seq.pop(name, None)
            try:
                os.unlink(os.path.join(self.directory, name))
            except FileNotFoundError:
                pass
        self._written = current

    def document(self, proc: ProcessState, own_pid: int, now: float, uuids: dict[str, str],
                 seq: int) -> dict[str, object]:
        probe = proc.probe
        assert probe is not None
        start_time = self.clock.start + proc.start
        # The probe reads every interval: the numbers are from its last read, not this instant.
        written_at = max(start_time, math.floor(now / probe.interval) * probe.interval)
        # Peaks and the driver's alloc/free counts are not simulated: null, as an old torch writes them.
        devices = [schema.device(index, _uuid(uuids[key]), {
            "allocated_bytes": numbers.allocated_bytes, "reserved_bytes": numbers.reserved_bytes,
            "active_bytes": numbers.allocated_bytes, "inactive_split_bytes": numbers.inactive_split_bytes,
            "alloc_retries": numbers.alloc_retries, "ooms": numbers.ooms})
            for index, (key, numbers) in enumerate(probe.devices.items())]
        return schema.document(
            probe_version=gpumem_probe.__version__, pid=own_pid, pid_ns=PID_NAMESPACE, start_ticks=None,
            start_time=start_time, written_at=written_at, interval=probe.interval, seq=seq,
            torch_version=TORCH_VERSION, backend="native",
            alloc_conf={"PYTORCH_CUDA_ALLOC_CONF": probe.alloc_conf} if probe.alloc_conf else {},
            errors=dict.fromkeys(schema.ERROR_KINDS, 0), devices=devices, history=None)

    def _write(self, name: str, doc: dict[str, object]) -> None:
        path = os.path.join(self.directory, name)
        temp = os.path.join(self.directory, schema.temp_name(name))
        with open(temp, "wb") as fh:
            fh.write(schema.encode(doc))
        os.replace(temp, path)


class ProbedSource:
    """The `allocator` source over a simulated host: the probes write, then the source reads."""

    def __init__(self, probes: SimulatedProbes, source: Source):
        self.probes = probes
        self.source = source
        self.name, self.needs, self.gives = source.name, source.needs, source.gives

    def collect(self, snapshot: Snapshot) -> Reading:
        self.probes.write()
        return self.source.collect(snapshot)

    def close(self) -> None:
        self.source.close()
