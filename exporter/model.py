"""The one shape every part shares: sources fill a Snapshot, analysis reads it.

All types are frozen dataclasses so a published snapshot can be read by scrapes on other
threads without locks. Byte counts are ints; a field that a source could not read is None
(absent in the exposition), never a made-up zero.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields

# A process: its PID and start time (a reused PID is another process).
Identity = tuple[int, "float | None"]


@dataclass(frozen=True)
class AllocatorStats:
    """PyTorch's CUDA caching allocator in one process on one GPU, as the in-process probe
    (probe/, docs/probe.md) read it. None: that torch does not report the number."""

    allocated_bytes: int | None = None  # held by live tensors
    reserved_bytes: int | None = None  # taken from the driver: allocated + cached
    active_bytes: int | None = None
    inactive_split_bytes: int | None = None  # free pieces of split blocks: fragmentation
    allocated_peak_bytes: int | None = None
    reserved_peak_bytes: int | None = None
    active_peak_bytes: int | None = None
    inactive_split_peak_bytes: int | None = None
    alloc_retries: int | None = None  # counter: cache flushed and cudaMalloc retried
    ooms: int | None = None  # counter: out-of-memory errors the allocator raised
    device_allocs: int | None = None  # counter: cudaMalloc calls
    device_frees: int | None = None
    # vLLM's sleep-mode pool, inside reserved_bytes; asleep, its physical memory is released
    # behind PyTorch's back, so NVML's figure can drop below reserved_bytes.
    cumem_bytes: int | None = None
    backend: str = ""  # native | cudaMallocAsync
    alloc_conf: tuple[tuple[str, str], ...] = ()  # (PYTORCH_[CUDA_]ALLOC_CONF, value) as set
    probe_errors: int = 0  # faults the probe counted in the process (all kinds)
    written_at: float = 0.0  # when the probe read these numbers (Unix s)
    # The probe's own identity (its file's name): where a request for allocation history goes.
    probe_pid: int | None = None  # in the process's own PID namespace
    probe_pid_ns: int = 0
    # The last allocation-history request the probe acted on (docs/probe.md): its id, state
    # (recording | done | failed, "" never asked), and the dump's file name in the probe
    # directory and size once done.
    history_request: str = ""
    history_state: str = ""
    history_file: str = ""
    history_bytes: int | None = None


@dataclass(frozen=True)
class ProcessSample:
    """One process's use of one GPU, with its host-side identity."""

    pid: int
    used_bytes: int | None  # None: the GPU library gave no figure (NVML: NVML_VALUE_NOT_AVAILABLE)
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
    # The parent's name: what started it, where its own name says nothing (a notebook kernel is
    # a "python3" whose parent is "jupyter-notebook"). "" when not known.
    parent_name: str = ""
    role: str = "other"  # vllm | other
    endpoint: str = ""  # the vLLM endpoint this process serves, when role == vllm
    # Which of its server's processes it is: api_server | engine_core | worker | "" (another
    # child, or not known); set for a vLLM server's own processes (VllmSample.processes).
    server_role: str = ""
    cmdline: str = ""  # only filled when the operator opted in
    allocator: AllocatorStats | None = None  # None: no probe in this process (or not read)

    @property
    def identity(self) -> Identity:
        """PID plus start time: a reused PID is a different process."""
        return (self.pid, self.start_time)

    @property
    def non_torch_bytes(self) -> int | None:
        """GPU memory of this process outside PyTorch's caching allocator (CUDA context, NCCL,
        CUDA graphs' driver memory, libraries calling cudaMalloc): NVML used - torch reserved.

        vLLM's sleep mode releases its pool's physical memory behind PyTorch's back, so asleep
        NVML used < reserved; then the pool (cumem) is taken out of reserved first. None (no
        number, never a made-up zero) without a probe, without either figure, or when the two
        cannot be reconciled (reserved above used with no sleep pool to explain it: the probe's
        numbers are up to one probe interval older than NVML's)."""
        stats = self.allocator
        if stats is None or stats.reserved_bytes is None or self.used_bytes is None:
            return None
        if self.used_bytes >= stats.reserved_bytes:
            return self.used_bytes - stats.reserved_bytes
        if stats.cumem_bytes and self.used_bytes >= stats.reserved_bytes - stats.cumem_bytes:
            return self.used_bytes - (stats.reserved_bytes - stats.cumem_bytes)
        return None


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
class GpuTools:
    """How a person inspects, lists the holders of and resets a GPU with its vendor's own tools,
    for the advice of findings. Each GPU backend declares its own (sources/gpu.py); the defaults
    say it in words that fit any vendor. `{gpu}` in a command stands for the GPU's index."""

    tool: str = "the GPU vendor's tool"  # what the sentences name when a command is not known
    reset: str = ""  # resets one GPU, e.g. `<tool> reset {gpu}`
    inspect: str = ""  # shows one GPU's state
    list_processes: str = ""  # lists the processes using GPU memory, with their bytes
    device_files: str = ""  # the device files a process holds a GPU through (for fuser)
    kernel_errors: str = "the driver's errors"  # what to look for in `dmesg` when a GPU fails
    lost_error: str = ""  # the kernel's message for a GPU that fell off the bus

    def command(self, which: str, gpu: str = "") -> str:
        """One of the commands above for GPU `gpu`, in backquotes; "" where the backend has none."""
        text: str = getattr(self, which)
        return f"`{text.replace('{gpu}', gpu or 'N')}`" if text else ""


