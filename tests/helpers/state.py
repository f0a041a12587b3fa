"""A hand-built, fully populated State for exposition, web and security tests."""
from __future__ import annotations

from exporter.model import (
    Analysis,
    Budget,
    CacheConfig,
    Finding,
    GpuAnalysis,
    GpuSample,
    HostMemory,
    ProcessSample,
    ProcessTrend,
    RecorderStats,
    Snapshot,
    SourceStatus,
    State,
    VllmEngineStats,
    VllmSample,
)

GiB = 1 << 30


def make_state(t=1_000_000.0, admission_open=True, pids=(101, 202)):
    """A hand-built State: a real snapshot of one GPU with two processes."""
    procs = tuple(ProcessSample(pid=pid, used_bytes=(i + 1) * GiB, name=f"proc{pid}",
                                role="vllm" if i == 0 else "other",
                                host_rss_bytes=GiB // 2, start_time=t - 100)
                  for i, pid in enumerate(pids))
    gpu = GpuSample(index="0", uuid="GPU-aaaa", name="NVIDIA H100 80GB HBM3", total_bytes=80 * GiB,
                    used_bytes=40 * GiB, free_bytes=40 * GiB, reserved_bytes=GiB // 2, processes=procs)
    vllm = (VllmSample(endpoint="llama", up=True, scrape_duration_seconds=0.004,
                       engines=(VllmEngineStats(model="meta-llama/Llama-3.1-8B", engine="0", kv_cache_usage_ratio=0.42,
                                                requests_running=3, requests_waiting=1, preemptions_total=5,
                                                prefix_cache_queries_total=1000, prefix_cache_hits_total=250),),
                       cache_config=CacheConfig(gpu_memory_utilization=0.9, num_gpu_blocks=27000, block_size=16,
                                                cache_dtype="auto"), pids=(pids[0],),
                       memory_profile=(("kv_cache", 60 * GiB), ("weights", 15 * GiB))),
            VllmSample(endpoint="down", up=False, error_kind="refused", error="connection refused"))
    snap = Snapshot(timestamp=t, gpus=(gpu,), host=HostMemory(512 * GiB, 400 * GiB, 1.5, 0.0, 3), vllm=vllm,
                    sources=(SourceStatus("nvml", True, 0.01), SourceStatus("host", True, 0.002)))
    finding = Finding(kind="leak", severity="warning", first_detected_at=t - 50, gpu="0", uuid="GPU-aaaa",
                      pid=pids[0], process=f"proc{pids[0]}", role="vllm", summary="grows 4 MiB/min",
                      evidence=(("slope_bytes_per_second", 69905.0),), advice=("check NCCL_CUMEM_ENABLE",))
    analysis = Analysis(timestamp=t, findings=(finding,),
                        process_trends=tuple(ProcessTrend("0", "GPU-aaaa", p.pid, p.name, p.role, 1.0, i == 0)
                                             for i, p in enumerate(procs)),
                        gpus=(GpuAnalysis("0", "GPU-aaaa", 0.5, admission_open, 3600.0, 37 * GiB, 39 * GiB),),
                        budgets=(Budget("llama", "0", "GPU-aaaa", int(0.9 * 80 * GiB), GiB),))
    return State(snapshot=snap, analysis=analysis, errors_total={("nvml", "timeout"): 2},
                 vllm_errors_total={("down", "refused"): 4}, oom_events_total={("torch_cuda_oom", "fragmentation"): 1},
                 samples_total=7, last_sample_at=t, sample_duration_seconds=0.02,
                 recorder=RecorderStats(writes_total=2, errors_total={"disk_full": 1}, triggers_total={"oom": 2},
                                        debounced_total={"oom": 1}, last_write_timestamp=t - 60))
