"""The rules of alerts/gpu-memory-exporter.rules.yml that are not generated from elsewhere: the
recording rules the alerts and dashboards share, and the alerts that judge the raw series.

The rules file is written from these, the thresholds (exporter/thresholds.py) and the alerts the
detectors declare for their findings (exporter/analysis/registry.py) by `python -m alerts.generate`.
Alerts on a verdict the daemon decides belong to its detector, not here (docs/architecture.md,
"One decision per verdict"); here are the ones that must page even when the daemon's analysis is
wrong or absent, and those on facts no detector judges (a GPU or endpoint down, a stalled sampler).

Thresholds are never numbers in an expression: an alert compares against a threshold's recording
rule (`gpumem:threshold_<name>:<unit>`, declared in exporter/thresholds.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from exporter.analysis.alert_text import (
    GPU_PROCESSES,
    HOST_PROCESSES_OUTSIDE_VLLM,
    HOST_RSS,
    IF_UNIFIED_GPU,
    NAME_PID_ROLE_SIZE,
    ON_HOST,
    OTHER_GPU_PROCESSES_NONZERO_QUERY,
    OTHER_GPU_PROCESSES_QUERY,
    process_list,
)


def beyond_budget(selector: str = "") -> str:
    """GpuMemoryHigh's second clause, which the dashboards draw too: GPUs with more than the slack
    of their memory used beyond the vLLM servers' budgets (all used memory on a GPU without vLLM).
    `selector`: the series' label matchers, braces included."""
    return (f"instance_gpu:gpumem_memory_beyond_vllm_budget:ratio{selector}\n"
            "  > on () group_left () gpumem:threshold_vllm_budget_slack:ratio")


@dataclass(frozen=True)
class Record:
    record: str
    expr: str
    comment: str = ""


@dataclass(frozen=True)
class Alert:
    name: str  # also the runbook: docs/runbooks/<name>.md
    severity: str  # page or ticket (alerts/README.md)
    for_: str | None  # a Prometheus duration; None: no `for`
    expr: str
    summary: str
    description: str
    comment: str = ""


# Per-GPU and per-host series that the alerts and dashboards share. Rules in a group run in
# order, so each may use the ones above it at the same evaluation.
RECORDS = (
    Record("instance_gpu:gpumem_memory_utilization:ratio",
           "gpumem_gpu_memory_used_bytes / (gpumem_gpu_memory_total_bytes > 0)"),
    Record("instance_gpu:gpumem_memory_headroom:ratio",
           "gpumem_gpu_memory_free_bytes / (gpumem_gpu_memory_total_bytes > 0)"),
    Record("instance_gpu:gpumem_other_process_memory:bytes", """\
sum by (instance, job, gpu, uuid) (gpumem_process_memory_used_bytes{role!="vllm"})
or 0 * gpumem_gpu_memory_used_bytes
""", comment="Memory of processes that belong to no vLLM server; 0 (not absent) when there are none."),
    Record("instance_gpu:gpumem_vllm_process_memory:bytes",
           'sum by (instance, job, gpu, uuid) (gpumem_process_memory_used_bytes{role="vllm"})',
           comment=("Memory of the GPU's vLLM processes (the memory-budget dashboard); absent when no vLLM "
                    "server's process is visible on the GPU.")),
    Record("instance_gpu:gpumem_vllm_memory_budget:bytes",
           "sum by (instance, job, gpu, uuid) (gpumem_vllm_memory_budget_bytes)",
           comment=("gpu_memory_utilization x total of every vLLM server on the GPU (the memory-budget dashboard, "
                    "runbooks); absent until a server's /metrics answers with its cache_config_info.")),
    Record("instance_gpu:gpumem_memory_beyond_vllm_budget:bytes", "gpumem_gpu_memory_beyond_budget_bytes",
           comment=("Used memory the vLLM servers did not budget for: other processes, vLLM beyond its budget, "
                    "memory no live process accounts for; all used memory on a GPU without vLLM. The exporter "
                    "computes it (exporter/analysis/pressure.py, docs/metrics.md) for its own pressure findings "
                    "and admission; reading it here keeps one definition for all of them.")),
    Record("instance_gpu:gpumem_memory_beyond_vllm_budget:ratio",
           "instance_gpu:gpumem_memory_beyond_vllm_budget:bytes / (gpumem_gpu_memory_total_bytes > 0)"),
    Record("instance:gpumem_host_memory_available:ratio",
           "gpumem_host_memory_available_bytes / (gpumem_host_memory_total_bytes > 0)"),
    Record("endpoint_model:gpumem_vllm_preemptions:rate5m", "rate(gpumem_vllm_preemptions_total[5m])"),
    Record("endpoint_model:gpumem_vllm_prefix_cache_hit:ratio_rate5m", """\
rate(gpumem_vllm_prefix_cache_hits_total[5m])
/ (rate(gpumem_vllm_prefix_cache_queries_total[5m]) > 0)
"""),
)

