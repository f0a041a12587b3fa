"""What a scenario file says, once validated: one frozen record per GPU, process, server, fault.

Curves stay curves here; `evaluate.Scenario` turns them into numbers at a given time.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .curves import Curve

# Why the GPU library fails to start, in words of no vendor: each backend's fake raises its own.
INIT_ERRORS = ("library_not_found", "driver_not_loaded", "version_mismatch")
RENAMED_INIT_ERRORS = {"lib_rm_version_mismatch": "version_mismatch"}  # old spelling -> new (deprecated)
VLLM_FAULTS = ("vllm_http_error", "vllm_slow", "vllm_garbage")
FAULT_KINDS = ("init_failure", "gpu_lost", "reset_required", "call_error") + VLLM_FAULTS


@dataclass(frozen=True)
class MigSpec:
    index: int
    profile: str
    memory_bytes: int
    gpu_instance_id: int
    compute_instance_id: int
    uuid: str


@dataclass(frozen=True)
class GpuSpec:
    index: int
    name: str
    uuid: str
    memory_bytes: int
    reserved_bytes: int
    unified: bool
    mig: tuple[MigSpec, ...] = ()

    @property
    def usable_bytes(self) -> int:
        return self.memory_bytes - self.reserved_bytes


@dataclass(frozen=True)
class HostSpec:
    memory_bytes: int
    available: Curve
    psi_some: Curve
    psi_full: Curve | None
    oom_kills: Curve
    subtract_processes: bool


@dataclass(frozen=True)
class AllocatorSpec:
    """The allocator probe in one process (docs/probe.md): PyTorch's numbers on each of its GPUs,
    derived from the process's memory curve so the two always agree. Curves run on process time."""

    non_torch: Curve  # outside PyTorch (context, NCCL, graphs): torch reserved = memory - this
    cached: Curve  # reserved but unallocated: torch allocated = reserved - this
    inactive_split: Curve  # the part of the cache in split blocks (fragmentation), <= cached
    alloc_retries: Curve  # counter
    ooms: Curve  # counter
    interval: float = 5.0  # GPUMEM_PROBE_INTERVAL
    start: float = 0.0  # process seconds: when the probe first writes (CUDA initialised)
    alloc_conf: str = ""  # PYTORCH_CUDA_ALLOC_CONF as set in the process


@dataclass(frozen=True)
class ProcessSpec:
    pid: int
    ppid: int
    name: str
    gpus: tuple[str, ...]  # "0" or "0/1" (MIG parent/instance)
    start: float
    stop: float | None
    memory: Mapping[str, Curve]  # per GPU key
    rss: Curve
    kind: str = "compute"
    cmdline: str = ""
    container: str = ""
    pod_uid: str = ""
    namespace: str = ""
    qos: str = "burstable"
    ns_pid: int | None = None
    memory_not_available: bool = False
    allocator: AllocatorSpec | None = None  # None: no probe in this process

    def alive_at(self, t: float) -> bool:
        return self.start <= t and (self.stop is None or t < self.stop)


@dataclass(frozen=True)
class StaleSpec:
    gpu: str
    bytes: int
    at: float
    until: float | None


@dataclass(frozen=True)
class CacheConfigSpec:
    gpu_memory_utilization: float
    num_gpu_blocks: int
    block_size: int
    cache_dtype: str
    enable_prefix_caching: bool = True
    kv_cache_memory_bytes: int | None = None


@dataclass(frozen=True)
class VllmSpec:
    index: int
    port: int
    pid: int
    model: str
    kv_cache_usage: Curve
    running: Curve
    waiting: Curve
    preemptions: Curve
    prefix_cache_queries: Curve
    prefix_cache_hit_ratio: float
    cache_config: CacheConfigSpec
    sleep_level: Curve | None = None  # 0 awake, 1 weights_offloaded, 2 discard_all (sleep mode)
    log_lines: tuple[tuple[float, str], ...] = ()  # (scenario seconds, line) the server logs, in time order


@dataclass(frozen=True)
class FaultSpec:
    kind: str  # one of FAULT_KINDS
    at: float
    until: float | None
    gpu: int | None = None  # None: every GPU
    error: str = ""  # init: one of INIT_ERRORS; call_error: the library's error, as its fake names it
    call: str = ""  # call_error: the GPU library's function (its fake checks the name)
    version: int | None = None  # call_error: the call's version, where the library has several; None: all
    server: int | None = None  # vLLM faults: server index; None: every server
    status: int = 500
    delay: float = 0.0

    def active_at(self, t: float) -> bool:
        return self.at <= t and (self.until is None or t < self.until)
