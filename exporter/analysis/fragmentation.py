"""Fragmentation: allocations fail (or vLLM behaves as if memory were short) while memory
is, on paper, there.

Three signals, one finding per (GPU, endpoint):
- an out-of-memory event (from the logs) where PyTorch held a large share reserved but
  unallocated, or NVML/the message showed enough free memory for the request;
- vLLM preemptions rising while the GPU had free memory. vLLM preempts only when the KV cache
  has no free block, so a preemption proves the cache was full at that moment: KV usage that
  looked low in the samples is sampling that missed the peak (a real ramp saw-tooths within
  seconds), never a sign of fragmentation, and is not read;
- a vLLM server using far more than its planned budget (gpu_memory_utilization x total)
  for a sustained time: memory outside what vLLM sized for (allocator cache, NCCL buffers).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from ..model import (
    AllocatorStats,
    Budget,
    Finding,
    GpuSample,
    OomEvent,
    ProcessSample,
    Snapshot,
    VllmEngineStats,
)
from ..units import GiB, counted, format_bytes
from .budget import tensor_parallel_endpoints
from .detector import DetectorSpec, FindingAlert, FindingKind, Tick
from .history import History, recent_events

GPU_OOM_KINDS = frozenset({"torch_cuda_oom", "cuda_runtime_oom", "nccl_oom"})
_SEVERITY = {"info": 0, "warning": 1, "critical": 2}


@dataclass(frozen=True)
class FragmentationConfig:
    reserved_unallocated_share: float = 0.20  # of PyTorch's reserved memory at the OOM
    free_ratio: float = 0.20  # GPU free share that makes an OOM or preemption suspicious
    window_seconds: float = 300.0  # how long OOM events and preemptions count
    budget_excess_bytes: int = GiB  # "far above budget": by this much ...
    budget_excess_ratio: float = 0.05  # ... and this share of the GPU's total
    budget_sustain_seconds: float = 60.0  # ... for this long
    # Allocator probe. Retries: at least this many within window_seconds, the counter having
    # risen at this many separate samples (one burst, e.g. a single huge prompt, is not a trend).
    alloc_retries_min: int = 3
    alloc_retries_min_rises: int = 2
    # Inactive splits: at least this share of the process's reserved memory and this many
    # bytes, throughout the last inactive_split_sustain_seconds (splits come and go within a
    # step; what stays for minutes is fragmentation).
    inactive_split_share: float = 0.20
    inactive_split_min_bytes: int = GiB
    inactive_split_sustain_seconds: float = 300.0

    def __post_init__(self) -> None:
        for name in ("reserved_unallocated_share", "free_ratio", "budget_excess_ratio", "inactive_split_share"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"fragmentation: {name} must be within 0-1")
        if self.window_seconds <= 0 or self.budget_sustain_seconds < 0:
            raise ValueError("fragmentation: window_seconds > 0, budget_sustain_seconds >= 0")
        if self.alloc_retries_min < 1 or self.alloc_retries_min_rises < 1 \
                or self.inactive_split_min_bytes < 0 or self.inactive_split_sustain_seconds < 0:
            raise ValueError("fragmentation: alloc_retries_min >= 1, alloc_retries_min_rises "
                             ">= 1, inactive_split_min_bytes >= 0, "
                             "inactive_split_sustain_seconds >= 0")


def detect_fragmentation(history: History, snapshot: Snapshot, config: FragmentationConfig,
                         budgets: tuple[Budget, ...]) -> list[Finding]:
    """`budgets`: this tick's memory budgets (earlier ticks' come with their snapshots)."""
    found: dict[tuple[object, ...], Finding] = {}
    tensor_parallel = tensor_parallel_endpoints(budgets)
    for finding in (*_from_ooms(history, snapshot, config, tensor_parallel),
                    *_from_preemptions(history, snapshot, config, budgets),
                    *_from_budgets(history, snapshot, config, budgets, tensor_parallel),
                    *_from_allocator(history, snapshot, config, tensor_parallel)):
        found[finding.key] = _merge(found[finding.key], finding) if finding.key in found \
            else finding
    return list(found.values())


def _merge(a: Finding, b: Finding) -> Finding:
    worse = a if _SEVERITY.get(a.severity, 0) >= _SEVERITY.get(b.severity, 0) else b
    return Finding(
        kind=a.kind, severity=worse.severity, first_detected_at=a.first_detected_at, gpu=a.gpu,
        uuid=a.uuid or b.uuid, pid=a.pid, endpoint=a.endpoint,
        summary=f"{a.summary}; {b.summary}", evidence=a.evidence + b.evidence,
        advice=tuple(dict.fromkeys(a.advice + b.advice)))


def _advice(tensor_parallel: bool) -> tuple[str, ...]:
    advice = ["Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in the server's environment "
              "so freed blocks can be reused for larger requests (on PyTorch without expandable "
              "segments, PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:512)."]
    if tensor_parallel:
        advice.append("With tensor parallelism set NCCL_CUMEM_ENABLE=0: NCCL's cuMem buffers "
                      "live outside PyTorch's allocator and add to fragmentation.")
    return tuple(advice)


def _gpu(snapshot: Snapshot, index: str | None) -> GpuSample | None:
    return next((g for g in snapshot.gpus if g.index == index), None)


def _from_ooms(history: History, snapshot: Snapshot, config: FragmentationConfig,
               tensor_parallel: frozenset[str]) -> list[Finding]:
    per_gpu: dict[str | None, list[tuple[OomEvent, str]]] = {}
    for snap, event in recent_events(history, snapshot, config.window_seconds):
        if event.kind not in GPU_OOM_KINDS:
            continue
        reason = _oom_reason(event, _gpu(snap, event.gpu), config)
        if reason:
            per_gpu.setdefault(event.gpu, []).append((event, reason))
    findings = []
    for gpu_index, events in per_gpu.items():
        event, reason = events[-1]
        gpu = _gpu(snapshot, gpu_index)
        evidence: list[tuple[str, float | int | str]] = [
            ("oom_events", len(events)), ("oom_kind", event.kind), ("oom_class", event.klass),
            ("log", f"{event.source}:{event.line}")]
        for name in ("requested_bytes", "free_bytes", "total_bytes", "reserved_bytes",
                     "reserved_unallocated_bytes"):
            if getattr(event, name) is not None:
                evidence.append((name, getattr(event, name)))
        findings.append(Finding(
            kind="fragmentation", severity="critical", first_detected_at=snapshot.timestamp,
            gpu=gpu_index, uuid=gpu.uuid if gpu else "",
            summary=f"GPU {gpu_index if gpu_index is not None else '?'}: out of memory "
                    f"{reason} ({counted(len(events), 'event')} in {config.window_seconds / 60:.0f} min)",
            evidence=tuple(evidence),
            advice=_advice(bool(tensor_parallel))))
    return findings


def _oom_reason(event: OomEvent, gpu: GpuSample | None, config: FragmentationConfig) -> str:
    """Why this OOM looks like fragmentation, or "" when it looks like a real shortage."""
    ru, reserved, requested = (event.reserved_unallocated_bytes, event.reserved_bytes,
                               event.requested_bytes)
    if ru is not None and ((reserved and ru >= config.reserved_unallocated_share * reserved)
                           or (requested is not None and ru >= requested)):
        return f"with {format_bytes(ru)} reserved by PyTorch but unallocated"
    free, total = event.free_bytes, event.total_bytes
    if free is None and gpu is not None:  # the message did not say: what NVML saw then
        free, total = gpu.free_bytes, gpu.total_bytes
    if free is not None and requested is not None and free >= requested:
        return f"although {format_bytes(free)} was free for a {format_bytes(requested)} request"
    if free is not None and total and free >= config.free_ratio * total:
        return f"although {free / total:.0%} of the GPU was free"
    if event.klass == "fragmentation":
        return "classified as fragmentation from its message"
    return ""


def _engine_stats(snap: Snapshot, endpoint: str) -> dict[tuple[str, str], VllmEngineStats]:
    for v in snap.vllm:
        if v.endpoint == endpoint and v.up:
            return {(e.model, e.engine): e for e in v.engines}
    return {}


def _from_preemptions(history: History, snapshot: Snapshot, config: FragmentationConfig,
                      budgets: tuple[Budget, ...]) -> list[Finding]:
    now = snapshot.timestamp
    start = now - config.window_seconds
    past: list[Snapshot] | None = None
    findings = []
    for server in snapshot.vllm:
        if not server.up:
            continue
        engines = _engine_stats(snapshot, server.endpoint)
        if all(_unmoved(history, server.endpoint, e, start) for e in engines.values()):
            continue  # no preemption within the window, the history's index says: no frame read (#18)
        if past is None:
            past = [s for s in history.recent(start) if s.timestamp < now]
        preempted, kv_peak = 0.0, None
        for key, current in engines.items():
            series = [e for s in past if (e := _engine_stats(s, server.endpoint).get(key))]
            series.append(current)
            preempted += _counter_increase([e.preemptions_total for e in series])
            kvs = [e.kv_cache_usage_ratio for e in series if e.kv_cache_usage_ratio is not None]
            if kvs:
                kv_peak = max(kvs) if kv_peak is None else max(kv_peak, *kvs)
        if preempted <= 0:
            continue
        gpus = [_gpu(snapshot, b.gpu) for b in budgets if b.endpoint == server.endpoint]
        free_ratios = [g.free_bytes / g.total_bytes for g in gpus
                       if g is not None and g.free_bytes is not None and g.total_bytes]
        if not free_ratios or min(free_ratios) < config.free_ratio:
            continue  # preempted with the GPU full: the KV cache ran out, which is kv_saturation's
        evidence: list[tuple[str, float | int | str]] = [
            ("preemptions_in_window", preempted), ("window_seconds", config.window_seconds)]
        if kv_peak is not None:
            evidence.append(("kv_cache_usage_peak_ratio", round(kv_peak, 4)))
        if free_ratios:
            evidence.append(("gpu_free_ratio_min", round(min(free_ratios), 4)))
        evidence.append(("gpus", ",".join(g.index for g in gpus if g is not None)))
        why = f"{min(free_ratios):.0%} of the GPU free"
        advice = _advice(len(gpus) > 1) + (
            "The GPU has memory vLLM does not use: raise --gpu-memory-utilization "
            "for a larger KV cache, or lower --max-num-seqs / --max-model-len.",)
        findings.append(Finding(
            kind="fragmentation", severity="warning", first_detected_at=now,
            gpu=gpus[0].index if len(gpus) == 1 and gpus[0] else None,
            uuid=gpus[0].uuid if len(gpus) == 1 and gpus[0] else "", endpoint=server.endpoint,
            summary=f"{server.endpoint}: {counted(preempted, 'request')} preempted in "
                    f"{config.window_seconds / 60:.0f} min with {why}",
            evidence=tuple(evidence), advice=advice))
    return findings


def _unmoved(history: History, endpoint: str, engine: VllmEngineStats, since: float) -> bool:
    """The engine's preemptions counter had its current value in every frame since `since`."""
    run = history.preemptions_run(endpoint, engine.model, engine.engine)
    return run is not None and run[0] == engine.preemptions_total and run[1] <= since


