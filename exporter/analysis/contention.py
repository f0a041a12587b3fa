"""Contention: processes outside the serving stack hold memory that its budget needs.

- Discrete GPU: the vLLM servers on a GPU planned to hold their budgets (analysis.budget); the
  other processes on it hold memory too. When what is left beside the budgets and the others
  (and memory no live process holds) falls under `min_spare_ratio` of the GPU, the others are
  named, every one of them, with what each holds and how much it grew within the window; when
  nothing is left, the budget itself does not fit (critical). Where a server's budget is not
  known, the GPU being `min_utilization_ratio` full decides instead. The finding lasts as long
  as the others hold the memory, however long ago they took it.
- Unified memory (GB10, Grace Hopper): the GPU's memory *is* host memory, so while the host is
  short of it (MemAvailable low, memory PSI high, or the kernel OOM killer ran within the
  window) the host processes outside the serving stack holding the most resident memory are
  named (the host source reads the largest processes on such hosts, GPU processes or not),
  with their growth. It is critical where GpuUnifiedMemoryHostPressure pages (the thresholds of
  exporter/thresholds.py, read through pressure.unified_host_short) or the OOM killer ran.
- vLLM's CPU backend (a host with no GPU, serving vLLM): the model and its KV cache are host
  memory too, so the same shortage names the same holders, in a finding without a GPU. It is
  critical once the OOM killer ran (no page reads the host pool of a host without GPUs).

Short of room (or of host memory) at any sample within `hold_seconds` counts as short now, so a
GPU hovering at a threshold keeps one finding; critical at any sample within it counts as
critical now, so its severity (the alert's label) does not flap either; while others still hold
memory, a discrete GPU's finding is then told as the newest sample that was critical (or short),
not as a GPU no longer short. A GPU with no serving process has no budget to take from: what
fills it is pressure's to say.
Growth is measured against the latest raw snapshot at least `window_seconds` old; until the
history reaches that far back it is not given (the memory held still is). A process that did not
grow is said to have held its memory for as long as its series' per-minute minima say (the
history's retention, not the window), so "held for 79 min" stays true an hour later; and, when it
took memory well before it reached its size, how long it has held any ("held for 8 min at this
size, 33 min in all": a notebook that grew is not a newcomer).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from .. import thresholds
from ..model import Budget, Finding, GpuSample, HostMemory, ProcessSample, Snapshot
from ..units import GiB, counted, format_bytes, format_duration
from .alert_text import (
    GPU_MEMORY,
    HOST_PROCESSES_OUTSIDE_VLLM,
    HOST_RSS,
    IF_UNIFIED_GPU,
    NAME_PID_SIZE,
    ON_GPU,
    ON_HOST,
    OTHER_GPU_PROCESSES_NONZERO_QUERY,
    OTHER_GPU_PROCESSES_QUERY,
    largest_outside_vllm,
    process_list,
)
from .budget import BASIS_UTILIZATION, cuda_total, memory_budgets
from .detector import DetectorSpec, FindingAlert, FindingKind, Tick
from .pressure import unified_host_short
from .process_names import named_evidence, process_name

if TYPE_CHECKING:
    from ..model import Identity
    from .history import History, SeriesView

MIB = 1 << 20
# What a new process's CUDA context holds before it allocates anything (gpu_checks/ measured 610
# MiB on an H100 and on an H200 with driver 580; smaller cards hold less): room a restarted
# server needs at once.
CUDA_CONTEXT_BYTES = 640 * MIB

Evidence = list[tuple[str, float | int | str]]


@dataclass(frozen=True)
class ContentionConfig:
    window_seconds: float = 300.0  # growth of the named processes is measured over this window
    min_bytes: int = 512 * MIB  # the other processes must hold at least this in all
    process_min_bytes: int = 64 * MIB  # a process holding less is not named
    # Budgets known: contention when the memory left beside the vLLM budgets and everything else
    # on the GPU is under this share of it (no room left for what the others do next) ...
    min_spare_ratio: float = 0.05
    # ... budgets unknown: when the GPU is at least this full (used/total).
    min_utilization_ratio: float = 0.80
    # Critical from the GPU's use at which GpuMemoryNearFull pages (exporter/thresholds.py), not a
    # setting of its own: the page and the finding read one number.
    critical_ratio: float = thresholds.MEMORY_NEAR_FULL.value
    # Unified memory: short (a warning, before the page) when MemAvailable is under this share ...
    host_available_low_ratio: float = 0.15
    psi_some_threshold: float = 10.0  # ... or memory PSI "some" avg10 (%) is at least this;
    # critical where GpuUnifiedMemoryHostPressure pages (pressure.unified_host_short, thresholds.py).
    top_processes: int = 8  # named in the summary and the evidence, the largest first
    # Short of room at any sample this recent counts as short now: a GPU or host hovering at a
    # threshold (PSI noise, a sawtooth) keeps one finding instead of raising it every other tick.
    hold_seconds: float = 120.0

    def __post_init__(self) -> None:
        if self.window_seconds <= 0 or self.min_bytes < 0 or self.process_min_bytes < 0:
            raise ValueError("contention: window_seconds > 0 and byte thresholds >= 0")
        if not all(0 <= r <= 1 for r in (self.min_utilization_ratio, self.host_available_low_ratio,
                                         self.min_spare_ratio, self.critical_ratio)):
            raise ValueError("contention: ratios must be within 0-1")
        if self.top_processes < 1 or self.hold_seconds < 0:
            raise ValueError("contention: top_processes must be >= 1, hold_seconds >= 0")


def _baseline(history: History, now: float, window: float) -> Snapshot | None:
    """The newest snapshot at least `window` seconds old, if history reaches back that far."""
    base = None
    for snap in history.recent(now - 2 * window):
        if snap.timestamp > now - window:
            break
        base = snap
    return base


def _budgets(history: History, snapshot: Snapshot) -> tuple[Budget, ...]:
    """The tick's budgets as the engine computed them (kept with the snapshot in the history)."""
    frames = history.recent_frames(snapshot.timestamp)
    if frames and frames[-1][0] is snapshot:
        return frames[-1][1]
    return memory_budgets(snapshot)


