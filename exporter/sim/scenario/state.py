"""What the simulated host looks like at one moment: the numbers every fake reports.

The fake NVML module, the simulated host and the fake vLLM server all read one State per
moment, so they always agree with each other.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .specs import CacheConfigSpec, FaultSpec


@dataclass(frozen=True)
class MigState:
    index: int
    profile: str
    uuid: str
    gpu_instance_id: int
    compute_instance_id: int
    total_bytes: int
    used_bytes: int


@dataclass(frozen=True)
class GpuState:
    index: int
    name: str
    uuid: str
    total_bytes: int
    reserved_bytes: int
    used_bytes: int  # NVML v2 meaning: excludes the driver-reserved part
    unified: bool
    stale_bytes: int = 0
    mig: tuple[MigState, ...] = ()

    @property
    def free_bytes(self) -> int:
        return self.total_bytes - self.reserved_bytes - self.used_bytes


@dataclass(frozen=True)
class AllocatorState:
    """What the probe in one process reports for one GPU at one moment."""

    allocated_bytes: int
    reserved_bytes: int
    inactive_split_bytes: int
    alloc_retries: int
    ooms: int


@dataclass(frozen=True)
class ProbeState:
    """The probe in one process: its settings and its numbers per GPU key."""

    interval: float
    alloc_conf: str
    devices: Mapping[str, AllocatorState]  # GPU key ("0", "0/1") -> numbers


@dataclass(frozen=True)
class ProcessState:
    pid: int
    ppid: int
    name: str
    kind: str
    start: float  # scenario seconds
    gpu_bytes: Mapping[str, int]  # GPU key ("0", "0/1") -> bytes
    rss_bytes: int
    cmdline: str = ""
    container: str = ""
    pod_uid: str = ""
    namespace: str = ""
    qos: str = "burstable"
    ns_pid: int | None = None
    memory_not_available: bool = False
    probe: ProbeState | None = None  # None: no probe, or it has not written yet


@dataclass(frozen=True)
class HostState:
    total_bytes: int
    available_bytes: int
    psi_some_avg10: float
    psi_full_avg10: float | None
    oom_kills: int


@dataclass(frozen=True)
class VllmState:
    index: int
    port: int
    pid: int
    model: str
    up: bool  # the API server process is alive
    started_at: float  # scenario seconds when the API server started
    kv_cache_usage: float
    requests_running: int
    requests_waiting: int
    preemptions_total: int
    prefix_cache_queries_total: int
    prefix_cache_hits_total: int
    cache_config: CacheConfigSpec
    sleep_state: str = ""  # vllm:engine_sleep_state's: awake, weights_offloaded, discard_all; "" if none


@dataclass(frozen=True)
class State:
    t: float
    gpus: tuple[GpuState, ...]
    processes: tuple[ProcessState, ...]  # live ones, by pid
    host: HostState
    vllm: tuple[VllmState, ...]
    faults: tuple[FaultSpec, ...]  # active at t
    _by_pid: Mapping[int, ProcessState] = field(default_factory=dict, repr=False, compare=False)

    def process(self, pid: int) -> ProcessState | None:
        return self._by_pid.get(pid)
