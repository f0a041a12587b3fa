"""Every metric family the exporter serves, declared once: the exposition creates its families
from these declarations, docs/metrics.md is written from them (`python -m exporter.catalogue.docs`),
and the tests check every `gpumem_` name used in the repository against them.

Declared in the order docs/metrics.md describes them, section by section. A family's `doc` is its
row in that page; a section's `intro` and `outro` are the page's prose around the table.
"""
from __future__ import annotations

from .family import Family, Section, Stability, counter, gauge

EXPERIMENTAL = Stability.EXPERIMENTAL

# Label sets several families share.
GPU = ("gpu", "uuid")
PROCESS = ("gpu", "uuid", "pid", "process", "role", "container", "pod", "namespace")
TREND = ("gpu", "pid", "process", "role")
ENGINE = ("endpoint", "model", "engine")

GPUS = Section("GPU")
PROCESSES = Section("Processes")
ALLOCATOR = Section("PyTorch's allocator, from the probe", level=3, intro="""\
Where the allocator probe runs inside a process (`gpu-memory-probe`, [probe.md](probe.md)) and
the exporter reads its directory (`allocator.probe_dir`), these come per process and GPU, with
the process labels above. A process without a probe has none of them (absent, not zero), and
a number that process's torch does not report is absent too. The numbers are as old as the
probe's interval (5 s by default).
""")
FINDINGS = Section("Findings and events")
HOST = Section("Host")
VLLM = Section("vLLM", intro="""\
Names are normalised across vLLM versions: V1 `vllm:kv_cache_usage_perc` and V0
`vllm:gpu_cache_usage_perc` (both a 0–1 fraction despite the name) become
`gpumem_vllm_kv_cache_usage_ratio`; old `gpu_prefix_cache_*` and new `prefix_cache_*` become
`gpumem_vllm_prefix_cache_*`.
""", outro="""\
### The vLLM memory budget

What a vLLM server plans to hold on each of its GPUs, computed once per sampling tick
(`exporter/analysis/budget.py`); beyond-budget memory, pressure findings, admission and the
85 % page all read this one figure. No default `gpu_memory_utilization` is ever assumed (its
default changed across releases): without the figures below the budget is unknown, and the
server's memory then counts as planned.

| vLLM | started with | budget per GPU |
|---|---|---|
| V0 (≤ 0.10) and V1 (0.8+) | `--gpu-memory-utilization` (`cache_config_info` label) | `gpu_memory_utilization × total`, the total CUDA reports (NVML's total less the driver's reserve, `gpumem_gpu_memory_reserved_bytes`, as `torch.cuda.mem_get_info` gives it to vLLM): weights, activation peak, non-torch memory and the KV cache are sized to fit in it (V1 0.21+ counts the CUDA-graph estimate in too; before, graphs come on top of it). |
| V1 0.11+ | `--kv-cache-memory` (`cache_config_info` label `kv_cache_memory_bytes`) | `kv_cache_memory_bytes` + the start-up log's non-KV memory (weights + activation peak + non-torch + CUDA graphs). vLLM skips memory profiling and takes exactly those bytes for the KV cache, ignoring `gpu_memory_utilization` (which only gates start-up: free memory must reach it), so no fraction of the total applies (`vllm/v1/worker/gpu_worker.py`, `Worker.determine_available_memory`). Without the log's weights figure the budget is unknown. In this mode vLLM logs neither the activation peak nor non-torch memory, so the budget is a lower bound by them (typically 1–3 GiB). |

### What vLLM's page has that is not exported

vLLM 0.32's page (`tests/fixtures/vllm/v0_32_cpu_served.prom`, about 620 lines) carries more than a
memory exporter reads. Each of these is left out on purpose, and why:

| vLLM series | why it is not exported |
|---|---|
| sleep-mode operations | vLLM counts none: its page has only the state, `vllm:engine_sleep_state` (exported as `gpumem_vllm_engine_sleep_state`). Each sleep's effect is read from the server's log (`Sleep mode freed … GiB memory`) and judged by the `sleep_leak` finding. |
| `vllm:prompt_tokens_cached_by_source_total{source}`, `vllm:prompt_tokens_by_source_total`, `vllm:prompt_tokens_cached_total`, `vllm:external_prefix_cache_*`, `vllm:mm_cache_*` | token accounting of the prefix cache by tier (device, host, disk, p2p) and of the multimodal cache: throughput, not memory. Whether prefix caching and KV offloading are on, and how large the offload is, are in `gpumem_vllm_cache_config_info`; the device prefix cache's hit rate is `gpumem_vllm_prefix_cache_{hits,queries}_total`. |
| `vllm:estimated_{flops,read_bytes,write_bytes}_per_gpu_total` | model FLOPs utilisation estimates: compute, not memory (and on the CPU backend they stay 0). |
| `vllm:request_success_total{finished_reason}`, `vllm:prompt_tokens_total`, `vllm:generation_tokens_total` | request outcomes and token counts: load, not memory. Finished requests are counted in `gpumem_vllm_requests_finished_total`. |
| the request histograms (`vllm:time_to_first_token_seconds`, `…_latency_seconds`, `…_queue_time_seconds`, `vllm:iteration_tokens_total`, `vllm:request_prompt_tokens`, …) | latency and size distributions: service quality, not memory. Of `vllm:request_num_preemptions` the sum and count are exported (preemptions per request). |
| the API server's `http_*` families, `process_*`, `python_*` | the HTTP server's and the API server process's own: the exporter reads every serving process's memory from `/proc` itself. |
| `vllm:cache_config_info`'s other labels (about forty in 0.32: block size details, Mamba settings, hashing) | configuration that does not change what memory holds; the labels read are those above. `num_gpu_blocks` is reported on the CPU backend too, where the blocks are host memory. |
""")  # noqa: E501
EXPORTER = Section("The exporter itself")
RECORDER = Section("Flight recorder", intro="""\
Present when `recorder.directory` is set. On an OOM event, a newly critical finding or a vLLM
process that disappeared, the last `recorder.window_seconds` of full-resolution samples are
written as a trace CSV (replay it with `gpu-memory-exporter analyze FILE --report out.html`).
The directory should belong to the exporter's user and be writable by no one else (mode 0700,
or 0750 for a group that reads the traces); the recorder creates it 0700 when it is missing.
It never writes through a link planted there: each file is written new (`O_EXCL|O_NOFOLLOW`,
mode 0600, under an unpredictable temporary name) and renamed to a name that did not exist.
""")
ALLOC_HISTORY = Section("Allocation history on demand", intro="""\
Present when `allocator.history.enabled` is set (off by default; [probe.md](probe.md#allocation-history-on-demand)).
When a leak or fragmentation finding is first raised for a process with the allocator probe,
the exporter asks that probe to record PyTorch's allocation history; the probe dumps it into
the probe directory for pytorch.org/memory_viz.
""")
SECTIONS = (GPUS, PROCESSES, ALLOCATOR, FINDINGS, HOST, VLLM, EXPORTER, RECORDER, ALLOC_HISTORY)