def detect_contention(history: History, snapshot: Snapshot,
                      config: ContentionConfig) -> list[Finding]:
    now = snapshot.timestamp
    base = _baseline(history, now, config.window_seconds)
    budgets = _budgets(history, snapshot)
    recent = [f for f in history.recent_frames(now - config.hold_seconds) if f[0] is not snapshot]
    recent.append((snapshot, budgets))
    findings = []
    for gpu in snapshot.gpus:
        if not gpu.up:
            continue
        old = next((g for g in base.gpus if g.uuid == gpu.uuid), None) if base is not None else None
        # Short, or critical, at any sample within hold_seconds counts as now: neither the finding
        # nor its severity (an alert label) flaps with a GPU or host hovering at a threshold.
        if gpu.unified:
            short = any(s.host is not None and _host_short(s.host, config) for s, _ in recent)
            paging = any(bool(unified_host_short(s.host)) for s, _ in recent)
            finding = _unified(gpu, snapshot, base, short, config, history, paging)
        else:
            frames = [(g, tuple(b for b in bs if b.uuid == gpu.uuid))
                      for s, bs in recent for g in s.gpus if g.uuid == gpu.uuid and g.up]
            short = any(_room_short(g, bs, config) for g, bs in frames)
            critical = any(_room_critical(g, bs, config) for g, bs in frames)
            finding = _discrete(*frames[-1], old, base is not None, short, critical, now, config, history)
            if finding is not None:  # told as the newest sample that shows its severity, then the shortage
                shown = next((f for f in reversed(frames) if _room_critical(*f, config)), None) if critical else None
                shown = shown or next((f for f in reversed(frames) if _room_short(*f, config)), frames[-1])
                if shown is not frames[-1]:
                    finding = _discrete(*shown, old, base is not None, short, critical, now, config,
                                        history) or finding
        if finding is not None:
            findings.append(finding)
    if not snapshot.gpus and any(server.up and server.processes for server in snapshot.vllm):
        short = any(s.host is not None and _host_short(s.host, config) for s, _ in recent)
        finding = _unified(None, snapshot, base, short, config, history)
        if finding is not None:
            findings.append(finding)
    return findings


