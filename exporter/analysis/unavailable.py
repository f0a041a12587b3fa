"""A GPU that does not answer: the `gpu_unavailable` finding, critical for as long as it stays down.

Its condition is `gpumem_gpu_up == 0`, which the GpuUnavailable rule judges over the raw series
(so it pages even when the analysis is wrong); the finding says why on the status page, in
/api/findings and in the log, with what to do.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..model import Finding, Snapshot
from .detector import DetectorSpec, FindingKind, Tick


@dataclass(frozen=True)
class UnavailableConfig:
    """Nothing to tune: a GPU answers or it does not."""


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


def _detect(tick: Tick, config: UnavailableConfig) -> list[Finding]:
    return detect_unavailable(tick.snapshot)


DETECTOR = DetectorSpec(
    name="gpu_unavailable", config=UnavailableConfig, create=lambda: _detect,
    help="A GPU that does not answer (lost, needing a reset) serves nothing.",
    kinds=(FindingKind(
        "gpu_unavailable", scenario="gpu-lost", raw_alerts=("GpuUnavailable",),
        help="a GPU does not answer (lost, needing a reset): critical while it stays down"),))
