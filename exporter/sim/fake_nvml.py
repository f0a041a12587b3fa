"""A pynvml-compatible module driven by a scenario: the exporter's real NVML code runs against it.

Use it wherever the real `pynvml` module (nvidia-ml-py) would go:

    from exporter.sim import fake_nvml
    fake_nvml.configure(scenario, clock)      # scenario time = clock.elapsed()
    sys.modules["pynvml"] = fake_nvml         # optional: for third-party tools

It is the simulated library of the `nvml` GPU backend (sources/gpu.py): the runtime loads
sim/fake_<backend>.py when simulating and binds it with `configure(scenario, clock)`. The
scenario's faults are vendor-neutral (`gpu_lost`, `reset_required`, `init_failure` with
`library_not_found|driver_not_loaded|version_mismatch`) and mapped to NVML's errors here; a
`call_error` fault names NVML's own function, error and version, and is checked here too.

Functions have the names, signatures, return shapes and errors of nvidia-ml-py. The error
classes, constants and ctypes structures are the real module's own objects, so
`except pynvml.NVMLError_GpuIsLost` catches this module's errors and vice versa.

Faithful details worth knowing:
- The plain (unversioned) process queries call the `_v3` variant and turn FunctionNotFound
  into `NVMLLibraryMismatchError` (not an NVMLError), exactly like nvidia-ml-py.
- A lost GPU (fault `gpu_lost`/`reset_required`) raises on every call that takes its handle,
  and on `nvmlDeviceGetHandleByIndex`/`ByUUID` for it, as the real driver does.
- A unified-memory GPU (GB10) raises NotSupported from nvmlDeviceGetMemoryInfo (both versions)
  and reports addressing mode ATS.
- Functions of the real module that this one does not implement exist as stubs raising
  NVMLError_FunctionNotFound (a library without that symbol).
- One sampling pass reads one moment. The real driver answers each call in microseconds; here
  a second of lag between two calls is two minutes of scenario time at `--speed 120`, enough
  for a leaking process to outgrow the memory its GPU reported a call earlier.
  `nvmlDeviceGetCount`, the call a sampler makes first, starts a pass: it reads the state at
  the clock's time and the calls after it, in the same thread, read that same state. The pass
  ends at the next `nvmlDeviceGetCount`, or when a call repeats with the same arguments (a
  tool that asked for the count once and is sampling again). Without a pass, each call reads
  the state at the clock's time.
"""
from __future__ import annotations

import ctypes
import functools
import threading
import types
from collections.abc import Callable
from typing import Any, NoReturn

import pynvml as _real

from .scenario import Scenario, ScenarioClock, ScenarioError
from .scenario.specs import FaultSpec
from .scenario.state import GpuState, State

# ---- Re-exports: the real module's errors, constants and structures -------------------------

NVMLError = _real.NVMLError
NVMLLibraryMismatchError = _real.NVMLLibraryMismatchError
nvmlExceptionClass = _real.nvmlExceptionClass
nvmlFriendlyObject = _real.nvmlFriendlyObject
nvmlStructToFriendlyObject = _real.nvmlStructToFriendlyObject
_PrintableStructure = _real._PrintableStructure


def _reexport() -> None:
    g = globals()
    for name, value in vars(_real).items():
        if name in g or name == "nvmlLib" or isinstance(value, (types.FunctionType, types.ModuleType)):
            continue
        if name.startswith(("NVML", "nvml", "c_nvml", "struct_c_nvml")):
            g[name] = value


_reexport()

_UNAVAILABLE_ID = 0xFFFFFFFF  # gpuInstanceId/computeInstanceId outside MIG mode
# The scenario's init_failure errors (vendor-neutral words) as NVML says them.
_INIT_ERRORS: dict[str, int] = {
    "library_not_found": _real.NVML_ERROR_LIBRARY_NOT_FOUND,
    "driver_not_loaded": _real.NVML_ERROR_DRIVER_NOT_LOADED,
    "version_mismatch": _real.NVML_ERROR_LIB_RM_VERSION_MISMATCH,
}
_VERSIONED = {"nvmlDeviceGetMemoryInfo": (1, 2)}  # the calls a call_error fault may aim at one version of
_MAX_MIG_DEVICES = 7  # an H100/A100 can be split into at most 7 instances

