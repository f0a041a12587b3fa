"""Per-GPU verdicts of a tick: utilisation, memory beyond the vLLM budgets, admission (with
its hysteresis, the one thing here that outlives a tick), time to full, unattributed memory."""
from __future__ import annotations

import bisect
import itertools

from .. import thresholds
from ..model import Budget, GpuAnalysis, GpuSample, HostMemory, Snapshot
from .history import History, SeriesView
from .leak import LeakConfig, time_to_full
from .pressure import admission_open, beyond_budget_bytes, memory_ratio, unified_host_short
from .stale import unattributed_bytes
from .trend import median, theil_sen_interval

MAX_GPUS_REMEMBERED = 4096  # GPUs come and go rarely; bound the admission memory anyway


def _servers_on(gpu: GpuSample) -> tuple[str, ...]:
    return tuple(sorted({p.endpoint for p in gpu.processes if p.role == "vllm" and p.endpoint}))


class GpuVerdicts:
    def __init__(self) -> None:
        self._admission: dict[str, bool] = {}  # GPU uuid -> open
        self._host_short: set[str] = set()  # unified GPUs closed for their host's memory, until it recovers
        self._servers: dict[str, tuple[str, ...]] = {}  # GPU uuid -> vLLM servers on it when last up

    def update(self, snapshot: Snapshot, budgets: tuple[Budget, ...], history: History,
               close_above: float, open_below: float, slack: float,
               forecast_window_seconds: float, leak: LeakConfig) -> tuple[GpuAnalysis, ...]:
        """Per GPU. A GPU that does not answer takes no work, and neither does one whose vLLM
        server also spans a GPU that does not answer: a tensor-parallel (or pipeline) server runs
        one worker per GPU and fails, or hangs in its collectives, when one is gone, so routing to
        it on the GPUs still up only fails later. That closure holds until the lost GPU answers
        again or the server no longer runs on this one (its memory verdict, with its hysteresis,
        is kept apart and decides again then)."""
        for gpu in snapshot.gpus:
            if gpu.up:
                self._servers[gpu.uuid] = _servers_on(gpu)
        while len(self._servers) > MAX_GPUS_REMEMBERED:
            self._servers.pop(next(iter(self._servers)))
        lost = {server: g.index for g in snapshot.gpus if not g.up for server in self._servers.get(g.uuid, ())}
        out = []
        for gpu in snapshot.gpus:
            ratio = memory_ratio(gpu, snapshot.host) if gpu.up else None
            beyond = beyond_budget_bytes(gpu, budgets) if gpu.up else None
            if not gpu.up:
                is_open = False  # a lost GPU takes no work
            else:
                beyond_ratio = beyond / gpu.total_bytes if beyond is not None and gpu.total_bytes \
                    else None
                is_open = admission_open(self._admission.get(gpu.uuid), ratio, beyond_ratio,
                                         close_above, open_below, slack)
            self._admission[gpu.uuid] = is_open
            if len(self._admission) > MAX_GPUS_REMEMBERED:
                self._admission.pop(next(iter(self._admission)))
            servers = self._servers.get(gpu.uuid, ())
            closed = [f"vLLM {s} also spans GPU {lost[s]}, which does not answer" for s in servers
                      if gpu.up and s in lost]
            if gpu.up and gpu.unified:
                short = self._unified_host(gpu.uuid, snapshot.host)
                closed += [short] if short else []
            out.append(GpuAnalysis(
                gpu=gpu.index, uuid=gpu.uuid, utilization_ratio=ratio, admission_open=is_open and not closed,
                servers=servers, closed_because="; ".join(closed),
                beyond_budget_bytes=beyond,
                time_to_full_seconds=_time_to_full(gpu, snapshot.timestamp, history,
                                                   forecast_window_seconds, leak),
                unattributed_bytes=unattributed_bytes(gpu) if gpu.up else None))
        return tuple(out)

    def _unified_host(self, uuid: str, host: HostMemory | None) -> str:
        """Why a unified GPU takes no work for its host's memory ("" when it may): closed where
        GpuUnifiedMemoryHostPressure pages, the host short of memory (a GPU allocation there takes
        host memory the host has not got, whatever the GPU's share in use), and kept closed until
        the host is clearly out of it (MemAvailable 1.5x that threshold, PSI half of its): memory
        PSI is a 10-second average, and a gate on it alone would flap."""
        short = unified_host_short(host)
        if short:
            self._host_short.add(uuid)
            while len(self._host_short) > MAX_GPUS_REMEMBERED:
                self._host_short.pop()
            return f"the host it shares memory with is short: {short}"
        if uuid in self._host_short and host is not None and host.total_bytes > 0:
            available = host.available_bytes / host.total_bytes
            if available < 1.5 * thresholds.UNIFIED_HOST_AVAILABLE.value or \
                    (host.psi_some_avg10 or 0.0) / 100.0 > 0.5 * thresholds.UNIFIED_HOST_PRESSURE.value:
                return f"the host it shares memory with has not recovered yet (MemAvailable {available:.0%})"
        self._host_short.discard(uuid)
        return ""


STEP_NOISE_FACTOR = 8.0  # a jump this many times the series' minute-to-minute noise is a step
MAX_SLOPE_SPREAD = 4.0  # the slope's 95 % interval spans at most this factor: else no forecast


def _time_to_full(gpu: GpuSample, now: float, history: History, window_seconds: float,
                  config: LeakConfig) -> float | None:
    """Forecast from the GPU's used trend (bucket medians), only where the trend is clear.

    A GPU's memory moves in steps (a co-tenant loads a model, a server starts) far more often
    than it trends, and a line through a staircase forecasts a fill that is not coming, then
    swings by orders of magnitude as the window slides past each step. So the forecast looks
    only after the last step (a jump of at least large_step_bytes and STEP_NOISE_FACTOR times
    the minute-to-minute noise), needs a significant upward trend there (leak.time_to_full:
    Mann-Kendall), and needs the slope known within a factor of MAX_SLOPE_SPREAD (Sen's 95 %
    interval, wholly above zero): a forecast is shown only when its order of magnitude is known."""
    if not gpu.up or gpu.used_bytes is None:
        return None
    series = history.gpu_used(gpu.uuid)
    times, values = series.times, series.values
    j = max(_last_step(values, config.large_step_bytes),
            bisect.bisect_left(times, times[-1] - window_seconds) if times else 0)
    times, values = times[j:], values[j:]
    forecast = time_to_full(SeriesView(times, values), gpu.total_bytes, now,
                            window_seconds=window_seconds, config=config)
    if forecast is None:
        return None
    interval = theil_sen_interval(times, values)
    if interval is None or interval[0] <= 0 or interval[1] > MAX_SLOPE_SPREAD * interval[0]:
        return None
    return forecast


def _last_step(values: tuple[float, ...], min_bytes: float) -> int:
    """Index of the first point after the last step up or down (0 when there is none)."""
    if len(values) < 3:
        return 0
    diffs = [abs(b - a) for a, b in itertools.pairwise(values)]
    threshold = max(min_bytes, STEP_NOISE_FACTOR * median(diffs))
    for i in range(len(diffs) - 1, -1, -1):
        if diffs[i] >= threshold:
            return i + 1
    return 0