# -- GPU --------------------------------------------------------------------------------------------
GPU_INFO = gauge(
    "gpumem_gpu_info",
    "GPU identity; always 1.", ("gpu", "uuid", "name", "unified", "mig"),
    section=GPUS, doc=(
        'Always 1. `unified="true"` where GPU memory is host memory (DGX Spark/GB10 report memory info '
        "NOT_SUPPORTED; Grace Hopper/Blackwell use ATS)."))
GPU_UP = gauge(
    "gpumem_gpu_up",
    "1 if the GPU answered its library (the GPU backend) in the last sample.", GPU,
    section=GPUS, doc=(
        "1 if the GPU answered the GPU library (`gpu.backend`, NVML by default); 0 when lost or needing reset "
        "(the other GPUs keep reporting)."))
GPU_MEMORY_TOTAL_BYTES = gauge(
    "gpumem_gpu_memory_total_bytes",
    "Total GPU memory (host memory on unified-memory devices).", GPU,
    section=GPUS, unit="bytes", doc=(
        "Total memory. On unified devices whose library reports no memory info: host MemTotal."))
GPU_MEMORY_USED_BYTES = gauge(
    "gpumem_gpu_memory_used_bytes",
    "GPU memory in use, as the GPU library reports it.", GPU,
    section=GPUS, unit="bytes", doc=(
        "Used memory as the GPU library reports it (includes memory held by no live process)."))
GPU_MEMORY_FREE_BYTES = gauge(
    "gpumem_gpu_memory_free_bytes",
    "GPU memory free.", GPU,
    section=GPUS, unit="bytes", doc=(
        "Free memory. On unified devices whose library reports no memory info: host MemAvailable."))
GPU_MEMORY_RESERVED_BYTES = gauge(
    "gpumem_gpu_memory_reserved_bytes",
    "GPU memory reserved by the driver and firmware.", GPU,
    section=GPUS, unit="bytes", doc=(
        "Memory reserved by driver and firmware (with NVML: memory info v2; absent where the library does not "
        "report it)."))
GPU_MEMORY_UTILIZATION_RATIO = gauge(
    "gpumem_gpu_memory_utilization_ratio",
    "Used over total GPU memory (0-1).", GPU,
    section=GPUS, unit="ratio", doc=(
        "used / total, the daemon's figure (on unified memory: the host's, read from MemAvailable). The 85 % page"
        " (`GpuMemoryHigh`) computes used / total from the GPU series in Prometheus "
        "(`instance_gpu:gpumem_memory_utilization:ratio`), and pages only where more than 2 % of the GPU is beyond"
        " the vLLM budgets: a GPU a vLLM server fills to its own `gpu_memory_utilization` is as planned."))
