"""Contention: something other than the serving stack is taking the memory it needs.

- Discrete GPU: processes with role "other" appeared or grew on the GPU within the window
  while its headroom shrank, leaving it at least `min_utilization_ratio` full. They are
  named (pid, process, container, pod).
- Unified memory (GB10, Grace Hopper): the GPU's memory *is* host memory, so host
  MemAvailable falling / memory PSI rising is contention; the processes whose RSS grew the
  most are named and kernel OOM kills in the window are counted.

The baseline is the latest raw snapshot at least `window_seconds` old; until the history
reaches that far back the detector says nothing (everything would look "new" at start-up).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..model import Finding, GpuSample, HostMemory, ProcessSample, Snapshot
from .detector import DetectorSpec, FindingAlert, FindingKind, Tick

if TYPE_CHECKING:
    from .history import History, Identity

GIB = 1 << 30
MIB = 1 << 20


@dataclass(frozen=True)
class ContentionConfig:
    window_seconds: float = 300.0
    min_bytes: int = 512 * MIB  # headroom lost and memory taken by others must reach this
    process_min_bytes: int = 64 * MIB  # a process that grew less is not named
    # Memory taken matters only when it leaves the GPU this full (used/total).
    min_utilization_ratio: float = 0.80
    critical_ratio: float = 0.95
    host_available_low_ratio: float = 0.15  # unified: MemAvailable under this share ...
    psi_some_threshold: float = 10.0  # ... or memory PSI "some" avg10 (%) at least this
    top_processes: int = 3

    def __post_init__(self) -> None:
        if self.window_seconds <= 0 or self.min_bytes < 0 or self.process_min_bytes < 0:
            raise ValueError("contention: window_seconds > 0 and byte thresholds >= 0")
        if not 0 <= self.min_utilization_ratio <= 1 or not 0 <= self.host_available_low_ratio <= 1:
            raise ValueError("contention: ratios must be within 0-1")
        if self.top_processes < 1:
            raise ValueError("contention: top_processes must be >= 1")


def _baseline(history: History, now: float, window: float) -> Snapshot | None:
    """The newest snapshot at least `window` seconds old, if history reaches back that far."""
    base = None
    for snap in history.recent(now - 2 * window):
        if snap.timestamp > now - window:
            break
        base = snap
    return base


def detect_contention(history: History, snapshot: Snapshot,
                      config: ContentionConfig) -> list[Finding]:
    now = snapshot.timestamp
    base = _baseline(history, now, config.window_seconds)
    if base is None:
        return []
    findings = []
    for gpu in snapshot.gpus:
        old = next((g for g in base.gpus if g.uuid == gpu.uuid), None)
        if gpu.unified:
            finding = _unified(gpu, snapshot, base, config)
        elif old is not None:
            finding = _discrete(gpu, old, now, config)
        else:
            finding = None
        if finding is not None:
            findings.append(finding)
    return findings


def describe(p: ProcessSample) -> str:
    """pid, name and where it runs, for a human."""
    parts = [f"pid {p.pid} ({p.name or '?'})"]
    if p.pod:
        parts.append(f"pod {p.namespace + '/' if p.namespace else ''}{p.pod}")
    if p.container:
        parts.append(f"container {p.container[:12]}")
    return " ".join(parts)


def _discrete(gpu: GpuSample, old: GpuSample, now: float,
              config: ContentionConfig) -> Finding | None:
    if gpu.used_bytes is None or old.used_bytes is None or not gpu.total_bytes:
        return None
    headroom_lost = gpu.used_bytes - old.used_bytes
    before = {p.identity: p.used_bytes or 0 for p in old.processes}
    grown = sorted((((p.used_bytes or 0) - before.get(p.identity, 0), p)
                    for p in gpu.processes if p.role != "vllm"), key=lambda gp: -gp[0])
    offenders = [(g, p) for g, p in grown if g >= config.process_min_bytes]
    taken = sum(g for g, _ in offenders)
    ratio = gpu.used_bytes / gpu.total_bytes
    if (headroom_lost < config.min_bytes or taken < config.min_bytes
            or ratio < config.min_utilization_ratio):
        return None  # a newcomer on a GPU with room to spare takes nothing anyone needs
    named = offenders[:config.top_processes]
    names = ", ".join(f"{describe(p)} +{g / GIB:.1f} GiB" for g, p in named)
    evidence: list[tuple[str, float | int | str]] = [
        ("headroom_lost_bytes", headroom_lost), ("taken_by_others_bytes", taken),
        ("free_bytes", max(0, gpu.total_bytes - gpu.used_bytes)),
        ("utilization_ratio", round(ratio, 4)), ("window_seconds", config.window_seconds)]
    for i, (g, p) in enumerate(named, 1):
        evidence += [(f"process_{i}_pid", p.pid), (f"process_{i}_name", p.name),
                     (f"process_{i}_container", p.container), (f"process_{i}_pod", p.pod),
                     (f"process_{i}_grew_bytes", g)]
    return Finding(
        kind="contention", severity="critical" if ratio >= config.critical_ratio else "warning",
        first_detected_at=now, gpu=gpu.index, uuid=gpu.uuid,
        summary=(f"GPU {gpu.index}: other processes took {taken / GIB:.1f} GiB in "
                 f"{config.window_seconds / 60:.0f} min: {names}"),
        evidence=tuple(evidence),
        advice=(
            "Move the named processes to another GPU (CUDA_VISIBLE_DEVICES) or stop them; "
            "a serving GPU should not be shared without limits.",
            "In Kubernetes, check that no pod gets this GPU besides the server "
            "(time-slicing shares memory without limits); use MIG partitions for isolation.",
            "If the GPU must be shared, lower vLLM's --gpu-memory-utilization so its budget "
            "plus the others fit, or cap MPS clients with CUDA_MPS_PINNED_DEVICE_MEM_LIMIT.",
        ))


def _unified(gpu: GpuSample, snapshot: Snapshot, base: Snapshot,
             config: ContentionConfig) -> Finding | None:
    host, old_host = snapshot.host, base.host
    if host is None or old_host is None or host.total_bytes <= 0:
        return None
    dropped = old_host.available_bytes - host.available_bytes
    low = host.available_bytes / host.total_bytes < config.host_available_low_ratio
    stalled = (host.psi_some_avg10 is not None
               and host.psi_some_avg10 >= config.psi_some_threshold)
    kills = _oom_kills(old_host, host)
    if not (kills > 0 or (dropped >= config.min_bytes and (low or stalled))):
        return None
    growers = _rss_growers(snapshot, base, config)
    names = ", ".join(f"{describe(p)} +{g / GIB:.1f} GiB" for g, p in growers) or "none seen"
    evidence: list[tuple[str, float | int | str]] = [
        ("host_available_bytes", host.available_bytes), ("host_total_bytes", host.total_bytes),
        ("host_available_dropped_bytes", dropped), ("oom_kills_in_window", kills),
        ("window_seconds", config.window_seconds)]
    if host.psi_some_avg10 is not None:
        evidence.append(("psi_some_avg10", host.psi_some_avg10))
    for i, (g, p) in enumerate(growers, 1):
        evidence += [(f"process_{i}_pid", p.pid), (f"process_{i}_name", p.name),
                     (f"process_{i}_role", p.role), (f"process_{i}_rss_grew_bytes", g)]
    critical = kills > 0 or host.available_bytes / host.total_bytes < 0.05
    summary = (f"GPU {gpu.index} (unified memory): host MemAvailable fell "
               f"{dropped / GIB:.1f} GiB to {host.available_bytes / GIB:.1f} GiB in "
               f"{config.window_seconds / 60:.0f} min; top growing: {names}")
    if kills:
        summary += f"; the kernel OOM killer ran {kills} time(s)"
    return Finding(
        kind="contention", severity="critical" if critical else "warning",
        first_detected_at=snapshot.timestamp, gpu=gpu.index, uuid=gpu.uuid,
        summary=summary, evidence=tuple(evidence),
        advice=(
            "On unified memory the GPU and the host share RAM: every host process counts "
            "against the model's memory. Stop or move the named processes, or cap them with "
            "a cgroup memory limit (systemd MemoryMax=, container --memory).",
            "Size vLLM's --gpu-memory-utilization from what the host can spare (it is a "
            "share of the whole shared memory), leaving room for the OS and page cache.",
            "Kernel OOM kills: see `journalctl -k | grep -i oom` for the victims.",
        ))


def _oom_kills(old: HostMemory, new: HostMemory) -> int:
    if old.oom_kills is None or new.oom_kills is None:
        return 0
    return new.oom_kills - old.oom_kills if new.oom_kills >= old.oom_kills else new.oom_kills


def _rss_growers(snapshot: Snapshot, base: Snapshot,
                 config: ContentionConfig) -> list[tuple[int, ProcessSample]]:
    """Processes whose host RSS grew the most since the baseline (once each, any GPU)."""
    before = {p.identity: p.host_rss_bytes or 0 for g in base.gpus for p in g.processes}
    now: dict[Identity, tuple[int, ProcessSample]] = {}  # identity -> (rss, p)
    for g in snapshot.gpus:
        for p in g.processes:
            if p.host_rss_bytes is not None:
                now.setdefault(p.identity, (p.host_rss_bytes, p))
    grown = sorted(((rss - before.get(ident, 0), p) for ident, (rss, p) in now.items()),
                   key=lambda gp: -gp[0])
    return [(g, p) for g, p in grown if g >= config.process_min_bytes][:config.top_processes]


def _detect(tick: Tick, config: ContentionConfig) -> list[Finding]:
    return detect_contention(tick.history, tick.snapshot, config)


DETECTOR = DetectorSpec(
    name="contention", config=ContentionConfig, create=lambda: _detect,
    help="Another process takes the memory a vLLM server needs (on unified memory: the host's).",
    history_needed={"window_seconds": 2},
    kinds=(FindingKind(
        "contention", scenario="contention",
        help="other processes took memory on a GPU within the window and left it nearly full",
        alert=FindingAlert(
            "GpuMemoryContention", severity="ticket", for_="5m",
            summary=("Another process competes for GPU {{ $labels.gpu }} memory on "
                     "{{ $labels.instance }}{{ with $labels.process }} ({{ . }}){{ end }}."),
            description=("The exporter's contention detector finds memory on GPU {{ $labels.gpu }} of "
                         "{{ $labels.instance }} taken by a process outside the vLLM "
                         "server{{ with $labels.endpoint }} {{ . }}{{ end }}{{ with $labels.pid }}: "
                         "{{ $labels.process }} (pid {{ . }}){{ end }}. Non-vLLM processes hold "
                         '{{ with printf "instance_gpu:gpumem_other_process_memory:bytes{instance=%q,gpu=%q}" '
                         "$labels.instance $labels.gpu | query }}{{ . | first | value | humanize1024 }}B{{ end }} "
                         "of the GPU, which is at "
                         '{{ with printf "instance_gpu:gpumem_memory_utilization:ratio{instance=%q,gpu=%q}" '
                         "$labels.instance $labels.gpu | query }}{{ . | first | value | "
                         "humanizePercentage }}{{ end }}. A vLLM restart will not get its budget back while they "
                         "run."))),),
    settings={
        "window_seconds": "Memory taken within this long counts (against the newest sample at least this old).",
        "min_bytes": "Headroom lost, and memory the other processes took, must each reach this.",
        "process_min_bytes": "A process that grew less than this is not named.",
        "min_utilization_ratio": ("Memory taken matters only when it leaves the GPU at least this full "
                                  "(used/total)."),
        "critical_ratio": "At or above this utilisation the finding is critical.",
        "host_available_low_ratio": "Unified memory: host MemAvailable below this share of its total ...",
        "psi_some_threshold": "... or memory PSI `some` avg10 (percent) at least this, counts as contention.",
        "top_processes": "How many of the processes that took the most memory a finding names.",
    })