NEUTRAL_TOOLS = GpuTools()  # what advice says where no backend declared its tools (a replayed trace)


@dataclass(frozen=True)
class HostMemory:
    total_bytes: int
    available_bytes: int
    psi_some_avg10: float | None = None  # % of time some task stalled on memory, 10 s avg
    psi_full_avg10: float | None = None
    oom_kills: int | None = None  # /proc/vmstat oom_kill, a kernel counter


@dataclass(frozen=True)
class CacheConfig:
    """vLLM's `vllm:cache_config_info` labels, parsed (engine 0's with data parallelism)."""

    gpu_memory_utilization: float | None = None
    num_gpu_blocks: int | None = None
    block_size: int | None = None
    cache_dtype: str = ""
    # Prefix caching and KV offloading (to host memory: vLLM's "native" backend, LMCache, ...):
    # the labels as vLLM prints them ("True"/"False", "None" for unset), "" where not reported.
    enable_prefix_caching: str = ""
    kv_offloading_backend: str = ""
    kv_offloading_size: str = ""
    # --kv-cache-memory: the KV cache size per GPU; when set, vLLM ignores gpu_memory_utilization.
    kv_cache_memory_bytes: int | None = None
    # The KV capacity vLLM computed at start-up (0.11+), per data-parallel engine: tokens that fit
    # (group-aware, so right for hybrid models where blocks x block size is not), and how many
    # requests of max_model_len tokens fit at once.
    kv_cache_size_tokens: int | None = None
    kv_cache_max_concurrency: float | None = None

    @property
    def kv_capacity_tokens(self) -> int | None:
        """Tokens the KV cache holds: vLLM's own figure, else GPU blocks x block size."""
        if self.kv_cache_size_tokens is not None:
            return self.kv_cache_size_tokens
        if self.num_gpu_blocks is not None and self.block_size is not None:
            return self.num_gpu_blocks * self.block_size
        return None


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
    # vllm:num_requests_waiting_by_reason (0.2x+): (reason, requests), "capacity" (waiting for the
    # scheduler's capacity: KV cache, max_num_seqs) or "deferred" (LoRA budget and the like).
    requests_waiting_by_reason: tuple[tuple[str, float], ...] = ()
    # vllm:request_num_preemptions (a histogram over finished requests): its sum (preemptions of
    # the requests that finished) and count (requests that finished); per request = sum / count.
    request_preemptions_total: float | None = None
    requests_finished_total: float | None = None
    # vllm:engine_sleep_state, in vLLM's words: awake | weights_offloaded (sleep level 1) |
    # discard_all (level 2) | asleep (no level given); "" when the server does not report it.
    sleep_state: str = ""