GPU_MEMORY_BEYOND_BUDGET_BYTES = gauge(
    "gpumem_gpu_memory_beyond_budget_bytes",
    "Used memory the vLLM servers did not budget for (all of it on a GPU without vLLM).", GPU,
    section=GPUS, unit="bytes", doc=(
        "Used memory the vLLM servers did not budget for: other processes, vLLM above its budget "
        "(`gpumem_vllm_memory_budget_bytes`, [below](#the-vllm-memory-budget)), memory no live process holds."
        " All used memory on a GPU without vLLM. A server whose budget is not known yet (still starting) "
        "counts as within budget. Pressure findings and the 85 % page need utilisation ≥ 85 % *and* more than"
        " 2 % of the GPU here, so a healthy vLLM GPU at 90 % by design pages nobody. A raised pressure "
        "finding clears only below 83 % or 1 %, so use hovering at the threshold is one episode."))
GPU_MEMORY_UNATTRIBUTED_BYTES = gauge(
    "gpumem_gpu_memory_unattributed_bytes",
    "GPU memory used that no live process accounts for.", GPU,
    section=GPUS, unit="bytes", doc=(
        "Used memory that no live process accounts for: stale memory from an earlier run, or a zombie."))
GPU_TIME_TO_FULL_SECONDS = gauge(
    "gpumem_gpu_time_to_full_seconds",
    "Projected seconds until the GPU is full at its current growth; absent unless the growth is clear.", GPU,
    section=GPUS, unit="seconds", doc=(
        "Projected time until the GPU is full at its current robust growth rate, measured since the GPU's last "
        "step (a process loading or leaving); absent unless the growth is clear (significant, and its rate "
        "known within a factor of 4)."))
ADMISSION_OPEN = gauge(
    "gpumem_admission_open",
    "1 while the GPU has headroom for new requests (closes above, reopens below thresholds).", ("gpu",),
    section=GPUS, doc=(
        "1 while the GPU has headroom. Closes above `admission.close_above` (0.90) utilisation when more than"
        " 2 % of the GPU is beyond the vLLM budgets; reopens below `admission.open_below` (0.80), or once the"
        " memory beyond budget is back under 1 %. A unified-memory GPU also closes while its host is short of"
        " memory where `GpuUnifiedMemoryHostPressure` pages (MemAvailable under 10 %, memory PSI over 20 %), and"
        " reopens once the host is clearly out of it (15 % and 10 %). Also served as `/admission` (200/503)."))


# -- Processes --------------------------------------------------------------------------------------
PROCESS_MEMORY_USED_BYTES = gauge(
    "gpumem_process_memory_used_bytes",
    "GPU memory used by a process on a GPU.", PROCESS,
    section=PROCESSES, unit="bytes", doc=(
        'GPU memory a process uses on a GPU (compute and graphics). Absent where the GPU library says "not '
        'available".'))
PROCESS_HOST_RSS_BYTES = gauge(
    "gpumem_process_host_rss_bytes",
    "Host resident memory of a process using a GPU, of a vLLM server on no GPU, and on unified memory of the "
    "host's largest processes.",
    ("pid", "process", "role", "container", "pod", "namespace"),
    section=PROCESSES, unit="bytes", doc=(
        "Host resident memory of each process that uses a GPU (vLLM leaks host memory too; on unified memory "
        "it is GPU memory), and of each process of a vLLM server that no GPU lists (vLLM's CPU backend: the API "
        "server, `VLLM::EngineCore` and `VLLM::Worker`, whose host memory holds the model and its KV cache). "
        "On a unified-memory host, or one with no GPU, also the host's largest processes by resident memory "
        "(`role=\"other\"`, a few of them), whatever they are: a browser there eats the memory the model runs in, "
        "and `GpuUnifiedMemoryHostPressure` names them."))
PROCESS_MEMORY_GROWTH_BYTES_PER_SECOND = gauge(
    "gpumem_process_memory_growth_bytes_per_second",
    "Robust trend of the process's GPU memory.", TREND,
    section=PROCESSES, unit="bytes_per_second", doc=(
        "Robust (Theil–Sen) trend of the process's GPU memory over the detector's window."))
LEAK_SUSPECTED = gauge(
    "gpumem_leak_suspected",
    "1 if the process's memory grows like a leak.", TREND,
    section=PROCESSES, doc=(
        "1 when the leak detector judges the growth a leak, else 0; one series per live process."))


# -- PyTorch's allocator, from the probe ------------------------------------------------------------
PROCESS_TORCH_ALLOCATED_BYTES = gauge(
    "gpumem_process_torch_allocated_bytes",
    "GPU memory held by live PyTorch tensors in a process (allocator probe).", PROCESS,
    section=ALLOCATOR, unit="bytes", doc=(
        "Held by live tensors (`allocated_bytes.all.current`). Growth here is tensors kept alive: an "
        "application or cache leak."))
PROCESS_TORCH_RESERVED_BYTES = gauge(
    "gpumem_process_torch_reserved_bytes",
    "GPU memory PyTorch's caching allocator holds from the driver: allocated + cached.", PROCESS,
    section=ALLOCATOR, unit="bytes", doc=(
        "Taken from the driver by PyTorch's caching allocator: allocated + cached "
        "(`reserved_bytes.all.current`). Reserved − allocated is the cache."))