GPU_MEMORY = (
    Alert("GpuMemoryHigh", severity="page", for_="5m",
          comment=("vLLM preallocates gpu_memory_utilization x total by design (0.9 by default), so a serving GPU "
                   "sits at ~90 % all day. This pages only when memory beyond the servers' budgets (other "
                   "processes, vLLM over budget, memory of dead processes) takes the GPU above the threshold. A "
                   "GPU without vLLM pages on plain utilisation."),
          expr="""\
instance_gpu:gpumem_memory_utilization:ratio
  > on () group_left () gpumem:threshold_memory_high:ratio
and on (instance, job, gpu, uuid)
""" + beyond_budget() + "\n",
          summary=("GPU {{ $labels.gpu }} on {{ $labels.instance }} is {{ $value | humanizePercentage }} full, "
                   "beyond what vLLM budgeted."),
          description=("GPU {{ $labels.gpu }} ({{ $labels.uuid }}) on {{ $labels.instance }} has used "
                       "{{ $value | humanizePercentage }} of its memory for 5 minutes (threshold "
                       '{{ with query "gpumem:threshold_memory_high:ratio" }}{{ . | first '
                       "| value | humanizePercentage }}{{ end }}). Beyond the vLLM servers' budget: "
                       '{{ with printf "instance_gpu:gpumem_memory_beyond_vllm_budget:bytes{instance=%q,gpu=%q}" '
                       "$labels.instance $labels.gpu | query }}{{ . | first | value | humanize1024 }}B{{ end }}"
                       # Unified memory: a host process's memory is the GPU's but no GPU process's, so
                       # "non-vLLM processes hold 0B" would be false; name the host's largest instead.
                       f"{IF_UNIFIED_GPU}{{{{ with {OTHER_GPU_PROCESSES_NONZERO_QUERY} }}}}, of which non-vLLM "
                       "processes on the GPU hold {{ . | first | value | humanize1024 }}B{{ end }}. GPU "
                       "{{ $labels.gpu }} takes its memory from the host (unified memory), where any process "
                       f"takes from it; the host's largest outside vLLM:{HOST_PROCESSES_OUTSIDE_VLLM} Largest "
                       f"processes on the GPU:{GPU_PROCESSES}"
                       "{{ else }}, of which non-vLLM processes hold "
                       f"{{{{ with {OTHER_GPU_PROCESSES_QUERY} }}}}{{{{ . | first | value | humanize1024 }}}}B"
                       f"{{{{ end }}}}. Largest processes:{GPU_PROCESSES}{{{{ end }}}}")),
    Alert("GpuMemoryNearFull", severity="page", for_="2m",
          comment=("Absolute: at this level any new allocation (activations, CUDA graphs, NCCL buffers, a restart, "
                   "another process) can fail, whoever owns the memory, vLLM included."),
          expr="""\
instance_gpu:gpumem_memory_utilization:ratio
  >= on () group_left () gpumem:threshold_memory_near_full:ratio
""",
          summary=("GPU {{ $labels.gpu }} on {{ $labels.instance }} is {{ $value | humanizePercentage }} full, at "
                   "the out-of-memory cliff."),
          description=("GPU {{ $labels.gpu }} ({{ $labels.uuid }}) on {{ $labels.instance }} has used "
                       "{{ $value | humanizePercentage }} of its memory for 2 minutes; only "
                       '{{ with printf "gpumem_gpu_memory_free_bytes{instance=%q,gpu=%q}" '
                       "$labels.instance $labels.gpu | query }}{{ . | first | value | humanize1024 }}B{{ end }} of "
                       '{{ with printf "gpumem_gpu_memory_total_bytes{instance=%q,gpu=%q}" '
                       "$labels.instance $labels.gpu | query }}{{ . | first | value | humanize1024 }}B{{ end }} "
                       "are free. The next allocation may fail with out-of-memory. "
                       f"{IF_UNIFIED_GPU}GPU {{{{ $labels.gpu }}}} takes its memory from the host (unified "
                       "memory), where any process takes from it; the host's largest outside "
                       f"vLLM:{HOST_PROCESSES_OUTSIDE_VLLM} Largest processes on the GPU:{GPU_PROCESSES}"
                       f"{{{{ else }}}}Largest processes:{GPU_PROCESSES}{{{{ end }}}}")),
    Alert("GpuAdmissionClosed", severity="ticket", for_="15m",
          comment=("Admission closes above 90 % by design, which a vLLM GPU always is; only a closure that memory "
                   "beyond the vLLM budget causes is worth a look."),
          expr="""\
gpumem_admission_open == 0
and on (instance, job, gpu)
instance_gpu:gpumem_memory_beyond_vllm_budget:ratio
  > on () group_left () gpumem:threshold_vllm_budget_slack:ratio
""",
          summary="GPU {{ $labels.gpu }} on {{ $labels.instance }} has been closed to new work for 15 minutes.",
          description=("The exporter's admission check for GPU {{ $labels.gpu }} of {{ $labels.instance }} has "
                       "said \"closed\" for 15 minutes, and not because of a vLLM server's planned budget: "
                       '{{ with printf "instance_gpu:gpumem_memory_beyond_vllm_budget:bytes{instance=%q,gpu=%q}" '
                       "$labels.instance $labels.gpu | query }}{{ . | first | value | humanize1024 }}B{{ end }} "
                       "lie beyond it and the GPU is at "
                       '{{ with printf "instance_gpu:gpumem_memory_utilization:ratio{instance=%q,gpu=%q}" '
                       "$labels.instance $labels.gpu | query }}{{ . | first | value | "
                       "humanizePercentage }}{{ end }}. Schedulers that ask /admission place nothing here until it "
                       "drops below the reopening level.")),
    Alert("GpuUnavailable", severity="page", for_="2m",
          expr="gpumem_gpu_up == 0",
          summary="GPU {{ $labels.gpu }} on {{ $labels.instance }} does not answer NVML.",
          description=("NVML has not answered for GPU {{ $labels.gpu }} ({{ $labels.uuid }}) on "
                       "{{ $labels.instance }} for 2 minutes (most frequent fault: "
                       '{{ with printf "topk(1, '
                       'increase(gpumem_exporter_errors_total{instance=%q,source=\\"nvml\\"}[10m]))" '
                       '$labels.instance | query }}{{ . | first | label "kind" }}{{ else }}none counted{{ end }}). '
                       "A GPU that fell off the bus or needs a reset serves nothing; check `dmesg` for Xid errors.")),
    Alert("GpuUnifiedMemoryHostPressure", severity="page", for_="5m",
          comment=("On unified-memory devices (GB10, Grace Hopper with ATS/HMM) GPU memory is host memory: host "
                   "pressure is GPU pressure, and the GPU library may not report GPU memory at all. One alert per "
                   "unified GPU (gpu, uuid), as the daemon's pressure finding, critical from the same thresholds."),
          expr="""\
max by (instance, job, gpu, uuid) (
  gpumem_gpu_info{unified="true"}
  and on (instance, job)
  (
    instance:gpumem_host_memory_available:ratio
      < on () group_left () gpumem:threshold_unified_host_available:ratio
    or
    gpumem_host_memory_pressure_some_ratio
      > on () group_left () gpumem:threshold_unified_host_pressure:ratio
  )
)
""",
          summary="Unified-memory host {{ $labels.instance }} is short of memory (GPU {{ $labels.gpu }}).",
          description=("{{ $labels.instance }} has GPUs that share host memory. Only "
                       '{{ with printf "gpumem_host_memory_available_bytes{instance=%q}" '
                       "$labels.instance | query }}{{ . | first | value | humanize1024 }}B{{ end }} "
                       '({{ with printf "instance:gpumem_host_memory_available:ratio{instance=%q}" '
                       "$labels.instance | query }}{{ . | first | value | humanizePercentage }}{{ end }}) of host "
                       "memory is available and tasks stalled on memory "
                       '{{ with printf "gpumem_host_memory_pressure_some_ratio{instance=%q}" '
                       "$labels.instance | query }}{{ . | first | value | humanizePercentage }}{{ else }}(PSI not "
                       "available){{ end }} of the last 10 seconds, for 5 minutes. GPU allocations and the host "
                       "now compete; the kernel OOM killer is next. Largest processes by host memory (any of "
                       "them takes GPU memory here):" + process_list(HOST_RSS, ON_HOST, NAME_PID_ROLE_SIZE))),
)

