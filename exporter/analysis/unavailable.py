"""A GPU that does not answer: the `gpu_unavailable` finding, critical for as long as it stays down.

Its condition is `gpumem_gpu_up == 0`, which the GpuUnavailable rule judges over the raw series
(so it pages even when the analysis is wrong); the finding says why on the status page, in
/api/findings and in the log, with what to do: it names the vLLM servers that ran on the GPU when
it last answered and the other GPUs they span, whose admission is closed with it (a
tensor-parallel server fails on every GPU it spans; gpu_verdicts.py). The commands it advises
are the GPU backend's own (Tick.gpu_tools, declared in sources/gpu.py), with the GPU's index.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..model import NEUTRAL_TOOLS, Finding, GpuSample, GpuTools, Snapshot
from .detector import DetectorSpec, FindingKind, Tick


@dataclass(frozen=True)
class UnavailableConfig:
    """Nothing to tune: a GPU answers or it does not."""


def detect_unavailable(snapshot: Snapshot, servers: dict[str, tuple[str, ...]] | None = None,
                       tools: GpuTools = NEUTRAL_TOOLS) -> list[Finding]:
    """A GPU that does not answer (lost, needing a reset, gone from the bus) serves nothing: a
    critical finding per GPU for as long as it stays down. `servers`: the vLLM servers each GPU
    (by uuid) had when it last answered."""
    findings = []
    for g in snapshot.gpus:
        if g.up:
            continue
        on_it = (servers or {}).get(g.uuid, ())
        spans = {s: sorted({o.index for o in snapshot.gpus if o.up for p in o.processes
                            if p.role == "vllm" and p.endpoint == s}) for s in on_it}
        summary = (f"GPU {g.index}{f' ({g.name})' if g.name else ''} does not answer "
                   f"({g.error or 'unknown error'}): its memory and processes cannot be read, the "
                   "servers on it fail their requests, and its admission is closed")
        if on_it:
            summary += "; vLLM " + ", ".join(
                s + (f" (also on GPU {', '.join(spans[s])}, closed to new work too)" if spans[s] else "")
                for s in on_it) + " ran on it"
        evidence: list[tuple[str, float | int | str]] = [("error", g.error), ("uuid", g.uuid)]
        for i, s in enumerate(on_it, 1):
            evidence += [(f"server_{i}_endpoint", s), (f"server_{i}_other_gpus", ",".join(spans[s]))]
        findings.append(Finding(
            kind="gpu_unavailable", severity="critical", first_detected_at=snapshot.timestamp,
            gpu=g.index, uuid=g.uuid, summary=summary, evidence=tuple(evidence),
            advice=_advice(g, tools, spanned=any(spans.values()))))
    return findings


def _advice(g: GpuSample, tools: GpuTools, spanned: bool) -> tuple[str, ...]:
    reset = tools.command("reset", g.index)
    reset = f"a reset ({reset}, with every process on it stopped)" if reset else \
        f"a reset with {tools.tool} (every process on it stopped)"
    lost = f"look for {tools.lost_error} in `dmesg` / `journalctl -k`" if tools.lost_error else \
        f"look for {tools.kernel_errors} in `dmesg` / `journalctl -k`"
    inspect = tools.command("inspect", g.index)
    specific = {
        "gpu_is_lost": (f"The GPU fell off the bus: {lost}. It comes back only after {reset} or a reboot; "
                        "if it recurs, check power, cooling and the PCIe slot.",),
        "reset_required": (f"The GPU needs {reset}, or a reboot of the node.",),
    }.get(g.error, ())
    return (*specific,
            f"Take the servers on this GPU out of the load balancer (/admission?gpu={g.index} says closed) and "
            "drain the node; a tensor-parallel server on it fails on every GPU it spans"
            + (" (their admission is closed too)." if spanned else "."),
            f"Look for {tools.kernel_errors} in `dmesg`"
            + (f" and the GPU's state in {inspect}" if inspect else "")
            + "; see docs/runbooks/GpuUnavailable.md.")


def _detect(tick: Tick, config: UnavailableConfig) -> list[Finding]:
    return detect_unavailable(tick.snapshot, {a.uuid: a.servers for a in tick.gpus}, tick.gpu_tools)


DETECTOR = DetectorSpec(
    name="gpu_unavailable", config=UnavailableConfig, create=lambda: _detect,
    help="A GPU that does not answer (lost, needing a reset) serves nothing.",
    kinds=(FindingKind(
        "gpu_unavailable", scenario="gpu-lost", raw_alerts=("GpuUnavailable",), clear_hold=False,
        help="a GPU does not answer (lost, needing a reset): critical while it stays down"),))