# ---- Module state ------------------------------------------------------------------------------

_lock = threading.RLock()
_scenario: Scenario | None = None
_clock: ScenarioClock | None = None
_refcount = 0
_handles: dict[tuple[int, int | None], _Handle] = {}
_generation = 0  # bumped by configure(): a pass begun before it is over


class _Pass(threading.local):
    """This thread's sampling pass: the state it reads and the calls already made in it."""

    def __init__(self) -> None:
        self.generation = -1
        self.state: State | None = None
        self.calls: set[tuple[object, ...]] = set()


_pass = _Pass()


class _Handle:
    """An opaque device handle: a physical GPU (mig None) or one of its MIG instances."""

    __slots__ = ("gpu", "mig")

    def __init__(self, gpu: int, mig: int | None):
        self.gpu = gpu
        self.mig = mig

    def __repr__(self) -> str:
        where = f"{self.gpu}" if self.mig is None else f"{self.gpu}/{self.mig}"
        return f"<fake nvmlDevice {where}>"


def configure(scenario: Scenario | None, clock: ScenarioClock | None) -> None:
    """Bind the module to a scenario and a clock; (None, None) is a host without a driver.

    Also drops any NVML initialisation, as if the process had restarted.
    """
    global _scenario, _clock, _refcount, _generation
    if scenario is not None:
        for i, fault in enumerate(scenario.faults):
            if fault.kind == "call_error":
                _check_call_error(fault, f"faults[{i}]")
    with _lock:
        _scenario, _clock = scenario, clock
        _refcount = 0
        _handles.clear()
        _generation += 1


def _error_class(name: str) -> type[Exception] | None:
    """A scenario's error name as pynvml's class: 'FunctionNotFound', 'function_not_found' or
    'NVMLError_FunctionNotFound'."""
    name = name.removeprefix("NVMLError_")
    if "_" in name or name.islower():
        name = "".join(part.capitalize() for part in name.split("_"))
    found = getattr(_real, "NVMLError_" + name, None)
    return found if isinstance(found, type) and issubclass(found, Exception) else None


def _check_call_error(fault: FaultSpec, path: str) -> None:
    """A call_error fault names NVML's own functions, errors and versions: checked here, where
    those names live."""
    if not fault.call.startswith("nvml") or not callable(globals().get(fault.call)):
        raise ScenarioError(f"{path}.call: the simulated NVML has no {fault.call} (expected an NVML function "
                            "name like nvmlDeviceGetMemoryInfo)")
    if _error_class(fault.error) is None:
        raise ScenarioError(f"{path}.error: unknown NVML error {fault.error!r} (e.g. FunctionNotFound, "
                            "NotSupported, NoPermission, Timeout, GpuIsLost, Unknown)")
    if fault.version is not None and fault.version not in _VERSIONED.get(fault.call, ()):
        raise ScenarioError(f"{path}.version: only nvmlDeviceGetMemoryInfo has versions (1 or 2)")


def _raise(code: int) -> NoReturn:
    raise NVMLError(code)


def _sample_state(scenario: Scenario, clock: ScenarioClock, call: tuple[object, ...],
                  start: bool = False) -> State:
    """The state `call` (its name and arguments) reads: the pass's, or the clock's now (see the
    module's docstring). `start`: this call begins a new pass."""
    p = _pass
    if start:
        state = scenario.state_for(clock)
        p.generation, p.state, p.calls = _generation, state, {call}
        return state
    if p.state is None or p.generation != _generation or call in p.calls:
        p.state = None  # no pass, or it is over: this call samples anew
        return scenario.state_for(clock)
    p.calls.add(call)
    return p.state


