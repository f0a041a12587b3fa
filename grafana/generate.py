"""Writes the Grafana dashboards in grafana/dashboards/ from this one description.

Dashboards are generated rather than hand-edited so that every panel uses the same data source
variable, label filters and units; tests/test_dashboards.py fails when the JSON files differ
from what this script writes. Run after editing: python grafana/generate.py

Why not grafana-foundation-sdk (evaluated for issue 15 with 1769699998!10.1.0, the release pip
picks: its versions carry a build-timestamp epoch, so the default is the Grafana 10.1 schema and
11.x needs an exact pin). Its builders are typed (py.typed; a strict-mypy sample is clean) and
emit correct JSON, but it needs Python >= 3.11 (typing.Self; we support 3.10), is Alpha, 2.2 MB,
and the error-prone parts stay untyped (override properties and transformation options are
`object`). One panel: 4 lines here (a timeseries() call) vs 14 with the SDK, and shared defaults
still need helpers of the same size as ours. Not clearly better: kept this builder.
"""
from __future__ import annotations

import argparse
import json
import string
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

# `python grafana/generate.py` puts grafana/ on the path, not the repository root where the alert
# rules' declarations live (alerts/rules.py): the paging stats read GpuMemoryHigh's condition there.
if str(REPO := Path(__file__).resolve().parents[1]) not in sys.path:
    sys.path.insert(0, str(REPO))

from alerts import rules
from alerts.rules import ALERT_GROUPS
from exporter import thresholds
from exporter.analysis.kv_cache import KvSaturationConfig

JSON = dict[str, Any]  # one object of Grafana's dashboard model

OUT = Path(__file__).resolve().parent / "dashboards"
DS = {"type": "prometheus", "uid": "${datasource}"}
TAGS = ["gpu-memory-exporter"]
GPU = 'instance=~"$instance",gpu=~"$gpu"'
PROC = 'instance=~"$instance",gpu=~"$gpu",process=~"$process"'
EP = 'instance=~"$instance",endpoint=~"$endpoint"'
PAGES_ON_MEMORY = next(a for _, group in ALERT_GROUPS for a in group if a.name == "GpuMemoryHigh")


# -- building blocks ------------------------------------------------------------------------
def target(expr: str, legend: str = "", instant: bool = False, table: bool = False) -> JSON:
    t: JSON = {"datasource": DS, "expr": expr, "legendFormat": legend, "range": not instant, "instant": instant}
    if table:
        t["format"] = "table"
    return t


def _panel(kind: str, title: str, targets: list[JSON], w: int, h: int, description: str, **extra: Any) -> JSON:
    for ref, t in zip(string.ascii_uppercase, targets, strict=False):
        t["refId"] = ref
    p: JSON = {"type": kind, "title": title, "description": description, "datasource": DS,
         "targets": targets, "gridPos": {"w": w, "h": h}}
    p.update(extra)
    return p


def timeseries(title: str, targets: list[JSON], unit: str = "bytes", w: int = 12, h: int = 8,
               description: str = "", stack: bool = False, overrides: Iterable[JSON] = (),
               max_: float | None = None, decimals: int | None = None, no_value: str | None = None) -> JSON:
    custom = {"fillOpacity": 60 if stack else 10, "lineWidth": 1, "showPoints": "never",
              "stacking": {"mode": "normal" if stack else "none", "group": "A"}}
    defaults: JSON = {"unit": unit, "custom": custom}
    if no_value is not None:
        defaults["noValue"] = no_value  # shown instead of Grafana's bare "No data"
    if max_ is not None:
        defaults.update(min=0, max=max_)
    if decimals is not None:
        defaults["decimals"] = decimals
    return _panel("timeseries", title, targets, w, h, description,
                  fieldConfig={"defaults": defaults, "overrides": list(overrides)},
                  options={"legend": {"displayMode": "table", "placement": "bottom",
                                      "calcs": ["lastNotNull", "max"]},
                           "tooltip": {"mode": "multi", "sort": "desc"}})


def per_gpu(expr: str) -> JSON:
    """Table query reduced to the labels every per-GPU metric has, so the merge makes one row per GPU."""
    return target(f"max by (instance, gpu) ({expr})", instant=True, table=True)


def per_process(expr: str) -> JSON:
    return target(f"max by (instance, gpu, pid, process) ({expr})", instant=True, table=True)


def stat(title: str, expr: str, unit: str = "none", w: int = 6, h: int = 4, description: str = "",
         thresholds: list[JSON] | None = None) -> JSON:
    steps = thresholds or [{"color": "green", "value": None}]
    return _panel("stat", title, [target(expr, instant=True)], w, h, description,
                  fieldConfig={"defaults": {"unit": unit, "thresholds": {"mode": "absolute", "steps": steps}},
                               "overrides": []},
                  options={"reduceOptions": {"calcs": ["lastNotNull"]}, "colorMode": "background"})