PROCESS_TORCH_INACTIVE_SPLIT_BYTES = gauge(
    "gpumem_process_torch_inactive_split_bytes",
    "PyTorch's cached memory in free pieces of split blocks (fragmentation).", PROCESS,
    section=ALLOCATOR, unit="bytes", doc=(
        "The part of the cache in free pieces of split blocks, usable only by smaller requests: a large share"
        " of the cache here is fragmentation (`expandable_segments:True` avoids it)."))
PROCESS_NON_TORCH_BYTES = gauge(
    "gpumem_process_non_torch_bytes",
    "GPU memory of a process outside PyTorch's allocator: its GPU memory used - torch reserved.", PROCESS,
    section=ALLOCATOR, unit="bytes", doc=(
        "Outside PyTorch: GPU memory used − torch reserved (CUDA context, NCCL buffers, CUDA graphs' driver memory,"
        " libraries calling `cudaMalloc`). While a vLLM server sleeps (sleep mode releases its pool behind "
        "PyTorch's back, so used < reserved) the pool is taken out of reserved first: used − (reserved −"
        " pool). Absent when reserved exceeds used with no sleep pool to explain it (the probe's numbers are "
        "up to one interval older than the GPU library's)."))
PROCESS_ALLOC_RETRIES_TOTAL = counter(
    "gpumem_process_alloc_retries_total",
    "Times PyTorch's allocator flushed its cache and retried cudaMalloc.", PROCESS,
    section=ALLOCATOR, doc=(
        "Times the allocator flushed its cache and retried `cudaMalloc` (`num_alloc_retries`): the early sign"
        " of fragmentation, long before an out-of-memory error."))
PROCESS_TORCH_OOMS_TOTAL = counter(
    "gpumem_process_torch_ooms_total",
    "Out-of-memory errors PyTorch's allocator raised in a process.", PROCESS,
    section=ALLOCATOR, doc=(
        "Out-of-memory errors PyTorch's allocator raised (`num_ooms`)."))


# -- Findings and events ----------------------------------------------------------------------------
FINDING_ACTIVE = gauge(
    "gpumem_finding_active",
    "One series per active finding of the detectors.",
    ("kind", "severity", "gpu", "pid", "process", "role", "endpoint"),
    section=FINDINGS, doc=(
        "One series (value 1) per active finding of the detectors. Every `kind`, what it means, the alert it "
        "raises and the scenario that shows it are listed in [runbooks/README.md](runbooks/README.md) "
        "(generated from the detectors' declarations). "
        "Details at `/api/findings`."))
OOM_EVENTS_TOTAL = counter(
    "gpumem_oom_events_total",
    "Out-of-memory events found in the watched logs.", ("kind", "class"),
    section=FINDINGS, doc=(
        "Out-of-memory messages found in watched logs, by kind (`torch_cuda_oom`, `vllm_insufficient_memory`,"
        " `vllm_kv_cache_too_small`, `sglang_kv_cache_too_small`, `tgi_warmup_oom`, `cuda_runtime_oom`, "
        "`nccl_oom`, `kernel_oom_kill`, `cgroup_oom`, `container_oom_killed`, `ray_oom_kill`, "
        "`host_memory_error` for a Python `MemoryError` on the host) and class (`contention`, "
        "`fragmentation`, `shortage`, `configuration`, `host`; the rule is in "
        "[oom-diagnosis.md](oom-diagnosis.md))."))


# -- Host -------------------------------------------------------------------------------------------
HOST_MEMORY_TOTAL_BYTES = gauge(
    "gpumem_host_memory_total_bytes",
    "Host memory (MemTotal).",
    section=HOST, unit="bytes", doc=(
        "MemTotal."))
HOST_MEMORY_AVAILABLE_BYTES = gauge(
    "gpumem_host_memory_available_bytes",
    "Host memory available (MemAvailable).",
    section=HOST, unit="bytes", doc=(
        "MemAvailable: the headroom that matters on unified-memory machines."))
HOST_MEMORY_PRESSURE_SOME_RATIO = gauge(
    "gpumem_host_memory_pressure_some_ratio",
    "Share of time some task stalled on memory (PSI some avg10).",
    section=HOST, unit="ratio", doc=(
        "PSI `some avg10` / 100 from /proc/pressure/memory, where the kernel has PSI."))
HOST_OOM_KILLS_TOTAL = counter(
    "gpumem_host_oom_kills_total",
    "Kernel OOM kills (/proc/vmstat oom_kill).",
    section=HOST, doc=(
        "Kernel OOM kills since boot (/proc/vmstat `oom_kill`)."))


# -- vLLM -------------------------------------------------------------------------------------------
VLLM_UP = gauge(
    "gpumem_vllm_up",
    "1 if the vLLM endpoint answered with valid metrics.", ("endpoint",),
    section=VLLM, doc=(
        "1 if the last scrape returned valid exposition text."))