@dataclass(frozen=True)
class MemoryProfile:
    """A vLLM server's own account of its memory at its latest start, from its log, per GPU
    (the first worker's with tensor parallelism); None = not logged. See sources/vllm_log.py."""

    weights_bytes: int | None = None
    kv_cache_bytes: int | None = None  # negative when vLLM found no room: it then fails to start
    activation_peak_bytes: int | None = None
    non_torch_bytes: int | None = None
    cuda_graph_bytes: int | None = None  # measured at capture when logged, else vLLM's estimate
    total_gpu_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    non_kv_cache_bytes: int | None = None
    kv_cache_tokens: int | None = None
    num_gpu_blocks: int | None = None
    # From the INFO start-up summary of vLLM 0.11+ (gpu_worker.py) and its neighbours:
    free_at_start_bytes: int | None = None  # free on the device when the worker started
    requested_bytes: int | None = None  # gpu_memory_utilization x total: the budget it sized within
    consumed_bytes: int | None = None  # weights + non-torch, measured with cudaMemGetInfo
    cuda_graph_estimate_bytes: int | None = None  # the profiler's estimate before capture
    kv_cache_max_concurrency: float | None = None  # requests of max_model_len that fit
    max_model_len: int | None = None  # tokens per request the KV cache was sized for
    kv_cache_memory_flag_bytes: int | None = None  # --kv-cache-memory as the worker applied it
    # Sleep mode (gpu_worker.py): the last "Sleep mode freed X GiB memory, Y GiB ... still in use".
    sleep_freed_bytes: int | None = None
    sleep_still_in_use_bytes: int | None = None
    sleeps: int = 0  # sleep lines since this start
    error: str = ""  # why the log could not be read

    def components(self) -> dict[str, int]:
        """The `component` values of gpumem_vllm_memory_profile_bytes that are known."""
        named = {"weights": self.weights_bytes, "kv_cache": self.kv_cache_bytes,
                 "activation_peak": self.activation_peak_bytes, "non_torch": self.non_torch_bytes,
                 "cuda_graph": self.cuda_graph_bytes}
        return {k: v for k, v in named.items() if v is not None}

    @property
    def empty(self) -> bool:
        return not self.sleeps and all(getattr(self, f.name) is None for f in fields(self)
                                       if f.name not in ("error", "sleeps"))


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
    # The server's own processes (the listener and its descendants) with their host memory, GPU
    # or not: on vLLM's CPU backend the model and KV cache live here, in host memory.
    processes: tuple[ProcessSample, ...] = ()
    memory_profile: tuple[tuple[str, int], ...] = ()  # (component, bytes) from its start-up log
    startup: MemoryProfile | None = None  # all of its start-up log's figures (memory_profile's source)
    # Metrics whose values were impossible (negative, NaN, a ratio over 1): dropped from this
    # sample, to be counted as gpumem_vllm_scrape_errors_total{kind="out_of_range"}.
    rejected_metrics: tuple[str, ...] = ()
    truncated: bool = False  # the page held more vllm: lines than its budget: the rest unread
    # vllm:admission_rejections_total (per model, no engine): (model, reason, rejections), the
    # requests refused by a queue limit (max_num_queued_reqs, max_num_queued_tokens).
    admission_rejections: tuple[tuple[str, str, float], ...] = ()
    # Seconds since this page was read: 0 when read this tick; an idle server's is read less often
    # (sources/vllm_idle.py), and shown again meanwhile.
    page_age_seconds: float = 0.0


@dataclass(frozen=True)
class SourceStatus:
    source: str  # nvml | host | vllm | logs
    up: bool
    duration_seconds: float = 0.0
    error: str = ""


@dataclass(frozen=True)
class SourceError:
    """A fault seen by a source during a tick; the daemon counts them. Faults of one kind in one
    tick are kept as one record (sources/source.collect): the first message and how many."""

    source: str
    kind: str  # a short stable token: library_not_found, gpu_lost, timeout, ...
    message: str = ""
    count: int = 1  # faults of this kind this tick


# The budgets that bound what one input can add to a tick (docs/memory.md). What a budget keeps
# out is counted in Snapshot.dropped and exported as gpumem_exporter_budget_dropped_total{budget}:
BUDGETS = (
    "probe_files",  # probe files named for one process, past the few opened per tick
    "source_errors",  # fault records of kinds past a source's per-tick limit (still counted)
    "log_events",  # out-of-memory messages past the per-tick limit
    "log_lines",  # log lines cut at the line limit (their rest skipped unread as text)
    "history_log_events",  # messages the raw history let go of to stay within its limit
    "vllm_pages",  # vLLM pages cut at the per-page limit of vllm: lines (the rest unread)
)


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
    # Out-of-memory messages read from logs this tick, as parsed; the analysis classifies them.
    log_events: tuple[OomMessage, ...] = ()
    # The host processes holding the most resident memory, largest first, GPU processes or not
    # (used_bytes None): read where a GPU shares the host's memory (unified memory), since
    # there any process takes from the GPU. Empty elsewhere.
    host_processes: tuple[ProcessSample, ...] = ()
    # What the inputs' budgets kept out of this tick: (one of BUDGETS, how many), counted by the
    # daemon; never the dropped data itself.
    dropped: tuple[tuple[str, int], ...] = ()

    def source_up(self, source: str) -> bool | None:
        for s in self.sources:
            if s.source == source:
                return s.up
        return None