def _counter_increase(values: list[float | None]) -> float:
    """Total increase of a counter over samples, counting a drop as a restart from zero."""
    total, last = 0.0, None
    for v in values:
        if v is None:
            continue
        if last is not None:
            total += v - last if v >= last else v
        last = v
    return total


def _from_budgets(history: History, snapshot: Snapshot, config: FragmentationConfig,
                  budgets: tuple[Budget, ...], tensor_parallel: frozenset[str]) -> list[Finding]:
    now = snapshot.timestamp
    over = {(b.endpoint, b.gpu): b for b in budgets if _excess(snapshot, b, config)}
    if not over:
        return []
    # Sustained: every snapshot of the last budget_sustain_seconds over as well, and the
    # history reaching back that far.
    since = now
    for snap, past in reversed([f for f in history.recent_frames(
            now - 2 * config.budget_sustain_seconds - 1) if f[0].timestamp < now]):
        if now - since >= config.budget_sustain_seconds:
            break
        still = {(b.endpoint, b.gpu) for b in past if _excess(snap, b, config)}
        over = {k: b for k, b in over.items() if k in still}
        if not over:
            return []
        since = snap.timestamp
    if now - since < config.budget_sustain_seconds:
        return []
    findings = []
    for (endpoint, gpu_index), b in over.items():
        used, budget = b.used_bytes, b.budget_bytes
        if used is None or budget is None:
            continue  # never: _excess() is False for these
        excess = used - budget
        findings.append(Finding(
            kind="fragmentation", severity="warning", first_detected_at=now, gpu=gpu_index,
            uuid=b.uuid, endpoint=endpoint,
            summary=f"{endpoint} uses {format_bytes(used)} on GPU {gpu_index}, "
                    f"{format_bytes(excess)} above its budget of {format_bytes(budget)}",
            evidence=(("used_bytes", used), ("budget_bytes", budget),
                      ("excess_bytes", excess),
                      ("sustained_seconds", round(now - since, 1))),
            advice=_advice(endpoint in tensor_parallel) + (
                "vLLM did not plan for this memory: check CUDA graph capture sizes "
                "(--cuda-graph-sizes, or --enforce-eager to confirm) and NCCL buffers.",)))
    return findings