VLLM_SCRAPE_DURATION_SECONDS = gauge(
    "gpumem_vllm_scrape_duration_seconds",
    "Time taken to scrape the vLLM endpoint.", ("endpoint",),
    section=VLLM, unit="seconds", doc=(
        "Duration of the last scrape."))
VLLM_PAGE_AGE_SECONDS = gauge(
    "gpumem_vllm_page_age_seconds",
    "Age of the vLLM page the endpoint's values come from.", ("endpoint",),
    section=VLLM, unit="seconds", doc=(
        "Seconds between the tick that last read the page and the last tick: 0 while the server works; "
        "an idle server's page is read every `idle_read_seconds` (30 by default), and as soon as its "
        "processes use CPU."),)
VLLM_SCRAPE_ERRORS_TOTAL = counter(
    "gpumem_vllm_scrape_errors_total",
    "Failed scrapes of a vLLM endpoint, by kind.", ("endpoint", "kind"),
    section=VLLM, doc=(
        "Failed scrapes: `refused`, `timeout`, `tls`, `http_status` (a redirect to another host, or past "
        "three hops, too), `too_large`, `truncated`, `parse`, `connection`; and `out_of_range` for a page "
        "that parsed but held impossible values (dropped, the scrape still up)."))
VLLM_KV_CACHE_USAGE_RATIO = gauge(
    "gpumem_vllm_kv_cache_usage_ratio",
    "KV cache blocks in use (0-1).", ENGINE,
    section=VLLM, unit="ratio", doc=(
        "KV cache blocks in use, 0–1."))
VLLM_REQUESTS_RUNNING = gauge(
    "gpumem_vllm_requests_running",
    "Requests running on the engine.", ENGINE,
    section=VLLM, doc=(
        "Requests being processed."))
VLLM_REQUESTS_WAITING = gauge(
    "gpumem_vllm_requests_waiting",
    "Requests waiting to be scheduled.", ENGINE,
    section=VLLM, doc=(
        "Requests queued."))
VLLM_REQUESTS_WAITING_BY_REASON = gauge(
    "gpumem_vllm_requests_waiting_by_reason",
    "Requests waiting to be scheduled, by vLLM's reason.", (*ENGINE, "reason"),
    section=VLLM, doc=(
        "`vllm:num_requests_waiting_by_reason`: `capacity` (waiting for the scheduler's capacity: KV cache "
        "blocks, `--max-num-seqs`, the token budget) or `deferred` (held back by a transient constraint such as "
        "the LoRA budget). A queue that waits for capacity while the KV cache is full is KV saturation."))
VLLM_PREEMPTIONS_TOTAL = counter(
    "gpumem_vllm_preemptions_total",
    "Requests preempted for lack of KV cache.", ENGINE,
    section=VLLM, doc=(
        "Requests preempted because the KV cache ran out. vLLM (V1) counts a preemption when the preempted "
        "request next produces output, so the counter lags a full cache."))
VLLM_REQUEST_PREEMPTIONS_TOTAL = counter(
    "gpumem_vllm_request_preemptions_total",
    "Preemptions of the requests that finished (the sum of vllm:request_num_preemptions).", ENGINE,
    section=VLLM, doc=(
        "Preemptions the finished requests went through: the sum of vLLM's `vllm:request_num_preemptions` "
        "histogram. Over `gpumem_vllm_requests_finished_total` it is the preemptions per request "
        "(`rate(a[5m]) / rate(b[5m])`): how often each request's KV cache was thrown away and recomputed."))
VLLM_REQUESTS_FINISHED_TOTAL = counter(
    "gpumem_vllm_requests_finished_total",
    "Requests that finished (the count of vllm:request_num_preemptions).", ENGINE,
    section=VLLM, doc=(
        "Requests that finished, whatever their outcome: the count of `vllm:request_num_preemptions`."))
VLLM_ADMISSION_REJECTIONS_TOTAL = counter(
    "gpumem_vllm_admission_rejections_total",
    "Requests vLLM refused at a queue limit, by reason.", ("endpoint", "model", "reason"),
    section=VLLM, doc=(
        "`vllm:admission_rejections_total`: requests refused because the queue was at a limit "
        "(`max_num_queued_reqs`, `max_num_queued_tokens`). The queue grows when the KV cache cannot take more "
        "requests, so rejections follow a saturated cache. Per model: vLLM's API server counts them, without an "
        "`engine`."))
VLLM_PREFIX_CACHE_QUERIES_TOTAL = counter(
    "gpumem_vllm_prefix_cache_queries_total",
    "Prefix cache queries (tokens).", ENGINE,
    section=VLLM, doc=(
        "Prefix-cache queries (tokens)."))
VLLM_PREFIX_CACHE_HITS_TOTAL = counter(
    "gpumem_vllm_prefix_cache_hits_total",
    "Prefix cache hits (tokens).", ENGINE,
    section=VLLM, doc=(
        "Prefix-cache hits (tokens)."))
