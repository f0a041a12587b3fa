"""GPU and per-process GPU memory from NVML.

Takes the NVML *module* as an argument: the real `pynvml` (nvidia-ml-py) or the simulator's
drop-in `exporter.sim.fake_nvml`; this code cannot tell them apart. It never raises on an NVML
fault: a missing library or driver turns the source down (retried with back-off), a lost GPU
turns that GPU down while the others keep reporting, and an unsupported field is left out.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..model import GpuSample, GpuTools, HostMemory, ProcessSample, Snapshot, SourceError
from .source import GPUS, Reading, announce_recovery

log = logging.getLogger("exporter.nvml")

# NVIDIA's own tools, for the advice of findings about a GPU this backend reads (sources/gpu.py).
TOOLS = GpuTools(
    tool="nvidia-smi", reset="nvidia-smi -r -i {gpu}", inspect="nvidia-smi -q -i {gpu}",
    list_processes="nvidia-smi --query-compute-apps=pid,used_memory --format=csv",
    device_files="/dev/nvidia*", kernel_errors="Xid errors", lost_error="Xid 79")

# Errors after which the GPU itself is unusable until reset or re-initialisation.
_GPU_DOWN = {"gpu_is_lost", "reset_required", "gpu_not_found"}
# A newer call missing from an older driver: try the older variant.
_FALL_BACK = {"function_not_found", "not_supported", "argument_version_mismatch", "version_mismatch"}
UNSUPPORTED = object()  # no variant of a call is supported on this GPU


class NvmlSource:
    """The `nvml` source: every GPU (and MIG instance) with its memory and processes.

    `label` names the library in log lines (the runtime says "simulated NVML" for the
    simulator's module); `retry` False is for one-shot use (`snapshot`), where a failure is
    reported without a retry schedule nobody will see."""

    name = "nvml"
    needs: tuple[str, ...] = ()
    gives = (GPUS,)

    def __init__(self, nvml: Any, host_memory: Callable[[], HostMemory | None],
                 now: Callable[[], float] = time.time,
                 retry_initial_seconds: float = 5.0, retry_max_seconds: float = 300.0,
                 label: str = "NVML", retry: bool = True):
        self.nvml = nvml
        self.label = label
        self.retry = retry
        self.host_memory = host_memory
        self.now = now
        self.retry_initial = retry_initial_seconds
        self.retry_max = retry_max_seconds
        self._codes = {getattr(nvml, n): n[len("NVML_ERROR_"):].lower()
                       for n in dir(nvml) if n.startswith("NVML_ERROR_")}
        self._initialised = False
        self._next_retry = 0.0
        self._backoff = retry_initial_seconds
        self._last_error = ""
        self._driver_version = ""
        self._identity: dict[int, tuple[str, str]] = {}  # index -> (uuid, name): stable labels for a lost GPU
        self._variant: dict[tuple[str, str], int] = {}  # (uuid, call) -> which fall-back works
        self._ats: dict[str, bool] = {}
        self._gpus_down: dict[int, str] = {}  # index -> why, for the GPUs down at the last tick

    # -- error helpers -------------------------------------------------------------------
    def error_kind(self, exc: BaseException) -> str:
        if isinstance(exc, getattr(self.nvml, "NVMLLibraryMismatchError", ())):
            return "version_mismatch"
        value = getattr(exc, "value", None)
        if value is not None and value in self._codes:
            return self._codes[value]
        return "unexpected"

    def _is_nvml_error(self, exc: BaseException) -> bool:
        return isinstance(exc, (self.nvml.NVMLError, getattr(self.nvml, "NVMLLibraryMismatchError", ())))

    # -- lifecycle ----------------------------------------------------------------------
    def _init(self, errors: list[SourceError]) -> bool:
        now = self.now()
        if now < self._next_retry:
            return False
        try:
            self.nvml.nvmlInit()
        except Exception as exc:  # an NVML error or the library failing to load at all
            kind = self.error_kind(exc) if self._is_nvml_error(exc) else "library_not_found"
            self._down(kind, str(exc), now, errors)
            return False
        self._initialised = True
        self._backoff = self.retry_initial
        try:
            self._driver_version = _text(self.nvml.nvmlSystemGetDriverVersion())
        except Exception:  # the version is a nicety, not a reason to stay down
            self._driver_version = ""
        if self._last_error:
            announce_recovery(log, "%s available again (driver %s)", self.label, self._driver_version or "unknown")
        else:
            log.info("%s initialised (driver %s)", self.label, self._driver_version or "unknown")
        self._last_error = ""
        return True

    def _down(self, kind: str, message: str, now: float, errors: list[SourceError]) -> None:
        errors.append(SourceError("nvml", kind, message))
        if kind != self._last_error:
            retrying = (f", retrying every {self._backoff:.0f} s up to {self.retry_max:.0f} s"
                        if self.retry else "")
            log.error("%s unavailable (%s: %s); GPU metrics are absent%s", self.label, kind,
                      message, retrying)
        self._last_error = kind
        self._next_retry = now + self._backoff
        self._backoff = min(self._backoff * 2, self.retry_max)

    def close(self) -> None:
        if self._initialised:
            try:
                self.nvml.nvmlShutdown()
            except Exception:
                pass
            self._initialised = False

    # -- sampling -----------------------------------------------------------------------
    def collect(self, snapshot: Snapshot) -> Reading:
        errors: list[SourceError] = []
        gpus: tuple[GpuSample, ...] = ()
        if self._initialised or self._init(errors):
            try:
                count = self.nvml.nvmlDeviceGetCount()
            except self.nvml.NVMLError as exc:
                # Driver unloaded or upgraded under us: start over with back-off.
                self.close()
                self._down(self.error_kind(exc), str(exc), self.now(), errors)
            else:
                gpus = tuple(g for i in range(count) for g in self._device(i, errors))
                self._log_gpus_down(gpus)
        # Up with GPUs down: the library answers but those GPUs do not, and the state says which.
        down = "; ".join(f"GPU {g.index} down: {g.error}" for g in gpus if not g.up and not g.mig)
        return Reading(dataclasses.replace(snapshot, gpus=gpus, driver_version=self._driver_version),
                       up=self._initialised, errors=tuple(errors),
                       error=self._last_error if not self._initialised else down)

    def _log_gpus_down(self, gpus: tuple[GpuSample, ...]) -> None:
        """Once when a GPU goes down (and again if why changes), once when it answers again."""
        down = {int(g.index): g.error for g in gpus if not g.up and not g.mig and g.index.isdigit()}
        for index, why in down.items():
            if self._gpus_down.get(index) != why:
                uuid = self._identity.get(index, ("", ""))[0]
                log.error("%s: GPU %d (%s) does not answer (%s); its memory is not read until it does",
                          self.label, index, uuid or "uuid unknown", why)
        for index in self._gpus_down.keys() - down.keys():
            announce_recovery(log, "%s: GPU %d answers again", self.label, index)
        self._gpus_down = down

    def _device(self, index: int, errors: list[SourceError]) -> list[GpuSample]:
        nvml = self.nvml
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            uuid, name = self._identity.get(index) or (
                _text(nvml.nvmlDeviceGetUUID(handle)), _text(nvml.nvmlDeviceGetName(handle)))
            self._identity[index] = (uuid, name)
            gpu = self._read(str(index), uuid, name, handle, errors)
        except nvml.NVMLError as exc:
            kind = self.error_kind(exc)
            errors.append(SourceError("nvml", kind, f"GPU {index}: {exc}"))
            uuid, name = self._identity.get(index, ("", ""))
            return [GpuSample(index=str(index), uuid=uuid, name=name, up=False, error=kind)]
        instances = self._mig_instances(index, handle, gpu, errors)
        if instances:
            # The parent lists every instance's processes too: attribute them to instances only.
            gpu = dataclasses.replace(gpu, processes=())
        return [gpu, *instances]

    def _read(self, index: str, uuid: str, name: str, handle: Any, errors: list[SourceError],
              mig: bool = False) -> GpuSample:
        total = used = free = reserved = None
        unified = self._addressing_is_ats(handle, uuid)
        memory = self._memory_info(handle, uuid, errors)
        if memory is not None and memory is not UNSUPPORTED:
            total, used, free = memory.total, memory.used, memory.free
            reserved = getattr(memory, "reserved", None)
        elif memory is UNSUPPORTED:
            # NOT_SUPPORTED memory info is how unified-memory devices (DGX Spark / GB10) answer:
            # their memory is the host's, so report that.
            unified = True
            host = self.host_memory()
            if host is not None:
                total, free = host.total_bytes, host.available_bytes
                used = total - free
        processes = self._processes(handle, uuid, errors)
        return GpuSample(index=index, uuid=uuid, name=name, total_bytes=total, used_bytes=used,
                         free_bytes=free, reserved_bytes=reserved, unified=unified, mig=mig,
                         processes=processes)

    def _memory_info(self, handle: Any, uuid: str, errors: list[SourceError]) -> Any:
        """Memory info v2 (with driver-reserved memory), falling back to v1: NVML's struct,
        UNSUPPORTED or None (see _first_working)."""
        nvml = self.nvml
        variants = [lambda: nvml.nvmlDeviceGetMemoryInfo(handle, version=nvml.nvmlMemory_v2),
                    lambda: nvml.nvmlDeviceGetMemoryInfo(handle)]
        if not hasattr(nvml, "nvmlMemory_v2"):
            variants = variants[1:]
        return self._first_working(uuid, "memory", variants, errors)

    def _first_working(self, uuid: str, call: str, variants: Sequence[Callable[[], Any]],
                       errors: list[SourceError]) -> Any:
        """Try `variants` from the newest the GPU is known to support. Returns UNSUPPORTED when
        none is supported, None on another error (counted); GPU-fatal errors propagate so the
        caller can mark the GPU down."""
        start = self._variant.get((uuid, call), 0)
        last_kind = ""
        mismatch: Any = getattr(self.nvml, "NVMLLibraryMismatchError", ())  # () where the bindings lack it
        for i in range(start, len(variants)):
            try:
                result = variants[i]()
            except (self.nvml.NVMLError, mismatch) as exc:
                last_kind = self.error_kind(exc)
                if last_kind in _FALL_BACK:
                    continue
                if last_kind in _GPU_DOWN:
                    raise
                errors.append(SourceError("nvml", last_kind, f"{call} on {uuid}: {exc}"))
                return None
            self._variant[(uuid, call)] = i
            return result
        return UNSUPPORTED

    def _processes(self, handle: Any, uuid: str, errors: list[SourceError]) -> tuple[ProcessSample, ...]:
        nvml = self.nvml
        found: dict[int, ProcessSample] = {}
        for kind, base in (("compute", "nvmlDeviceGetComputeRunningProcesses"),
                           ("graphics", "nvmlDeviceGetGraphicsRunningProcesses")):
            variants = [getattr(nvml, base + suffix) for suffix in ("_v3", "_v2", "")
                        if hasattr(nvml, base + suffix)]
            procs = self._first_working(uuid, kind, [functools.partial(f, handle) for f in variants], errors)
            if procs is None or procs is UNSUPPORTED:
                continue
            for p in procs:
                used = p.usedGpuMemory  # None: NVML_VALUE_NOT_AVAILABLE
                seen = found.get(p.pid)
                if seen is not None:
                    # A process doing both compute and graphics is listed twice for the same memory.
                    used = max(used or 0, seen.used_bytes or 0) if (used, seen.used_bytes) != (None, None) else None
                    kind = "compute+graphics"
                found[p.pid] = ProcessSample(pid=p.pid, used_bytes=used, kind=kind)
        return tuple(found[pid] for pid in sorted(found))

    def _addressing_is_ats(self, handle: Any, uuid: str) -> bool:
        """ATS means the GPU addresses host memory coherently (Grace Hopper/Blackwell). HMM is
        left out on purpose: it is available on ordinary discrete GPUs with open kernel modules."""
        nvml = self.nvml
        if uuid not in self._ats:
            try:
                mode = nvml.nvmlDeviceGetAddressingMode(handle)
            except (AttributeError, nvml.NVMLError):  # older bindings or drivers lack the call
                mode = None
            self._ats[uuid] = mode == getattr(nvml, "NVML_DEVICE_ADDRESSING_MODE_ATS", 2)
        return self._ats[uuid]

    def _mig_instances(self, index: int, handle: Any, parent: GpuSample,
                       errors: list[SourceError]) -> list[GpuSample]:
        nvml = self.nvml
        try:
            current, _pending = nvml.nvmlDeviceGetMigMode(handle)
            if current != getattr(nvml, "NVML_DEVICE_MIG_ENABLE", 1):
                return []
            slots = nvml.nvmlDeviceGetMaxMigDeviceCount(handle)
        except nvml.NVMLError:
            return []  # NOT_SUPPORTED on GPUs without MIG
        out: list[GpuSample] = []
        for slot in range(slots):
            try:
                mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
            except nvml.NVMLError:
                continue  # NOT_FOUND: an empty slot
            label = f"{index}/{slot}"
            try:
                uuid = _text(nvml.nvmlDeviceGetUUID(mig))
                out.append(self._read(label, uuid, parent.name, mig, errors, mig=True))
            except nvml.NVMLError as exc:
                errors.append(SourceError("nvml", self.error_kind(exc), f"MIG {label}: {exc}"))
        return out


def _text(value: object) -> str:
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)