VLLM = (
    Alert("VllmPreemptions", severity="ticket", for_="10m",
          expr="""\
endpoint_model:gpumem_vllm_preemptions:rate5m
  > on () group_left () gpumem:threshold_vllm_preemptions:per_second
""",
          summary="vLLM {{ $labels.endpoint }} on {{ $labels.instance }} keeps preempting requests.",
          description=("{{ $labels.model }} (engine {{ $labels.engine }}) at {{ $labels.endpoint }} on "
                       '{{ $labels.instance }} has preempted {{ printf "%.3g" $value }} requests per second for 10 '
                       "minutes because its KV cache ran out (KV cache "
                       '{{ with printf '
                       '"gpumem_vllm_kv_cache_usage_ratio{instance=%q,endpoint=%q,model=%q,engine=%q}" '
                       "$labels.instance $labels.endpoint $labels.model $labels.engine "
                       "| query }}{{ . | first | value | humanizePercentage }}{{ end }} used). Every preemption "
                       "recomputes or swaps a request's cache: throughput and latency suffer.")),
    Alert("VllmEndpointDown", severity="page", for_="10m",
          comment="10 minutes: a large model loads for several minutes before /metrics answers.",
          expr="gpumem_vllm_up == 0",
          summary="vLLM endpoint {{ $labels.endpoint }} on {{ $labels.instance }} does not answer.",
          description=("The exporter on {{ $labels.instance }} has not been able to read {{ $labels.endpoint }} "
                       "for 10 minutes (most frequent error: "
                       '{{ with printf "topk(1, '
                       'increase(gpumem_vllm_scrape_errors_total{instance=%q,endpoint=%q}[10m]))" '
                       '$labels.instance $labels.endpoint | query }}{{ . | first | label "kind" }}{{ else }}none '
                       "counted{{ end }}). The server is down, hung, or still loading its model.")),
)