def _bound(name: str, *args: object, start: bool = False) -> tuple[Scenario, State]:
    """Check initialisation and the faults aimed at this call; return the scenario and the
    state it reads. `args`: the call's arguments; `start`: the call begins a sampling pass."""
    with _lock:
        if _refcount == 0 or _scenario is None or _clock is None:
            _raise(_real.NVML_ERROR_UNINITIALIZED)
        scenario, clock = _scenario, _clock
    state = _sample_state(scenario, clock, (name, *args), start)
    _check_call_fault(state, name, None)
    return scenario, state


def _state(name: str, *args: object, start: bool = False) -> State:
    """Check initialisation and the faults aimed at this call; return the state it reads."""
    return _bound(name, *args, start=start)[1]


def _check_call_fault(state: State, name: str, gpu: int | None, version: int | None = None) -> None:
    for f in state.faults:
        if f.kind != "call_error" or f.call != name:
            continue
        if f.gpu is not None and f.gpu != gpu:
            continue
        if f.version is not None and version is not None and f.version != version:
            continue
        error = _error_class(f.error)  # configure() checked the name
        raise error() if error is not None else NVMLError(_real.NVML_ERROR_UNKNOWN)


def _device(name: str, handle: object, *args: object,
            version: int | None = None) -> tuple[State, GpuState, _Handle]:
    """Resolve a handle for a device call: lost/reset GPUs and per-call faults raise here.
    `args`: the call's other arguments."""
    if not isinstance(handle, _Handle):
        _raise(_real.NVML_ERROR_INVALID_ARGUMENT)
    with _lock:
        if _refcount == 0 or _scenario is None or _clock is None:
            _raise(_real.NVML_ERROR_UNINITIALIZED)
        scenario, clock = _scenario, _clock
    state = _sample_state(scenario, clock, (name, handle.gpu, handle.mig, version, *args))
    if handle.gpu >= len(state.gpus):
        _raise(_real.NVML_ERROR_INVALID_ARGUMENT)
    gpu = state.gpus[handle.gpu]
    if handle.mig is not None and handle.mig >= len(gpu.mig):
        _raise(_real.NVML_ERROR_INVALID_ARGUMENT)
    _check_lost(state, handle.gpu)
    _check_call_fault(state, name, handle.gpu, version)
    return state, gpu, handle


def _check_lost(state: State, gpu: int) -> None:
    for f in state.faults:
        if f.gpu == gpu and f.kind == "gpu_lost":
            _raise(_real.NVML_ERROR_GPU_IS_LOST)
        if f.gpu == gpu and f.kind == "reset_required":
            _raise(_real.NVML_ERROR_RESET_REQUIRED)


def _handle(gpu: int, mig: int | None = None) -> _Handle:
    with _lock:
        h = _handles.get((gpu, mig))
        if h is None:
            h = _handles[(gpu, mig)] = _Handle(gpu, mig)
        return h


# ---- Initialisation ----------------------------------------------------------------------------


def nvmlInitWithFlags(flags: int) -> None:
    global _refcount
    with _lock:
        scenario, clock = _scenario, _clock
    if scenario is None or clock is None:
        _raise(_real.NVML_ERROR_LIBRARY_NOT_FOUND)
    for f in scenario.faults_at(clock.elapsed()):
        if f.kind == "init_failure":
            _raise(_INIT_ERRORS[f.error])
    with _lock:
        _refcount += 1


def nvmlInit() -> None:
    nvmlInitWithFlags(0)


def nvmlShutdown() -> None:
    global _refcount
    with _lock:
        if _refcount == 0:
            _raise(_real.NVML_ERROR_UNINITIALIZED)
        _refcount -= 1


def nvmlErrorString(result: int) -> str:
    return str(NVMLError(result))


# ---- System ------------------------------------------------------------------------------------


def nvmlSystemGetDriverVersion() -> str:
    scenario, _ = _bound("nvmlSystemGetDriverVersion")
    return scenario.driver_version


def nvmlSystemGetNVMLVersion() -> str:
    scenario, _ = _bound("nvmlSystemGetNVMLVersion")
    return f"{scenario.cuda_driver_version // 1000}.{scenario.driver_version}"


