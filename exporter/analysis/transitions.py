"""What changed at a tick that deserves a recording of the moments before it (model.TRANSITIONS):

  oom        the tick read an out-of-memory event from a log
  critical   a finding is critical that was not critical (or not active) on the tick before
  vllm_exit  a serving process left a GPU that is up on both ticks (a lost GPU hides its
             processes; that is no exit)

Decided once per tick by the analysis; the flight recorder only reacts to them.
"""
from __future__ import annotations

from ..model import Finding, Snapshot
from .stale import exited_servers


def transitions(before: Snapshot | None, now: Snapshot, active_before: tuple[Finding, ...],
                active: tuple[Finding, ...]) -> tuple[str, ...]:
    out = []
    if now.log_events:
        out.append("oom")
    was_critical = {f.key for f in active_before if f.severity == "critical"}
    if any(f.severity == "critical" and f.key not in was_critical for f in active):
        out.append("critical")
    if before is not None:
        up = {g.uuid for g in before.gpus if g.up} & {g.uuid for g in now.gpus if g.up}
        if any(uuid in up for uuid in exited_servers(now, [before])):
            out.append("vllm_exit")
    return tuple(out)
