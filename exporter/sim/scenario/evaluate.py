"""A scenario: its specs, and the host state they give at time t (`Scenario.state_at`).

Process curves run on the process's own time (seconds since it started), so a process that
starts at 30 min begins its ramp then; host and vLLM curves run on scenario time. Values are
clamped where a real host would clamp them (no GPU holds more than it has, no ratio above 1).
"""
from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol

from .specs import AllocatorSpec, FaultSpec, GpuSpec, HostSpec, ProcessSpec, StaleSpec, VllmSpec
from .state import AllocatorState, GpuState, HostState, MigState, ProbeState, ProcessState, State, VllmState


class ScenarioClock(Protocol):
    """The time a scenario runs on: exporter.clock's VirtualClock or FixedClock."""

    @property
    def start(self) -> float:
        """Unix seconds at scenario time 0."""

    def now(self) -> float:
        """Clock time, Unix seconds."""

    def elapsed(self) -> float:
        """Clock seconds since `start`: the scenario's time."""


@dataclass
class Scenario:
    name: str
    description: str
    duration: float
    gpus: tuple[GpuSpec, ...]
    host: HostSpec
    processes: tuple[ProcessSpec, ...]
    stale_memory: tuple[StaleSpec, ...]
    vllm: tuple[VllmSpec, ...]
    faults: tuple[FaultSpec, ...]
    driver_version: str = "570.172.08"
    cuda_driver_version: int = 12080
    source: str = ""
    resolution: float = 1.0  # state_for(clock) rounds scenario time down to this many seconds
    _memo: tuple[float, State] | None = field(default=None, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def faults_at(self, t: float) -> tuple[FaultSpec, ...]:
        return tuple(f for f in self.faults if f.active_at(t))

    def replace_processes(self, processes: Iterable[ProcessSpec]) -> None:
        """Swap in a new process list, in place: the fake NVML module and the simulated host
        keep holding this Scenario. For hosts with more processes over time than one scenario
        may list (the soak benchmark's churn comes in windows)."""
        with self._lock:
            self.processes = tuple(processes)
            self._memo = None

    def state_for(self, clock: ScenarioClock) -> State:
        """The state at the clock's scenario time (a VirtualClock or FixedClock: `elapsed()`),
        rounded down to `resolution` so the many calls of one sampling tick share one evaluation."""
        t = clock.elapsed()
        if self.resolution > 0:
            t = math.floor(t / self.resolution) * self.resolution
        return self.state_at(t)

    def state_at(self, t: float) -> State:
        memo = self._memo
        if memo is not None and memo[0] == t:
            return memo[1]
        with self._lock:
            memo = self._memo
            if memo is not None and memo[0] == t:
                return memo[1]
            state = self._evaluate(float(t))
            self._memo = (t, state)
            return state

    def _evaluate(self, t: float) -> State:
        totals = {}
        for g in self.gpus:
            for m in g.mig:
                totals[f"{g.index}/{m.index}"] = m.memory_bytes
            totals[str(g.index)] = g.usable_bytes
        used: dict[str, int] = dict.fromkeys(totals, 0)
        procs = []
        for p in self.processes:
            if not p.alive_at(t):
                continue
            pt = t - p.start
            gpu_bytes = {}
            for key in p.gpus:
                v = p.memory[key](pt)
                v = int(min(max(v, 0.0), totals[key]))
                gpu_bytes[key] = v
                used[key] += v
            rss = int(max(p.rss(pt), 0.0))
            procs.append(ProcessState(
                pid=p.pid, ppid=p.ppid, name=p.name, kind=p.kind, start=p.start,
                gpu_bytes=MappingProxyType(gpu_bytes), rss_bytes=rss, cmdline=p.cmdline,
                container=p.container, pod_uid=p.pod_uid, namespace=p.namespace, qos=p.qos,
                ns_pid=p.ns_pid, memory_not_available=p.memory_not_available,
                probe=_probe_state(p.allocator, pt, gpu_bytes) if p.allocator is not None else None))
        procs.sort(key=lambda p: p.pid)
        stale: dict[str, int] = {}
        for s in self.stale_memory:
            if s.at <= t and (s.until is None or t < s.until):
                stale[s.gpu] = stale.get(s.gpu, 0) + s.bytes
                used[s.gpu] += s.bytes
        gpus = []
        for g in self.gpus:
            migs = []
            for m in g.mig:
                key = f"{g.index}/{m.index}"
                migs.append(MigState(m.index, m.profile, m.uuid, m.gpu_instance_id,
                                     m.compute_instance_id, m.memory_bytes,
                                     min(used[key], m.memory_bytes)))
            own = used[str(g.index)] + sum(m.used_bytes for m in migs)
            gpus.append(GpuState(
                index=g.index, name=g.name, uuid=g.uuid, total_bytes=g.memory_bytes,
                reserved_bytes=g.reserved_bytes, used_bytes=min(own, g.usable_bytes),
                unified=g.unified, stale_bytes=stale.get(str(g.index), 0), mig=tuple(migs)))
        host = self._host_state(t, procs, gpus)
        by_pid = {p.pid: p for p in procs}
        servers = tuple(self._vllm_state(v, t, by_pid) for v in self.vllm)
        return State(t=t, gpus=tuple(gpus), processes=tuple(procs), host=host, vllm=servers,
                     faults=self.faults_at(t), _by_pid=by_pid)

    def _host_state(self, t: float, procs: list[ProcessState], gpus: list[GpuState]) -> HostState:
        h = self.host
        avail = h.available(t)
        if h.subtract_processes:
            # On a unified-memory machine GPU allocations come out of host RAM too.
            avail -= sum(p.rss_bytes for p in procs)
            avail -= sum(g.used_bytes for g in gpus if g.unified)
        psi_full = None if h.psi_full is None else min(max(h.psi_full(t), 0.0), 100.0)
        return HostState(
            total_bytes=h.memory_bytes,
            available_bytes=int(min(max(avail, 0.0), h.memory_bytes)),
            psi_some_avg10=round(min(max(h.psi_some(t), 0.0), 100.0), 2),
            psi_full_avg10=None if psi_full is None else round(psi_full, 2),
            oom_kills=int(max(h.oom_kills(t), 0.0)))

    def _vllm_state(self, v: VllmSpec, t: float, by_pid: Mapping[int, ProcessState]) -> VllmState:
        api = by_pid.get(v.pid)
        start = next((p.start for p in self.processes if p.pid == v.pid and p.alive_at(t)),
                     next(p.start for p in self.processes if p.pid == v.pid))
        up = api is not None
        queries = int(max(v.prefix_cache_queries(t), 0.0)) if up else 0
        return VllmState(
            index=v.index, port=v.port, pid=v.pid, model=v.model, up=up, started_at=start,
            kv_cache_usage=min(max(v.kv_cache_usage(t), 0.0), 1.0) if up else 0.0,
            requests_running=int(max(round(v.running(t)), 0)) if up else 0,
            requests_waiting=int(max(round(v.waiting(t)), 0)) if up else 0,
            preemptions_total=int(max(v.preemptions(t), 0.0)) if up else 0,
            prefix_cache_queries_total=queries,
            prefix_cache_hits_total=int(queries * v.prefix_cache_hit_ratio),
            cache_config=v.cache_config,
            sleep_state=_sleep_state(v.sleep_level(t)) if up and v.sleep_level is not None else "")


SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")  # vLLM's words, by sleep level


def _sleep_state(level: float) -> str:
    return SLEEP_STATES[min(max(round(level), 0), len(SLEEP_STATES) - 1)]


def _probe_state(spec: AllocatorSpec, pt: float, gpu_bytes: Mapping[str, int]) -> ProbeState | None:
    """What the process's probe reports at process time `pt`: nothing before it first writes;
    on each GPU, PyTorch's share of the memory the GPU shows for the process, so NVML used =
    torch reserved + non-torch exactly."""
    if pt < spec.start:
        return None
    devices = {}
    for key, used in gpu_bytes.items():
        reserved = used - int(min(max(spec.non_torch(pt), 0.0), used))
        cached = int(min(max(spec.cached(pt), 0.0), reserved))
        devices[key] = AllocatorState(
            allocated_bytes=reserved - cached, reserved_bytes=reserved,
            inactive_split_bytes=int(min(max(spec.inactive_split(pt), 0.0), cached)),
            alloc_retries=int(max(spec.alloc_retries(pt), 0.0)), ooms=int(max(spec.ooms(pt), 0.0)))
    return ProbeState(spec.interval, spec.alloc_conf, MappingProxyType(devices))