VLLM_CACHE_CONFIG_INFO = gauge(
    "gpumem_vllm_cache_config_info",
    "The server's KV cache configuration; always 1.",
    ("endpoint", "block_size", "cache_dtype", "gpu_memory_utilization", "num_gpu_blocks", "enable_prefix_caching",
     "kv_offloading_backend", "kv_offloading_size"),
    section=VLLM, doc=(
        "Always 1: the server's KV cache configuration, as `vllm:cache_config_info` states it: `enable_prefix_caching`"
        " (`True`/`False`), and KV offloading to host memory (`kv_offloading_backend`, e.g. `native` or `lmcache`;"
        " `kv_offloading_size`, in GiB, empty when unset: no offloading). Empty where vLLM does not say. With an "
        "explicit KV size (`kv_cache_memory_bytes`) `gpu_memory_utilization` sizes nothing, though vLLM still "
        "reports it."))
VLLM_MEMORY_BUDGET_BYTES = gauge(
    "gpumem_vllm_memory_budget_bytes",
    "What the server planned to use on the GPU: gpu_memory_utilization x the GPU's total less the driver's "
    "reserve (what vLLM sizes it from), or --kv-cache-memory plus its non-KV memory.",
    ("endpoint", "gpu", "uuid"),
    section=VLLM, unit="bytes", doc=(
        "What the server planned to hold on the GPU; the formula depends on how it was started "
        "([below](#the-vllm-memory-budget)). Absent while unknown."))
VLLM_MEMORY_USED_BYTES = gauge(
    "gpumem_vllm_memory_used_bytes",
    "What the server's processes use on the GPU.", ("endpoint", "gpu", "uuid"),
    section=VLLM, unit="bytes", doc=(
        "What the server's processes use on the GPU. Above the budget: non-torch growth (NCCL, CUDA graphs)."))
VLLM_MEMORY_PROFILE_BYTES = gauge(
    "gpumem_vllm_memory_profile_bytes",
    "The server's start-up memory profile from its log, by component.", ("endpoint", "component"),
    stability=EXPERIMENTAL, section=VLLM, unit="bytes", doc=(
        "The server's start-up memory profile from its log: `weights`, `kv_cache`, `activation_peak`, "
        "`non_torch`, `cuda_graph`."))
VLLM_ENGINE_SLEEP_STATE = gauge(
    "gpumem_vllm_engine_sleep_state",
    "Sleep mode: 0 awake, 1 asleep at level 1 (weights offloaded), 2 at level 2 (weights discarded).",
    ("endpoint", "engine"),
    stability=EXPERIMENTAL, section=VLLM, doc=(
        "Sleep mode (`vllm:engine_sleep_state`): 0 awake, 1 asleep at level 1 (weights offloaded to host "
        "memory, KV cache discarded; also a sleep whose level vLLM does not report), 2 asleep at level 2 "
        "(weights and KV cache discarded). Absent where vLLM does not report it. While a server sleeps and "
        "for a while after each sleep or wake, the leak and stale-memory detectors leave its memory alone; "
        "`sleep_leak` findings judge the cycle."))
VLLM_KV_CACHE_CAPACITY_TOKENS = gauge(
    "gpumem_vllm_kv_cache_capacity_tokens",
    "Tokens the KV cache holds.", ENGINE,
    stability=EXPERIMENTAL, section=VLLM, unit="tokens", doc=(
        "Tokens the KV cache holds: `kv_cache_size_tokens` of `vllm:cache_config_info` (0.11+), else "
        '`num_gpu_blocks × block_size`, else the start-up log\'s "GPU KV cache size".'))
VLLM_KV_CACHE_CAPACITY_BYTES = gauge(
    "gpumem_vllm_kv_cache_capacity_bytes",
    "The KV cache's memory on each of the engine's GPUs.", ENGINE,
    stability=EXPERIMENTAL, section=VLLM, unit="bytes", doc=(
        "The KV cache's memory on each of the engine's GPUs: `kv_cache_memory_bytes` (`--kv-cache-memory`), "
        "else the start-up log's KV cache size."))
VLLM_KV_CACHE_USED_TOKENS = gauge(
    "gpumem_vllm_kv_cache_used_tokens",
    "KV cache in use, in tokens.", ENGINE,
    stability=EXPERIMENTAL, section=VLLM, unit="tokens", doc=(
        "`gpumem_vllm_kv_cache_usage_ratio × capacity tokens`."))
VLLM_KV_CACHE_USED_BYTES = gauge(
    "gpumem_vllm_kv_cache_used_bytes",
    "KV cache in use on each of the engine's GPUs: usage ratio x capacity bytes.", ENGINE,
    stability=EXPERIMENTAL, section=VLLM, unit="bytes", doc=(
        "`gpumem_vllm_kv_cache_usage_ratio × capacity bytes`: KV memory in use on each GPU of the engine."))
