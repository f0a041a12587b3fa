"""The one shape every part shares: sources fill a Snapshot, analysis reads it.

All types are frozen dataclasses so a published snapshot can be read by scrapes on other
threads without locks. Byte counts are ints; a field that a source could not read is None
(absent in the exposition), never a made-up zero.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ProcessSample:
    """One process's use of one GPU, with its host-side identity."""

    pid: int
    used_bytes: int | None  # None: NVML reported NVML_VALUE_NOT_AVAILABLE
    kind: str = "compute"  # compute | graphics
    name: str = ""  # comm, "" when the process vanished before we looked
    host_rss_bytes: int | None = None
    start_time: float | None = None  # process creation (Unix s): tells PID reuse apart
    container: str = ""  # container id from the cgroup path
    pod_uid: str = ""
    pod: str = ""
    namespace: str = ""
    ns_pid: int | None = None  # PID inside the process's own PID namespace
    ppid: int | None = None  # parent PID: tells which vLLM server a worker belongs to
    role: str = "other"  # vllm | other
    endpoint: str = ""  # the vLLM endpoint this process serves, when role == vllm
    cmdline: str = ""  # only filled when the operator opted in

    @property
    def identity(self) -> tuple[int, float | None]:
        """PID plus start time: a reused PID is a different process."""
        return (self.pid, self.start_time)


@dataclass(frozen=True)
class GpuSample:
    """One GPU (or MIG instance) at one tick."""

    index: str  # "0", or "0/1" for a MIG instance (parent/instance)
    uuid: str
    name: str = ""
    up: bool = True
    error: str = ""  # why the GPU is down: gpu_lost, reset_required, ...
    total_bytes: int | None = None
    used_bytes: int | None = None
    free_bytes: int | None = None
    reserved_bytes: int | None = None  # driver-reserved (memory info v2)
    unified: bool = False  # memory shared with the host (GB10, Grace Hopper ATS/HMM)
    mig: bool = False
    processes: tuple[ProcessSample, ...] = ()

    @property
    def process_used_bytes(self) -> int:
        return sum(p.used_bytes or 0 for p in self.processes)


@dataclass(frozen=True)
class HostMemory:
    total_bytes: int
    available_bytes: int
    psi_some_avg10: float | None = None  # % of time some task stalled on memory, 10 s avg
    psi_full_avg10: float | None = None
    oom_kills: int | None = None  # /proc/vmstat oom_kill, a kernel counter


@dataclass(frozen=True)
class CacheConfig:
    """vLLM's `vllm:cache_config_info` labels, parsed."""

    gpu_memory_utilization: float | None = None
    num_gpu_blocks: int | None = None
    block_size: int | None = None
    cache_dtype: str = ""
    kv_cache_memory_bytes: int | None = None


@dataclass(frozen=True)
class VllmEngineStats:
    """Normalised metrics of one (model, engine) pair of a vLLM server."""

    model: str = ""
    engine: str = ""
    kv_cache_usage_ratio: float | None = None
    requests_running: float | None = None
    requests_waiting: float | None = None
    preemptions_total: float | None = None
    prefix_cache_queries_total: float | None = None
    prefix_cache_hits_total: float | None = None


@dataclass(frozen=True)
class VllmSample:
    endpoint: str
    up: bool
    error_kind: str = ""  # refused | timeout | http_status | too_large | parse | ...
    error: str = ""
    scrape_duration_seconds: float = 0.0
    engines: tuple[VllmEngineStats, ...] = ()
    cache_config: CacheConfig | None = None
    pids: tuple[int, ...] = ()  # the server's root processes (listener or PID file); descendants belong too
    memory_profile: tuple[tuple[str, int], ...] = ()  # (component, bytes) from its start-up log


@dataclass(frozen=True)
class SourceStatus:
    source: str  # nvml | host | vllm | logs
    up: bool
    duration_seconds: float = 0.0
    error: str = ""


@dataclass(frozen=True)
class SourceError:
    """One fault seen by a source during a tick; the daemon counts them."""

    source: str
    kind: str  # a short stable token: library_not_found, gpu_lost, timeout, ...
    message: str = ""