def _room_short(gpu: GpuSample, budgets: tuple[Budget, ...], config: ContentionConfig) -> bool:
    """Discrete: too little left beside the vLLM budgets and everything else on the GPU (or,
    budgets unknown, the GPU nearly full)."""
    spare = _spare(gpu, budgets)
    if spare is not None:
        return spare < config.min_spare_ratio * (gpu.total_bytes or 0)
    return (gpu.used_bytes is not None and bool(gpu.total_bytes)
            and gpu.used_bytes / (gpu.total_bytes or 1) >= config.min_utilization_ratio)


def _room_critical(gpu: GpuSample, budgets: tuple[Budget, ...], config: ContentionConfig) -> bool:
    """Discrete, critical: the vLLM budget does not fit beside the others, or the GPU is at the
    critical utilisation."""
    spare = _spare(gpu, budgets)
    return ((spare is not None and spare < 0)
            or (gpu.used_bytes is not None and bool(gpu.total_bytes)
                and gpu.used_bytes / (gpu.total_bytes or 1) >= config.critical_ratio))


def _spare(gpu: GpuSample, budgets: tuple[Budget, ...]) -> int | None:
    """What is left of the GPU once the vLLM budgets are held in full beside what the other
    processes (and memory no live process holds, driver context) take; None where a budget is
    not known."""
    capacity = cuda_total(gpu)
    if gpu.used_bytes is None or not capacity or not budgets or any(b.budget_bytes is None for b in budgets):
        return None
    serving = sum(p.used_bytes or 0 for p in gpu.processes if p.role == "vllm")
    return capacity - _planned(budgets) - max(0, gpu.used_bytes - serving)


def _planned(budgets: tuple[Budget, ...]) -> int:
    """What the vLLM servers hold once their budgets are held in full (or more, where they use more)."""
    return sum(max(b.budget_bytes or 0, b.used_bytes or 0) for b in budgets)


def _host_short(host: HostMemory, config: ContentionConfig) -> bool:
    """Unified: the host (so the GPU) short of memory: MemAvailable low or memory PSI high, at
    this detector's warning levels or at the page's (whichever a configuration makes earlier)."""
    low = host.total_bytes > 0 and host.available_bytes / host.total_bytes < config.host_available_low_ratio
    return (low or (host.psi_some_avg10 is not None and host.psi_some_avg10 >= config.psi_some_threshold)
            or bool(unified_host_short(host)))


def describe(p: ProcessSample) -> str:
    """pid, name and where it runs, for a human."""
    parts = [f"pid {p.pid} ({process_name(p)})"]
    if p.pod:
        parts.append(f"pod {p.namespace + '/' if p.namespace else ''}{p.pod}")
    if p.container:
        parts.append(f"container {p.container[:12]}")
    return " ".join(parts)


HELD_SHARE = 0.9  # "held since": the earliest minute from which it held at least this share of it


class Lasted(NamedTuple):
    at_size: float  # seconds it has held at least HELD_SHARE of what it holds now
    in_all: float  # seconds it has held at least the bytes a process is named for
    lower_bound: bool  # it held it as far back as the history goes