def nvmlSystemGetCudaDriverVersion() -> int:
    scenario, _ = _bound("nvmlSystemGetCudaDriverVersion")
    return scenario.cuda_driver_version


def nvmlSystemGetCudaDriverVersion_v2() -> int:
    scenario, _ = _bound("nvmlSystemGetCudaDriverVersion_v2")
    return scenario.cuda_driver_version


def nvmlSystemGetProcessName(pid: int) -> str:
    state = _state("nvmlSystemGetProcessName", pid)
    proc = state.process(int(pid))
    if proc is None:
        _raise(_real.NVML_ERROR_NOT_FOUND)
    # NVML reports the executable path when it knows it, else the short name.
    return proc.cmdline.split(" ", 1)[0] if proc.cmdline else proc.name


# ---- Devices -----------------------------------------------------------------------------------


def nvmlDeviceGetCount() -> int:
    return len(_state("nvmlDeviceGetCount", start=True).gpus)


def nvmlDeviceGetHandleByIndex(index: int) -> _Handle:
    state = _state("nvmlDeviceGetHandleByIndex", index)
    if not isinstance(index, int) or not 0 <= index < len(state.gpus):
        _raise(_real.NVML_ERROR_INVALID_ARGUMENT)
    _check_lost(state, index)
    return _handle(index)


def nvmlDeviceGetHandleByUUID(uuid: str | bytes) -> _Handle:
    state = _state("nvmlDeviceGetHandleByUUID", uuid)
    if isinstance(uuid, bytes):
        uuid = uuid.decode(errors="replace")
    for g in state.gpus:
        if g.uuid == uuid:
            _check_lost(state, g.index)
            return _handle(g.index)
        for m in g.mig:
            if m.uuid == uuid:
                _check_lost(state, g.index)
                return _handle(g.index, m.index)
    _raise(_real.NVML_ERROR_NOT_FOUND)


def nvmlDeviceGetIndex(handle: _Handle) -> int:
    _, gpu, _ = _device("nvmlDeviceGetIndex", handle)
    return gpu.index


def nvmlDeviceGetMinorNumber(handle: _Handle) -> int:
    _, gpu, _ = _device("nvmlDeviceGetMinorNumber", handle)
    return gpu.index


def nvmlDeviceGetUUID(handle: _Handle) -> str:
    _, gpu, h = _device("nvmlDeviceGetUUID", handle)
    return gpu.uuid if h.mig is None else gpu.mig[h.mig].uuid


def nvmlDeviceGetName(handle: _Handle) -> str:
    _, gpu, h = _device("nvmlDeviceGetName", handle)
    return gpu.name if h.mig is None else f"{gpu.name} MIG {gpu.mig[h.mig].profile}"


def nvmlDeviceGetBrand(handle: _Handle) -> int:
    _device("nvmlDeviceGetBrand", handle)
    brand: int = _real.NVML_BRAND_NVIDIA
    return brand


def nvmlDeviceGetSerial(handle: _Handle) -> str:
    _, gpu, _ = _device("nvmlDeviceGetSerial", handle)
    return f"16523{gpu.index:08d}"


def nvmlDeviceGetArchitecture(handle: _Handle) -> int:
    _, gpu, _ = _device("nvmlDeviceGetArchitecture", handle)
    arch: int = _real.NVML_DEVICE_ARCH_BLACKWELL if gpu.unified else _real.NVML_DEVICE_ARCH_HOPPER
    return arch


def nvmlDeviceGetCudaComputeCapability(handle: _Handle) -> tuple[int, int]:
    _, gpu, _ = _device("nvmlDeviceGetCudaComputeCapability", handle)
    return (12, 1) if gpu.unified else (9, 0)


