"""Memory pressure per GPU: utilisation thresholds and admission with hysteresis.

(The time-to-full forecast itself is leak.time_to_full over the GPU's used series;
gpu_verdicts puts it in GpuAnalysis and this detector quotes it.)

vLLM pre-allocates its whole budget at start-up and stays inside it (analysis.budget:
`gpu_memory_utilization x total` as configured, or the `--kv-cache-memory` bytes plus its non-KV
memory; no default fraction is ever assumed: the default changed across releases), so used/total
sits near the configured fraction on a perfectly healthy server. Pressure therefore needs
both: utilisation above the threshold *and* more than a small slack of memory beyond the vLLM
budgets (other processes, vLLM over its budget, stale memory). On a GPU with no vLLM server all
used memory is beyond budget, so plain utilisation decides. The shipped alert rules
(GpuMemoryHigh, GpuMemoryNearFull, GpuAdmissionClosed) use the same definition and the same
numbers: both read them from exporter/thresholds.py. So does GpuUnifiedMemoryHostPressure: on a
unified-memory GPU a host short of memory at its level is critical pressure (`unified_host_short`).

Admission is a gate a router or autoscaler can read (`/admission`, `gpumem_admission_open`):
it closes when a GPU goes above the close threshold (0.90) and reopens only below the open
threshold (0.80), so a GPU hovering at the threshold does not flap. A unified GPU's gate also
closes while its host is short of memory, as GpuUnifiedMemoryHostPressure pages
(gpu_verdicts.py).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .. import thresholds
from ..model import Budget, Finding, GpuAnalysis, GpuSample, HostMemory, ProcessSample
from ..units import format_bytes, format_duration
from .detector import DetectorSpec, FindingKind, Tick
from .process_names import named_evidence, process_name


@dataclass(frozen=True)
class PressureConfig:
    # used/total that raises a warning (the paging threshold) ...
    warning_ratio: float = thresholds.MEMORY_HIGH.value
    # ... with more than this share of the GPU beyond vLLM's budgets
    budget_slack_ratio: float = thresholds.VLLM_BUDGET_SLACK.value
    # absolute: at the out-of-memory cliff whoever owns the memory
    critical_ratio: float = thresholds.MEMORY_NEAR_FULL.value
    # A raised finding clears only this far below the warning ratio (or once the memory beyond
    # budget fell to half the slack): use hovering around 85 % must not raise it every tick.
    clear_margin_ratio: float = 0.02

    def __post_init__(self) -> None:
        if not 0 < self.warning_ratio <= self.critical_ratio <= 1:
            raise ValueError("pressure: need 0 < warning_ratio <= critical_ratio <= 1")
        if not 0 <= self.clear_margin_ratio < self.warning_ratio:
            raise ValueError("pressure: need 0 <= clear_margin_ratio < warning_ratio")


def memory_ratio(gpu: GpuSample, host: HostMemory | None) -> float | None:
    """used/total; on unified memory without NVML memory info, the host's share in use."""
    if gpu.total_bytes and gpu.used_bytes is not None:
        return min(1.0, max(0.0, gpu.used_bytes / gpu.total_bytes))
    if gpu.unified and host is not None and host.total_bytes > 0:
        return min(1.0, max(0.0, 1 - host.available_bytes / host.total_bytes))
    return None


def unified_host_short(host: HostMemory | None) -> str:
    """Why a unified-memory host is short of memory at the level GpuUnifiedMemoryHostPressure pages
    at (exporter/thresholds.py: MemAvailable under UNIFIED_HOST_AVAILABLE of the total, or memory
    PSI `some` avg10 over UNIFIED_HOST_PRESSURE), in words; "" when it is not. The rule and the
    daemon judge the same condition with the same numbers: on such a host, GPU memory is host
    memory."""
    if host is None or host.total_bytes <= 0:
        return ""
    why = []
    available = host.available_bytes / host.total_bytes
    if available < thresholds.UNIFIED_HOST_AVAILABLE.value:
        why.append(f"MemAvailable {format_bytes(host.available_bytes)} ({available:.0%}, under "
                   f"{thresholds.UNIFIED_HOST_AVAILABLE.value:.0%})")
    if host.psi_some_avg10 is not None and host.psi_some_avg10 / 100.0 > thresholds.UNIFIED_HOST_PRESSURE.value:
        # The kernel's two decimals: rounded to whole percent, 20.4 read "20 % (over 20%)".
        why.append(f"memory PSI {host.psi_some_avg10:.4g} % (over {thresholds.UNIFIED_HOST_PRESSURE.value:.0%})")
    return ", ".join(why)


def beyond_budget_bytes(gpu: GpuSample, budgets: Iterable[Budget]) -> int | None:
    """Used memory minus what the vLLM servers on this GPU use within their budgets
    (analysis.budget.Budget). A server whose budget is not known yet (still starting, its
    /metrics not up) counts all its memory as planned, so a start-up never looks like pressure."""
    if gpu.used_bytes is None:
        return None
    within = 0
    for b in budgets:
        if b.uuid == gpu.uuid and b.used_bytes is not None:
            within += b.used_bytes if b.budget_bytes is None else min(b.used_bytes, b.budget_bytes)
    return max(0, gpu.used_bytes - within)


