"""Each vLLM server's budget (gpu_memory_utilization x GPU total) against its processes' use."""
from __future__ import annotations

import pytest

from exporter.analysis.budget import memory_budgets
from exporter.model import Budget, CacheConfig, GpuSample, ProcessSample, Snapshot, VllmSample

GiB = 2**30


def proc(pid, used, endpoint=""):
    return ProcessSample(pid=pid, used_bytes=used, role="vllm" if endpoint else "other", endpoint=endpoint)


def snapshot():
    gpus = (
        GpuSample(index="0", uuid="GPU-a", total_bytes=80 * GiB,
                  processes=(proc(11, 60 * GiB, "chat"), proc(12, 10 * GiB, "chat"), proc(99, 5 * GiB))),
        GpuSample(index="1", uuid="GPU-b", total_bytes=40 * GiB,
                  processes=(proc(13, 30 * GiB, "chat"), proc(21, None, "embed"))),
        GpuSample(index="2", uuid="GPU-c", total_bytes=None, processes=(proc(22, 3 * GiB, "embed"),)),
    )
    vllm = (VllmSample(endpoint="chat", up=True, cache_config=CacheConfig(gpu_memory_utilization=0.9)),
            VllmSample(endpoint="embed", up=False))
    return Snapshot(timestamp=1_700_000_000.0, gpus=gpus, vllm=vllm)


def test_budget_per_endpoint_and_gpu():
    assert memory_budgets(snapshot()) == (
        Budget(endpoint="chat", gpu="0", uuid="GPU-a", budget_bytes=int(0.9 * 80 * GiB), used_bytes=70 * GiB),
        Budget(endpoint="chat", gpu="1", uuid="GPU-b", budget_bytes=36 * GiB, used_bytes=30 * GiB),
        # embed is down, so its utilisation is unknown; GPU 2's total too
        Budget(endpoint="embed", gpu="1", uuid="GPU-b", budget_bytes=None, used_bytes=None),
        Budget(endpoint="embed", gpu="2", uuid="GPU-c", budget_bytes=None, used_bytes=3 * GiB),
    )


def test_no_server_processes_no_budget():
    snap = Snapshot(timestamp=0.0, gpus=(GpuSample(index="0", uuid="u", total_bytes=GiB,
                                                   processes=(proc(1, GiB),)),),
                    vllm=(VllmSample(endpoint="chat", up=True,
                                     cache_config=CacheConfig(gpu_memory_utilization=0.5)),))
    assert memory_budgets(snap) == ()


# -- memory beyond the budgets: what GpuMemoryHigh and admission act on -------------------------
def _gpu(used, uuid="GPU-a"):
    from exporter.model import GpuSample
    return GpuSample(index="0", uuid=uuid, total_bytes=80 * GiB, used_bytes=used)


@pytest.mark.parametrize("used, budgets, beyond", [
    (60 * GiB, [], 60 * GiB),  # no vLLM: everything used is beyond
    (70 * GiB, [Budget("a", "0", "GPU-a", 72 * GiB, 69 * GiB)], 1 * GiB),  # healthy vLLM: only the rest
    (80 * GiB, [Budget("a", "0", "GPU-a", 72 * GiB, 74 * GiB)], 8 * GiB),  # vLLM 2 GiB over its budget
    (70 * GiB, [Budget("a", "0", "GPU-a", None, 69 * GiB)], 1 * GiB),  # budget unknown (starting)
    (76 * GiB, [Budget("a", "0", "GPU-a", 36 * GiB, 30 * GiB),
                Budget("b", "0", "GPU-a", 36 * GiB, 40 * GiB)], 10 * GiB),  # two servers, one over
    (70 * GiB, [Budget("a", "0", "GPU-b", 72 * GiB, 69 * GiB)], 70 * GiB),  # another GPU's server
    (70 * GiB, [Budget("a", "0", "GPU-a", 72 * GiB, None)], 70 * GiB),  # no per-process figure
    (10 * GiB, [Budget("a", "0", "GPU-a", 72 * GiB, 69 * GiB)], 0),  # never negative
])
def test_beyond_budget_bytes(used, budgets, beyond):
    from exporter.analysis.pressure import beyond_budget_bytes
    assert beyond_budget_bytes(_gpu(used), budgets) == beyond


def test_beyond_budget_is_unknown_without_used_memory():
    from exporter.analysis.pressure import beyond_budget_bytes
    assert beyond_budget_bytes(_gpu(None), [Budget("a", "0", "GPU-a", 72 * GiB, 69 * GiB)]) is None


def test_a_unified_hosts_memory_pressure_is_quoted_to_the_kernels_decimals():
    """20.04 % read "memory PSI 20 % (over 20%)" when rounded: a reason that contradicts itself."""
    from exporter.analysis.pressure import unified_host_short
    from exporter.model import HostMemory

    GiB = 1 << 30
    assert unified_host_short(HostMemory(128 * GiB, 64 * GiB, psi_some_avg10=20.04)) == "memory PSI 20.04 % (over 20%)"
    assert unified_host_short(HostMemory(128 * GiB, 64 * GiB, psi_some_avg10=20.0)) == ""  # at the level: not over
    assert unified_host_short(HostMemory(128 * GiB, 64 * GiB, psi_some_avg10=47.0)) == "memory PSI 47 % (over 20%)"