def held_for(tier: SeriesView, now: float, held: int, floor: int, history: History) -> Lasted | None:
    """How long a process has held at least HELD_SHARE of `held` bytes, and at least `floor`
    bytes, from its series' tier (per-minute minima, kept for the history's retention, so true
    beyond the raw window). A notebook that took 5 GiB, then 3 more, has held 8 GiB for minutes
    but memory for half an hour: both are what on-call wants. None without a tier to read, or
    when it took most of it within the last minute."""
    if not tier.times or not tier.lows:
        return None

    def since(least: float) -> int | None:
        i = len(tier.lows) - 1
        if tier.lows[i] < least:
            return None
        while i > 0 and tier.lows[i - 1] >= least:
            i -= 1
        return i

    at_size = since(HELD_SHARE * held)
    if at_size is None:
        return None
    first = since(min(floor, HELD_SHARE * held))
    first = at_size if first is None else first
    # A series that starts where the history does (the exporter's start, or its retention) may
    # have begun before: only a lower bound. One that starts later began when the process did.
    horizon = max(history.started_at or now, now - history.retention_seconds) + history.bucket_seconds
    return Lasted(now - tier.times[at_size], now - tier.times[first], first == 0 and tier.times[0] <= horizon)


def _growth(grew: int | None, lasted: Lasted | None, window: float, age: float | None) -> str:
    """Growth over the window (since the process started, where it is younger: "+5.6 GiB in 5
    min" of a process 3 minutes old reads as a rate it never had), or, where it did not grow, how
    long it has held the memory (a duration the window does not cap), and how long memory at all
    when that is much longer. `age`: seconds since the process started, None if not known."""
    if grew is None or abs(grew) < GiB / 20:
        if lasted is not None:
            bound = "at least " if lasted.lower_bound else ""
            at_size, in_all = (format_duration(s, hours_from=5400) for s in (lasted.at_size, lasted.in_all))
            if at_size == in_all or lasted.in_all - lasted.at_size < 120:
                return f", held for {bound}{at_size}"
            return f", held for {at_size} at this size, {bound}{in_all} in all"
        return "" if grew is None else f", no growth in the last {window / 60:.0f} min"
    sign = "+" if grew >= 0 else "-"
    if age is not None and 0 <= age < window:
        return f", {sign}{format_bytes(abs(grew))} since it started {format_duration(max(age, 60))} ago"
    return f", {sign}{format_bytes(abs(grew))} in {window / 60:.0f} min"


Held = tuple[int, "int | None", ProcessSample, "Lasted | None"]  # bytes, growth, process, how long held


def _named(held: list[Held], config: ContentionConfig, now: float, rss: bool = False) -> tuple[str, Evidence]:
    """The summary's list of processes (bytes, growth or how long held) and their evidence,
    largest first."""
    shown = held[:config.top_processes]
    text = "; ".join(f"{describe(p)} {format_bytes(b)}{' resident' if rss else ''}"
                     f"{_growth(g, h, config.window_seconds, None if p.start_time is None else now - p.start_time)}"
                     for b, g, p, h in shown)
    rest = held[config.top_processes:]
    if rest:
        text += f"; and {len(rest)} more ({format_bytes(sum(b for b, _, _, _ in rest))})"
    evidence: Evidence = []
    for i, (b, g, p, h) in enumerate(shown, 1):
        evidence += [*named_evidence(i, p), (f"process_{i}_container", p.container), (f"process_{i}_pod", p.pod),
                     (f"process_{i}_{'rss_' if rss else ''}bytes", b)]
        if g is not None:
            evidence.append((f"process_{i}_{'rss_' if rss else ''}grew_bytes", g))
        if h is not None:
            evidence += [(f"process_{i}_held_seconds", round(h.at_size, 1)),
                         (f"process_{i}_holding_seconds", round(h.in_all, 1))]
    return text, evidence


