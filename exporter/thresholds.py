"""The thresholds the daemon and the shipped alert rules judge by, declared once.

Most verdicts are decided once, in the daemon: its detectors raise findings, and the alerts on
them fire from `gpumem_finding_active{kind=...}` (docs/architecture.md, "One decision per
verdict"). A few alerts deliberately judge the raw series instead, so that they page even when
the daemon's analysis is wrong or absent: the 85 % page (GpuMemoryHigh), the out-of-memory cliff
(GpuMemoryNearFull), host pressure on unified memory, vLLM preemptions and a stalled sampler.
Where such a rule and the daemon judge the same condition (memory pressure, admission, a unified-
memory host short of memory), both read their number from here:

- the daemon: the defaults of PressureConfig (analysis/pressure.py) and of the admission gate
  (analysis/engine.py, config/schema.py); `unified_host_short` (analysis/pressure.py), which makes
  the pressure and contention findings critical where GpuUnifiedMemoryHostPressure pages;
- the rules: alerts/generate.py writes each RULE_THRESHOLDS entry as a recording rule
  (`gpumem:threshold_<name>:<unit>`, a constant series) that the alerts compare against, and
  grafana/generate.py draws the same numbers.

Change a number here and regenerate (`python -m alerts.generate`, `python grafana/generate.py`,
`python deploy/kubernetes/generate.py`); tests fail while a generated file is out of date.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Threshold:
    name: str
    unit: str  # the recording rule's suffix: ratio, per_second, seconds
    value: float
    help: str  # what it means and who uses it; written above its recording rule

    @property
    def record(self) -> str:
        """The recording rule (a constant series) that alerts and dashboards compare against."""
        return f"gpumem:threshold_{self.name}:{self.unit}"


MEMORY_HIGH = Threshold("memory_high", "ratio", 0.85, (
    "GpuMemoryHigh: share of a GPU's memory in use, above which memory outside the vLLM\n"
    "servers' own budgets pages. The daemon's pressure finding warns at the same level."))
MEMORY_NEAR_FULL = Threshold("memory_near_full", "ratio", 0.95, (
    "GpuMemoryNearFull: share in use above which the GPU is at the out-of-memory cliff,\n"
    "whoever owns the memory. The daemon's pressure finding is critical from the same level."))
VLLM_BUDGET_SLACK = Threshold("vllm_budget_slack", "ratio", 0.02, (
    "Memory a vLLM GPU may carry beyond the servers' gpu_memory_utilization budget before it\n"
    "counts as \"beyond budget\" (driver reservations, profiling error), as a share of total.\n"
    "The daemon's pressure finding and admission gate use the same slack."))
VLLM_PREEMPTIONS = Threshold("vllm_preemptions", "per_second", 0.05, (
    "VllmPreemptions: sustained preemptions per second (5-minute rate) that hurt latency."))
UNIFIED_HOST_AVAILABLE = Threshold("unified_host_available", "ratio", 0.10, (
    "GpuUnifiedMemoryHostPressure: host memory available below this share, or ..."))
UNIFIED_HOST_PRESSURE = Threshold("unified_host_pressure", "ratio", 0.20, (
    "... tasks stalled on memory (PSI some, avg10) above this share of the time. From either,\n"
    "the daemon's pressure finding on a unified-memory GPU is critical, and so is its contention\n"
    "finding where one is raised."))
EXPORTER_SAMPLE_AGE = Threshold("exporter_sample_age", "seconds", 120.0, (
    "GpuMemoryExporterSamplingStalled: age of the sample a scrape shows."))

# Each is a recording rule in the rules file's first group, in this order.
RULE_THRESHOLDS = (MEMORY_HIGH, MEMORY_NEAR_FULL, VLLM_BUDGET_SLACK, VLLM_PREEMPTIONS,
                   UNIFIED_HOST_AVAILABLE, UNIFIED_HOST_PRESSURE, EXPORTER_SAMPLE_AGE)

# The admission gate (/admission, gpumem_admission_open) closes above the first utilisation
# and reopens below the second; configurable (admission.*), these are the defaults.
ADMISSION_CLOSE_ABOVE = 0.90
ADMISSION_OPEN_BELOW = 0.80