def admission_open(previous: bool | None, ratio: float | None, beyond_ratio: float | None,
                   close_above: float, open_below: float, slack: float) -> bool:
    """Hysteresis: close when utilisation goes above `close_above` with more than `slack` of
    the GPU beyond the vLLM budgets; reopen below `open_below`, or once the memory beyond budget
    fell to half the slack; in between keep the last state. Unknown keeps the last state (open
    at the very start)."""
    if ratio is not None:
        unplanned = beyond_ratio is None or beyond_ratio > slack
        if ratio > close_above and unplanned:
            return False
        if ratio < open_below or (beyond_ratio is not None and beyond_ratio <= slack / 2):
            return True
    return True if previous is None else previous


def holders(gpu: GpuSample, host_processes: Iterable[ProcessSample] = (),
            limit: int = 3) -> list[tuple[int, ProcessSample]]:
    """(bytes, process) of the processes that fill the GPU, the largest first: their GPU memory;
    on unified memory, where a process's GPU figure may be missing and any host process takes
    from it, the larger of that and its resident memory, over the host's largest processes too."""
    found: dict[tuple[int, float | None], tuple[int, ProcessSample]] = {}
    pool = (*gpu.processes, *host_processes) if gpu.unified else gpu.processes
    for p in pool:
        held = max(p.used_bytes or 0, p.host_rss_bytes or 0) if gpu.unified else p.used_bytes or 0
        if held > 0 and (p.identity not in found or found[p.identity][0] < held):
            found[p.identity] = (held, p)
    return sorted(found.values(), key=lambda bp: (-bp[0], bp[1].pid))[:limit]


def _who(p: ProcessSample) -> str:
    role = f", vLLM {p.endpoint}" if p.role == "vllm" and p.endpoint else (", vLLM" if p.role == "vllm" else "")
    return f"pid {p.pid} ({process_name(p)}{role})"


def detect_pressure(snapshot_gpus: tuple[GpuSample, ...], analyses: list[GpuAnalysis],
                    now: float, config: PressureConfig, raised: frozenset[str] = frozenset(),
                    host_processes: tuple[ProcessSample, ...] = (),
                    host: HostMemory | None = None) -> list[Finding]:
    """One pressure finding per GPU at or above the warning ratio, naming the processes that
    fill it (`host_processes`: the host's largest, which count on unified memory). `raised`
    holds the UUIDs whose finding is active: it stays until use is clear_margin_ratio below the
    threshold. On unified memory a host short of memory where GpuUnifiedMemoryHostPressure pages
    (`unified_host_short`) is critical pressure, whatever the GPU's share in use."""
    by_uuid = {g.uuid: g for g in snapshot_gpus}
    short = unified_host_short(host)
    findings = []
    for a in analyses:
        ratio = a.utilization_ratio
        gpu = by_uuid.get(a.uuid)
        if ratio is None or gpu is None:
            continue
        beyond = (a.beyond_budget_bytes / gpu.total_bytes
                  if a.beyond_budget_bytes is not None and gpu.total_bytes else None)
        host_short = short if gpu.unified else ""
        critical = ratio >= config.critical_ratio or bool(host_short)
        held = a.uuid in raised
        warning_ratio = config.warning_ratio - (config.clear_margin_ratio if held else 0.0)
        slack = config.budget_slack_ratio / 2 if held else config.budget_slack_ratio
        if not critical and (ratio < warning_ratio or (beyond is not None and beyond <= slack)):
            continue
        evidence: list[tuple[str, float | int | str]] = [("utilization_ratio", round(ratio, 4))]
        if a.beyond_budget_bytes is not None:
            evidence.append(("beyond_vllm_budget_bytes", a.beyond_budget_bytes))
        if gpu is not None and gpu.used_bytes is not None and gpu.total_bytes is not None:
            evidence += [("used_bytes", gpu.used_bytes), ("total_bytes", gpu.total_bytes)]
        if a.time_to_full_seconds is not None:
            evidence.append(("time_to_full_seconds", round(a.time_to_full_seconds, 1)))
        evidence.append(("admission_open", int(a.admission_open)))
        holding = holders(gpu, host_processes)
        for i, (b, p) in enumerate(holding, 1):
            evidence += [*named_evidence(i, p), (f"process_{i}_role", p.role), (f"process_{i}_bytes", b)]
        summary = f"GPU {a.gpu} memory {ratio:.0%} used"
        if host_short:
            summary += f" and its host (unified memory) is short of memory: {host_short}"
            evidence.append(("host_short", host_short))
        if beyond is not None and beyond < ratio:
            summary += f", {beyond:.0%} of the GPU beyond the vLLM budget"
        if a.time_to_full_seconds is not None:
            summary += f", full in about {format_duration(a.time_to_full_seconds)} at the current rate"
        if holding:
            summary += "; held by " + ", ".join(f"{_who(p)} {format_bytes(b)}" for b, p in holding)
        findings.append(Finding(
            kind="pressure", severity="critical" if critical else "warning",
            first_detected_at=now, gpu=a.gpu, uuid=a.uuid, summary=summary,
            evidence=tuple(evidence),
            advice=_advice(gpu, a.admission_open, beyond, config.budget_slack_ratio,
                           budgeted=a.beyond_budget_bytes is None or gpu.used_bytes is None
                           or a.beyond_budget_bytes < gpu.used_bytes)))
    return findings