@dataclass(frozen=True)
class ServerSettings:
    """A vLLM server's settings as its log states them (sources/vllm_args.py); None = not stated.
    What advice reads so that it never suggests what is already set."""

    source: str = ""  # where they were read: "non-default args" | "command line" | "" (engine lines only)
    tensor_parallel_size: int | None = None
    pipeline_parallel_size: int | None = None
    data_parallel_size: int | None = None
    max_model_len: int | None = None
    gpu_memory_utilization: float | None = None
    kv_cache_memory_bytes: int | None = None  # --kv-cache-memory-bytes as given
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    kv_cache_dtype: str | None = None
    quantization: str | None = None
    sleep_mode: bool | None = None
    backend: str = ""  # "cpu" when the log shows vLLM's CPU backend
    memory_node: str = ""  # the CPU backend's memory (NUMA) node
    # The CPU backend said "Explicitly set (...) GiB for KV cache": the KV size was given, by
    # --kv-cache-memory-bytes or VLLM_CPU_KVCACHE_SPACE (which vLLM turns into it).
    kv_cache_explicit: bool = False

    @property
    def explicit_kv_cache(self) -> bool:
        """The KV cache size was given, so gpu_memory_utilization sizes nothing."""
        return self.kv_cache_memory_bytes is not None or self.kv_cache_explicit

    @property
    def empty(self) -> bool:
        return self == ServerSettings()

    def stated(self) -> dict[str, object]:
        """The fields the log stated (for JSON and evidence)."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) not in (None, "", False)}


# What an OomMessage can be (its `kind`), as sources/oom_messages.py finds them.
OOM_KINDS = (
    "torch_cuda_oom",  # PyTorch's caching allocator: CUDA, ROCm/HIP and Ascend NPU alike
    "vllm_insufficient_memory",  # vLLM start-up: free memory below its budget; sampler warm-up
    "vllm_kv_cache_too_small",
    "sglang_kv_cache_too_small",
    "tgi_warmup_oom",
    "cuda_runtime_oom",  # a CUDA/HIP call outside PyTorch's allocator (cuBLAS, kernels, ...)
    "nccl_oom",
    "kernel_oom_kill",
    "cgroup_oom",
    "container_oom_killed",  # Kubernetes / Docker reporting a container OOM-killed
    "ray_oom_kill",  # Ray's memory monitor killed a worker
    "host_memory_error",  # Python MemoryError, PyTorch's CPU allocator
    "vllm_cpu_memory_check",  # vLLM's CPU backend: its memory node has less available than it wants
)
# The kinds about host RAM rather than GPU memory.
HOST_OOM_KINDS = frozenset({"kernel_oom_kill", "cgroup_oom", "container_oom_killed",
                            "ray_oom_kill", "host_memory_error", "vllm_cpu_memory_check"})


@dataclass(frozen=True)
class OomMessage:
    """An out-of-memory message found in a log, with the numbers it states (sources/oom_messages).

    Sizes are bytes, None where the message does not say. The parser only reads; what the
    numbers mean (the class, the advice) is decided in analysis/oom.py.
    """

    kind: str  # one of OOM_KINDS
    line: int  # 1-based line number in its file
    source: str = ""  # the log file
    message: str = ""  # the message, one line, truncated, secrets masked
    gpu: str | None = None
    timestamp: float | None = None  # when known (the daemon stamps live events)
    requested_bytes: int | None = None
    total_bytes: int | None = None
    free_bytes: int | None = None
    allocated_bytes: int | None = None  # allocated by PyTorch
    reserved_bytes: int | None = None  # reserved by PyTorch (allocated + cached)
    reserved_unallocated_bytes: int | None = None
    # This process's GPU memory ("this process has X", or the listed process that is this one);
    # for a host kill, the victim's resident memory.
    process_bytes: int | None = None
    other_processes: tuple[tuple[int, int], ...] = ()  # (pid, bytes): other GPU processes listed
    processes_listed: bool = False  # the message carried the GPU's process list
    allowed_bytes: int | None = None  # PyTorch's per-process cap ("X allowed")
    allocator_hint: str = ""  # the allocator setting the message itself suggests
    gpu_memory_utilization: float | None = None  # vLLM start-up: the configured fraction
    max_model_len: int | None = None  # vLLM start-up: the configured --max-model-len
    max_model_len_fits: int | None = None  # vLLM start-up: the length the KV cache can hold
    batch: int | None = None  # warm-up batch that failed: vLLM dummy requests, TGI prefill tokens
    victim_pid: int | None = None  # host kills: the killed process
    victim_name: str = ""
    memory_limit: str = ""  # host kills: the cgroup (or Ray threshold) whose limit was hit
    memory_node: str | None = None  # vLLM's CPU backend: the memory (NUMA) node its check read
    # The server's settings as its log stated them before this message (vLLM logs only).
    settings: ServerSettings = field(default_factory=ServerSettings)


@dataclass(frozen=True, kw_only=True)
class OomEvent(OomMessage):
    """An OomMessage with its verdict (analysis/oom.classify): the class, why, and what to do."""

    klass: str  # "class" in JSON: shortage | fragmentation | contention | configuration | host
    verdict: str = ""  # the counterfactual that decided the class, with the numbers
    shortfall_bytes: int | None = None  # requested - free, where both are known
    causes: tuple[tuple[str, int], ...] = ()  # (cause, bytes) that contributed, largest first
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
    def key(self) -> tuple[str, str | None, int | None, str]:
        """Same key across ticks = the same finding (raised once, cleared once)."""
        return (self.kind, self.gpu, self.pid, self.endpoint)

    def to_json(self) -> dict[str, object]:
        return {
            "kind": self.kind, "gpu": self.gpu, "uuid": self.uuid, "pid": self.pid,
            "process": self.process, "role": self.role, "endpoint": self.endpoint,
            "severity": self.severity, "first_detected_at": self.first_detected_at,
            "summary": self.summary, "evidence": dict(self.evidence), "advice": list(self.advice),
        }


@dataclass
class Episode:
    """One finding from raise to clear: `finding` is its worst (then latest) version, reported
    at `reported_at`; `raised` the version that raised it; `cleared_at` None while active;
    `eased` the newest version, reported at `eased_at`, where the finding went on less severe
    than its worst (None where its newest is its worst)."""

    finding: Finding
    raised: Finding
    reported_at: float
    cleared_at: float | None = None
    eased: Finding | None = None
    eased_at: float | None = None

    @property
    def updated(self) -> bool:
        """Whether the version shown says something else than the one that raised it (its words
        are then dated)."""
        return self.finding != self.raised


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
    # Used memory the vLLM servers did not budget for (their budget, analysis.budget, is taken
    # by design): other processes, vLLM over budget, memory no live process holds.
    beyond_budget_bytes: int | None = None
    # The vLLM servers (endpoints) with a process on this GPU; for a GPU that does not answer,
    # those it had when it last did.
    servers: tuple[str, ...] = ()
    # Why admission is closed when its memory is not why: a server on it also spans a GPU that
    # does not answer (a tensor-parallel server fails on every GPU it spans). "" otherwise.
    closed_because: str = ""


@dataclass(frozen=True)
class Budget:
    """A vLLM server's memory budget on one GPU (analysis.budget), against what it uses."""

    endpoint: str
    gpu: str
    uuid: str
    budget_bytes: int | None  # None: the figures it is computed from are unknown
    used_bytes: int | None  # None: NVML gave no per-process figure for any of its processes
    # How budget_bytes was computed: "gpu_memory_utilization" (x total) or "kv_cache_memory"
    # (--kv-cache-memory plus the start-up profile's non-KV memory); "" when unknown. Says how,
    # not what: two budgets of the same bytes are equal whatever the basis.
    basis: str = field(default="", compare=False)


