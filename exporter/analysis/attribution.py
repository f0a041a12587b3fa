"""Which part of a leaking process's GPU memory grows, from the allocator probe's numbers.

A process's GPU memory (NVML's per-process figure) is the sum of three components, each kept as
a series by History (ALLOCATOR_COMPONENTS):
  torch_allocated  held by live tensors: growth is tensors kept alive (an application or cache
                   leak);
  torch_cached     reserved by PyTorch but unallocated: its cache grows, which is fragmentation,
                   not a leak;
  non_torch        NVML used - PyTorch reserved: NCCL buffers, CUDA graphs' private pools,
                   cuBLAS workspaces, the CUDA context and driver.
Each component's growth rate is the Theil-Sen slope of its floor (bucket minima, as the leak
detector reads the process's total) over the window the leak was found in. The component is the
one that grows fastest, if it grows at least as fast as a leak must (LeakConfig's
min_slope_bytes_per_second); `unknown` where the process has no probe data, or none of its
components grows that fast (the probe's view does not explain the growth).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

from ..model import ProcessSample
from .history import ALLOCATOR_COMPONENTS, History
from .leak import LeakConfig
from .trend import theil_sen

UNKNOWN = "unknown"
# Fewest tier points (one a minute) a component needs in the window for a rate.
MIN_POINTS = 4
MAX_POINTS = 32  # thinned to at most this many (Theil-Sen is quadratic)


@dataclass(frozen=True)
class Attribution:
    component: str  # one of ALLOCATOR_COMPONENTS, or "unknown"
    rates: tuple[tuple[str, float], ...] = ()  # (component, bytes/s) for those with data

    @property
    def evidence(self) -> tuple[tuple[str, float | int | str], ...]:
        return (("component", self.component),) + tuple(
            (f"{name}_growth_bytes_per_second", round(rate, 1)) for name, rate in self.rates)


NO_PROBE = Attribution(UNKNOWN)


def attribute(history: History, uuid: str, p: ProcessSample, window_seconds: float, now: float,
              config: LeakConfig) -> Attribution:
    """The growing component of process `p` on GPU `uuid` over the last `window_seconds`."""
    if p.allocator is None:
        return NO_PROBE
    rates = []
    for name in ALLOCATOR_COMPONENTS:
        view = history.process_allocator(name, uuid, p.identity)
        times = view.times
        values = view.least
        j = bisect.bisect_left(times, now - window_seconds)
        if len(times) - j < MIN_POINTS:
            continue
        stride = -(-(len(times) - j) // MAX_POINTS)
        idx = range(len(times) - 1, j - 1, -stride)
        rate = theil_sen([times[i] for i in idx][::-1], [values[i] for i in idx][::-1])
        if rate is not None:
            rates.append((name, rate))
    if not rates:
        return NO_PROBE
    name, rate = max(rates, key=lambda r: r[1])
    component = name if rate >= config.min_slope_bytes_per_second else UNKNOWN
    return Attribution(component, tuple(rates))


def component_advice(component: str, tensor_parallel: bool, role: str) -> tuple[str, ...]:
    """What to do about growth in this component (empty for unknown)."""
    if component == "torch_allocated":
        advice = [
            "PyTorch's allocated memory grows: tensors are kept alive (an application or cache "
            "leak). Record allocation history in the process (torch.cuda.memory."
            "_record_memory_history(max_entries=100000), then torch.cuda.memory._dump_snapshot) "
            "and open it at https://pytorch.org/memory_viz to see the stacks that allocate it."]
        if role == "vllm":
            advice.append("In vLLM look at what grows per request: multimodal/processor caches "
                          "(--mm-processor-cache-gb), LoRA adapters (--max-loras), custom logits "
                          "processors; upgrade vLLM, several such leaks were fixed.")
        return tuple(advice)
    if component == "torch_cached":
        return (
            "PyTorch's reserved-but-unallocated memory grows while live tensors do not: the "
            "allocator's cache, fragmentation rather than a leak (see the fragmentation "
            "finding's numbers where there is one).",
            "Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (PyTorch 2.1+), or "
            "max_split_size_mb:512 where expandable segments are unavailable (PyTorch before "
            "2.1) or do not apply (vLLM sleep mode's pool); torch.cuda.empty_cache() gives the "
            "cache back only for a while.",
        )
    if component == "non_torch":
        advice = []
        if tensor_parallel or role == "vllm":
            advice.append("Memory outside PyTorch grows (GPU memory used - reserved): set "
                          "NCCL_CUMEM_ENABLE=0 in the server's environment (NCCL's cuMem "
                          "allocations have leaked in several NCCL/vLLM versions).")
        else:
            advice.append("Memory outside PyTorch grows (GPU memory used - reserved): NCCL buffers, "
                          "CUDA graphs, cuBLAS workspaces or the driver; with NCCL, try "
                          "NCCL_CUMEM_ENABLE=0.")
        advice += [
            "Check CUDA graph capture sizes (--cuda-graph-sizes / compilation_config "
            "cudagraph_capture_sizes): graphs captured for new batch shapes keep private "
            "pools; --enforce-eager confirms it.",
            "Upgrade vLLM, PyTorch, NCCL and the driver: several leaks outside PyTorch were "
            "fixed in recent releases.",
        ]
        return tuple(advice)
    return ()


def describe(component: str) -> str:
    """A few words for a finding's summary ("" for unknown)."""
    return {"torch_allocated": "in PyTorch tensors (allocated)",
            "torch_cached": "in PyTorch's cache (reserved, unallocated)",
            "non_torch": "outside PyTorch (non-torch)"}.get(component, "")