def table(title: str, targets: list[JSON], w: int = 24, h: int = 8, description: str = "",
          hide: Sequence[str] = (), units: dict[str, str] | None = None, no_value: str | None = None) -> JSON:
    """Instant queries in table format, merged into one row per label set."""
    overrides = [{"matcher": {"id": "byName", "options": name}, "properties": [{"id": "unit", "value": unit}]}
                 for name, unit in (units or {}).items()]
    organize = {"excludeByName": {name: True for name in ("Time", "job", "__name__", *hide)}}
    defaults: JSON = {} if no_value is None else {"noValue": no_value}
    return _panel("table", title, targets, w, h, description,
                  fieldConfig={"defaults": defaults, "overrides": overrides},
                  transformations=[{"id": "merge", "options": {}},
                                   {"id": "organize", "options": organize}],
                  options={"showHeader": True})


def bargauge(title: str, targets: list[JSON], steps: list[JSON], unit: str = "percentunit", w: int = 12,
             h: int = 8, description: str = "", max_: float | None = 1, overrides: Iterable[JSON] = ()) -> JSON:
    defaults: JSON = {"unit": unit, "min": 0, "thresholds": {"mode": "absolute", "steps": steps}}
    if max_ is not None:
        defaults["max"] = max_
    return _panel("bargauge", title, targets, w, h, description,
                  fieldConfig={"defaults": defaults, "overrides": list(overrides)},
                  options={"orientation": "horizontal", "displayMode": "gradient",
                           "reduceOptions": {"calcs": ["lastNotNull"]}})


def pct(ratio: float) -> str:
    return f"{ratio * 100:.6g} %"


HIGH, NEAR_FULL, SLACK = thresholds.MEMORY_HIGH, thresholds.MEMORY_NEAR_FULL, thresholds.VLLM_BUDGET_SLACK


def beyond_budget(selector: str) -> str:
    """GpuMemoryHigh's second clause (alerts/rules.py), on one line, for the GPUs `selector` picks."""
    return " ".join(rules.beyond_budget(f"{{{selector}}}").split())


def page_line(gpus: str, selector: str, by: str = "instance, gpu") -> str:
    """GpuMemoryHigh's threshold, one series per `by` of `gpus` (per-GPU series) that carry memory
    beyond the vLLM budgets, and none for the others: above this line such a GPU pages, while a
    vLLM GPU at its own budget (~90 % by design) above it pages nobody."""
    return (f"max by ({by}) (0 * ({gpus} and on (instance, job, gpu, uuid) ({beyond_budget(selector)}))) "
            f"+ on () group_left () {HIGH.record}")


NEAR_FULL_LINE = "near full: pages whoever owns the memory"
PAGE_LINE = "pages above this (memory beyond the vLLM budget)"


def utilisation_lines(drawn_for: str = "a GPU with") -> str:
    """What the dashed lines of a utilisation panel say, in its description."""
    return (f" Dashed: {pct(NEAR_FULL.value)} ({NEAR_FULL.record}), where GpuMemoryNearFull pages whoever "
            f"owns the memory; and {pct(HIGH.value)} ({HIGH.record}), drawn only for {drawn_for} more than "
            f"{pct(SLACK.value)} of it used beyond the vLLM servers' budgets, where GpuMemoryHigh pages. A vLLM "
            "GPU at its own budget (~90 % by design) draws no such line: it pages nobody.")


# The headroom bars of GPUs for which GpuMemoryHigh's level is a page carry this label (and legend).
BEYOND_BUDGET_LABEL = "beyond the vLLM budget"


def headroom(selector: str) -> JSON:
    """Free / total per GPU. Red at the near-full level, which pages whoever owns the memory; orange
    at GpuMemoryHigh's only for the GPUs it pages for, marked with a label: a vLLM GPU at its own
    budget has ~10 % free by design and pages nobody."""
    ratio = f"instance_gpu:gpumem_memory_headroom:ratio{{{selector}}}"
    marked = (f'label_replace({ratio} and on (instance, job, gpu, uuid) ({beyond_budget(selector)}), '
              f'"budget", "{BEYOND_BUDGET_LABEL}", "", "")')
    red = {"color": "red", "value": None}
    near_full = {"color": "green", "value": round(1 - NEAR_FULL.value, 6)}
    return bargauge("Headroom", [target(f"{marked} or on (instance, job, gpu, uuid) {ratio}",
                                        "{{instance}} GPU {{gpu}} {{budget}}", instant=True)],
                    steps=[red, near_full], w=8,
                    overrides=[{"matcher": {"id": "byRegexp", "options": f"/ {BEYOND_BUDGET_LABEL}$/"},
                                "properties": [{"id": "thresholds", "value": {"mode": "absolute", "steps": [
                                    red, {**near_full, "color": "orange"},
                                    {"color": "green", "value": round(1 - HIGH.value, 6)}]}}]}],
                    description=f"Free / total per GPU, now. Red below {pct(1 - NEAR_FULL.value)}, where "
                                "GpuMemoryNearFull pages whoever owns the memory. Orange below "
                                f"{pct(1 - HIGH.value)} only on a GPU marked \"{BEYOND_BUDGET_LABEL}\" (more "
                                f"than {pct(SLACK.value)} of it used beyond the vLLM servers' budgets), where "
                                "GpuMemoryHigh pages; a vLLM GPU at its own budget (~10 % free by design) "
                                "pages nobody.")