@dataclass(frozen=True)
class KvCache:
    """One vLLM engine's KV cache: capacity (per GPU) and what is in use (analysis.kv_cache)."""

    endpoint: str
    model: str
    engine: str
    capacity_tokens: int | None = None  # tokens the cache holds
    capacity_bytes: int | None = None  # the KV cache's memory on each of its GPUs
    usage_ratio: float | None = None
    used_tokens: int | None = None  # usage ratio x capacity tokens
    used_bytes: int | None = None  # usage ratio x capacity bytes, per GPU
    max_model_len: int | None = None
    # Requests of max_model_len tokens that fit at once: vLLM's own figure where it gives one,
    # else capacity tokens / max_model_len.
    max_concurrency: float | None = None


# What changed at a tick that deserves a recording of the moments before it (the flight
# recorder's triggers): an OOM event was read, a finding became critical, a serving process
# left a GPU that stayed up.
TRANSITIONS = ("oom", "critical", "vllm_exit")


@dataclass(frozen=True)
class Analysis:
    """What the analysis decided at one tick; everything downstream reads it, nothing
    recomputes it."""

    timestamp: float
    findings: tuple[Finding, ...] = ()  # active now
    process_trends: tuple[ProcessTrend, ...] = ()
    gpus: tuple[GpuAnalysis, ...] = ()
    budgets: tuple[Budget, ...] = ()  # per (vLLM server, GPU)
    kv_caches: tuple[KvCache, ...] = ()  # per (vLLM server, model, engine)
    transitions: tuple[str, ...] = ()  # of TRANSITIONS, each at most once
    oom_events: tuple[OomEvent, ...] = ()  # this tick's log messages, classified
    # The `oom` findings raised within the last RECENT_OOM_SECONDS, newest first, each with when
    # it cleared (None while active): the status page shows the last OOM after its finding's hold.
    recent_ooms: tuple[tuple[Finding, float | None], ...] = ()