def _excess(snapshot: Snapshot, b: Budget, config: FragmentationConfig) -> bool:
    if b.budget_bytes is None or b.used_bytes is None:
        return False
    gpu = _gpu(snapshot, b.gpu)
    total = gpu.total_bytes if gpu and gpu.total_bytes else 0
    return b.used_bytes - b.budget_bytes >= max(config.budget_excess_bytes,
                                                config.budget_excess_ratio * total)


# ------------------------------------------------------------------ allocator probe

def _from_allocator(history: History, snapshot: Snapshot, config: FragmentationConfig,
                    tensor_parallel: frozenset[str]) -> list[Finding]:
    now = snapshot.timestamp
    findings = []
    for gpu in snapshot.gpus:
        for p in gpu.processes:
            a = p.allocator
            if a is None:
                continue
            since = now - config.window_seconds
            span = history.process_allocator_span("alloc_retries", gpu.uuid, p.identity, since)
            if span is None or span.flat:
                rise, rises = 0.0, 0  # what counter_rise() says of no values or flat ones
            else:
                rise, rises = counter_rise(history.process_allocator(
                    "alloc_retries", gpu.uuid, p.identity, since=since).values)
            retrying = rise >= config.alloc_retries_min and rises >= config.alloc_retries_min_rises
            split_floor = _sustained_floor(history, gpu.uuid, p, now,
                                           config.inactive_split_sustain_seconds)
            split_needed = max(config.inactive_split_min_bytes,
                               config.inactive_split_share * (a.reserved_bytes or 0))
            fragmented = a.reserved_bytes is not None and split_floor is not None \
                and split_floor >= split_needed
            if retrying or fragmented:
                findings.append(_allocator_finding(
                    gpu, p, a, now, config, rise, split_floor if fragmented else None, retrying,
                    p.endpoint in tensor_parallel))
    return findings


