"""The shipped alert and recording rules, and the metric names rules and dashboards may use."""
from __future__ import annotations

import re

import yaml

from helpers.tools import REPO

ALERTS_DIR = REPO / "alerts"
RULES = ALERTS_DIR / "gpu-memory-exporter.rules.yml"
ALERTMANAGER_CONFIG = ALERTS_DIR / "alertmanager.example.yml"

# The exporter's metric names (the contract in docs/metrics.md and the design brief). Rules and
# dashboards may use only these, their own recording rules, and Prometheus' `up` and `ALERTS`.
PLANNED_METRICS = frozenset([
    "gpumem_gpu_info", "gpumem_gpu_up", "gpumem_gpu_memory_total_bytes", "gpumem_gpu_memory_used_bytes",
    "gpumem_gpu_memory_free_bytes", "gpumem_gpu_memory_reserved_bytes", "gpumem_gpu_memory_utilization_ratio",
    "gpumem_gpu_memory_unattributed_bytes", "gpumem_gpu_memory_beyond_budget_bytes",
    "gpumem_gpu_time_to_full_seconds", "gpumem_process_memory_used_bytes", "gpumem_process_host_rss_bytes",
    "gpumem_process_memory_growth_bytes_per_second", "gpumem_leak_suspected", "gpumem_finding_active",
    "gpumem_admission_open", "gpumem_host_memory_total_bytes", "gpumem_host_memory_available_bytes",
    "gpumem_host_memory_pressure_some_ratio", "gpumem_host_oom_kills_total", "gpumem_oom_events_total",
    "gpumem_vllm_up", "gpumem_vllm_scrape_duration_seconds", "gpumem_vllm_scrape_errors_total",
    "gpumem_vllm_kv_cache_usage_ratio", "gpumem_vllm_requests_running", "gpumem_vllm_requests_waiting",
    "gpumem_vllm_preemptions_total", "gpumem_vllm_prefix_cache_queries_total",
    "gpumem_vllm_prefix_cache_hits_total", "gpumem_vllm_cache_config_info", "gpumem_vllm_memory_budget_bytes",
    "gpumem_vllm_memory_used_bytes", "gpumem_vllm_memory_profile_bytes", "gpumem_exporter_source_up",
    "gpumem_exporter_sample_duration_seconds", "gpumem_exporter_last_sample_timestamp_seconds",
    "gpumem_exporter_sample_age_seconds", "gpumem_exporter_errors_total", "gpumem_exporter_build_info",
    # From the allocator probe inside the serving processes (docs/probe.md); absent without it.
    "gpumem_process_torch_allocated_bytes", "gpumem_process_torch_reserved_bytes", "gpumem_process_non_torch_bytes",
    "gpumem_process_alloc_retries_total", "gpumem_process_torch_inactive_split_bytes",
    "gpumem_process_torch_ooms_total",
])
PROMETHEUS_METRICS = frozenset({"up", "ALERTS"})

_PROMQL_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or",
                    "unless", "offset", "bool", "inf", "nan", "atan2"}


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (not functions, keywords, labels or durations)."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals: label values, regexes
    s = re.sub(r"\{[^}]*\}", " ", s)  # label matchers
    s = re.sub(r"\[[^\]]*\]", " ", s)  # range and subquery durations
    s = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)  # label lists
    names = set()
    for m in re.finditer(r"(?<![A-Za-z0-9_:.])[A-Za-z_:][A-Za-z0-9_:]*", s):
        if s[m.end():].lstrip().startswith("("):
            continue  # a function or an aggregation
        if m.group().lower() not in _PROMQL_KEYWORDS:
            names.add(m.group())
    return names


def load_groups() -> list[dict]:
    return yaml.safe_load(RULES.read_text())["groups"]


def alert_rules() -> list[dict]:
    return [r for g in load_groups() for r in g["rules"] if "alert" in r]


def recording_rules() -> list[dict]:
    return [r for g in load_groups() for r in g["rules"] if "record" in r]