def _discrete(gpu: GpuSample, budgets: tuple[Budget, ...], old: GpuSample | None, have_baseline: bool,
              short: bool, critical: bool, now: float, config: ContentionConfig,
              history: History) -> Finding | None:
    if gpu.used_bytes is None or not gpu.total_bytes or not any(p.role == "vllm" for p in gpu.processes):
        return None  # no serving process here: nothing of its budget to take
    others = [p for p in gpu.processes if p.role != "vllm"]
    held_all = sum(p.used_bytes or 0 for p in others)
    before = {p.identity: p.used_bytes or 0 for p in old.processes} if old is not None else None
    held: list[Held] = sorted(
        ((p.used_bytes or 0,
          (p.used_bytes or 0) - before.get(p.identity, 0) if before is not None
          else (None if not have_baseline else p.used_bytes or 0), p, None)
         for p in others if (p.used_bytes or 0) >= config.process_min_bytes),
        key=lambda bgp: (-bgp[0], bgp[2].pid))
    if not held or held_all < config.min_bytes or not short:
        return None
    held = [(b, g, p, held_for(history.process_memory(gpu.uuid, p.identity), now, b, config.process_min_bytes,
                                    history))
            for b, g, p, _ in held]
    ratio = gpu.used_bytes / gpu.total_bytes
    spare = _spare(gpu, budgets)
    evidence: Evidence = [("held_by_others_bytes", held_all), ("utilization_ratio", round(ratio, 4)),
                          ("free_bytes", gpu.free_bytes if gpu.free_bytes is not None
                           else max(0, gpu.total_bytes - gpu.used_bytes))]
    names, named_evidence = _named(held, config, now)
    if spare is not None:
        planned = _planned(budgets)
        evidence += [("vllm_budget_bytes", planned), ("spare_bytes", spare)]
        budget = "budgets" if len(budgets) > 1 else "budget"
        if spare < 0:
            why = (f"{format_bytes(-spare)} more than the vLLM {budget} ({format_bytes(planned)}) "
                   f"{'leave' if len(budgets) > 1 else 'leaves'} them")
        else:
            why = (f"beside the vLLM {budget} ({format_bytes(planned)}) only {format_bytes(spare)} "
                   f"({spare / gpu.total_bytes:.0%} of the GPU) is left")
    else:
        why = f"the GPU is {ratio:.0%} used and the vLLM budget is not known"
    evidence += [("window_seconds", config.window_seconds), *named_evidence]
    return Finding(
        kind="contention", severity="critical" if critical else "warning",
        first_detected_at=now, gpu=gpu.index, uuid=gpu.uuid,
        summary=f"GPU {gpu.index}: other processes hold {format_bytes(held_all)}; {why}: {names}",
        evidence=tuple(evidence),
        advice=(
            "Move the named processes to another GPU (CUDA_VISIBLE_DEVICES) or stop them; "
            "a serving GPU should not be shared without limits.",
            "In Kubernetes, check that no pod gets this GPU besides the server "
            "(time-slicing shares memory without limits); use MIG partitions for isolation.",
            _smaller_budget(gpu, budgets, spare),
        ))


def _smaller_budget(gpu: GpuSample, budgets: tuple[Budget, ...], spare: int | None) -> str:
    """How far to lower the vLLM budget so it fits beside the others: where one server's budget
    is a share of the GPU, the share to restart with (rounded down); else the bytes to give up.
    The share is what the others leave once the new server's CUDA context is made: vLLM's
    start-up check wants `share x total` free at that point (gpu_worker.init_device)."""
    mps = "or cap MPS clients with CUDA_MPS_PINNED_DEVICE_MEM_LIMIT."
    capacity = cuda_total(gpu)
    if spare is None or spare >= 0 or not capacity:
        return ("If the GPU must be shared, lower vLLM's --gpu-memory-utilization so its budget plus the others "
                f"fit, {mps}")
    budget = budgets[0]
    if len(budgets) == 1 and budget.basis == BASIS_UTILIZATION and budget.budget_bytes:
        left = _planned(budgets) + spare - CUDA_CONTEXT_BYTES  # what the others leave, less the context
        share = math.floor(100 * left / capacity) / 100
        if share > 0:
            return (f"If the GPU must be shared, restart vLLM with --gpu-memory-utilization {share:.2f} or less "
                    f"(now {budget.budget_bytes / capacity:.2f}: its budget is {format_bytes(-spare)} more than "
                    f"the others leave it; at {share:.2f} the share vLLM checks for at start-up is free, its own CUDA "
                    "context included), "
                    f"{mps}")
    return (f"If the GPU must be shared, lower the vLLM budgets here by {format_bytes(-spare)} together "
            f"(--gpu-memory-utilization, or --kv-cache-memory), {mps}")


