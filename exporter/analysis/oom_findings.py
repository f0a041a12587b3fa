"""OOM findings: every out-of-memory event becomes a critical finding, one per GPU (host-level
events under gpu None), held for `hold_seconds` after the last event so an alert has time to fire.

Two kinds of event:
- messages read from the logs, classified and advised where they are parsed (analysis.oom);
  this only gathers them per GPU;
- the kernel's OOM killer running (the host's `oom_kill` counter, /proc/vmstat, rose between two
  samples) on a host where it hits GPU memory: a unified-memory host, whose RAM is its GPUs'
  memory (the finding goes on each unified GPU), or a host serving vLLM (on the host). The kill
  is named from the process table: the processes gone between the two samples, the largest
  first (the kernel picks the largest), or the victim a kernel log line names.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from ..model import Finding, OomEvent, ProcessSample, Snapshot
from ..units import counted, format_bytes
from .detector import DetectorSpec, FindingAlert, FindingKind, Tick
from .history import History, recent_events

MAX_VICTIMS = 3  # processes named per kill, the largest first

Evidence = list[tuple[str, float | int | str]]


@dataclass(frozen=True)
class OomConfig:
    hold_seconds: float = 300.0  # a finding stays active this long after the last event

    def __post_init__(self) -> None:
        if self.hold_seconds < 0:
            raise ValueError("oom: hold_seconds must not be negative")


@dataclass(frozen=True)
class KernelKill:
    """The host's OOM-kill counter rose between two samples."""

    at: float  # the sample that saw it
    count: int
    gone: tuple[ProcessSample, ...]  # processes of the sample before, gone at `at`, largest first


def _serves_gpu_memory(snapshot: Snapshot) -> bool:
    """A host where a kernel OOM kill is about GPU memory: unified memory, or vLLM serving."""
    return (any(g.unified for g in snapshot.gpus) or bool(snapshot.vllm)
            or any(p.role == "vllm" for g in snapshot.gpus for p in g.processes))


def _processes(snap: Snapshot) -> dict[tuple[int, float | None], ProcessSample]:
    found: dict[tuple[int, float | None], ProcessSample] = {}
    for p in (*snap.host_processes, *(p for g in snap.gpus for p in g.processes)):
        if p.identity not in found or (p.host_rss_bytes or 0) > (found[p.identity].host_rss_bytes or 0):
            found[p.identity] = p
    return found


def kernel_kills(history: History, snapshot: Snapshot, window: float) -> list[KernelKill]:
    """Rises of the host's OOM-kill counter within `window` seconds, oldest first."""
    now = snapshot.timestamp
    # From further back, for the sample before a rise at the window's start (as far as it holds).
    frames = [s for s in history.recent(now - 2 * window) if s.timestamp < now] + [snapshot]
    kills = []
    for before, after in itertools.pairwise(frames):
        if after.timestamp < now - window:
            continue
        old = before.host.oom_kills if before.host is not None else None
        new = after.host.oom_kills if after.host is not None else None
        if old is None or new is None or new <= old:
            continue  # unknown, none, or the counter restarted (a reboot)
        alive = _processes(after)
        gone = sorted((p for ident, p in _processes(before).items() if ident not in alive),
                      key=lambda p: (-(p.host_rss_bytes or p.used_bytes or 0), p.pid))
        kills.append(KernelKill(after.timestamp, new - old, tuple(gone[:MAX_VICTIMS])))
    return kills


def _victim(p: ProcessSample) -> str:
    held = p.host_rss_bytes or p.used_bytes
    return f"pid {p.pid} ({p.name or '?'}{f', {format_bytes(held)} resident' if held else ''})"


def _kill_text(kills: list[KernelKill], events: list[OomEvent], hold: float) -> tuple[str, Evidence]:
    count = sum(k.count for k in kills)
    last = kills[-1]
    named = [f"pid {e.victim_pid} ({e.victim_name or '?'})" for e in events
             if e.kind == "kernel_oom_kill" and e.victim_pid is not None]
    if named:
        victims = "; killed (kernel log): " + ", ".join(dict.fromkeys(named))
    elif last.gone:
        victims = "; gone from the process table then: " + ", ".join(_victim(p) for p in last.gone)
    else:
        victims = "; no process seen here went away with it"
    text = f"the kernel OOM killer ran {counted(count, 'time')} in the last {hold / 60:.0f} min{victims}"
    evidence: Evidence = [("kernel_oom_kills", count), ("last_kill_at", last.at)]
    for i, p in enumerate(last.gone, 1):
        evidence += [(f"process_{i}_pid", p.pid), (f"process_{i}_name", p.name),
                     (f"process_{i}_rss_bytes", p.host_rss_bytes or 0)]
    return text, evidence


