"""Each vLLM server's memory budget per GPU, against what its processes really use.

vLLM sizes itself to `gpu_memory_utilization x total` of every GPU it runs on (weights,
activations, CUDA graphs and the KV cache all come out of that), so usage above the budget
means memory vLLM did not plan for: a leak, a fragmenting allocator, or a co-tenant's
share counted in.
"""
from __future__ import annotations

from ..model import Budget, Snapshot


def memory_budgets(snapshot: Snapshot) -> tuple[Budget, ...]:
    """One Budget per (endpoint, GPU) where the server has processes. Expects roles assigned
    (exporter.sources.vllm_procs.assign_roles)."""
    utilization = {
        s.endpoint: s.cache_config.gpu_memory_utilization if s.cache_config else None
        for s in snapshot.vllm
    }
    order = {s.endpoint: i for i, s in enumerate(snapshot.vllm)}
    budgets = []
    for gpu in snapshot.gpus:
        used: dict[str, list[int | None]] = {}
        for proc in gpu.processes:
            if proc.role == "vllm" and proc.endpoint:
                used.setdefault(proc.endpoint, []).append(proc.used_bytes)
        for endpoint, amounts in used.items():
            util = utilization.get(endpoint)
            budget = int(util * gpu.total_bytes) if util is not None and gpu.total_bytes is not None else None
            known = [a for a in amounts if a is not None]
            budgets.append(Budget(endpoint=endpoint, gpu=gpu.index, uuid=gpu.uuid, budget_bytes=budget,
                                  used_bytes=sum(known) if known else None))
    budgets.sort(key=lambda b: (order.get(b.endpoint, len(order)), b.endpoint))  # stable: GPU order kept
    return tuple(budgets)


def tensor_parallel_endpoints(budgets: tuple[Budget, ...]) -> frozenset[str]:
    """The servers with processes on more than one GPU (tensor or pipeline parallel)."""
    gpus: dict[str, set[str]] = {}
    for b in budgets:
        gpus.setdefault(b.endpoint, set()).add(b.gpu)
    return frozenset(endpoint for endpoint, g in gpus.items() if len(g) > 1)