def _serving_pids(snapshot: Snapshot) -> set[int]:
    """The vLLM servers' processes: their roots, and every GPU process serving one."""
    pids = {pid for server in snapshot.vllm for pid in server.pids}
    pids |= {p.pid for server in snapshot.vllm for p in server.processes}
    pids |= {p.pid for g in snapshot.gpus for p in g.processes if p.role == "vllm"}
    return pids


def _unified(gpu: GpuSample | None, snapshot: Snapshot, base: Snapshot | None, short: bool,
             config: ContentionConfig, history: History, paging: bool = False) -> Finding | None:
    """The host short of memory where that memory is the model's: a unified GPU's, or (`gpu`
    None) that of vLLM's CPU backend."""
    host = snapshot.host
    if host is None or host.total_bytes <= 0:
        return None
    old_host = base.host if base is not None else None
    stalled = (host.psi_some_avg10 is not None
               and host.psi_some_avg10 >= config.psi_some_threshold)
    kills = _oom_kills(old_host, host) if old_host is not None else 0
    if not (kills > 0 or short):
        return None
    held = _rss_holders(snapshot, base, config, history)
    if not held or (sum(b for b, _, _, _ in held) < config.min_bytes and not kills):
        return None
    names, named_evidence = _named(held, config, snapshot.timestamp, rss=True)
    evidence: Evidence = [
        ("host_available_bytes", host.available_bytes), ("host_total_bytes", host.total_bytes),
        ("oom_kills_in_window", kills), ("window_seconds", config.window_seconds)]
    if old_host is not None:
        evidence.append(("host_available_dropped_bytes", old_host.available_bytes - host.available_bytes))
    if host.psi_some_avg10 is not None:
        evidence.append(("psi_some_avg10", host.psi_some_avg10))
    evidence += named_evidence
    # Critical exactly where GpuUnifiedMemoryHostPressure pages, or once the OOM killer ran.
    critical = kills > 0 or (gpu is not None and paging)
    reasons = [f"MemAvailable {format_bytes(host.available_bytes)} ({host.available_bytes / host.total_bytes:.0%})"]
    if stalled:  # a host without PSI (older kernels, containers) has psi_some_avg10 None
        reasons.append(f"memory PSI {host.psi_some_avg10:.4g} %")  # the kernel's 2 decimals
    if kills > 0:
        reasons.append(f"the kernel OOM killer ran {counted(kills, 'time')} in {config.window_seconds / 60:.0f} min")
    why = ", ".join(reasons)
    if gpu is None:
        who = "The host serving vLLM on its CPU backend is short of memory"
        shared = ("On vLLM's CPU backend the model and its KV cache live in host memory: every host process "
                  "counts against them.")
        size = ("Size the KV cache (--kv-cache-memory-bytes or VLLM_CPU_KVCACHE_SPACE) from what the host can "
                "spare beside the model, the OS and the page cache.")
        evidence.append(("cpu_backend", 1))
    else:
        who = f"GPU {gpu.index} (unified memory) is short of host memory"
        shared = ("On unified memory the GPU and the host share RAM: every host process counts against the "
                  "model's memory.")
        size = ("Size vLLM's --gpu-memory-utilization from what the host can spare (it is a share of the whole "
                "shared memory), leaving room for the OS and page cache.")
    return Finding(
        kind="contention", severity="critical" if critical else "warning",
        first_detected_at=snapshot.timestamp, gpu=gpu.index if gpu else None, uuid=gpu.uuid if gpu else "",
        summary=f"{who} ({why}); outside vLLM the most is held by: {names}",
        evidence=tuple(evidence),
        advice=(
            shared + " Stop or move the named processes, or cap them with a cgroup memory limit "
            "(systemd MemoryMax=, container --memory).",
            size,
            "Kernel OOM kills: see `journalctl -k | grep -i oom` for the victims.",
        ))