def counter_rise(values: tuple[float, ...]) -> tuple[float, int]:
    """(increase, samples at which it rose) of a counter over its samples. A drop is a reset
    (the stats were reset, or a reused PID's new process): the value after it is a new baseline,
    not a rise, and neither is the first value (what happened before the window, or before we
    looked)."""
    if values.count(values[0] if values else 0.0) == len(values):
        return 0.0, 0  # flat (the usual case), or empty
    total, rises = 0.0, 0
    for before, after in itertools.pairwise(values):
        if after > before:
            total += after - before
            rises += 1
    return total, rises


def _sustained_floor(history: History, uuid: str, p: ProcessSample, now: float,
                     sustain: float) -> float | None:
    """The least inactive-split bytes over the last `sustain` seconds, None until the series
    reaches back that far (a process just seen, or one whose splits were not reported)."""
    # From the sample in effect at the window's start: it held until the next one.
    span = history.process_allocator_span("inactive_split", uuid, p.identity, since=now - sustain)
    if span is None or span.first_time > now - sustain or span.last_time < now:
        return None
    return span.low


def _allocator_finding(gpu: GpuSample, p: ProcessSample, a: AllocatorStats, now: float,
                       config: FragmentationConfig, rise: float, split_floor: float | None,
                       retrying: bool, tensor_parallel: bool) -> Finding:
    """`split_floor`: the sustained inactive-split bytes when they made the finding, else None."""
    reserved, allocated, split = a.reserved_bytes, a.allocated_bytes, a.inactive_split_bytes
    evidence: list[tuple[str, float | int | str]] = [
        ("alloc_retries_in_window", int(rise)), ("window_seconds", config.window_seconds)]
    if a.alloc_retries is not None:
        evidence.append(("alloc_retries_total", a.alloc_retries))
    for name, value in (("reserved_bytes", reserved), ("allocated_bytes", allocated),
                        ("inactive_split_bytes", split)):
        if value is not None:
            evidence.append((name, value))
    if reserved is not None and allocated is not None:
        evidence.append(("reserved_unallocated_bytes", reserved - allocated))
    if split is not None and reserved:
        evidence.append(("inactive_split_share", round(split / reserved, 4)))
    if split_floor is not None:
        evidence.append(("inactive_split_floor_bytes", int(split_floor)))
        evidence.append(("sustained_seconds", config.inactive_split_sustain_seconds))
    if split is not None:
        evidence.append(("recoverable_bytes", split))
    if a.ooms is not None:
        evidence.append(("allocator_ooms_total", a.ooms))
    if a.backend:
        evidence.append(("allocator_backend", a.backend))
    conf = _alloc_conf(a)
    if conf:
        evidence.append(("alloc_conf", conf))
    who = f"{p.name or 'pid ' + str(p.pid)} (pid {p.pid}) on GPU {gpu.index}"
    why = []
    if retrying:
        why.append(f"PyTorch's allocator retried {counted(rise, 'time')} in "
                   f"{config.window_seconds / 60:.0f} min (cache flushed, cudaMalloc retried)")
    if split_floor is not None and reserved:
        why.append(f"{format_bytes(split_floor)} of its {format_bytes(reserved)} reserved has "
                   f"stayed in inactive splits for {config.inactive_split_sustain_seconds / 60:.0f} min")
    return Finding(
        kind="fragmentation", severity="warning", first_detected_at=now, gpu=gpu.index,
        uuid=gpu.uuid, pid=p.pid, process=p.name, role=p.role, endpoint=p.endpoint,
        summary=f"{who}: " + "; ".join(why or ["allocator fragmentation"]),
        evidence=tuple(evidence), advice=allocator_advice(a, retrying, tensor_parallel))


