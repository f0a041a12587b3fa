"""The leak detector: leak.assess over every process's GPU memory and host RSS, a latch so a
raised leak does not flap, a finding per leaking process (with what to change), and the
per-process trend exported for every process, leaking or not.

Host RSS is a serving process's second leak signal: a vLLM server whose RSS leaks gets a finding
without a GPU; on unified memory that RSS is GPU memory, so it also counts for the process's
per-GPU verdict there.

Where the allocator probe reports on a process, its GPU memory is also read as its parts: torch
allocated (live tensors) and non-torch (NVML used - torch reserved) are tested as series of their
own, with the same test, the false-alarm budget shared among every series tested for the
process. They are quieter than NVML's figure (the cache's cycles live in torch reserved), so a
leak in either is found sooner, and the finding then comes from that component. Growth in NVML's
figure that the attribution puts in one of them is that part's to judge: NVML's verdict stands
only where the part's own verdict finds a leak too, or has none yet (too few points, settling, a
young rise left unjudged).

A GPU leak finding names the component that grows (attribution.py: torch_allocated,
torch_cached, non_torch, or unknown without probe data), with each component's growth rate, and
its advice follows the component; without probe data it is as it always was, plus
`component: unknown`. A host RSS leak is not GPU memory: its component is unknown.
"""
from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from ..model import Budget, Finding, GpuSample, Identity, ProcessSample, ProcessTrend, Snapshot
from .attribution import NO_PROBE, Attribution, attribute, component_advice, describe
from .budget import tensor_parallel_endpoints
from .detector import DetectorSpec, FindingAlert, FindingKind, Tick
from .history import History
from .leak import LeakAssessment, LeakAssessor, LeakConfig, LeakLatch
from .sleep import quiet_endpoints

# The probe's parts of a process's GPU memory tested as series of their own (torch_cached is the
# allocator's cache: its growth is fragmentation, told by the attribution, not a leak to test).
PROBED_SERIES = ("torch_allocated", "non_torch")
SIGNALS_PER_SERIES = 1  # each series is read as its medians or its minima (leak.py)


@dataclass(frozen=True)
class LeakDetectorConfig(LeakConfig):
    """The statistics' settings (leak.LeakConfig) and what the findings make of them."""

    critical_seconds: float = 3600.0  # a leak that fills the GPU (or host) sooner is critical

    def __post_init__(self) -> None:
        checks = getattr(super(), "__post_init__", None)  # LeakConfig's own, should it have any
        if checks is not None:
            checks()
        if self.critical_seconds < 0:
            raise ValueError("leak: critical_seconds must not be negative")


@dataclass(frozen=True)
class LeakResult:
    trends: tuple[ProcessTrend, ...]
    findings: tuple[Finding, ...]