def _oom_kills(old: HostMemory, new: HostMemory) -> int:
    if old.oom_kills is None or new.oom_kills is None:
        return 0
    return new.oom_kills - old.oom_kills if new.oom_kills >= old.oom_kills else new.oom_kills


def _rss_holders(snapshot: Snapshot, base: Snapshot | None, config: ContentionConfig,
                 history: History) -> list[Held]:
    """(RSS, growth since the baseline or None, process, how long held where its RSS has a
    series: GPU processes) of the processes outside the serving stack, largest first: the host's
    largest processes and the GPU's own, once each."""
    def processes(snap: Snapshot) -> dict[Identity, ProcessSample]:
        found: dict[Identity, ProcessSample] = {}
        for p in (*snap.host_processes, *(p for g in snap.gpus for p in g.processes)):
            if p.host_rss_bytes is not None:
                found.setdefault(p.identity, p)
        return found

    serving = _serving_pids(snapshot)
    before = processes(base) if base is not None else None
    held = []
    for ident, p in processes(snapshot).items():
        rss = p.host_rss_bytes or 0
        if p.pid in serving or p.ppid in serving or rss < config.process_min_bytes:
            continue
        then = before.get(ident) if before is not None else None
        if then is not None:
            grew: int | None = rss - (then.host_rss_bytes or 0)
        elif base is not None and p.start_time is not None and p.start_time > base.timestamp:
            grew = rss  # started within the window
        else:
            grew = None  # not among the largest back then: how much it had is not known
        held.append((rss, grew, p, held_for(history.process_rss(ident), snapshot.timestamp, rss,
                                            config.process_min_bytes, history)))
    held.sort(key=lambda bgp: (-bgp[0], bgp[2].pid))
    return held


# The largest holder of host memory outside vLLM (unified memory, vLLM's CPU backend).
LARGEST_ON_HOST = largest_outside_vllm(HOST_RSS, ON_HOST)


def _detect(tick: Tick, config: ContentionConfig) -> list[Finding]:
    return detect_contention(tick.history, tick.snapshot, config)