def _alloc_conf(a: AllocatorStats) -> str:
    return ";".join(f"{k}={v}" for k, v in a.alloc_conf)


def allocator_advice(a: AllocatorStats, retrying: bool, tensor_parallel: bool) -> tuple[str, ...]:
    """Which allocator knob, for this process's allocator and settings."""
    split = a.inactive_split_bytes
    recover = (f" It would give back up to {format_bytes(split)} now held in inactive splits."
               if split else "")
    conf = _alloc_conf(a).replace(" ", "")
    advice = []
    if a.backend == "cudaMallocAsync":
        advice.append("The process uses PyTorch's cudaMallocAsync backend, to which "
                      "expandable_segments and max_split_size_mb do not apply: try the native "
                      "backend with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True." + recover)
    elif "expandable_segments:True" in conf or "expandable_segments:true" in conf:
        advice.append("expandable_segments is already on: allocation sizes that vary per "
                      "request still fragment; add garbage_collection_threshold:0.8 to "
                      "PYTORCH_CUDA_ALLOC_CONF so cached blocks are reclaimed before a retry, "
                      "and pad variable shapes to a few fixed sizes.")
    elif a.cumem_bytes:
        advice.append("vLLM sleep mode is on, and its memory pool (CuMemAllocator) cannot use "
                      "expandable segments (older vLLM refuses to start with them, newer turns "
                      "them off inside the pool): set PYTORCH_CUDA_ALLOC_CONF="
                      "max_split_size_mb:512 instead (blocks above 512 MiB are never split, so "
                      "large requests find whole blocks)." + recover)
    else:
        advice.append("Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in the process's "
                      "environment (PyTorch 2.1+): segments grow in place instead of being "
                      "split, so freed memory serves requests of any size." + recover
                      + " Use max_split_size_mb:512 instead where expandable segments are "
                      "unavailable (PyTorch before 2.1) or do not apply (vLLM sleep mode's pool).")
    if retrying:
        advice.append("Every retry frees PyTorch's whole cache and synchronises the GPU (a "
                      "latency spike); when a retry fails the process runs out of memory. "
                      "Until the setting is changed, leave more headroom (a lower "
                      "--gpu-memory-utilization, --max-num-seqs or --max-num-batched-tokens).")
    if tensor_parallel:
        advice.append("With tensor parallelism set NCCL_CUMEM_ENABLE=0: NCCL's cuMem buffers "
                      "live outside PyTorch's allocator and add to fragmentation.")
    return tuple(advice)


