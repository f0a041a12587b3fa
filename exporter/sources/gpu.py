"""The GPU-memory interface: a source that gives each GPU, its memory and the processes using
it (the snapshot's `gpus` part), read through a vendor's library. NVML (nvml.py) is one
implementation; the rest of the exporter knows a GPU backend only by this declaration.

A backend is a source module (sources/<name>.py) whose class takes the library module as its
first argument, the same arguments as `NvmlSource` after it, and never raises on the library's
faults; its simulated library is exporter/sim/fake_<name>.py (the runtime loads it by that name
when simulating). It is registered by one line in BACKENDS below, with the vendor's tools that
advice names (model.GpuTools: reset, inspect, list the holders), and chosen by the
configuration's `gpu.backend`.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ..model import NEUTRAL_TOOLS, GpuTools, HostMemory, Snapshot
from . import nvml
from .source import GPUS, Reading, Source


class GpuSourceFactory(Protocol):
    def __call__(self, library: Any, host_memory: Callable[[], HostMemory | None], /, *,
                 now: Callable[[], float], retry_initial_seconds: float, retry_max_seconds: float,
                 label: str, retry: bool) -> Source:
        """`library`: the vendor's module or its simulated stand-in; `host_memory`: the host's
        memory, for devices that share it (unified memory); `label`: the library's name in log
        lines; `retry` False for a one-shot sample (no back-off schedule)."""


@dataclass(frozen=True)
class GpuBackend:
    name: str  # gpu.backend in the configuration, and the source's `source` label
    library: str  # the vendor's Python module, imported on a real host ("": none to import)
    title: str  # how log lines name the library
    source: GpuSourceFactory
    # The vendor's own tools (reset, inspect, list holders), which the findings' advice names
    # (analysis reads them from the configuration's backend); the defaults are vendor-neutral.
    tools: GpuTools = NEUTRAL_TOOLS


class NoGpuSource:
    """`gpu.backend: none`, for a host that has no GPU to read (vLLM's CPU backend): it gives no
    GPU and is never down, so such a host is not reported as a GPU host whose driver is missing."""

    name = "none"
    needs: tuple[str, ...] = ()
    gives = (GPUS,)

    def __init__(self, library: Any, host_memory: Callable[[], HostMemory | None], /, **_: Any):
        pass

    def collect(self, snapshot: Snapshot) -> Reading:
        return Reading(snapshot)

    def close(self) -> None:
        pass


BACKENDS = (
    GpuBackend("nvml", library="pynvml", title="NVML", source=nvml.NvmlSource, tools=nvml.TOOLS),
    GpuBackend("none", library="", title="no GPU", source=NoGpuSource),
)
DEFAULT = BACKENDS[0].name


def backend(name: str) -> GpuBackend:
    """The backend named `name`. Raises KeyError (the configuration checks the name first)."""
    for b in BACKENDS:
        if b.name == name:
            return b
    raise KeyError(name)
