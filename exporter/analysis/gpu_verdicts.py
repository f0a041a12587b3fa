"""Per-GPU verdicts of a tick: utilisation, memory beyond the vLLM budgets, admission (with
its hysteresis, the one thing here that outlives a tick), time to full, unattributed memory."""
from __future__ import annotations

from ..model import Budget, Finding, GpuAnalysis, GpuSample, Snapshot
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


def detect_unavailable(snapshot: Snapshot) -> list[Finding]:
    """A GPU that does not answer (lost, needing a reset, gone from the bus) serves nothing: a
    critical finding per GPU for as long as it stays down."""
    return [Finding(
        kind="gpu_unavailable", severity="critical", first_detected_at=snapshot.timestamp,
        gpu=g.index, uuid=g.uuid,
        summary=(f"GPU {g.index}{f' ({g.name})' if g.name else ''} does not answer "
                 f"({g.error or 'unknown error'}): its memory and processes cannot be read, the "
                 "servers on it fail their requests, and its admission is closed"),
        evidence=(("error", g.error), ("uuid", g.uuid)),
        advice=_UNAVAILABLE_ADVICE.get(g.error, ()) + _UNAVAILABLE_COMMON)
        for g in snapshot.gpus if not g.up]


_UNAVAILABLE_ADVICE = {
    "gpu_is_lost": ("The GPU fell off the bus: look for Xid 79 in `dmesg` / `journalctl -k`. It "
                    "comes back only after a reset (`nvidia-smi -r -i N`, with every process on it "
                    "stopped) or a reboot; if it recurs, check power, cooling and the PCIe slot.",),
    "reset_required": ("The GPU needs a reset: stop the processes on it, then `nvidia-smi -r -i N`, "
                       "or reboot the node.",),
}
_UNAVAILABLE_COMMON = (
    "Take the servers on this GPU out of the load balancer (/admission?gpu=N says closed) and "
    "drain the node; a tensor-parallel server on it fails on every GPU it spans.",
    "Look for Xid errors in `dmesg` and the GPU's state in `nvidia-smi -q`; see "
    "docs/runbooks/GpuUnavailable.md.",
)


def _time_to_full(gpu: GpuSample, now: float, history: History, window_seconds: float,
                  config: LeakConfig) -> float | None:
    """Forecast from the GPU's used trend (bucket medians; start-up steps ignored)."""
    if not gpu.up or gpu.used_bytes is None:
        return None
    return time_to_full(history.gpu_used(gpu.uuid), gpu.total_bytes, now,
                        window_seconds=window_seconds, config=config)
