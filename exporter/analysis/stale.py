"""Stale memory: GPU memory in use that no live process accounts for.

Two patterns, reported as one finding per GPU so the finding does not flap when the
explanation changes:
- a serving (vLLM) process exited and, `exit_grace_seconds` later, most of what it held is
  still in use with no owner (a zombie worker, a leaked IPC handle, a hung context);
- used minus the sum of live processes' used stays above a threshold for `seconds`.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..model import NEUTRAL_TOOLS, Finding, GpuSample, GpuTools, Identity, ProcessSample, Snapshot
from ..units import GiB, format_bytes, format_duration
from .detector import DetectorSpec, FindingAlert, FindingKind, Tick
from .history import unattributed_bytes
from .sleep import quiet_endpoints

if TYPE_CHECKING:
    from .history import History, SeriesView

__all__ = ["StaleConfig", "detect_stale", "exited_servers", "unattributed_bytes"]



@dataclass(frozen=True)
class StaleConfig:
    min_bytes: int = GiB  # unattributed memory must be at least this ...
    min_ratio: float = 0.05  # ... and this share of the GPU's total
    seconds: float = 120.0  # ... for this long
    exit_grace_seconds: float = 60.0  # time a serving process's memory gets to come back
    exit_min_bytes: int = 256 << 20  # ignore exits of processes that held less
    exit_returned_share: float = 0.5  # "did not come back": this share of it still unowned
    lookback_seconds: float = 900.0  # how far back exited processes are remembered

    def __post_init__(self) -> None:
        if self.min_bytes < 0 or not 0 <= self.min_ratio <= 1 or self.seconds < 0:
            raise ValueError("stale: min_bytes, min_ratio (0-1) and seconds must be >= 0")
        if self.exit_grace_seconds < 0 or not 0 < self.exit_returned_share <= 1:
            raise ValueError("stale: exit_grace_seconds >= 0, 0 < exit_returned_share <= 1")
        if self.lookback_seconds < max(self.seconds, self.exit_grace_seconds):
            raise ValueError("stale: lookback_seconds must cover seconds and exit_grace_seconds")


def _threshold(gpu: GpuSample, config: StaleConfig) -> int:
    return max(config.min_bytes, int(config.min_ratio * (gpu.total_bytes or 0)))


def detect_stale(history: History, snapshot: Snapshot, config: StaleConfig,
                 tools: GpuTools = NEUTRAL_TOOLS, active: Sequence[Finding] = ()) -> list[Finding]:
    """`tools`: the GPU backend's commands the advice names (vendor-neutral words by default);
    `active`: the findings active before this tick (an exited server named once stays named)."""
    now = snapshot.timestamp
    past = [s for s in history.recent(now - config.lookback_seconds) if s.timestamp < now]
    live = {(g.uuid, p.identity) for g in snapshot.gpus for p in g.processes}
    # Only when a serving process seen within the lookback is gone are the frames read for its
    # exit (they were read every tick, most of this detector's cost at the steady state; #18).
    gone = any(key not in live for key in history.serving_seen(now - config.lookback_seconds))
    exited = exited_servers(snapshot, _thin(past, config.lookback_seconds / _MAX_SCANNED)) if gone else {}
    # An exit found within lookback_seconds is remembered by the finding itself for as long as
    # the memory stays: the cause is named while it lasts, not for the lookback only.
    for f in active:
        named = _exited_from(f)
        if named is not None and named not in exited.get(f.uuid, ()):
            exited.setdefault(f.uuid, []).append(named)
    # vLLM sleep mode frees and maps memory behind PyTorch's back, and the GPU library reads the
    # device's and each process's figures at different moments: unowned memory on a GPU whose server
    # sleeps, or slept or woke within `seconds`, is not judged until it has settled.
    asleep = quiet_endpoints(history, snapshot, config.seconds)
    findings = []
    for gpu in snapshot.gpus:
        unowned = unattributed_bytes(gpu)
        if unowned is None:
            continue
        sleeping = any(p.role == "vllm" and p.endpoint in asleep for p in gpu.processes)
        finding = (_exited_server(gpu, unowned, exited.get(gpu.uuid, ()), now, config, tools)
                   or (None if sleeping else _persistent(gpu, unowned, past, now, config,
                                                         history.gpu_unowned(gpu.uuid), tools)))
        if finding is not None:
            findings.append(finding)
    return findings


_MAX_SCANNED = 120  # snapshots scanned for exited servers, whatever the sampling interval


def _thin(snaps: list[Snapshot], min_gap: float) -> list[Snapshot]:
    """At most about _MAX_SCANNED snapshots, evenly spread, always keeping the newest: exit
    times are then late by at most min_gap, far below the grace period."""
    out: list[Snapshot] = []
    for snap in snaps:
        if not out or snap.timestamp - out[-1].timestamp >= min_gap:
            out.append(snap)
    if snaps and out[-1] is not snaps[-1]:
        out.append(snaps[-1])
    return out


def exited_servers(snapshot: Snapshot,
                   past: list[Snapshot]) -> dict[str, list[tuple[float, ProcessSample]]]:
    """GPU uuid -> (exit time, last sample) of each serving process (role "vllm") seen on that
    GPU in `past` and not on it in `snapshot`. Its exit time is the first snapshot after its
    last sighting. The one definition of a serving process's exit: the stale detector asks it
    of the last minutes, the transitions of a tick ask it of the tick before."""
    now = snapshot.timestamp
    live = {(g.uuid, p.identity) for g in snapshot.gpus for p in g.processes}
    last_seen: dict[tuple[str, Identity], tuple[int, ProcessSample]] = {}
    for i, snap in enumerate(past):
        for g in snap.gpus:
            for p in g.processes:
                if p.role == "vllm" and (g.uuid, p.identity) not in live:
                    last_seen[(g.uuid, p.identity)] = (i, p)
    exited: dict[str, list[tuple[float, ProcessSample]]] = {}
    for (uuid, _), (i, p) in last_seen.items():
        gone_at = past[i + 1].timestamp if i + 1 < len(past) else now
        exited.setdefault(uuid, []).append((gone_at, p))
    return exited


def _persistent(gpu: GpuSample, unowned: int, past: list[Snapshot], now: float,
                config: StaleConfig, tier: SeriesView, tools: GpuTools) -> Finding | None:
    threshold = _threshold(gpu, config)
    if unowned < threshold:
        return None
    since = now
    walked_all = True
    for snap in reversed(past):  # walk back while every sample is over the threshold
        old = next((g for g in snap.gpus if g.uuid == gpu.uuid), None)
        value = unattributed_bytes(old) if old is not None else None
        if value is None or value < threshold:
            walked_all = False
            break
        since = snap.timestamp
    if now - since < config.seconds:
        return None
    at_least = False
    if walked_all and past:  # over it for all the raw snapshots looked at: the tier goes further
        since, at_least = _since_in_tier(tier, since, threshold)
    lasted = f"{'at least ' if at_least else ''}{format_duration(now - since, hours_from=5400)}"
    return Finding(
        kind="stale_memory", severity="warning", first_detected_at=now, gpu=gpu.index,
        uuid=gpu.uuid,
        summary=f"GPU {gpu.index}: {format_bytes(unowned)} in use by no live process for {lasted}",
        evidence=(("unattributed_bytes", unowned), ("threshold_bytes", threshold),
                  ("for_seconds", round(now - since, 1)), ("used_bytes", gpu.used_bytes or 0),
                  ("process_used_bytes", gpu.process_used_bytes),
                  ("live_processes", len(gpu.processes))),
        advice=_advice(gpu, tools))


def _since_in_tier(tier: SeriesView, since: float, threshold: int) -> tuple[float, bool]:
    """Walk the GPU's unowned-memory tier (per-minute minima, kept for the history's retention)
    back from `since` while every bucket stayed over the threshold: how long it has really
    lasted, and whether that is only a lower bound (over it as far back as the tier goes)."""
    i = len(tier.times) - 1
    while i >= 0 and tier.times[i] >= since:
        i -= 1
    while i >= 0 and tier.lows[i] >= threshold:
        since = tier.times[i]
        i -= 1
    return since, i < 0 and len(tier.times) > 0


def _exited_from(f: Finding) -> tuple[float, ProcessSample] | None:
    """(when, the process) of an exited server a stale_memory finding names, from its evidence."""
    if f.kind != "stale_memory":
        return None
    ev = dict(f.evidence)
    pid, gone_at, held = ev.get("exited_pid"), ev.get("exited_at"), ev.get("held_bytes")
    if not isinstance(pid, int) or not isinstance(gone_at, (int, float)) or not isinstance(held, int):
        return None
    return float(gone_at), ProcessSample(pid=pid, used_bytes=held, name=str(ev.get("exited_process", "")),
                                         role="vllm", endpoint=str(ev.get("exited_endpoint", "")))


def _exited_server(gpu: GpuSample, unowned: int, exited: Sequence[tuple[float, ProcessSample]],
                   now: float, config: StaleConfig, tools: GpuTools) -> Finding | None:
    """The largest serving process that left this GPU while its memory stayed behind."""
    best = None
    for gone_at, proc in exited:
        held = proc.used_bytes or 0
        if (held < config.exit_min_bytes or now - gone_at < config.exit_grace_seconds
                or unowned < config.exit_returned_share * held):
            continue
        if best is None or held > (best[1].used_bytes or 0):
            best = (gone_at, proc)
    if best is None:
        return None
    gone_at, proc = best
    name = proc.name or "?"
    where = f" serving {proc.endpoint}" if proc.endpoint else ""
    return Finding(
        kind="stale_memory", severity="warning", first_detected_at=now, gpu=gpu.index,
        uuid=gpu.uuid, endpoint="",
        summary=(f"GPU {gpu.index}: vLLM process {proc.pid} ({name}){where} exited "
                 f"{(now - gone_at) / 60:.0f} min ago and {format_bytes(unowned)} of the "
                 f"{format_bytes(proc.used_bytes or 0)} it held is still in use by no process"),
        evidence=(("unattributed_bytes", unowned), ("exited_pid", proc.pid),
                  ("exited_process", name), ("exited_endpoint", proc.endpoint),
                  ("exited_at", gone_at), ("held_bytes", proc.used_bytes or 0),
                  ("used_bytes", gpu.used_bytes or 0)),
        advice=(("Look for leftover vLLM workers of the exited server (`ps -ef | grep -i vllm`"
                 + (f", `fuser -v {tools.device_files}`" if tools.device_files else "")
                 + ") and kill them; with tensor parallelism a worker can outlive its engine.",)
                + _advice(gpu, tools)))


def _advice(gpu: GpuSample, tools: GpuTools) -> tuple[str, ...]:
    """Find the holder and, failing that, reset: with the GPU backend's own commands where it
    declares them (sources/gpu.py), else in words that fit any vendor."""
    find = [c for c in (tools.command("list_processes", gpu.index),
                        f"`fuser -v {tools.device_files}`" if tools.device_files else "") if c]
    reset = tools.command("reset", gpu.index)
    return (
        (f"Find the holder: {' and '.join(find)}" if find else
         f"Find the holder: list the processes using GPU {gpu.index} with {tools.tool}")
        + "; defunct or zombie processes and containers without hostPID keep memory the GPU "
        "library cannot attribute.",
        f"If no process holds it, drain the GPU and reset it ({reset or 'with ' + tools.tool}) or restart "
        "the node.",
    )


def _detect(tick: Tick, config: StaleConfig) -> list[Finding]:
    return detect_stale(tick.history, tick.snapshot, config, tick.gpu_tools, tick.active)


DETECTOR = DetectorSpec(
    name="stale_memory", config=StaleConfig, create=lambda: _detect,
    help="GPU memory that no live process accounts for (an exited server's memory that stayed).",
    history_needed={"lookback_seconds": 1},
    kinds=(FindingKind(
        "stale_memory", scenario="stale-memory",
        help="GPU memory held by no live process, for a while or after a serving process exited",
        alert=FindingAlert(
            "GpuMemoryStale", severity="ticket", for_="10m",
            summary=("GPU {{ $labels.gpu }} on {{ $labels.instance }} holds memory that no live process accounts "
                     "for."),
            description=("For 10 minutes GPU {{ $labels.gpu }} of {{ $labels.instance }} has held "
                         '{{ with printf "gpumem_gpu_memory_unattributed_bytes{instance=%q,gpu=%q}" '
                         "$labels.instance $labels.gpu | query }}{{ . | first | value | humanize1024 }}B{{ end }} "
                         "that no live process accounts for{{ with $labels.pid }} (last seen with "
                         "{{ $labels.process }}, pid {{ . }}){{ end }}: a process that exited without freeing it, "
                         "a zombie, or a process in a container the exporter cannot see. That memory is lost to "
                         "serving until it is released."))),),
    settings={
        "min_bytes": "Memory no live process accounts for must be at least this ...",
        "min_ratio": "... and this share of the GPU's total ...",
        "seconds": "... for this long.",
        "exit_grace_seconds": "How long a serving process's memory gets to come back after it exits.",
        "exit_min_bytes": "Exits of processes that held less than this are ignored.",
        "exit_returned_share": ("\"Did not come back\": at least this share of the exited process's memory is still "
                                "unowned."),
        "lookback_seconds": "How far back exited processes are remembered (at most history.raw_seconds).",
    })