DETECTOR = DetectorSpec(
    name="contention", config=ContentionConfig, create=lambda: _detect,
    help=("Another process takes the memory a vLLM server needs (on unified memory and vLLM's CPU backend: "
          "the host's)."),
    history_needed={"window_seconds": 2, "hold_seconds": 1},
    kinds=(FindingKind(
        "contention", scenario="contention",
        help=("processes outside the serving stack hold memory a vLLM server's budget needs (on unified "
              "memory and vLLM's CPU backend: the host is short of memory); named, with their bytes and growth, "
              "while they hold it"),
        alert=FindingAlert(
            "GpuMemoryContention", severity="ticket", for_="5m",
            # The finding is one per GPU (or host), whoever holds the memory, so that it lasts while
            # they change: its labels name no process. The text names the largest holder now.
            summary=("Another process competes for {{ if $labels.gpu }}GPU {{ $labels.gpu }} memory{{ else }}the "
                     "host memory of vLLM's CPU backend{{ end }} on {{ $labels.instance }}"
                     f"{{{{ if $labels.gpu }}}}{IF_UNIFIED_GPU}{LARGEST_ON_HOST}{{{{ else }}}}"
                     f"{largest_outside_vllm(GPU_MEMORY, ON_GPU)}{{{{ end }}}}"
                     f"{{{{ else }}}}{LARGEST_ON_HOST}{{{{ end }}}}."),
            description=("{{ if $labels.gpu }}The exporter's contention detector finds memory on GPU {{ $labels.gpu }} "
                         "of {{ $labels.instance }} taken by processes outside the vLLM "
                         '{{ range $i, $_ := printf "gpumem_vllm_memory_budget_bytes{instance=%q,gpu=%q}" '
                         "$labels.instance $labels.gpu | query }}{{ if $i }},{{ else }}server{{ end }} "
                         "{{ .Labels.endpoint }}{{ else }}servers{{ end }}. "
                         # Unified memory: the contenders hold host memory, which no GPU process figure
                         # shows ("non-vLLM processes hold 0B" would be false); name the host's largest.
                         f"{IF_UNIFIED_GPU}GPU {{{{ $labels.gpu }}}} takes its memory from the host (unified "
                         "memory), which has "
                         '{{ with printf "gpumem_host_memory_available_bytes{instance=%q}" $labels.instance | query }}'
                         "{{ . | first | value | humanize1024 }}B{{ end }} available"
                         f"{{{{ with {OTHER_GPU_PROCESSES_NONZERO_QUERY} }}}}; non-vLLM processes on the GPU "
                         "hold {{ . | first | value | humanize1024 }}B{{ end }}; the GPU is at "
                         '{{ with printf "instance_gpu:gpumem_memory_utilization:ratio{instance=%q,gpu=%q}" '
                         "$labels.instance $labels.gpu | query }}{{ . | first | value | "
                         "humanizePercentage }}{{ end }}. A vLLM restart will not get its budget back while they "
                         f"run. Largest outside vLLM by host memory:{HOST_PROCESSES_OUTSIDE_VLLM}"
                         "{{ else }}Non-vLLM processes hold "
                         f"{{{{ with {OTHER_GPU_PROCESSES_QUERY} }}}}"
                         "{{ . | first | value | humanize1024 }}B{{ end }} "
                         "of the GPU, which is at "
                         '{{ with printf "instance_gpu:gpumem_memory_utilization:ratio{instance=%q,gpu=%q}" '
                         "$labels.instance $labels.gpu | query }}{{ . | first | value | "
                         "humanizePercentage }}{{ end }}. A vLLM restart will not get its budget back while they "
                         "run. Largest outside vLLM:"
                         + process_list(GPU_MEMORY, ON_GPU, NAME_PID_SIZE, outside_vllm=True) + "{{ end }}"
                         "{{ else }}The exporter's contention detector finds {{ $labels.instance }}, which serves "
                         "vLLM on its CPU backend (the model and its KV cache in host memory), short of host memory, "
                         "held by processes outside vLLM; MemAvailable is "
                         '{{ with printf "gpumem_host_memory_available_bytes{instance=%q}" $labels.instance | query }}'
                         "{{ . | first | value | humanize1024 }}B{{ end }}. Largest outside vLLM by host memory:"
                         f"{HOST_PROCESSES_OUTSIDE_VLLM}{{{{ end }}}}"))),),
    settings={
        "window_seconds": "The named processes' growth is measured over this window.",
        "min_bytes": "The other processes must hold at least this in all.",
        "process_min_bytes": "A process holding less than this is not named.",
        "min_spare_ratio": ("Budgets known: contention when what is left beside the vLLM budgets and "
                            "everything else on the GPU is under this share of it."),
        "min_utilization_ratio": "Budgets unknown: contention when the GPU is at least this full (used/total).",
        "host_available_low_ratio": ("Unified memory and vLLM's CPU backend: host MemAvailable below this share "
                                     "of its total ..."),
        "psi_some_threshold": "... or memory PSI `some` avg10 (percent) at least this, counts as short.",
        "top_processes": "How many of the processes that hold the most a finding names.",
        "hold_seconds": ("Short of room (or critical) at any sample this recent counts as now, so a GPU "
                         "hovering at a threshold keeps one finding and one severity."),
    })