RECENT_OOM_SECONDS = 24 * 3600.0


@dataclass(frozen=True)
class RecorderStats:
    """A consistent copy of the counters, for the exposition (read from any thread)."""

    writes_total: int = 0
    errors_total: Mapping[str, int] = field(default_factory=dict)  # kind -> count
    triggers_total: Mapping[str, int] = field(default_factory=dict)  # trigger -> count (fired)
    debounced_total: Mapping[str, int] = field(default_factory=dict)  # trigger -> suppressed
    coalesced_total: int = 0  # triggers merged into a pending write
    rotated_total: int = 0  # files deleted by rotation
    last_write_timestamp: float | None = None  # `now()` when the last file was complete
    last_file: str = ""


@dataclass(frozen=True)
class AllocHistoryStats:
    """The allocation-history requests the exporter made (reactions/alloc_history.py)."""

    requests_total: Mapping[str, int] = field(default_factory=dict)  # result -> count
    results_total: Mapping[str, int] = field(default_factory=dict)  # probe's outcome -> count


@dataclass(frozen=True)
class ListenerStats:
    """One HTTP listener's connection budgets (serve/admission.py), read at scrape time."""

    listener: str  # the configuration key it serves: listen, health_listen
    open_connections: int
    refused_total: Mapping[str, int]  # the limit that refused -> connections closed at once
    evicted_total: int  # connections displaced to make room


@dataclass(frozen=True)
class ReloadStats:
    """How the last configuration load went (SIGHUP's reload; the start counts as one, as in
    Prometheus's prometheus_config_last_reload_* metrics)."""

    successful: bool
    last_success_at: float  # clock time of the last successful load


@dataclass(frozen=True)
class State:
    """What a scrape renders. Replaced whole after every tick."""

    snapshot: Snapshot | None = None
    analysis: Analysis | None = None
    errors_total: Mapping[tuple[str, str], int] = field(default_factory=dict)  # (source, kind)
    vllm_errors_total: Mapping[tuple[str, str], int] = field(default_factory=dict)  # (endpoint, kind)
    oom_events_total: Mapping[tuple[str, str], int] = field(default_factory=dict)  # (kind, class)
    budget_dropped_total: Mapping[str, int] = field(default_factory=dict)  # one of BUDGETS -> count
    recorder: RecorderStats | None = None  # when the flight recorder is on
    alloc_history: AllocHistoryStats | None = None  # when allocator.history is on
    reload: ReloadStats | None = None  # in `run` (the daemon that reloads on SIGHUP)
    samples_total: int = 0
    last_sample_at: float | None = None  # clock time the last tick completed
    sample_duration_seconds: float = 0.0
