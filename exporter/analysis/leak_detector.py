"""The leak detector: leak.assess over every process's GPU memory and host RSS, a latch so a
raised leak does not flap, a finding per leaking process (with what to change), and the
per-process trend exported for every process, leaking or not.

Host RSS is a serving process's second leak signal: a vLLM server whose RSS leaks gets a finding
without a GPU; on unified memory that RSS is GPU memory, so it also counts for the process's
per-GPU verdict there.

A GPU leak finding names the component that grows (attribution.py: torch_allocated,
torch_cached, non_torch, or unknown without probe data), with each component's growth rate, and
its advice follows the component; without probe data it is as it always was, plus
`component: unknown`. A host RSS leak is not GPU memory: its component is unknown.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..model import Budget, Finding, GpuSample, ProcessSample, ProcessTrend, Snapshot
from .attribution import NO_PROBE, Attribution, attribute, component_advice, describe
from .budget import tensor_parallel_endpoints
from .history import History, Identity
from .leak import LeakAssessment, LeakAssessor, LeakConfig, LeakLatch
from .sleep import quiet_endpoints


@dataclass(frozen=True)
class LeakResult:
    trends: tuple[ProcessTrend, ...]
    findings: tuple[Finding, ...]


class LeakDetector:
    """Holds what must outlive a tick: the latch, and each series' last verdict."""

    def __init__(self) -> None:
        self._latch = LeakLatch()
        self._assess = LeakAssessor()

    def detect(self, history: History, snapshot: Snapshot, budgets: tuple[Budget, ...],
               config: LeakConfig, critical_seconds: float) -> LeakResult:
        now = snapshot.timestamp
        host_total = snapshot.host.total_bytes if snapshot.host else None
        tensor_parallel = tensor_parallel_endpoints(budgets)
        rss: dict[Identity, tuple[LeakAssessment, bool]] = {}  # identity -> (assessment, latched)
        # vLLM sleep mode: memory falls on sleep and comes back on wake by design (analysis.sleep
        # judges the cycle), so a sleeping or just-woken server's memory is not judged here.
        asleep = quiet_endpoints(history, snapshot, config.settle_seconds)
        trends, findings = [], []
        for gpu in snapshot.gpus:
            for p in gpu.processes:
                key = (gpu.uuid, p.identity)
                mem = self._assess(key, history.process_memory(gpu.uuid, p.identity),
                                   gpu.total_bytes, now, config)
                # assess() can pass and fail on consecutive minutes (between staircase steps,
                # under a sawtooth): the latch keeps a raised leak until it stays quiet a while.
                leaking = self._latch.update(key, mem.suspected and p.endpoint not in asleep, now)
                if p.host_rss_bytes is not None and p.identity not in rss:
                    a = self._assess(("rss", p.identity), history.process_rss(p.identity),
                                     host_total, now, config)
                    rss[p.identity] = (a, self._latch.update(("rss", p.identity), a.suspected, now))
                host, host_leaking = rss.get(p.identity, (None, False))
                rss_leak = p.role == "vllm" and host_leaking
                trends.append(ProcessTrend(
                    gpu=gpu.index, uuid=gpu.uuid, pid=p.pid, process=p.name, role=p.role,
                    growth_bytes_per_second=mem.slope_bytes_per_second,
                    leak_suspected=leaking or (rss_leak and gpu.unified),
                    host_rss_growth_bytes_per_second=host.slope_bytes_per_second if host else None))
                tp = p.endpoint in tensor_parallel
                if leaking:
                    window = dict(mem.evidence).get("window_seconds", config.slope_window_seconds)
                    why = attribute(history, gpu.uuid, p, float(window), now, config)
                    findings.append(_gpu_leak(gpu, p, mem, now, tp, critical_seconds, why))
                if rss_leak and host is not None and \
                        not any(f.pid == p.pid and f.gpu is None for f in findings):
                    findings.append(_rss_leak(p, host, snapshot, tp, critical_seconds, gpu.unified))
        # A vLLM server's own processes on no GPU (vLLM's CPU backend: the model and its KV cache
        # are host memory, as on unified memory): their host memory is all there is to judge.
        for server in snapshot.vllm:
            for p in server.processes:
                if p.host_rss_bytes is None or p.identity in rss:
                    continue
                a = self._assess(("rss", p.identity), history.process_rss(p.identity), host_total, now, config)
                leaking = self._latch.update(("rss", p.identity), a.suspected and p.endpoint not in asleep, now)
                rss[p.identity] = (a, leaking)
                if leaking:
                    findings.append(_rss_leak(p, a, snapshot, False, critical_seconds, True, cpu=True))
        self._latch.prune(now)
        self._assess.prune()  # only the series of live processes are kept
        return LeakResult(tuple(trends), tuple(findings))


def _severity(seconds_to_full: float | None, critical_seconds: float) -> str:
    return "critical" if seconds_to_full is not None and seconds_to_full < critical_seconds \
        else "warning"