VLLM_MAX_MODEL_LEN_TOKENS = gauge(
    "gpumem_vllm_max_model_len_tokens",
    "Tokens per request the server accepts.", ENGINE,
    stability=EXPERIMENTAL, section=VLLM, unit="tokens", doc=(
        "`--max-model-len` as the start-up log gives it (or capacity tokens / vLLM's max concurrency)."))
VLLM_KV_CACHE_MAX_CONCURRENCY = gauge(
    "gpumem_vllm_kv_cache_max_concurrency",
    "Requests of max_model_len tokens the KV cache holds at once.", ENGINE,
    stability=EXPERIMENTAL, section=VLLM, doc=(
        "Requests of `max_model_len` tokens that fit in the KV cache at once: vLLM's own "
        "`kv_cache_max_concurrency` (`cache_config_info`, 0.11+, or its log), else capacity tokens / "
        "`max_model_len`. Compare with `--max-num-seqs` and `gpumem_vllm_requests_running`."))


# -- The exporter itself ----------------------------------------------------------------------------
EXPORTER_BUILD_INFO = gauge(
    "gpumem_exporter_build_info",
    "Build information; always 1.", ("version", "python", "driver_version"),
    section=EXPORTER, doc=(
        "Always 1."))
EXPORTER_SOURCE_UP = gauge(
    "gpumem_exporter_source_up",
    "1 if the source worked in the last sample.", ("source",),
    section=EXPORTER, doc=(
        "1 if the source (`nvml`, `host`, `kubelet` in Kubernetes, `vllm` with endpoints, `logs` with log "
        "files, `allocator` with `allocator.probe_dir`) worked in the last sample. With no GPU or driver, "
        "`nvml` is 0 and the exporter keeps retrying with back-off; `vllm` is 0 while any endpoint fails "
        "(`gpumem_vllm_up` says which); `allocator` is 0 while its directory is missing or unreadable (a bad "
        'probe file is counted in `gpumem_exporter_errors_total{source="allocator"}`, the source stays up).'))
EXPORTER_SOURCE_DURATION_SECONDS = gauge(
    "gpumem_exporter_source_duration_seconds",
    "Time the last sample spent in the source.", ("source",),
    section=EXPORTER, unit="seconds", doc=(
        "Time the last sample spent in each source (the kubelet's includes a pod-list fetch when one was "
        "due)."))
EXPORTER_SAMPLE_DURATION_SECONDS = gauge(
    "gpumem_exporter_sample_duration_seconds",
    "Time the last tick took: every source and the analysis.",
    section=EXPORTER, unit="seconds", doc=(
        "Time the last tick took: every source and the analysis."))
EXPORTER_ERRORS_TOTAL = counter(
    "gpumem_exporter_errors_total",
    "Faults seen by each source, by kind.", ("source", "kind"),
    section=EXPORTER, doc=(
        "Faults by source and kind (`library_not_found`, `gpu_is_lost`, `not_supported`, `timeout`, ...)."))
EXPORTER_BUDGET_DROPPED_TOTAL = counter(
    "gpumem_exporter_budget_dropped_total",
    "What the inputs' budgets kept out, by budget.", ("budget",),
    section=EXPORTER, doc=(
        "What each input's budget kept out of the ticks, so that no input can grow the exporter's "
        "memory ([memory.md](memory.md)): `probe_files` (probe files named for one process past the "
        "few opened per tick), `source_errors` (fault records of kinds past a source's per-tick "
        "limit; still counted in `gpumem_exporter_errors_total{kind=\"other\"}`), `log_events` "
        "(out-of-memory messages past the per-tick limit), `log_lines` (log lines cut at the line "
        "limit), `history_log_events` (messages the raw history let go of, oldest first), "
        "`vllm_pages` (vLLM pages cut at the per-page limit of `vllm:` lines, the rest unread). "
        "Zero while nothing bites; `rate(...) > 0` means an input is flooding."))
EXPORTER_SAMPLES_TOTAL = counter(
    "gpumem_exporter_samples_total",
    "Sampling ticks completed.",
    section=EXPORTER, doc=(
        "Sampling ticks completed."))
EXPORTER_LAST_SAMPLE_TIMESTAMP_SECONDS = gauge(
    "gpumem_exporter_last_sample_timestamp_seconds",
    "When the last sample completed (Unix seconds).",
    section=EXPORTER, unit="seconds", doc=(
        "When the last sample completed."))
EXPORTER_SAMPLE_AGE_SECONDS = gauge(
    "gpumem_exporter_sample_age_seconds",
    "Age of the sample this scrape shows; grows when sampling is stuck.",
    section=EXPORTER, unit="seconds", doc=(
        "Age of the data this scrape shows. It grows if sampling is stuck, and `/healthz` turns 503 past "
        "`stale_after_seconds` (3 intervals by default)."))
