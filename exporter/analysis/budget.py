"""Each vLLM server's memory budget per GPU, against what its processes really use.

The budget is what vLLM planned to hold on each of its GPUs; usage above it is memory vLLM
did not plan for: a leak, a fragmenting allocator, or a co-tenant's share counted in. How
vLLM plans depends on how it was started (docs/metrics.md, "The vLLM memory budget"):

- `gpu_memory_utilization` (every version, the usual case): the worker sizes the KV cache so
  that weights + activation peak + non-torch memory (+ CUDA graphs, estimated, 0.21+) + KV
  cache fit in `gpu_memory_utilization x total` of each GPU, so the budget is that product
  (the total CUDA reports: NVML's less the driver's reserve, `cuda_total`).
  There is no default to assume: the fraction is read from `vllm:cache_config_info` (its
  default changed across releases), and without it the budget is unknown.
- `--kv-cache-memory` (V1 0.11+, `cache_config_info` label `kv_cache_memory_bytes`): the worker
  skips memory profiling and takes exactly that many bytes for the KV cache on each GPU;
  `gpu_memory_utilization` then sizes nothing (it still gates start-up: free memory must reach
  it). vllm/v1/worker/gpu_worker.py, Worker.determine_available_memory: `if
  kv_cache_memory_bytes := self.cache_config.kv_cache_memory_bytes: ...
  self.model_runner.profile_run(); logger.info(...); return kv_cache_memory_bytes` -- no
  fraction of the total anywhere. What the server holds is then the KV bytes plus its non-KV
  memory: weights + activation peak + non-torch + CUDA graphs (compile_or_warm_up_model adds
  the same four up as `non_kv_cache_memory`). So the budget is kv_cache_memory_bytes plus the
  non-KV memory of the start-up log (vLLM's "Total non KV cache memory" where logged, else the
  components). Without the weights figure the budget is unknown. vLLM logs neither activation
  peak nor non-torch memory in this mode (it did not profile), so those count where known and
  the budget is then a lower bound by them (typically 1-3 GiB).

Unknown budgets are None: the server's memory then counts as planned (pressure.py).
"""
from __future__ import annotations

from ..model import Budget, GpuSample, MemoryProfile, Snapshot, VllmSample

BASIS_UTILIZATION = "gpu_memory_utilization"
BASIS_KV_CACHE_MEMORY = "kv_cache_memory"


def cuda_total(gpu: GpuSample) -> int | None:
    """The total CUDA reports (cudaMemGetInfo), of which gpu_memory_utilization is a share:
    NVML's total less what the driver reserves (memory info v2, 503 MiB on an H100 with driver
    580; v1 does not say, and counts it in used)."""
    if gpu.total_bytes is None:
        return None
    return gpu.total_bytes - (gpu.reserved_bytes or 0)


def server_budget(server: VllmSample | None, total_bytes: int | None) -> tuple[int | None, str]:
    """(budget bytes on one GPU of `total_bytes`, basis); (None, basis or "") when unknown."""
    config = server.cache_config if server is not None else None
    if server is None or config is None:
        return None, ""
    if config.kv_cache_memory_bytes:  # vLLM treats 0 as unset too (`if kv_cache_memory_bytes := ...`)
        return _with_kv_cache_memory(config.kv_cache_memory_bytes, server.startup), BASIS_KV_CACHE_MEMORY
    if config.gpu_memory_utilization is not None and total_bytes is not None:
        return int(config.gpu_memory_utilization * total_bytes), BASIS_UTILIZATION
    return None, BASIS_UTILIZATION if config.gpu_memory_utilization is not None else ""


def _with_kv_cache_memory(kv: int, p: MemoryProfile | None) -> int | None:
    """kv_cache_memory_bytes + the start-up profile's non-KV memory; None without the weights."""
    if p is None:
        return None
    if p.non_kv_cache_bytes is not None:
        return kv + p.non_kv_cache_bytes + (p.cuda_graph_bytes or 0)
    if p.weights_bytes is None:
        return None
    return kv + p.weights_bytes + sum(x or 0 for x in (p.activation_peak_bytes, p.non_torch_bytes,
                                                         p.cuda_graph_bytes))


def memory_budgets(snapshot: Snapshot) -> tuple[Budget, ...]:
    """One Budget per (endpoint, GPU) where the server has processes. Expects roles assigned
    (exporter.sources.vllm_procs.assign_roles)."""
    servers = {s.endpoint: s for s in snapshot.vllm}
    order = {s.endpoint: i for i, s in enumerate(snapshot.vllm)}
    budgets = []
    for gpu in snapshot.gpus:
        used: dict[str, list[int | None]] = {}
        for proc in gpu.processes:
            if proc.role == "vllm" and proc.endpoint:
                used.setdefault(proc.endpoint, []).append(proc.used_bytes)
        for endpoint, amounts in used.items():
            budget, basis = server_budget(servers.get(endpoint), cuda_total(gpu))
            known = [a for a in amounts if a is not None]
            budgets.append(Budget(endpoint=endpoint, gpu=gpu.index, uuid=gpu.uuid, budget_bytes=budget,
                                  used_bytes=sum(known) if known else None, basis=basis))
    budgets.sort(key=lambda b: (order.get(b.endpoint, len(order)), b.endpoint))  # stable: GPU order kept
    return tuple(budgets)


def tensor_parallel_endpoints(budgets: tuple[Budget, ...]) -> frozenset[str]:
    """The servers with processes on more than one GPU (tensor or pipeline parallel)."""
    gpus: dict[str, set[str]] = {}
    for b in budgets:
        gpus.setdefault(b.endpoint, set()).add(b.gpu)
    return frozenset(endpoint for endpoint, g in gpus.items() if len(g) > 1)