EXPORTER = (
    Alert("GpuMemoryExporterDown", severity="page", for_="5m",
          comment="The only rule that names the scrape job; change the job here if yours differs.",
          expr='up{job="gpu-memory-exporter"} == 0',
          summary="gpu-memory-exporter on {{ $labels.instance }} is down; GPU memory there is unwatched.",
          description=("Prometheus has failed to scrape gpu-memory-exporter at {{ $labels.instance }} (job "
                       "{{ $labels.job }}) for 5 minutes. No GPU memory alert can fire for that host until it is "
                       "back.")),
    Alert("GpuMemoryExporterNvmlDown", severity="page", for_="5m",
          expr='gpumem_exporter_source_up{source="nvml"} == 0',
          summary="gpu-memory-exporter on {{ $labels.instance }} cannot read NVML.",
          description=("The exporter on {{ $labels.instance }} has been unable to read GPU memory through NVML for "
                       "5 minutes (most frequent fault: "
                       '{{ with printf "topk(1, '
                       'increase(gpumem_exporter_errors_total{instance=%q,source=\\"nvml\\"}[10m]))" '
                       '$labels.instance | query }}{{ . | first | label "kind" }}{{ else }}none counted{{ end }}). '
                       "No GPU memory alert can fire for that host meanwhile.")),
    Alert("GpuMemoryExporterSamplingStalled", severity="page", for_="5m",
          comment=("A sampler stuck in a hung NVML call keeps serving its last, ever older, sample: every other "
                   "alert would look at frozen numbers."),
          expr="""\
gpumem_exporter_sample_age_seconds
  > on () group_left () gpumem:threshold_exporter_sample_age:seconds
""",
          summary=("gpu-memory-exporter on {{ $labels.instance }} serves a sample {{ $value | humanizeDuration }} "
                   "old."),
          description=("The exporter on {{ $labels.instance }} still answers scrapes but its last sample is "
                       "{{ $value | humanizeDuration }} old: sampling is stuck, most often in an NVML call to a "
                       "GPU that stopped answering. The GPU memory numbers from that host are frozen.")),
)

# The groups of raw-series alerts, by name, in the order the rules file lists them.
ALERT_GROUPS = (
    ("gpu-memory-exporter.gpu-memory", GPU_MEMORY),
    ("gpu-memory-exporter.vllm", VLLM),
    ("gpu-memory-exporter.exporter", EXPORTER),
)
