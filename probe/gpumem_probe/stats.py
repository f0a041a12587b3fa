"""One read of PyTorch's CUDA caching allocator: the probe file's `devices` list.

Only public `torch.cuda` calls that never initialise CUDA themselves are used, and only once
the process has initialised it. Nothing here allocates GPU memory.
"""
from __future__ import annotations

import sys
import uuid as uuid_module
from collections.abc import Callable, Mapping
from typing import Any

from . import schema

# The file's counts read from torch.cuda.memory_stats(): (file key, memory_stats key).
STAT_KEYS = tuple((key, torch_key) for key, torch_key in schema.COUNTS if torch_key is not None)

CUMEM_MODULE = "vllm.device_allocator.cumem"


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def device_uuid(props: Any) -> str | None:
    """The device's UUID as 8-4-4-4-12 hex (NVML prints the same digits after `GPU-`/`MIG-`)."""
    raw = getattr(props, "uuid", None)  # torch >= 2.4
    if raw is None:
        return None
    data = getattr(raw, "bytes", None)
    if isinstance(data, bytes) and len(data) == 16:
        return str(uuid_module.UUID(bytes=data))
    return str(raw)[:64]


def cumem_bytes_by_device(modules: Mapping[str, Any] = sys.modules) -> dict[int, int]:
    """Bytes in vLLM's sleep-mode pool (CuMemAllocator) per device, {} when it is not in use.

    The pool's segments are counted in memory_stats() like any other (they come through the
    caching allocator's private pool), but `sleep()` releases their physical memory behind
    PyTorch's back: knowing the pool's size lets the exporter explain NVML < reserved.
    Read-only, and only when vLLM itself imported the module."""
    module = modules.get(CUMEM_MODULE)
    instance = getattr(getattr(module, "CuMemAllocator", None), "instance", None)
    if instance is None:
        return {}
    out: dict[int, int] = {}
    for data in list(instance.pointer_to_data.values()):  # a copy: vLLM's thread mutates the dict
        device, size = data.handle[0], data.handle[1]  # (device, size, pointer, handle)
        out[int(device)] = out.get(int(device), 0) + int(size)
    return out


def read_devices(cuda: Any, uuid_of: Callable[[int], str | None], errors: dict[str, int],
                 modules: Mapping[str, Any] = sys.modules) -> list[dict[str, Any]]:
    """One entry per device this process uses: one it allocated on, or its current device.
    A failing call is counted in `errors` under a stable kind and the rest still reported."""
    try:
        count = min(int(cuda.device_count()), schema.MAX_DEVICES)  # bounds the file whatever torch says
        current = int(cuda.current_device())
    except Exception:
        errors["device_count"] += 1
        return []
    try:
        cumem = cumem_bytes_by_device(modules)
    except Exception:
        errors["cumem"] += 1
        cumem = {}
    devices = []
    for index in range(count):
        try:
            stats = cuda.memory_stats(index)
        except Exception:
            errors["memory_stats"] += 1
            continue
        if index != current and not stats.get("num_device_alloc") and not stats.get("reserved_bytes.all.current"):
            continue  # visible but never used by this process
        counts = {key: _count(stats.get(torch_key)) for key, torch_key in STAT_KEYS}
        devices.append(schema.device(index, uuid_of(index), {**counts, "cumem_bytes": cumem.get(index)}))
    return devices