class LeakDetector:
    """Holds what must outlive a tick: the latch, and each series' last verdict."""

    def __init__(self) -> None:
        self._latch = LeakLatch()
        # The verdict that raised each latched finding (and the probed part it came from): while
        # the latch holds a finding through quiet minutes, it tells that verdict's rate, not a
        # quiet minute's (which may be flat or falling: "grows -0.2 MiB/min", and its severity).
        self._raised: dict[Hashable, tuple[LeakAssessment, str]] = {}
        self._assess = LeakAssessor()
        self.process_trends: tuple[ProcessTrend, ...] = ()  # of the last tick judged

    def __call__(self, tick: Tick, config: LeakDetectorConfig) -> tuple[Finding, ...]:
        """The detector interface (analysis.detector); the tick's per-process trends are left
        in `process_trends` (none after a tick that failed)."""
        self.process_trends = ()
        result = self.detect(tick.history, tick.snapshot, tick.budgets, config, config.critical_seconds)
        self.process_trends = result.trends
        return result.findings

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
                mem, via = self._gpu_memory(history, gpu, p, now, config)
                # assess() can pass and fail on consecutive minutes (between staircase steps,
                # under a sawtooth): the latch keeps a raised leak until it stays quiet a while.
                leaking = self._latched(key, mem, via, p.endpoint not in asleep, now)
                if p.host_rss_bytes is not None and p.identity not in rss:
                    rss[p.identity] = self._host_memory(history, p, host_total, now, config, True)
                host, host_leaking = rss.get(p.identity, (None, False))
                rss_leak = p.role == "vllm" and host_leaking
                trends.append(ProcessTrend(
                    gpu=gpu.index, uuid=gpu.uuid, pid=p.pid, process=p.name, role=p.role,
                    growth_bytes_per_second=mem.slope_bytes_per_second,
                    leak_suspected=leaking or (rss_leak and gpu.unified),
                    host_rss_growth_bytes_per_second=host.slope_bytes_per_second if host else None))
                tp = p.endpoint in tensor_parallel
                if leaking:
                    found, via = self._raised[key]
                    window = dict(found.evidence).get("window_seconds", config.slope_window_seconds)
                    why = attribute(history, gpu.uuid, p, float(window), now, config)
                    if via:  # found in that part: it is the one that grows
                        why = Attribution(via, why.rates)
                    findings.append(_gpu_leak(gpu, p, found, now, tp, critical_seconds, why))
                if rss_leak and not any(f.pid == p.pid and f.gpu is None for f in findings):
                    findings.append(_rss_leak(p, self._raised[("rss", p.identity)][0], snapshot, tp,
                                              critical_seconds, gpu.unified))
        # A vLLM server's own processes on no GPU (vLLM's CPU backend: the model and its KV cache
        # are host memory, as on unified memory): their host memory is all there is to judge.
        for server in snapshot.vllm:
            for p in server.processes:
                if p.host_rss_bytes is None or p.identity in rss:
                    continue
                rss[p.identity] = self._host_memory(history, p, host_total, now, config, p.endpoint not in asleep)
                if rss[p.identity][1]:
                    findings.append(_rss_leak(p, self._raised[("rss", p.identity)][0], snapshot, False,
                                              critical_seconds, True, cpu=True))
        self._latch.prune(now)
        self._raised = {k: v for k, v in self._raised.items() if k in self._latch}
        self._assess.prune()  # only the series of live processes are kept
        return LeakResult(tuple(trends), tuple(findings))

    def _bar(self, key: Hashable, config: LeakConfig) -> float:
        """The fraction of the budget's threshold `key`'s series is judged at: lower while its
        finding is raised, so a leak stays found while it goes on (LeakConfig.hold_bar)."""
        return config.hold_bar if key in self._latch else 1.0

    def _latched(self, key: Hashable, a: LeakAssessment, via: str, judged: bool, now: float) -> bool:
        """The latch updated with this tick's verdict (counted only where `judged`); the verdict
        kept as the one the finding tells while it suspects a leak."""
        suspected = a.suspected and judged
        if suspected:
            self._raised[key] = (a, via)
        return self._latch.update(key, suspected, now, undecided=judged and a.undecided)

    def _host_memory(self, history: History, p: ProcessSample, host_total: int | None, now: float,
                     config: LeakConfig, judged: bool) -> tuple[LeakAssessment, bool]:
        """The verdict on a process's host memory (RSS), and whether its finding is raised (the
        latch updated, counted only where `judged`)."""
        key = ("rss", p.identity)
        a = self._assess(key, history.process_rss(p.identity), host_total, now, config, SIGNALS_PER_SERIES,
                         bar=self._bar(key, config))
        return a, self._latched(key, a, "", judged, now)

    def _gpu_memory(self, history: History, gpu: GpuSample, p: ProcessSample, now: float,
                    config: LeakConfig) -> tuple[LeakAssessment, str]:
        """The verdict on a process's GPU memory, and the probed part it came from ("" for
        NVML's figure): NVML's first, then each part the probe reports."""
        parts = []
        if p.allocator is not None:
            for name in PROBED_SERIES:
                view = history.process_allocator(name, gpu.uuid, p.identity)
                if len(view):
                    parts.append((name, view))
        signals = SIGNALS_PER_SERIES * (1 + len(parts))
        key = (gpu.uuid, p.identity)
        bar = self._bar(key, config)
        mem = self._assess(key, history.process_memory(gpu.uuid, p.identity), gpu.total_bytes, now,
                           config, signals,
                           lambda since=None: history.process_memory(gpu.uuid, p.identity, raw=True, since=since),
                           bar)
        verdicts = {name: self._assess((name, *key), view, None, now, config, signals, bar=bar)
                    for name, view in parts}
        if mem.suspected:
            # Growth the probe puts in a part tested on its own (quieter than NVML's figure, under
            # the same budget) is that part's to judge: a warm-up's steps in live tensors, read
            # through NVML's floor under the cache's cycles, pass there for a line
            # (probed_mixed#11007), where the tensors' own series shows them as steps. NVML's
            # verdict stands where the part has none yet: too few points, settling, or a young rise
            # it leaves unjudged as it may be a first tooth.
            window = dict(mem.evidence).get("window_seconds", config.slope_window_seconds)
            grows = attribute(history, gpu.uuid, p, float(window), now, config).component
            part = verdicts.get(grows)
            if part is None or part.suspected or part.undecided or \
                    dict(part.evidence).get("reason") == "maybe_first_tooth":
                return mem, ""
            return LeakAssessment(False, mem.slope_bytes_per_second, (("reason", f"{grows}_not_leaking"),)), ""
        for name, a in verdicts.items():
            if a.suspected:
                return LeakAssessment(True, a.slope_bytes_per_second,
                                      (("series", name),) + a.evidence, a.interval), name
        return mem, ""


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
                 + _rate(slope, a) + (f" {where}" if where else "")
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
        summary=(f"{who} host memory grows " + _rate(slope, a) + where
                 + _full_in(left)),
        evidence=tuple(evidence), advice=_advice(p, left, tp, host=True, cpu=cpu))


