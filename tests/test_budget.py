"""Each vLLM server's budget (gpu_memory_utilization x GPU total) against its processes' use."""
from __future__ import annotations

from exporter.analysis.budget import Budget, memory_budgets
from exporter.model import CacheConfig, GpuSample, ProcessSample, Snapshot, VllmSample

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


def test_headroom_and_ratio():
    over = Budget(endpoint="chat", gpu="0", uuid="u", budget_bytes=72 * GiB, used_bytes=75 * GiB)
    assert over.headroom_bytes == -3 * GiB
    assert over.used_ratio == 75 / 72
    unknown = Budget(endpoint="chat", gpu="0", uuid="u", budget_bytes=None, used_bytes=GiB)
    assert unknown.headroom_bytes is None and unknown.used_ratio is None


def test_no_server_processes_no_budget():
    snap = Snapshot(timestamp=0.0, gpus=(GpuSample(index="0", uuid="u", total_bytes=GiB,
                                                   processes=(proc(1, GiB),)),),
                    vllm=(VllmSample(endpoint="chat", up=True,
                                     cache_config=CacheConfig(gpu_memory_utilization=0.5)),))
    assert memory_budgets(snap) == ()
