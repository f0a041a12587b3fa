"""Per-GPU verdicts of a tick: utilisation, memory beyond the vLLM budgets, admission (with
its hysteresis, the one thing here that outlives a tick), time to full, unattributed memory."""
from __future__ import annotations

from ..model import Budget, GpuAnalysis, GpuSample, Snapshot
from .history import History
from .leak import LeakConfig, time_to_full
from .pressure import admission_open, beyond_budget_bytes, memory_ratio
from .stale import unattributed_bytes

MAX_GPUS_REMEMBERED = 4096  # GPUs come and go rarely; bound the admission memory anyway


class GpuVerdicts:
    def __init__(self) -> None:
        self._admission: dict[str, bool] = {}  # GPU uuid -> open

    def update(self, snapshot: Snapshot, budgets: tuple[Budget, ...], history: History,
               close_above: float, open_below: float, slack: float,
               forecast_window_seconds: float, leak: LeakConfig) -> tuple[GpuAnalysis, ...]:
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
            out.append(GpuAnalysis(
                gpu=gpu.index, uuid=gpu.uuid, utilization_ratio=ratio, admission_open=is_open,
                beyond_budget_bytes=beyond,
                time_to_full_seconds=_time_to_full(gpu, snapshot.timestamp, history,
                                                   forecast_window_seconds, leak),
                unattributed_bytes=unattributed_bytes(gpu) if gpu.up else None))
        return tuple(out)


def _time_to_full(gpu: GpuSample, now: float, history: History, window_seconds: float,
                  config: LeakConfig) -> float | None:
    """Forecast from the GPU's used trend (bucket medians; start-up steps ignored)."""
    if not gpu.up or gpu.used_bytes is None:
        return None
    return time_to_full(history.gpu_used(gpu.uuid), gpu.total_bytes, now,
                        window_seconds=window_seconds, config=config)