def _rate(slope: float, a: LeakAssessment) -> str:
    """The rate in MiB/min and how sure the test is: its 95 % interval and the false-alarm budget
    in force, with as many decimals (up to 3) as it takes for the interval to show its width."""
    rate = slope * 60 / (1 << 20)
    if a.interval is None:
        return f"{rate:.1f} MiB/min"
    low, high = (x * 60 / (1 << 20) for x in a.interval)
    low = max(low, 0.0)
    digits = next((d for d in (1, 2) if round(low, d) != round(high, d)), 3)
    budget = dict(a.evidence).get("false_alarms_per_day")
    return (f"{rate:.{digits}f} MiB/min (95 % interval {low:.{digits}f}-{high:.{digits}f}"
            + (f"; budget {budget:g} false alarms/day" if budget is not None else "") + ")")


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


DETECTOR = DetectorSpec(
    name="leak", config=LeakDetectorConfig, create=LeakDetector,
    help=("GPU memory (and a serving process's host memory) that grows the way a leak grows; the "
          "statistics are in exporter/analysis/leak.py."),
    kinds=(FindingKind(
        "leak", scenario="leak",
        help="a process whose GPU memory (or a vLLM server's host memory) grows like a leak",
        alert=FindingAlert(
            "GpuMemoryLeakSuspected", severity="ticket", for_="1m",
            comment=("The leak detector's test already holds its false alarms to a budget, and its latch keeps a "
                     "raised finding for half an hour, so the finding does not flicker: `for` only rides out one "
                     "evaluation (a longer one would hold back a leak found within a minute or two of its start)."),
            summary=("Process {{ $labels.process }} (pid {{ $labels.pid }}){{ with $labels.gpu }} on GPU "
                     "{{ . }}{{ end }} of {{ $labels.instance }} looks like it leaks "
                     "{{ if $labels.gpu }}GPU{{ else }}host{{ end }} memory."),
            description=("The exporter's leak detector sees the {{ if $labels.gpu }}GPU{{ else }}host{{ end }} "
                         "memory of {{ $labels.process }} (pid {{ $labels.pid }}, role "
                         "{{ $labels.role }}){{ with $labels.gpu }} on GPU {{ . }}{{ end }} of "
                         "{{ $labels.instance }} grow steadily{{ if $labels.gpu }}: "
                         '{{ with printf "gpumem_process_memory_growth_bytes_per_second{instance=%q,gpu=%q,pid=%q} '
                         '* 3600" $labels.instance $labels.gpu $labels.pid | query }}{{ '
                         ". | first | value | humanize1024 }}B per hour{{ end }}; it now holds "
                         '{{ with printf "gpumem_process_memory_used_bytes{instance=%q,gpu=%q,pid=%q}" '
                         "$labels.instance $labels.gpu $labels.pid | query }}{{ . | first "
                         "| value | humanize1024 }}B{{ end }}. "
                         '{{ with printf "gpumem_gpu_time_to_full_seconds{instance=%q,gpu=%q}" '
                         "$labels.instance $labels.gpu | query }}At this pace the GPU is full in "
                         "{{ . | first | value | humanizeDuration }}.{{ else }}The GPU as a whole is not "
                         "growing.{{ end }}{{ else }}; its resident host memory is "
                         '{{ with printf "max(gpumem_process_host_rss_bytes{instance=%q,pid=%q})" '
                         "$labels.instance $labels.pid | query }}{{ . | first | value | humanize1024 }}B{{ end }} "
                         "(on unified memory and vLLM's CPU backend that is the model's memory).{{ end }}"))),),
    settings={
        "critical_seconds": (
            "A leak that fills the GPU (for host memory: the host's available memory) sooner than this at its "
            "current rate is critical."),
        "false_alarms_per_day": (
            "False leak findings the trend tests may raise per process and day on noise alone (above 0, below 1440), "
            "half for the test of the per-minute medians and half for the test of the raw samples (which runs "
            "where nothing but "
            "noise or a leak climbs: past the young period, no sawtooth, no drop or wandering noise in the raw "
            "hour): it sets the z the growth must reach (at 0.01 about 5.35 for the medians and 5.5 for the "
            "samples, at 1 about 4.45 and 4.6). Larger finds leaks sooner, smaller later; "
            "each leak finding's evidence names the budget and the threshold in force."),
    })