def paging_on_memory(selector: str) -> JSON:
    """GPUs for which GpuMemoryHigh's condition holds now (its `for:` aside), read from the alert's
    own declaration: plain utilisation above the page threshold is every vLLM GPU at its budget
    (gpu_memory_utilization x total, 0.9 by default) on a healthy host, which pages nobody."""
    condition = " ".join(PAGES_ON_MEMORY.expr.split())  # one line: JSON would carry "\n" into the names
    return stat("GPUs paging on memory",
                f"count(({condition}) and on (instance, job, gpu) gpumem_gpu_info{{{selector}}}) or vector(0)",
                description=f"GPUs where {PAGES_ON_MEMORY.name}'s condition holds now (it pages once it has held "
                            f"for {PAGES_ON_MEMORY.for_}): above gpumem:threshold_memory_high:ratio with more "
                            "than gpumem:threshold_vllm_budget_slack:ratio of the GPU used beyond the vLLM "
                            "servers' budgets (other processes, vLLM over its budget, memory of dead "
                            "processes). A vLLM GPU at its budget (~90 % by design) is normal and not counted.",
                thresholds=[{"color": "green", "value": None}, {"color": "red", "value": 1}])


def row(title: str) -> JSON:
    return {"type": "row", "title": title, "collapsed": False, "panels": [], "gridPos": {"w": 24, "h": 1}}