def _detect(tick: Tick, config: FragmentationConfig) -> list[Finding]:
    return detect_fragmentation(tick.history, tick.snapshot, config, tick.budgets)


DETECTOR = DetectorSpec(
    name="fragmentation", config=FragmentationConfig, create=lambda: _detect,
    help=("Allocations fail, or vLLM behaves as if memory were short, while memory is there: "
          "out-of-memory events with memory free, preemptions with the KV cache not full, a "
          "server far above its budget, the allocator probe's retries and inactive splits."),
    history_needed={"window_seconds": 1, "budget_sustain_seconds": 2, "inactive_split_sustain_seconds": 1},
    kinds=(FindingKind(
        "fragmentation", scenario="fragmentation",
        help="memory that is free or cached but cannot be used (docs/oom-diagnosis.md)",
        alert=FindingAlert(
            "GpuMemoryFragmentation", severity="ticket", for_="10m",
            comment=("The detector reads the allocator probe's retry counter itself (alloc_retries_min "
                     "retries within its window): the early sign, long before an out-of-memory error."),
            summary=("GPU memory on GPU {{ $labels.gpu }} of {{ $labels.instance }} is "
                     "fragmented{{ with $labels.process }} in {{ . }}{{ end }}."),
            description=("{{ with $labels.pid }}{{ $labels.process }} (pid "
                         "{{ . }}){{ else }}{{ with $labels.endpoint }}vLLM {{ . }}{{ else }}A "
                         "process{{ end }}{{ end }} on GPU {{ $labels.gpu }} of {{ $labels.instance }} has had "
                         "fragmented GPU memory for 10 minutes: "
                         '{{ with printf "increase(gpumem_process_alloc_retries_total{instance=%q,gpu=%q,pid=%q}[15m]) '
                         "> 0\" $labels.instance $labels.gpu $labels.pid | query }}PyTorch's allocator had to free "
                         'its cache and retry cudaMalloc {{ . | first | value | printf "%.0f" }} times in 15 '
                         "minutes{{ else }}the exporter's detector sees memory reserved but not allocatable in "
                         "large enough blocks{{ end }}. Reserved but free in PyTorch's cache: "
                         '{{ with printf "gpumem_process_torch_reserved_bytes{instance=%q,gpu=%q,pid=%q} '
                         '- gpumem_process_torch_allocated_bytes{instance=%q,gpu=%q,pid=%q}" '
                         "$labels.instance $labels.gpu $labels.pid $labels.instance $labels.gpu "
                         "$labels.pid | query }}{{ . | first | value | humanize1024 }}B{{ else }}unknown (no "
                         "allocator probe){{ end }}; the GPU is at "
                         '{{ with printf "instance_gpu:gpumem_memory_utilization:ratio{instance=%q,gpu=%q}" '
                         "$labels.instance $labels.gpu | query }}{{ . | first | value | "
                         "humanizePercentage }}{{ end }}. Requests can fail with out-of-memory although enough "
                         "memory is free in total."))),),
    settings={
        "window_seconds": "How long out-of-memory events, preemptions and allocator retries count.",
        "reserved_unallocated_share": ("An out-of-memory event where PyTorch held at least this share of its "
                                       "reserved memory unallocated is fragmentation."),
        "free_ratio": ("A GPU with at least this share free makes an out-of-memory event or preemptions "
                       "suspicious."),
        "budget_excess_bytes": "A vLLM server above its budget by this much ...",
        "budget_excess_ratio": "... and this share of the GPU's total ...",
        "budget_sustain_seconds": "... for this long is using memory outside what it sized for.",
        "alloc_retries_min": "Allocator probe: at least this many allocation retries within window_seconds ...",
        "alloc_retries_min_rises": ("... the counter having risen at this many separate samples (one burst is no "
                                    "trend)."),
        "inactive_split_share": ("Allocator probe: inactive split blocks of at least this share of the process's "
                                 "reserved memory ..."),
        "inactive_split_min_bytes": "... and at least this many bytes ...",
        "inactive_split_sustain_seconds": "... throughout this long.",
    })