def _advice(gpu: GpuSample | None, admission_open: bool, beyond: float | None, slack: float,
            budgeted: bool = True) -> tuple[str, ...]:
    """What to change. Where much of the GPU is beyond the vLLM budgets (another process,
    a browser on unified memory, a server past its budget), shrinking vLLM is the wrong first
    advice; and beside the point where no vLLM process uses the GPU. `budgeted` False: no vLLM
    budget on this GPU is known, all its memory counts as outside one."""
    outside = beyond if beyond is not None and beyond > slack else None  # share of the GPU
    serving = gpu is not None and any(p.role == "vllm" for p in gpu.processes)
    if outside is not None and not budgeted and not serving:
        last = (f"No vLLM server the exporter watches uses this GPU: the {outside:.0%} in use is held by the "
                "processes named. Free it (stop or move them) if a server is to run here.")
    elif outside is not None and not budgeted:
        last = ("The vLLM processes on this GPU have no known budget (the exporter does not watch their "
                "server's /metrics, or it does not answer), so their memory counts as outside one: add the "
                "server to vllm.endpoints to tell its planned memory from the rest. For vLLM, lower "
                "--gpu-memory-utilization, --max-num-seqs or --max-model-len; stop or move any other process named.")
    elif outside is not None:
        last = (f"{outside:.0%} of the GPU is beyond the vLLM servers' budgets: free it first (stop or move "
                "the processes named outside vLLM, or a server past its budget). Lowering vLLM's "
                "--gpu-memory-utilization takes effect only at its next start: do it only if those "
                "processes must stay on this GPU.")
    else:
        last = ("For vLLM, lower --gpu-memory-utilization, --max-num-seqs or --max-model-len, or "
                "spread the model over more GPUs (tensor parallelism).")
    advice = [
        "The processes named hold the most; see whether one is growing "
        "(gpumem_process_memory_growth_bytes_per_second) and whether it belongs on this GPU.",
        # The gate closes on use (and, on unified memory, where the host is short), with its
        # hysteresis; say which way it stands, so no one trusts a closed gate that is open.
        "Stop routing new work to this GPU until it drains: its admission (/admission, "
        "gpumem_admission_open) is " + ("closed, so routers that read it already do." if not admission_open else
                                        "still open (it closes on the GPU's use): route away from it by hand."),
        last,
    ]
    if gpu is not None and gpu.unified:
        advice.append("This GPU shares memory with the host: host processes count against it; "
                      "check gpumem_host_memory_available_bytes.")
    return tuple(advice)


def _detect(tick: Tick, config: PressureConfig) -> list[Finding]:
    # A raised finding holds until use is clearly below the threshold (clear_margin_ratio).
    raised = frozenset(f.uuid for f in tick.active if f.kind == "pressure" and f.uuid)
    return detect_pressure(tick.snapshot.gpus, list(tick.gpus), tick.now, config, raised,
                           tick.snapshot.host_processes, tick.snapshot.host)


DETECTOR = DetectorSpec(
    name="pressure", config=PressureConfig, create=lambda: _detect,
    help=("Memory pressure per GPU. Its thresholds (the utilisation that warns and the one that is "
          "critical, the slack beyond the vLLM budgets, a unified-memory host short of memory) are "
          "shared with the GpuMemoryHigh, GpuMemoryNearFull and GpuUnifiedMemoryHostPressure rules and "
          "set in exporter/thresholds.py, so the page and the finding cannot disagree."),
    kinds=(FindingKind(
        "pressure", scenario="pressure",
        raw_alerts=("GpuMemoryHigh", "GpuMemoryNearFull", "GpuUnifiedMemoryHostPressure"),
        help=(f"a GPU at least {thresholds.MEMORY_HIGH.value:.0%} used with more than "
              f"{thresholds.VLLM_BUDGET_SLACK.value:.0%} of it beyond the vLLM budgets (warning), or at "
              f"least {thresholds.MEMORY_NEAR_FULL.value:.0%} used whoever holds it (critical); on unified "
              f"memory also a host with under {thresholds.UNIFIED_HOST_AVAILABLE.value:.0%} available or "
              f"memory PSI over {thresholds.UNIFIED_HOST_PRESSURE.value:.0%} (critical)")),),
    settings={"clear_margin_ratio": (
        "A raised pressure finding clears only this far below the warning level (or once the "
        "memory beyond budget fell to half the slack): use hovering at the threshold must not "
        "raise it every tick.")})