def threshold_line(ref: str, name: str | None = None) -> JSON:
    """Draw a threshold series as a dashed line outside the stack; `name` replaces its legend (not
    for a line per GPU, whose legend says which GPU it is for)."""
    properties = [{"id": "custom.stacking", "value": {"mode": "none", "group": "A"}},
                  {"id": "custom.fillOpacity", "value": 0},
                  {"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}},
                  {"id": "color", "value": {"mode": "fixed", "fixedColor": "red"}}]
    if name is not None:
        properties.append({"id": "displayName", "value": name})
    return {"matcher": {"id": "byFrameRefID", "options": ref}, "properties": properties}


def variable(name: str, label: str, query: str, multi: bool = True) -> JSON:
    return {"type": "query", "name": name, "label": label, "datasource": DS,
            "query": {"query": query, "refId": f"{name}-variable"}, "definition": query,
            "refresh": 2, "sort": 3, "includeAll": multi, "multi": multi, "allValue": ".*",
            "current": {}, "hide": 0, "options": [], "regex": ""}


DATASOURCE: JSON = {"type": "datasource", "name": "datasource", "label": "Data source", "query": "prometheus",
              "current": {}, "hide": 0, "refresh": 1, "regex": "", "options": []}
INSTANCE = variable("instance", "Host", "label_values(gpumem_gpu_info, instance)")
GPU_VAR = variable("gpu", "GPU", 'label_values(gpumem_gpu_info{instance=~"$instance"}, gpu)')
PROCESS = variable("process", "Process",
                   'label_values(gpumem_process_memory_used_bytes{instance=~"$instance",gpu=~"$gpu"}, process)')
ENDPOINT = variable("endpoint", "vLLM endpoint", 'label_values(gpumem_vllm_up{instance=~"$instance"}, endpoint)')


def annotation(name: str, expr: str, title: str, text: str, color: str) -> JSON:
    return {"name": name, "datasource": DS, "enable": True, "iconColor": color, "expr": expr,
            "step": "60s", "titleFormat": title, "textFormat": text, "tagKeys": "gpu,pid,kind",
            "useValueForTime": False}


def layout(panels: list[JSON]) -> list[JSON]:
    """Place panels left to right, wrapping at 24 columns, and give them ids."""
    x = y = row_h = 0
    for i, p in enumerate(panels, start=1):
        w, h = p["gridPos"]["w"], p["gridPos"]["h"]
        if x + w > 24 or p["type"] == "row":
            x, y, row_h = 0, y + row_h, 0
        p["gridPos"].update(x=x, y=y)
        p["id"] = i
        x, row_h = x + w, max(row_h, h)
        if p["type"] == "row":
            x, y, row_h = 0, y + h, 0
    return panels


def dashboard(uid: str, title: str, description: str, variables: list[JSON], panels: list[JSON],
              annotations: Sequence[JSON] = (), time_from: str = "now-6h") -> JSON:
    builtin = {"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True,
               "hide": True, "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts",
               "type": "dashboard"}
    return {"uid": uid, "title": title, "description": description, "tags": TAGS, "editable": True,
            "schemaVersion": 39, "version": 1, "refresh": "30s", "timezone": "",
            "time": {"from": time_from, "to": "now"}, "graphTooltip": 1,
            "links": [{"type": "dashboards", "tags": TAGS, "asDropdown": True, "title": "GPU memory",
                       "includeVars": True, "keepTime": True}],
            "templating": {"list": [DATASOURCE, *variables]},
            "annotations": {"list": [builtin, *annotations]},
            "panels": layout(panels)}


# -- the dashboards -------------------------------------------------------------------------
def overview() -> JSON:
    util = f"instance_gpu:gpumem_memory_utilization:ratio{{{GPU}}}"
    panels = [
        stat("GPUs", f'count(gpumem_gpu_info{{{GPU}}}) or vector(0)', description="GPUs the exporters see."),
        paging_on_memory(GPU),
        stat("Active findings", 'count(gpumem_finding_active{instance=~"$instance"}) or vector(0)',
             description="Findings of the exporter's detectors (leak, fragmentation, contention, ...).",
             thresholds=[{"color": "green", "value": None}, {"color": "orange", "value": 1}]),
        stat("Exporters down", 'count(up{job="gpu-memory-exporter"} == 0) or vector(0)',
             description="Scrape targets of job gpu-memory-exporter that do not answer.",
             thresholds=[{"color": "green", "value": None}, {"color": "red", "value": 1}]),
        timeseries("GPU memory utilisation", [
            target(util, "{{instance}} GPU {{gpu}}"),
            target(NEAR_FULL.record, NEAR_FULL_LINE),
            target(page_line(util, GPU), "{{instance}} GPU {{gpu}} " + PAGE_LINE),
        ], unit="percentunit", w=16, max_=1, description="Used / total per GPU." + utilisation_lines(),
            overrides=[threshold_line("B", NEAR_FULL_LINE), threshold_line("C")]),
        headroom(GPU),
        table("Every GPU", [
            per_gpu(util),
            per_gpu(f"gpumem_gpu_memory_free_bytes{{{GPU}}}"),
            per_gpu(f"instance_gpu:gpumem_memory_beyond_vllm_budget:bytes{{{GPU}}}"),
            per_gpu(f"instance_gpu:gpumem_other_process_memory:bytes{{{GPU}}}"),
            per_gpu(f'gpumem_admission_open{{{GPU}}}'),
            per_gpu(f"gpumem_gpu_time_to_full_seconds{{{GPU}}}"),
        ], h=9, description="A: utilisation, B: free, C: beyond the vLLM budget, D: other processes, "
                            "E: admission open, F: time to full (empty when not growing).",
            units={"Value #A": "percentunit", "Value #B": "bytes", "Value #C": "bytes", "Value #D": "bytes",
                   "Value #F": "s"}),
        table("Active findings", [target(f'gpumem_finding_active{{{GPU}}}', instant=True, table=True)],
              h=7, hide=("Value",), description="One row per finding the exporters report now."),
        timeseries("Exporter sources up", [
            target('min by (instance, source) (gpumem_exporter_source_up{instance=~"$instance"})',
                   "{{instance}} {{source}}")], unit="none", max_=1,
            description="1 when the source (nvml, host, vllm, logs) answered in the last sample."),
        timeseries("Sample age", [
            target('gpumem_exporter_sample_age_seconds{instance=~"$instance"}', "{{instance}}"),
            target("gpumem:threshold_exporter_sample_age:seconds", "stall threshold")], unit="s",
            description="Age of the sample each scrape shows; it grows when sampling is stuck.",
            overrides=[threshold_line("B", "stall threshold")]),
    ]
    return dashboard("gpumem-overview", "GPU memory / Overview",
                     "Every GPU's memory use, headroom and the exporter's active findings.",
                     [INSTANCE, GPU_VAR], panels)


def _profile(components: str) -> str:
    """vLLM's memory profile is per endpoint; spread it onto each GPU the server's budget covers."""
    return (f'sum by (instance, gpu) ('
            f'sum by (instance, job, endpoint) (gpumem_vllm_memory_profile_bytes{{instance=~"$instance",'
            f'component=~"{components}"}}) * on (instance, job, endpoint) group_right () '
            f'(0 * gpumem_vllm_memory_budget_bytes{{{GPU}}} + 1))')


# -- the allocator probe's series ---------------------------------------------------------------
# They exist only for processes that run gpu-memory-probe (docs/probe.md); every panel that reads
# them says so, and shows NO_PROBE instead of Grafana's bare "No data" when none is installed.
PROBE_NOTE = (" These series come from the allocator probe inside the process (gpu-memory-probe with "
              "GPUMEM_PROBE_DIR shared with the exporter, docs/probe.md). Without it they are absent "
              "and the panel is empty: NVML's per-process total is then all there is.")
NO_PROBE = "No allocator probe in these processes (docs/probe.md)"
ALLOCATED = f"gpumem_process_torch_allocated_bytes{{{PROC}}}"
RESERVED = f"gpumem_process_torch_reserved_bytes{{{PROC}}}"
CACHED = f"{RESERVED} - {ALLOCATED}"  # reserved by PyTorch, held by no tensor
NON_TORCH = f"gpumem_process_non_torch_bytes{{{PROC}}}"
RETRIES = f"gpumem_process_alloc_retries_total{{{PROC}}}"
COMPONENT_LEGENDS = ("torch allocated", "torch cached, free", "non-torch")


def component_colors() -> list[JSON]:
    """One colour per component (targets A, B, C), whichever process the series belongs to."""
    return [{"matcher": {"id": "byFrameRefID", "options": ref},
             "properties": [{"id": "color", "value": {"mode": "fixed", "fixedColor": color}}]}
            for ref, color in zip("ABC", ("blue", "orange", "purple"), strict=True)]


def components(exprs: Sequence[str], who: str = "GPU {{gpu}} {{process}} ({{pid}})") -> list[JSON]:
    return [target(e, f"{who} {legend}") for e, legend in zip(exprs, COMPONENT_LEGENDS, strict=True)]


def memory_budget() -> JSON:
    profiled = _profile("weights|kv_cache|activation_peak|non_torch|cuda_graph")
    stack = timeseries("GPU $gpu: where the memory goes", [
        target(_profile("weights"), "{{instance}} weights"),
        target(_profile("kv_cache"), "{{instance}} KV cache"),
        target(_profile("activation_peak|non_torch|cuda_graph"),
               "{{instance}} scratch (activations, non-torch, CUDA graphs)"),
        target(f"clamp_min(instance_gpu:gpumem_vllm_process_memory:bytes{{{GPU}}} - on (instance, gpu) {profiled}, 0)",
               "{{instance}} vLLM beyond its profile"),
        target(f"instance_gpu:gpumem_other_process_memory:bytes{{{GPU}}}", "{{instance}} other processes"),
        target(f"gpumem_gpu_memory_unattributed_bytes{{{GPU}}}", "{{instance}} no live process"),
        target(f"gpumem_gpu_memory_free_bytes{{{GPU}}}", "{{instance}} free"),
        target(f"instance_gpu:gpumem_vllm_memory_budget:bytes{{{GPU}}}", "{{instance}} vLLM budget"),
        target(f"gpumem_gpu_memory_total_bytes{{{GPU}}}", "{{instance}} total"),
    ], stack=True, w=24, h=10,
        description="Stacked: the vLLM servers' profile (weights, KV cache, scratch, from their start-up "
                    "log), what their processes use beyond it, other processes, memory no live process "
                    "accounts for, and free headroom. Dashed: the servers' budget "
                    "(gpu_memory_utilization x total) and the GPU's total.",
        overrides=[threshold_line("H", "vLLM budget"), threshold_line("I", "total")])
    stack["repeat"] = "gpu"
    stack["repeatDirection"] = "h"
    # The exporter never exports a negative non-torch figure (a vLLM sleep pool's released memory
    # is taken out of reserved first; what cannot be reconciled is left out, docs/probe.md); the
    # clamp only keeps a stack of series scraped a moment apart from dipping below zero.
    inside = timeseries("GPU $gpu: each process as torch allocated / cached free / non-torch",
                        components([ALLOCATED, CACHED, f"clamp_min({NON_TORCH}, 0)"]), stack=True, w=24, h=10,
                        no_value=NO_PROBE, overrides=component_colors(),
                        description="Stacked per process: memory held by live tensors (torch allocated), "
                                    "memory PyTorch reserved and holds free in its cache (cached, free: "
                                    "reserved - allocated; large and split into pieces, it is "
                                    "fragmentation), and memory outside PyTorch (non-torch: CUDA context, "
                                    "NCCL, CUDA graphs, libraries calling cudaMalloc). The three add up to "
                                    "the process's NVML total." + PROBE_NOTE)
    inside["repeat"] = "gpu"
    inside["repeatDirection"] = "h"
    panels = [
        stack,
        timeseries("Processes on the GPU", [
            target(f"gpumem_process_memory_used_bytes{{{PROC}}}",
                   "{{instance}} GPU {{gpu}} {{process}} ({{pid}}, {{role}})")], stack=True,
            description="GPU memory per process, stacked."),
        timeseries("vLLM servers: used vs budget", [
            target(f'gpumem_vllm_memory_used_bytes{{{GPU}}}', "{{endpoint}} GPU {{gpu}} used"),
            target(f'gpumem_vllm_memory_budget_bytes{{{GPU}}}', "{{endpoint}} GPU {{gpu}} budget"),
        ], description="What each server's processes use on each GPU against gpu_memory_utilization x total."),
        bargauge("vLLM memory profile", [
            target('gpumem_vllm_memory_profile_bytes{instance=~"$instance"}', "{{endpoint}} {{component}}",
                   instant=True)], steps=[{"color": "blue", "value": None}], unit="bytes", max_=None,
            description="From each server's start-up log: weights, KV cache, activation peak, non-torch, CUDA graphs."),
        table("vLLM cache configuration", [
            target('gpumem_vllm_cache_config_info{instance=~"$instance"}', instant=True, table=True)],
            w=12, hide=("Value",), description="The servers' cache_config_info labels."),
        row("Inside the processes: PyTorch's allocator (needs the allocator probe)"),
        inside,
        table("Allocator per process", [
            per_process(ALLOCATED),
            per_process(RESERVED),
            per_process(CACHED),
            per_process(NON_TORCH),
            per_process(f"gpumem_process_torch_inactive_split_bytes{{{PROC}}}"),
            per_process(f"increase({RETRIES}[$__range])"),
            per_process(f"increase(gpumem_process_torch_ooms_total{{{PROC}}}[$__range])"),
        ], h=8, no_value=NO_PROBE,
            description="Now, per probed process. A: torch allocated (live tensors), B: torch reserved, "
                        "C: cached but free (B - A), D: non-torch (NVML used - B; while a vLLM server sleeps, "
                        "its released pool is not counted in B), E: inactive split (free pieces only a "
                        "smaller request fits), "
                        "F: allocator retries and G: allocator out-of-memory errors over the range "
                        "(retries climbing: fragmentation, see GpuMemoryFragmentation)." + PROBE_NOTE,
            units={f"Value #{c}": "bytes" for c in "ABCDE"}),
    ]
    return dashboard("gpumem-memory-budget", "GPU memory / Memory budget",
                     "Per GPU: vLLM's planned memory (weights, KV cache, scratch) against what is used, "
                     "by whom, and what is left.", [INSTANCE, GPU_VAR, PROCESS], panels)


def leak_investigation() -> JSON:
    used = f"gpumem_process_memory_used_bytes{{{PROC}}}"
    panels = [
        timeseries("GPU memory per process", [target(used, "{{instance}} GPU {{gpu}} {{process}} ({{pid}})")],
                   w=24, h=10, description="Pick the range with the time picker; leak findings are annotations."),
        timeseries("Growth rate (exporter's robust trend)", [
            target(f"gpumem_process_memory_growth_bytes_per_second{{{PROC}}}",
                   "{{instance}} GPU {{gpu}} {{process}} ({{pid}})")], unit="Bps",
            description="The leak detector's slope over its window: steady and positive is a leak."),
        timeseries("Host RSS of the same processes", [
            target('gpumem_process_host_rss_bytes{instance=~"$instance",process=~"$process"}',
                   "{{instance}} {{process}} ({{pid}})")],
            description="Host memory growing with GPU memory points at Python objects keeping tensors alive."),
        table("Processes over the selected range", [
            per_process(used),
            per_process(f"min_over_time({used}[$__range])"),
            per_process(f"max_over_time({used}[$__range])"),
            per_process(f"gpumem_process_memory_growth_bytes_per_second{{{PROC}}} * 3600"),
            per_process(f"gpumem_leak_suspected{{{PROC}}}"),
        ], h=8,
            description="A: now, B: lowest and C: highest over the range, D: growth per hour, E: leak suspected.",
            units={"Value #A": "bytes", "Value #B": "bytes", "Value #C": "bytes", "Value #D": "bytes"}),
        timeseries("Leak suspected", [target(f"gpumem_leak_suspected{{{PROC}}}",
                                             "{{instance}} GPU {{gpu}} {{process}} ({{pid}})")],
                   unit="none", max_=1, description="1 while the leak detector suspects the process."),
        timeseries("GPU time to full", [target(f"gpumem_gpu_time_to_full_seconds{{{GPU}}}",
                                               "{{instance}} GPU {{gpu}}")], unit="s",
                   description="At the GPU's current growth; absent when it is not growing."),
        row("Which part grows (needs the allocator probe)"),
        timeseries("Allocator components per process", components([ALLOCATED, CACHED, NON_TORCH]), w=24,
                   no_value=NO_PROBE, overrides=component_colors(),
                   description="The process's memory split three ways. The one that climbs says what leaks: "
                               "torch allocated (tensors kept alive: an application or cache leak), torch "
                               "cached, free (reserved but unallocated: caching or fragmentation, not a "
                               "leak), non-torch (NCCL, CUDA graphs, the driver)." + PROBE_NOTE),
        timeseries("Growth by component (30-minute slope)", components([
            f"deriv({ALLOCATED}[30m])",
            f"deriv({RESERVED}[30m]) - deriv({ALLOCATED}[30m])",
            f"deriv({NON_TORCH}[30m])"]), unit="Bps", no_value=NO_PROBE, overrides=component_colors(),
            description="Least-squares slope of each component over the last 30 minutes; the component "
                        "with a steady positive slope is the one growing." + PROBE_NOTE),
        table("Which part grew over the selected range", [
            per_process(f"deriv({used}[$__range]) * 3600"),
            per_process(f"deriv({ALLOCATED}[$__range]) * 3600"),
            per_process(f"(deriv({RESERVED}[$__range]) - deriv({ALLOCATED}[$__range])) * 3600"),
            per_process(f"deriv({NON_TORCH}[$__range]) * 3600"),
            per_process(f"increase({RETRIES}[$__range])"),
        ], w=12, no_value=NO_PROBE,
            description="Growth per hour over the range (least-squares slope). A: NVML total, B: torch "
                        "allocated, C: torch cached, free, D: non-torch, E: allocator retries. A process "
                        "without the probe has only A." + PROBE_NOTE,
            units={f"Value #{c}": "bytes" for c in "ABCD"}),
    ]
    annotations = [
        annotation("Leak suspected", f"gpumem_leak_suspected{{{PROC}}} == 1",
                   "Leak suspected: {{process}} ({{pid}}) on GPU {{gpu}}", "{{instance}}", "red"),
        annotation("Findings", f"gpumem_finding_active{{{GPU}}}",
                   "{{kind}} ({{severity}}) on GPU {{gpu}}", "{{instance}} {{process}} {{pid}}", "orange"),
    ]
    return dashboard("gpumem-leak-investigation", "GPU memory / Leak investigation",
                     "One process's GPU memory over time, its growth rate and host RSS, with the "
                     "exporter's leak findings as annotations.", [INSTANCE, GPU_VAR, PROCESS], panels,
                     annotations, time_from="now-24h")


def vllm() -> JSON:
    util = f"instance_gpu:gpumem_memory_utilization:ratio{{{GPU}}}"
    panels = [
        timeseries("KV cache usage", [
            target(f"gpumem_vllm_kv_cache_usage_ratio{{{EP}}}", "{{endpoint}} {{model}} engine {{engine}}"),
            # The exporter decides saturation (its kv_saturation finding); this draws its default level.
            target(f"vector({KvSaturationConfig.usage_ratio:g})", "full (kv_saturation's default)")],
            unit="percentunit", max_=1, overrides=[threshold_line("B", "full (kv_saturation's default)")],
            description=("Share of KV cache blocks in use. A saturated cache saw-tooths: full in a share of the "
                         "samples with requests waiting (the exporter's kv_saturation finding, "
                         "detectors.kv_saturation in its configuration), never full in all.")),
        timeseries("GPU memory of the servers' GPUs", [
            target(util, "{{instance}} GPU {{gpu}}"),
            target(NEAR_FULL.record, NEAR_FULL_LINE),
            target(page_line(util, GPU), "{{instance}} GPU {{gpu}} " + PAGE_LINE)],
            unit="percentunit", max_=1, overrides=[threshold_line("B", NEAR_FULL_LINE), threshold_line("C")],
            description="Next to the KV cache: memory use of the GPUs (choose them with the GPU variable)."
                        + utilisation_lines()),
        timeseries("Requests", [
            target(f"gpumem_vllm_requests_running{{{EP}}}", "{{endpoint}} running"),
            target(f"gpumem_vllm_requests_waiting{{{EP}}}", "{{endpoint}} waiting")], unit="none",
            description="Running and queued requests per engine."),
        timeseries("Preemptions", [
            target(f"endpoint_model:gpumem_vllm_preemptions:rate5m{{{EP}}}", "{{endpoint}} {{model}}"),
            target("gpumem:threshold_vllm_preemptions:per_second", "alert threshold")],
            unit="reqps", overrides=[threshold_line("B", "alert threshold")],
            description="Requests preempted per second for lack of KV cache (5-minute rate)."),
        timeseries("Prefix cache hit ratio", [
            target(f"endpoint_model:gpumem_vllm_prefix_cache_hit:ratio_rate5m{{{EP}}}", "{{endpoint}} {{model}}")],
            unit="percentunit", max_=1, description="Prefix cache hits / queries (tokens), 5-minute rate."),
        timeseries("Server memory: used vs budget", [
            target(f"gpumem_vllm_memory_used_bytes{{{EP}}}", "{{endpoint}} GPU {{gpu}} used"),
            target(f"gpumem_vllm_memory_budget_bytes{{{EP}}}", "{{endpoint}} GPU {{gpu}} budget")],
            description="What the server's processes use on each GPU against gpu_memory_utilization x total."),
        timeseries("Endpoint health", [
            target(f"gpumem_vllm_up{{{EP}}}", "{{endpoint}} up"),
            target(f"sum by (endpoint, kind) (rate(gpumem_vllm_scrape_errors_total{{{EP}}}[$__rate_interval]))",
                   "{{endpoint}} errors: {{kind}}")], unit="none",
            description="1 while the exporter reads the endpoint; scrape errors per second by kind."),
        timeseries("Scrape duration", [
            target(f"gpumem_vllm_scrape_duration_seconds{{{EP}}}", "{{endpoint}}")], unit="s",
            description="How long the exporter takes to read each endpoint's /metrics."),
        table("Cache configuration", [
            target(f"gpumem_vllm_cache_config_info{{{EP}}}", instant=True, table=True)],
            hide=("Value",), description="block_size, cache_dtype, gpu_memory_utilization, num_gpu_blocks."),
    ]
    return dashboard("gpumem-vllm", "GPU memory / vLLM",
                     "vLLM's KV cache, queue and preemptions next to GPU memory.",
                     [INSTANCE, ENDPOINT, GPU_VAR], panels)


NAMESPACE = variable("namespace", "Namespace",
                     'label_values(gpumem_process_memory_used_bytes{instance=~"$instance"}, namespace)')
POD = variable("pod", "Pod", 'label_values(gpumem_process_memory_used_bytes{instance=~"$instance",'
                             'namespace=~"$namespace"}, pod)')
POD_SEL = 'instance=~"$instance",namespace=~"$namespace",pod=~"$pod"'


def fleet() -> JSON:
    """Many GPU nodes at once: by node (instance; the ServiceMonitor sets it to the node's name),
    and by Kubernetes namespace and pod. On a single host without Kubernetes it still works:
    one node, and processes outside pods under an empty namespace and pod (the variables'
    "All" matches the empty value)."""
    gpu = 'instance=~"$instance"'
    util = f"instance_gpu:gpumem_memory_utilization:ratio{{{gpu}}}"
    used = f"gpumem_process_memory_used_bytes{{{POD_SEL}}}"
    # The process series only lends its pod labels to the 0/1 leak flag (x 0 + 1 keeps the flag).
    leak_by_pod = (f"max by (instance, namespace, pod) (gpumem_leak_suspected{{{gpu}}} * on (instance, job, gpu, pid) "
                   f"group_left (namespace, pod) (0 * max by (instance, job, gpu, pid, namespace, pod) ({used}) + 1))")
    panels = [
        stat("Nodes", f"count(count by (instance) (gpumem_gpu_info{{{gpu}}})) or vector(0)",
             description="Hosts (Kubernetes nodes) whose exporter reports GPUs."),
        stat("GPUs", f"count(gpumem_gpu_info{{{gpu}}}) or vector(0)", description="GPUs on those hosts."),
        # Blue, not green, below the near-full level: the mean cannot say whether GpuMemoryHigh pages.
        stat("Fleet GPU memory in use",
             f"sum(gpumem_gpu_memory_used_bytes{{{gpu}}}) / sum(gpumem_gpu_memory_total_bytes{{{gpu}}})",
             unit="percentunit",
             description="Used / total over every GPU of the selected hosts. A vLLM fleet sits near 90 % by "
                         "design (each server reserves gpu_memory_utilization of its GPU), which pages nobody. "
                         f"Red from {pct(NEAR_FULL.value)}: then at least one GPU is that full, and "
                         "GpuMemoryNearFull pages whoever owns the memory. Which GPUs page: the stat beside.",
             thresholds=[{"color": "blue", "value": None}, {"color": "red", "value": NEAR_FULL.value}]),
        paging_on_memory(gpu),
        table("By node", [
            target(f"count by (instance) (gpumem_gpu_info{{{gpu}}})", instant=True, table=True),
            target(f"sum by (instance) (gpumem_gpu_memory_used_bytes{{{gpu}}})", instant=True, table=True),
            target(f"sum by (instance) (gpumem_gpu_memory_total_bytes{{{gpu}}})", instant=True, table=True),
            target(f"max by (instance) ({util})", instant=True, table=True),
            target(f"count by (instance) (gpumem_finding_active{{{gpu}}}) or 0 * count by (instance) "
                   f"(gpumem_gpu_info{{{gpu}}})", instant=True, table=True),
        ], h=9, description="A: GPUs, B: used, C: total, D: fullest GPU's utilisation, E: active findings.",
            units={"Value #B": "bytes", "Value #C": "bytes", "Value #D": "percentunit"}),
        timeseries("GPU memory used by node", [
            target(f"sum by (instance) (gpumem_gpu_memory_used_bytes{{{gpu}}})", "{{instance}}")],
            description="Sum over each host's GPUs."),
        timeseries("Fullest GPU per node", [
            target(f"max by (instance) ({util})", "{{instance}}"),
            target(NEAR_FULL.record, NEAR_FULL_LINE),
            # Per node, the page line of the GPU drawn: its fullest.
            target(page_line(f"topk by (instance) (1, {util})", gpu, by="instance"), "{{instance}} " + PAGE_LINE)],
            unit="percentunit", max_=1, overrides=[threshold_line("B", NEAR_FULL_LINE), threshold_line("C")],
            description="The highest utilisation among each host's GPUs."
                        + utilisation_lines("a node whose fullest GPU has")),
        row("Kubernetes: by namespace and pod"),
        timeseries("GPU memory by namespace", [target(f"sum by (namespace) ({used})", "{{namespace}}")],
                   stack=True, description="Processes outside any pod have an empty namespace."),
        timeseries("GPU memory by pod", [target(f"sum by (namespace, pod) ({used})", "{{namespace}}/{{pod}}")],
                   stack=True, description="Every GPU process of a pod, on every GPU and node, summed."),
        table("Pods", [
            target(f"sum by (instance, namespace, pod) ({used})", instant=True, table=True),
            target(f"count by (instance, namespace, pod) ({used})", instant=True, table=True),
            target(f"sum by (instance, namespace, pod) (gpumem_process_host_rss_bytes{{{POD_SEL}}})",
                   instant=True, table=True),
            target(leak_by_pod, instant=True, table=True),
        ], h=9, description="Per pod and node. A: GPU memory, B: GPU processes (a process on two GPUs "
                            "counts twice), C: host RSS, D: a leak is suspected in one of its processes.",
            units={"Value #A": "bytes", "Value #C": "bytes"}),
    ]
    return dashboard("gpumem-fleet", "GPU memory / Fleet",
                     "Every GPU node at once, and GPU memory by Kubernetes namespace and pod.",
                     [INSTANCE, NAMESPACE, POD], panels)


DASHBOARDS: dict[str, Callable[[], JSON]] = {
    "overview.json": overview,
    "fleet.json": fleet,
    "memory-budget.json": memory_budget,
    "leak-investigation.json": leak_investigation,
    "vllm.json": vllm,
}


def render() -> dict[str, str]:
    """File name -> JSON text, exactly as written to disk."""
    return {name: json.dumps(build(), indent=2, sort_keys=True) + "\n" for name, build in DASHBOARDS.items()}


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0]).parse_args(argv)  # --help writes nothing
    OUT.mkdir(parents=True, exist_ok=True)
    for name, text in render().items():
        (OUT / name).write_text(text)
        print(f"wrote {OUT / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