def _gpu_leak(gpu: GpuSample, p: ProcessSample, a: LeakAssessment, now: float, tp: bool,
              critical_seconds: float, why: Attribution = NO_PROBE) -> Finding:
    slope = a.slope_bytes_per_second or 0.0
    left = None
    if gpu.total_bytes is not None and gpu.used_bytes is not None and slope > 0:
        left = max(0.0, (gpu.total_bytes - gpu.used_bytes) / slope)
    evidence: list[tuple[str, float | int | str]] = [
        ("slope_bytes_per_second", round(slope, 1)), ("used_bytes", p.used_bytes or 0)]
    if gpu.total_bytes is not None:
        evidence.append(("total_bytes", gpu.total_bytes))
    if left is not None:
        evidence.append(("time_to_full_seconds", round(left, 1)))
    evidence += [(k, v) for k, v in a.evidence if k not in dict(evidence)]
    evidence += why.evidence
    where = describe(why.component)
    return Finding(
        kind="leak", severity=_severity(left, critical_seconds), first_detected_at=now,
        gpu=gpu.index, uuid=gpu.uuid, pid=p.pid, process=p.name, role=p.role,
        endpoint=p.endpoint,
        summary=(f"{p.name or 'pid ' + str(p.pid)} (pid {p.pid}) GPU {gpu.index} memory grows "
                 f"{slope * 60 / (1 << 20):.1f} MiB/min" + (f" {where}" if where else "")
                 + _full_in(left)),
        evidence=tuple(evidence), advice=_advice(p, left, tp, host=False, component=why.component))


def _rss_leak(p: ProcessSample, a: LeakAssessment, snapshot: Snapshot, tp: bool, critical_seconds: float,
              unified: bool, cpu: bool = False) -> Finding:
    """A serving process's host memory leaking; `unified`: that memory is also what the model
    runs in (unified memory, or vLLM's CPU backend: `cpu`)."""
    slope = a.slope_bytes_per_second or 0.0
    host = snapshot.host
    left = host.available_bytes / slope if host is not None and slope > 0 else None
    evidence: list[tuple[str, float | int | str]] = [
        ("slope_bytes_per_second", round(slope, 1)), ("host_rss_bytes", p.host_rss_bytes or 0)]
    if host is not None:
        evidence.append(("host_available_bytes", host.available_bytes))
    if left is not None:
        evidence.append(("time_to_full_seconds", round(left, 1)))
    evidence.append(("unified_memory", int(unified and not cpu)))
    if cpu:
        evidence.append(("cpu_backend", 1))
    if p.server_role:
        evidence.append(("server_role", p.server_role))
    evidence += [(k, v) for k, v in a.evidence if k not in dict(evidence)]
    evidence += NO_PROBE.evidence
    where = (" (vLLM's CPU backend: the model and its KV cache live in this memory)" if cpu
             else " (unified memory: this is GPU memory)" if unified else "")
    part = {"api_server": "API server", "engine_core": "engine core", "worker": "worker"}.get(p.server_role, "")
    role = f", the server's {part}" if part else ""
    who = f"{p.name or 'pid ' + str(p.pid)} (pid {p.pid}{role})"
    return Finding(
        kind="leak", severity=_severity(left, critical_seconds),
        first_detected_at=snapshot.timestamp, gpu=None, uuid="", pid=p.pid, process=p.name,
        role=p.role, endpoint=p.endpoint,
        summary=(f"{who} host memory grows {slope * 60 / (1 << 20):.1f} MiB/min{where}" + _full_in(left)),
        evidence=tuple(evidence), advice=_advice(p, left, tp, host=True, cpu=cpu))


def _full_in(seconds: float | None) -> str:
    if seconds is None:
        return ""
    return f"; full in about {seconds / 3600:.1f} h at this rate" if seconds >= 3600 \
        else f"; full in about {seconds / 60:.0f} min at this rate"


def _advice(p: ProcessSample, left: float | None, tp: bool, host: bool,
            component: str = "unknown", cpu: bool = False) -> tuple[str, ...]:
    # Where the probe says what grows, its advice replaces the guesses below.
    advice = list(component_advice(component, tp, p.role))
    if cpu:
        advice += [
            "On vLLM's CPU backend the KV cache is allocated once, at its set size "
            "(--kv-cache-memory-bytes or VLLM_CPU_KVCACHE_SPACE): memory that keeps growing beyond it is "
            "held by the process itself. Check what the server loads besides vLLM (vllm.general_plugins "
            "entry points, patches), multimodal and processor caches, and KV offloading to host memory.",
            "Compare the engine core's and the worker's growth with the request rate: growth per request "
            "is something kept for every request.",
        ]
    elif not advice and p.role == "vllm":
        if tp:
            advice.append("Tensor parallelism: set NCCL_CUMEM_ENABLE=0 in the server's "
                          "environment (NCCL's cuMem allocations have leaked in several "
                          "NCCL/vLLM versions).")
        if host:
            advice.append("Host memory of the server grows: check multimodal/processor caches "
                          "and the CPU KV offload or swap space settings; on unified memory "
                          "this takes GPU memory directly.")
        advice += [
            "Check CUDA graph capture sizes (--cuda-graph-sizes / compilation_config "
            "cudagraph_capture_sizes): growth with new batch shapes points at graph capture; "
            "--enforce-eager confirms it.",
            "If sleep mode is on (--enable-sleep-mode), check that each sleep/wake cycle "
            "gives the memory back.",
            "Upgrade vLLM, PyTorch and NCCL: several leaks were fixed in recent releases.",
        ]
    elif not advice:
        advice.append("Profile the process (torch.cuda.memory_summary(), "
                      "torch.cuda.memory._record_memory_history) for tensors kept alive.")
    if left is not None:
        advice.append(f"At this rate memory runs out in about {left / 3600:.1f} h: plan a "
                      "restart of the process before then.")
    return tuple(advice)