EXPORTER_LISTENER_CONNECTIONS = gauge(
    "gpumem_exporter_listener_connections",
    "Connections the HTTP listener holds open.", ("listener",),
    section=EXPORTER, doc=(
        "Connections each HTTP listener holds (`listen`, and `health_listen` where set), at most 1,024, "
        "128 from one peer ([architecture.md](architecture.md), \"The listener's budgets\")."))
EXPORTER_LISTENER_REFUSED_TOTAL = counter(
    "gpumem_exporter_listener_refused_total",
    "Connections the HTTP listener closed at once, by the limit that refused them.", ("listener", "reason"),
    section=EXPORTER, doc=(
        "New connections closed at once because a budget was full: `peer_connections` (the peer holds its "
        "128), `peer_handshakes` (16 unfinished TLS handshakes of its own), `connections` (1,024 in all, "
        "and none could make way), `handshakes` (64 unfinished in all). A rise while scrapes fail means a "
        "client, or an attacker at the scraper's address, holds the budget."))
EXPORTER_LISTENER_EVICTED_TOTAL = counter(
    "gpumem_exporter_listener_evicted_total",
    "Connections the HTTP listener closed to make room for another peer's.", ("listener",),
    section=EXPORTER, doc=(
        "Connections displaced at a total: answered ones lingering for their client's close first, then "
        "the oldest idle one of the peer holding the most."))
EXPORTER_CONFIG_LAST_RELOAD_SUCCESSFUL = gauge(
    "gpumem_exporter_config_last_reload_successful",
    "1 if the last configuration load (start or SIGHUP reload) succeeded.",
    section=EXPORTER, doc=(
        "`run` only: 1 if the last configuration load worked (the start, or the last `kill -HUP` reload), 0 "
        "while the last reload failed and the daemon runs on its previous configuration."))
EXPORTER_CONFIG_LAST_RELOAD_SUCCESS_TIMESTAMP_SECONDS = gauge(
    "gpumem_exporter_config_last_reload_success_timestamp_seconds",
    "When the configuration was last loaded successfully (start or reload).",
    section=EXPORTER, unit="seconds", doc=(
        "`run` only: when the configuration was last loaded successfully (the start or a reload)."))


# -- Flight recorder --------------------------------------------------------------------------------
RECORDER_WRITES_TOTAL = counter(
    "gpumem_recorder_writes_total",
    "Trace files the flight recorder wrote.",
    section=RECORDER, doc=(
        "Trace files written."))
RECORDER_ERRORS_TOTAL = counter(
    "gpumem_recorder_errors_total",
    "Flight recorder failures (disk full, permission, ...), by kind.", ("kind",),
    section=RECORDER, doc=(
        "Failures: `disk_full`, `permission`, `read_only`, `not_a_directory`, `not_found`, `io`, ... Writing "
        "never blocks or stops sampling."))
RECORDER_TRIGGERS_TOTAL = counter(
    "gpumem_recorder_triggers_total",
    "Events that made the flight recorder write, by trigger.", ("trigger",),
    section=RECORDER, doc=(
        "Triggers that wrote: `oom`, `critical`, `vllm_exit`."))
RECORDER_DEBOUNCED_TOTAL = counter(
    "gpumem_recorder_debounced_total",
    "Triggers suppressed because the same kind wrote recently.", ("trigger",),
    section=RECORDER, doc=(
        "Triggers suppressed because the same kind wrote within the debounce period."))
RECORDER_LAST_WRITE_TIMESTAMP_SECONDS = gauge(
    "gpumem_recorder_last_write_timestamp_seconds",
    "When the flight recorder last finished a trace file.",
    section=RECORDER, unit="seconds", doc=(
        "When the last file was finished."))


# -- Allocation history on demand -------------------------------------------------------------------
ALLOCATOR_HISTORY_REQUESTS_TOTAL = counter(
    "gpumem_allocator_history_requests_total",
    "Allocation-history requests to probes, by result (written, rate_limited, or an error kind).", ("result",),
    stability=EXPERIMENTAL, section=ALLOC_HISTORY, doc=(
        "Requests: `written` (a control file written for the probe), `rate_limited` (the process was asked "
        "less than `allocator.history.min_interval_seconds` ago), or why writing failed (`permission`, "
        "`read_only`, `disk_full`, `not_found`, `io`, ...; the probe directory must be writable by the "
        "exporter for this feature)."))
ALLOCATOR_HISTORY_RESULTS_TOTAL = counter(
    "gpumem_allocator_history_results_total",
    "The probes' answers to those requests: done, failed, unanswered.", ("state",),
    stability=EXPERIMENTAL, section=ALLOC_HISTORY, doc=(
        "What the probes answered: `done` (a dump was written), `failed` (refused or failed; the probe file's"
        " `history.reason` says why), `unanswered` (no answer by `record_seconds` + 5 min: no probe reads "
        "requests, or the process exited)."))



FAMILIES: tuple[Family, ...] = tuple(v for v in tuple(globals().values()) if isinstance(v, Family))
"""Every declared family, in declaration order (the docs' order)."""
BY_NAME = {f.name: f for f in FAMILIES}