def detect_ooms(history: History, snapshot: Snapshot, hold_seconds: float) -> list[Finding]:
    per_gpu: dict[str | None, list[OomEvent]] = {}
    for _, event in recent_events(history, snapshot, hold_seconds):
        per_gpu.setdefault(event.gpu, []).append(event)
    kills = kernel_kills(history, snapshot, hold_seconds) if _serves_gpu_memory(snapshot) else []
    unified = [g.index for g in snapshot.gpus if g.unified]
    # On unified memory a kill took the GPUs' memory: it goes on each of them, else on the host.
    killed_on: list[str | None] = ([*unified] or [None]) if kills else []
    uuids = {g.index: g.uuid for g in snapshot.gpus}
    findings = []
    for gpu_index in dict.fromkeys([*per_gpu, *killed_on]):
        events = per_gpu.get(gpu_index, [])
        where = (f"GPU {gpu_index}{' (unified memory)' if gpu_index in unified else ''}"
                 if gpu_index is not None else "host")
        parts: list[str] = []
        evidence: Evidence = []
        advice = list(dict.fromkeys(a for e in events for a in e.advice))
        if gpu_index in killed_on:
            text, evidence = _kill_text(kills, per_gpu.get(None, []) + events, hold_seconds)
            parts.append(text)
            advice = [*_KILL_ADVICE, *advice]
        if events:
            last = events[-1]
            parts.append(f"{counted(len(events), 'out-of-memory event')} in the logs, last "
                         f"{last.kind} ({last.klass}) at {last.source}:{last.line}")
            evidence += [("events", len(events)), ("oom_kind", last.kind), ("class", last.klass),
                         ("log", f"{last.source}:{last.line}")]
            for name in ("requested_bytes", "free_bytes", "total_bytes", "reserved_bytes",
                         "reserved_unallocated_bytes", "process_bytes"):
                if getattr(last, name) is not None:
                    evidence.append((name, getattr(last, name)))
        findings.append(Finding(
            kind="oom", severity="critical", first_detected_at=snapshot.timestamp,
            gpu=gpu_index, uuid=uuids.get(gpu_index, "") if gpu_index is not None else "",
            summary=f"{where}: " + "; and ".join(parts),
            evidence=tuple(evidence),
            advice=tuple(advice[:8]) or ("Run `gpu-memory-exporter explain` on the log for details.",)))
    return findings


_KILL_ADVICE = (
    "The kernel killed a process for host memory (`journalctl -k | grep -i 'killed process'` names "
    "it and its cgroup). On unified memory that RAM is the GPU's: cap what runs beside the server "
    "(systemd MemoryMax=, container --memory) or lower vLLM's --gpu-memory-utilization.",
    "If the victim was a vLLM process, its server is down or restarting: see gpumem_vllm_up and its log.",
)


def _detect(tick: Tick, config: OomConfig) -> list[Finding]:
    return detect_ooms(tick.history, tick.snapshot, config.hold_seconds)


DETECTOR = DetectorSpec(
    name="oom", config=OomConfig, create=lambda: _detect,
    help=("Out-of-memory events read from the watched logs, classified (docs/oom-diagnosis.md), and the "
          "kernel's OOM killer on a unified-memory host or one serving vLLM."),
    history_needed={"hold_seconds": 1},
    kinds=(FindingKind(
        "oom", scenario="oom",
        help=("out-of-memory events read from the logs in the last few minutes, per GPU, and kernel OOM kills "
              "on a unified-memory host (on its GPU) or one serving vLLM (on the host)"),
        alert=FindingAlert(
            "GpuOutOfMemoryEvent", severity="ticket", for_="0s",
            comment=("A fact read from a log or a kernel counter, no threshold: it fires at once, and the "
                     "finding holds (detectors.oom.hold_seconds) long enough for the rule to see it."),
            summary=("Out-of-memory on {{ $labels.instance }}{{ with $labels.gpu }} (GPU "
                     "{{ . }}){{ end }}."),
            description=(
                "The exporter on {{ $labels.instance }} found out-of-memory events in the logs it watches, "
                "or kernel OOM kills,{{ with $labels.gpu }} for GPU {{ . }}{{ end }} in the last few minutes "
                '(counted so far, by kind and class:{{ range printf "gpumem_oom_events_total{instance=%q} > 0" '
                '$labels.instance | query }} {{ .Labels.kind }}/{{ .Labels.class }} {{ .Value | printf "%.0f" }};'
                '{{ end }}{{ with printf "gpumem_host_oom_kills_total{instance=%q} > 0" $labels.instance | query }} '
                'kernel OOM kills since boot {{ . | first | value | printf "%.0f" }};{{ end }}). '
                "Run `gpu-memory-exporter explain <log>` on the server's log for the requested, free and "
                "reserved bytes and the advice for its class. If the server died, VllmEndpointDown follows.")
        )),),
    settings={"hold_seconds": ("An out-of-memory finding stays active this long after the last event, so an "
                              "alert sees it.")})