def nvmlDeviceGetMemoryInfo(handle: _Handle, version: int | None = None) -> ctypes.Structure:
    v = 2 if version else 1
    _, gpu, h = _device("nvmlDeviceGetMemoryInfo", handle, version=v)
    if version and version != _real.nvmlMemory_v2:
        _raise(_real.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
    if gpu.unified:
        _raise(_real.NVML_ERROR_NOT_SUPPORTED)
    if h.mig is None:
        total, reserved, used = gpu.total_bytes, gpu.reserved_bytes, gpu.used_bytes
    else:
        m = gpu.mig[h.mig]
        total, reserved, used = m.total_bytes, 0, m.used_bytes
    free = total - reserved - used
    mem: ctypes.Structure
    if version:
        mem = _real.c_nvmlMemory_v2_t()
        mem.version = version
        mem.total, mem.reserved, mem.free, mem.used = total, reserved, free, used
    else:
        # v1 counts the driver-reserved memory as used.
        mem = _real.c_nvmlMemory_t()
        mem.total, mem.free, mem.used = total, free, used + reserved
    return mem


def nvmlDeviceGetBAR1MemoryInfo(handle: _Handle) -> ctypes.Structure:
    _, gpu, _ = _device("nvmlDeviceGetBAR1MemoryInfo", handle)
    if gpu.unified:
        _raise(_real.NVML_ERROR_NOT_SUPPORTED)
    bar1: ctypes.Structure = _real.c_nvmlBAR1Memory_t()
    bar1.bar1Total, bar1.bar1Used = 128 * 2**30, 64 * 2**20
    bar1.bar1Free = bar1.bar1Total - bar1.bar1Used
    return bar1


def nvmlDeviceGetAddressingMode(device: _Handle) -> int:
    _, gpu, _ = _device("nvmlDeviceGetAddressingMode", device)
    mode: int = _real.NVML_DEVICE_ADDRESSING_MODE_ATS if gpu.unified else _real.NVML_DEVICE_ADDRESSING_MODE_NONE
    return mode


# ---- Processes ---------------------------------------------------------------------------------


def _processes(name: str, handle: object, kind: str) -> list[Any]:
    """nvmlFriendlyObject instances, as nvidia-ml-py returns: their fields are set at run time."""
    state, gpu, h = _device(name, handle)
    out: list[Any] = []
    mig_ids = {m.index: m for m in gpu.mig}
    for proc in state.processes:
        if proc.kind != kind:
            continue
        for key, used in proc.gpu_bytes.items():
            g, _, inst = key.partition("/")
            if int(g) != gpu.index:
                continue
            if h.mig is not None and (not inst or int(inst) != h.mig):
                continue
            m = mig_ids.get(int(inst)) if inst else None
            out.append(nvmlFriendlyObject({
                "pid": proc.pid,
                "usedGpuMemory": None if proc.memory_not_available else used,
                "gpuInstanceId": m.gpu_instance_id if m else _UNAVAILABLE_ID,
                "computeInstanceId": m.compute_instance_id if m else _UNAVAILABLE_ID,
            }))
    return out


def nvmlDeviceGetComputeRunningProcesses_v3(handle: _Handle) -> list[Any]:
    return _processes("nvmlDeviceGetComputeRunningProcesses_v3", handle, "compute")


def nvmlDeviceGetComputeRunningProcesses_v2(handle: _Handle) -> list[Any]:
    return _processes("nvmlDeviceGetComputeRunningProcesses_v2", handle, "compute")


def nvmlDeviceGetComputeRunningProcesses(handle: _Handle) -> list[Any]:
    _plain_check("nvmlDeviceGetComputeRunningProcesses", handle)
    try:
        return nvmlDeviceGetComputeRunningProcesses_v3(handle)
    except _real.NVMLError_FunctionNotFound:
        raise _mismatch("nvmlDeviceGetComputeRunningProcesses") from None


def nvmlDeviceGetGraphicsRunningProcesses_v3(handle: _Handle) -> list[Any]:
    return _processes("nvmlDeviceGetGraphicsRunningProcesses_v3", handle, "graphics")


def nvmlDeviceGetGraphicsRunningProcesses_v2(handle: _Handle) -> list[Any]:
    return _processes("nvmlDeviceGetGraphicsRunningProcesses_v2", handle, "graphics")


def nvmlDeviceGetGraphicsRunningProcesses(handle: _Handle) -> list[Any]:
    _plain_check("nvmlDeviceGetGraphicsRunningProcesses", handle)
    try:
        return nvmlDeviceGetGraphicsRunningProcesses_v3(handle)
    except _real.NVMLError_FunctionNotFound:
        raise _mismatch("nvmlDeviceGetGraphicsRunningProcesses") from None


def nvmlDeviceGetMPSComputeRunningProcesses_v3(handle: _Handle) -> list[Any]:
    _device("nvmlDeviceGetMPSComputeRunningProcesses_v3", handle)
    return []


def nvmlDeviceGetMPSComputeRunningProcesses(handle: _Handle) -> list[Any]:
    return nvmlDeviceGetMPSComputeRunningProcesses_v3(handle)


def _plain_check(name: str, handle: object) -> None:
    """A fault aimed at the unversioned function itself raises its own error."""
    with _lock:
        scenario, clock = _scenario, _clock
    if scenario is not None and clock is not None and _refcount > 0:
        gpu, mig = getattr(handle, "gpu", None), getattr(handle, "mig", None)
        _check_call_fault(_sample_state(scenario, clock, (name, gpu, mig)), name, gpu)


def _mismatch(name: str) -> Exception:
    error: Exception = NVMLLibraryMismatchError(
        "Unversioned function called and the pyNVML version does not match the NVML lib version. "
        "Either use matching pyNVML and NVML lib versions or use a versioned function such as "
        f"{name}_v2")
    return error


# ---- MIG ---------------------------------------------------------------------------------------


def nvmlDeviceGetMigMode(device: _Handle) -> list[int]:
    _, gpu, h = _device("nvmlDeviceGetMigMode", device)
    if gpu.unified or h.mig is not None:
        _raise(_real.NVML_ERROR_NOT_SUPPORTED)
    mode = _real.NVML_DEVICE_MIG_ENABLE if gpu.mig else _real.NVML_DEVICE_MIG_DISABLE
    return [mode, mode]


def nvmlDeviceGetMaxMigDeviceCount(device: _Handle) -> int:
    _, gpu, h = _device("nvmlDeviceGetMaxMigDeviceCount", device)
    if gpu.unified or h.mig is not None:
        _raise(_real.NVML_ERROR_NOT_SUPPORTED)
    return _MAX_MIG_DEVICES


def nvmlDeviceGetMigDeviceHandleByIndex(device: _Handle, index: int) -> _Handle:
    _, gpu, h = _device("nvmlDeviceGetMigDeviceHandleByIndex", device, index)
    if h.mig is not None or not isinstance(index, int) or not 0 <= index < _MAX_MIG_DEVICES:
        _raise(_real.NVML_ERROR_INVALID_ARGUMENT)
    if index >= len(gpu.mig):
        _raise(_real.NVML_ERROR_NOT_FOUND)
    return _handle(gpu.index, index)


def nvmlDeviceIsMigDeviceHandle(device: _Handle) -> ctypes.c_uint:
    _, _, h = _device("nvmlDeviceIsMigDeviceHandle", device)
    # nvidia-ml-py returns the c_uint itself here, not its value; so do we.
    return ctypes.c_uint(0 if h.mig is None else 1)


def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(migDevice: _Handle) -> _Handle:
    _, gpu, h = _device("nvmlDeviceGetDeviceHandleFromMigDeviceHandle", migDevice)
    if h.mig is None:
        _raise(_real.NVML_ERROR_INVALID_ARGUMENT)
    return _handle(gpu.index)


def nvmlDeviceGetGpuInstanceId(device: _Handle) -> int:
    _, gpu, h = _device("nvmlDeviceGetGpuInstanceId", device)
    if h.mig is None:
        _raise(_real.NVML_ERROR_INVALID_ARGUMENT)
    return gpu.mig[h.mig].gpu_instance_id


def nvmlDeviceGetComputeInstanceId(device: _Handle) -> int:
    _, gpu, h = _device("nvmlDeviceGetComputeInstanceId", device)
    if h.mig is None:
        _raise(_real.NVML_ERROR_INVALID_ARGUMENT)
    return gpu.mig[h.mig].compute_instance_id


# ---- Plausible constants for tools that ask more (nvitop, gpustat, exporters) ------------------


def nvmlDeviceGetUtilizationRates(handle: _Handle) -> ctypes.Structure:
    state, gpu, _ = _device("nvmlDeviceGetUtilizationRates", handle)
    busy = any(str(gpu.index) == k.partition("/")[0] for p in state.processes for k in p.gpu_bytes)
    util: ctypes.Structure = _real.c_nvmlUtilization_t()
    util.gpu, util.memory = (87, 41) if busy else (0, 0)
    return util


def nvmlDeviceGetTemperature(handle: _Handle, sensor: int) -> int:
    _device("nvmlDeviceGetTemperature", handle, sensor)
    if sensor != _real.NVML_TEMPERATURE_GPU:
        _raise(_real.NVML_ERROR_INVALID_ARGUMENT)
    return 46


def nvmlDeviceGetTemperatureThreshold(handle: _Handle, threshold: int) -> int:
    _device("nvmlDeviceGetTemperatureThreshold", handle, threshold)
    return 92


def nvmlDeviceGetFanSpeed(handle: _Handle) -> int:
    _device("nvmlDeviceGetFanSpeed", handle)
    _raise(_real.NVML_ERROR_NOT_SUPPORTED)  # data-centre cards are passively cooled


def nvmlDeviceGetNumFans(device: _Handle) -> int:
    _device("nvmlDeviceGetNumFans", device)
    return 0


def nvmlDeviceGetPowerUsage(handle: _Handle) -> int:
    _device("nvmlDeviceGetPowerUsage", handle)
    return 312_000  # milliwatts


def nvmlDeviceGetTotalEnergyConsumption(handle: _Handle) -> int:
    state, _, _ = _device("nvmlDeviceGetTotalEnergyConsumption", handle)
    return int(312 * 1000 * max(state.t, 0.0))  # millijoules, grows with time


def nvmlDeviceGetPowerManagementLimit(handle: _Handle) -> int:
    _device("nvmlDeviceGetPowerManagementLimit", handle)
    return 700_000


def nvmlDeviceGetEnforcedPowerLimit(handle: _Handle) -> int:
    _device("nvmlDeviceGetEnforcedPowerLimit", handle)
    return 700_000


def nvmlDeviceGetPowerManagementLimitConstraints(handle: _Handle) -> list[int]:
    _device("nvmlDeviceGetPowerManagementLimitConstraints", handle)
    return [200_000, 700_000]


def nvmlDeviceGetClockInfo(handle: _Handle, type: int) -> int:
    _device("nvmlDeviceGetClockInfo", handle, type)
    return {0: 1980, 1: 1980, 2: 2619, 3: 1755}.get(type, 1980)


def nvmlDeviceGetMaxClockInfo(handle: _Handle, type: int) -> int:
    _device("nvmlDeviceGetMaxClockInfo", handle, type)
    return {0: 1980, 1: 1980, 2: 2619, 3: 1755}.get(type, 1980)


def nvmlDeviceGetPerformanceState(handle: _Handle) -> int:
    _device("nvmlDeviceGetPerformanceState", handle)
    return 0


def nvmlDeviceGetPersistenceMode(handle: _Handle) -> int:
    _device("nvmlDeviceGetPersistenceMode", handle)
    mode: int = _real.NVML_FEATURE_ENABLED
    return mode


def nvmlDeviceGetComputeMode(handle: _Handle) -> int:
    _device("nvmlDeviceGetComputeMode", handle)
    mode: int = _real.NVML_COMPUTEMODE_DEFAULT
    return mode


def nvmlDeviceGetDisplayMode(handle: _Handle) -> int:
    _device("nvmlDeviceGetDisplayMode", handle)
    mode: int = _real.NVML_FEATURE_DISABLED
    return mode


def nvmlDeviceGetDisplayActive(handle: _Handle) -> int:
    _device("nvmlDeviceGetDisplayActive", handle)
    mode: int = _real.NVML_FEATURE_DISABLED
    return mode


def nvmlDeviceGetEccMode(handle: _Handle) -> list[int]:
    _device("nvmlDeviceGetEccMode", handle)
    return [_real.NVML_FEATURE_ENABLED, _real.NVML_FEATURE_ENABLED]


def nvmlDeviceGetTotalEccErrors(handle: _Handle, errorType: int, counterType: int) -> int:
    _device("nvmlDeviceGetTotalEccErrors", handle, errorType, counterType)
    return 0


def nvmlDeviceGetCurrentClocksThrottleReasons(handle: _Handle) -> int:
    _device("nvmlDeviceGetCurrentClocksThrottleReasons", handle)
    return 0


def nvmlDeviceGetCurrentClocksEventReasons(handle: _Handle) -> int:
    _device("nvmlDeviceGetCurrentClocksEventReasons", handle)
    return 0


def nvmlDeviceGetEncoderUtilization(handle: _Handle) -> list[int]:
    _device("nvmlDeviceGetEncoderUtilization", handle)
    return [0, 167_000]


def nvmlDeviceGetDecoderUtilization(handle: _Handle) -> list[int]:
    _device("nvmlDeviceGetDecoderUtilization", handle)
    return [0, 167_000]


def nvmlDeviceGetCurrPcieLinkGeneration(handle: _Handle) -> int:
    _device("nvmlDeviceGetCurrPcieLinkGeneration", handle)
    return 5


def nvmlDeviceGetMaxPcieLinkGeneration(handle: _Handle) -> int:
    _device("nvmlDeviceGetMaxPcieLinkGeneration", handle)
    return 5


def nvmlDeviceGetCurrPcieLinkWidth(handle: _Handle) -> int:
    _device("nvmlDeviceGetCurrPcieLinkWidth", handle)
    return 16


def nvmlDeviceGetMaxPcieLinkWidth(handle: _Handle) -> int:
    _device("nvmlDeviceGetMaxPcieLinkWidth", handle)
    return 16


def nvmlDeviceGetPcieThroughput(device: _Handle, counter: int) -> int:
    _device("nvmlDeviceGetPcieThroughput", device, counter)
    return 1024  # KB/s


def nvmlDeviceGetVbiosVersion(handle: _Handle) -> str:
    _device("nvmlDeviceGetVbiosVersion", handle)
    return "96.00.99.00.01"


def nvmlDeviceGetPciInfo_v3(handle: _Handle) -> ctypes.Structure:
    _, gpu, _ = _device("nvmlDeviceGetPciInfo_v3", handle)
    info: ctypes.Structure = _real.nvmlPciInfo_t()
    bus = 0x18 + 0x10 * gpu.index
    info.busIdLegacy = (_real.NVML_DEVICE_PCI_BUS_ID_LEGACY_FMT % (0, bus, 0)).encode()
    info.busId = (_real.NVML_DEVICE_PCI_BUS_ID_FMT % (0, bus, 0)).encode()
    info.domain, info.bus, info.device = 0, bus, 0
    info.pciDeviceId, info.pciSubSystemId = 0x233010DE, 0x16C110DE
    return info


def nvmlDeviceGetPciInfo(handle: _Handle) -> ctypes.Structure:
    return nvmlDeviceGetPciInfo_v3(handle)


# ---- Everything else the real module has: a library without that symbol ----------------------


def __getattr__(name: str) -> Any:
    # Any: to a type checker this stands for every name _reexport() copied in at run time too.
    real = getattr(_real, name, None)
    if name.startswith("nvml") and isinstance(real, types.FunctionType):
        return _missing(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _missing(name: str) -> Callable[..., NoReturn]:
    """One function per name, as a module attribute is: callers that remember which functions
    failed (nvitop logs each one once) know it again on the next lookup."""
    def missing(*args: Any, **kwargs: Any) -> NoReturn:
        _raise(_real.NVML_ERROR_FUNCTION_NOT_FOUND)
    missing.__name__ = missing.__qualname__ = name
    return missing
