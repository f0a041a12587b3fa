"""A vLLM server's sleep state as one word (the history indexes it, the sleep detectors read it)."""
from __future__ import annotations

from ..model import VllmSample

SLEEPING_STATES = ("weights_offloaded", "discard_all")  # the levels that release memory


def sleep_state(server: VllmSample) -> str:
    """The server's state: a sleeping engine's state if any sleeps, "awake" if all report awake,
    "" when not reported (down, or a vLLM without sleep metrics)."""
    if not server.up:
        return ""
    states = [e.sleep_state for e in server.engines if e.sleep_state]
    asleep = [s for s in states if s != "awake"]
    return asleep[0] if asleep else ("awake" if states else "")


def is_asleep(state: str) -> bool:
    return state not in ("", "awake")