@dataclass(frozen=True)
class Snapshot:
    """Everything sampled in one tick."""

    timestamp: float  # Unix seconds (virtual time when simulated)
    gpus: tuple[GpuSample, ...] = ()
    host: HostMemory | None = None
    vllm: tuple[VllmSample, ...] = ()
    sources: tuple[SourceStatus, ...] = ()
    errors: tuple[SourceError, ...] = ()
    driver_version: str = ""
    log_events: tuple = field(default=())  # OOM events read from logs this tick

    def source_up(self, source: str) -> bool | None:
        for s in self.sources:
            if s.source == source:
                return s.up
        return None


@dataclass(frozen=True)
class OomEvent:
    """One out-of-memory message found in a log, parsed and classified."""

    kind: str  # exporter.analysis.oom.KINDS: torch_cuda_oom, vllm_*, cuda_runtime_oom, nccl_oom, kernel_oom_kill, cgroup_oom, host_memory_error, ...
    klass: str  # "class" in JSON: shortage | fragmentation | contention | configuration | host
    line: int  # 1-based line number in its file
    source: str = ""  # the log file
    message: str = ""  # the line, truncated
    gpu: str | None = None
    timestamp: float | None = None  # when known (the daemon stamps live events)
    requested_bytes: int | None = None
    total_bytes: int | None = None
    free_bytes: int | None = None
    allocated_bytes: int | None = None  # allocated by PyTorch
    reserved_bytes: int | None = None  # reserved by PyTorch (allocated + cached)
    reserved_unallocated_bytes: int | None = None
    process_bytes: int | None = None  # "this process has X memory in use"
    other_processes: tuple[tuple[int, int], ...] = ()  # (pid, bytes)
    advice: tuple[str, ...] = ()


@dataclass(frozen=True)
class Finding:
    """A detector's verdict: what is wrong, where, the numbers, and what to change."""

    kind: str  # leak | fragmentation | contention | stale_memory | pressure | oom | ...
    severity: str  # info | warning | critical
    first_detected_at: float  # Unix s: when the live daemon raised (or would have raised) it
    gpu: str | None = None
    uuid: str = ""
    pid: int | None = None
    process: str = ""
    role: str = ""
    endpoint: str = ""
    summary: str = ""  # one line for logs and alert text
    evidence: tuple[tuple[str, float | int | str], ...] = ()  # ordered (name, value) pairs
    advice: tuple[str, ...] = ()

    @property
    def key(self) -> tuple:
        """Same key across ticks = the same finding (raised once, cleared once)."""
        return (self.kind, self.gpu, self.pid, self.endpoint)

    def to_json(self) -> dict:
        return {
            "kind": self.kind, "gpu": self.gpu, "uuid": self.uuid, "pid": self.pid,
            "process": self.process, "role": self.role, "endpoint": self.endpoint,
            "severity": self.severity, "first_detected_at": self.first_detected_at,
            "summary": self.summary, "evidence": dict(self.evidence), "advice": list(self.advice),
        }


@dataclass(frozen=True)
class ProcessTrend:
    """The leak detector's view of one process on one GPU (exported for every process)."""

    gpu: str
    uuid: str
    pid: int
    process: str
    role: str
    growth_bytes_per_second: float | None  # robust slope over the window; None: too few samples
    leak_suspected: bool
    host_rss_growth_bytes_per_second: float | None = None


@dataclass(frozen=True)
class GpuAnalysis:
    gpu: str
    uuid: str
    utilization_ratio: float | None  # used / total
    admission_open: bool
    time_to_full_seconds: float | None  # None: not growing
    unattributed_bytes: int | None  # used minus what live processes account for
    # Used memory the vLLM servers did not budget for (their gpu_memory_utilization x total is
    # taken by design): other processes, vLLM over budget, memory no live process holds.
    beyond_budget_bytes: int | None = None


@dataclass(frozen=True)
class Analysis:
    timestamp: float
    findings: tuple[Finding, ...] = ()
    process_trends: tuple[ProcessTrend, ...] = ()
    gpus: tuple[GpuAnalysis, ...] = ()
