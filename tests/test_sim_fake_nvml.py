"""The fake NVML module: real pynvml shapes, errors and fall-back paths, driven by a scenario."""
from __future__ import annotations

import importlib
import sys
import threading

import pynvml
import pytest

from exporter.clock import FixedClock
from exporter.sim import fake_nvml as nv
from exporter.sim import scenario as sc

GiB, MiB = 2**30, 2**20
START = 1_700_000_000.0

SCENARIO = """
name: nvml-test
description: fake NVML test
duration: 1h
gpus:
  - {name: NVIDIA H100 80GB HBM3, memory: 80GiB, reserved: 512MiB}
  - {name: NVIDIA H100 80GB HBM3, memory: 80GiB, reserved: 512MiB}
  - name: NVIDIA H100 80GB HBM3
    memory: 80GiB
    reserved: 512MiB
    mig: [{profile: 3g.40gb, memory: 39GiB}, {profile: 2g.20gb, memory: 19GiB}]
  - {name: NVIDIA GB10, memory: 128GiB, unified: true}
host: {memory: 512GiB}
processes:
  - {pid: 10, name: worker, gpu: 0, memory: 10GiB}
  - {pid: 11, name: Xorg, gpu: 0, kind: graphics, memory: 100MiB}
  - {pid: 12, name: late, gpu: [0, 1], start: 100, memory: 1GiB}
  - {pid: 13, name: wddm, gpu: 1, memory: 2GiB, memory_not_available: true}
  - {pid: 20, name: mig-a, gpu: "2/0", memory: 5GiB, cmdline: /usr/bin/python3 -m serve}
  - {pid: 21, name: mig-b, gpu: "2/1", memory: 3GiB}
  - {pid: 30, name: spark, gpu: 3, memory: 20GiB}
faults:
  - {kind: gpu_lost, gpu: 1, at: 600, until: 1200}
  - {kind: reset_required, gpu: 0, at: 2000, until: 2100}
  - {kind: init_failure, error: driver_not_loaded, at: 3000, until: 3100}
  - {kind: init_failure, error: library_not_found, at: 3100, until: 3200}
  - {kind: init_failure, error: version_mismatch, at: 3200, until: 3300}
  - {call: nvmlDeviceGetComputeRunningProcesses_v3, error: FunctionNotFound, at: 1300, until: 1400}
  - {call: nvmlDeviceGetComputeRunningProcesses_v2, error: FunctionNotFound, at: 1350, until: 1400}
  - {call: nvmlDeviceGetMemoryInfo, version: 2, error: FunctionNotFound, gpu: 0, at: 1500, until: 1600}
  - {call: nvmlDeviceGetMemoryInfo, version: 1, error: NoPermission, at: 1600, until: 1700}
  - {call: nvmlDeviceGetAddressingMode, error: FunctionNotFound, at: 1700, until: 1800}
  - {call: nvmlDeviceGetGraphicsRunningProcesses_v3, error: NotSupported, at: 1800, until: 1900}
  - {call: nvmlDeviceGetComputeRunningProcesses, error: Timeout, at: 1900, until: 2000}
  - {call: nvmlSystemGetDriverVersion, error: Unknown, at: 2200, until: 2300}
"""


@pytest.fixture
def clock():
    scenario = sc.loads(SCENARIO)
    clk = FixedClock(START, 0.0)
    nv.configure(scenario, clk)
    nv.nvmlInit()
    yield clk
    nv.configure(None, None)


def at(clock, t):
    clock.at = t


def handle(i):
    return nv.nvmlDeviceGetHandleByIndex(i)


# ---- identity with the real module -------------------------------------------------------------


def test_errors_and_constants_are_the_real_modules_objects():
    assert nv.NVMLError is pynvml.NVMLError
    for name in dir(pynvml):
        if name.startswith("NVMLError_") or name.startswith("NVML_"):
            assert getattr(nv, name) is getattr(pynvml, name), name
    assert nv.nvmlMemory_v2 == pynvml.nvmlMemory_v2
    assert nv.NVMLLibraryMismatchError is pynvml.NVMLLibraryMismatchError


def test_real_and_fake_errors_catch_each_other(clock):
    at(clock, 700)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        handle(1)
    with pytest.raises(nv.NVMLError_GpuIsLost):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)


def test_every_planned_function_exists_with_pynvml_parameter_names():
    import inspect
    names = ["nvmlInit", "nvmlShutdown", "nvmlSystemGetDriverVersion", "nvmlDeviceGetCount",
             "nvmlDeviceGetHandleByIndex", "nvmlDeviceGetUUID", "nvmlDeviceGetName",
             "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetComputeRunningProcesses_v3",
             "nvmlDeviceGetComputeRunningProcesses_v2", "nvmlDeviceGetComputeRunningProcesses",
             "nvmlDeviceGetGraphicsRunningProcesses_v3", "nvmlDeviceGetGraphicsRunningProcesses_v2",
             "nvmlDeviceGetGraphicsRunningProcesses", "nvmlDeviceGetMigMode",
             "nvmlDeviceGetMaxMigDeviceCount", "nvmlDeviceGetMigDeviceHandleByIndex",
             "nvmlDeviceGetAddressingMode", "nvmlDeviceIsMigDeviceHandle", "nvmlDeviceGetIndex",
             "nvmlSystemGetProcessName", "nvmlInitWithFlags", "nvmlDeviceGetUtilizationRates",
             "nvmlDeviceGetTemperature", "nvmlDeviceGetPowerUsage"]
    for name in names:
        real = inspect.signature(getattr(pynvml, name))
        fake = inspect.signature(getattr(nv, name))
        assert list(fake.parameters) == list(real.parameters), name


# ---- initialisation ----------------------------------------------------------------------------


def test_calls_before_init_raise_uninitialized():
    nv.configure(sc.loads(SCENARIO), FixedClock(START))
    try:
        with pytest.raises(pynvml.NVMLError_Uninitialized):
            nv.nvmlDeviceGetCount()
        with pytest.raises(pynvml.NVMLError_Uninitialized):
            nv.nvmlShutdown()
    finally:
        nv.configure(None, None)


def test_init_is_reference_counted(clock):
    nv.nvmlInit()
    nv.nvmlShutdown()
    assert nv.nvmlDeviceGetCount() == 4  # still one init outstanding
    nv.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nv.nvmlDeviceGetCount()


def test_no_scenario_is_a_host_without_a_driver():
    nv.configure(None, None)
    with pytest.raises(pynvml.NVMLError_LibraryNotFound):
        nv.nvmlInit()


@pytest.mark.parametrize("t,error", [
    (3050, pynvml.NVMLError_DriverNotLoaded),
    (3150, pynvml.NVMLError_LibraryNotFound),
    (3250, pynvml.NVMLError_LibRmVersionMismatch),
])
def test_init_failures_in_their_windows(clock, t, error):
    at(clock, t)
    with pytest.raises(error):
        nv.nvmlInit()
    at(clock, 3300)
    nv.nvmlInit()  # the window is over


def test_configure_rejects_faults_on_functions_it_does_not_have():
    bad = sc.loads(SCENARIO.replace("nvmlSystemGetDriverVersion", "nvmlDeviceGetWarpDrive"))
    with pytest.raises(sc.ScenarioError, match=r"faults\[12\].call: the simulated NVML has no nvmlDeviceGetWarpDrive"):
        nv.configure(bad, FixedClock(START))


@pytest.mark.parametrize("fault, message", [
    ({"call": "nvmlDeviceGetMemoryInfo", "error": "Exploded"}, "faults[0].error: unknown NVML error 'Exploded'"),
    ({"call": "nvmlDeviceGetUUID", "error": "Timeout", "version": 2},
     "faults[0].version: only nvmlDeviceGetMemoryInfo has versions"),
    ({"call": "amdsmi_get_gpu_vram_usage", "error": "Timeout"},
     "faults[0].call: the simulated NVML has no amdsmi_get_gpu_vram_usage"),
])
def test_the_nvml_names_of_a_call_fault_are_checked_by_the_fake_that_has_them(fault, message):
    """The scenario's schema knows no vendor: NVML's function, error and version names are
    checked where they live, in the fake NVML, when it is bound to the scenario."""
    scenario = sc.from_dict({"name": "f", "duration": 60, "gpus": [{"name": "g", "memory": "8GiB"}],
                             "host": {"memory": "16GiB"}, "faults": [fault]})
    with pytest.raises(sc.ScenarioError) as err:
        nv.configure(scenario, FixedClock(START))
    assert message in str(err.value)


@pytest.mark.parametrize("spelling", ["NVMLError_GpuIsLost", "GpuIsLost", "gpu_is_lost"])
def test_a_call_fault_raises_the_nvml_error_in_each_spelling(spelling):
    scenario = sc.from_dict({"name": "f", "duration": 60, "gpus": [{"name": "g", "memory": "8GiB"}],
                             "host": {"memory": "16GiB"},
                             "faults": [{"call": "nvmlDeviceGetUUID", "error": spelling}]})
    nv.configure(scenario, FixedClock(START))
    try:
        nv.nvmlInit()
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            nv.nvmlDeviceGetUUID(nv.nvmlDeviceGetHandleByIndex(0))
    finally:
        nv.configure(None, None)


# ---- devices and memory ------------------------------------------------------------------------


def test_devices_names_uuids_and_driver(clock):
    assert nv.nvmlDeviceGetCount() == 4
    assert nv.nvmlSystemGetDriverVersion() == "570.172.08"
    uuids = [nv.nvmlDeviceGetUUID(handle(i)) for i in range(4)]
    assert len(set(uuids)) == 4 and all(u.startswith("GPU-") for u in uuids)
    assert nv.nvmlDeviceGetName(handle(3)) == "NVIDIA GB10"
    assert nv.nvmlDeviceGetIndex(handle(2)) == 2
    assert handle(0) is handle(0)
    assert nv.nvmlDeviceGetHandleByUUID(uuids[1]) is handle(1)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        handle(4)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nv.nvmlDeviceGetUUID("not a handle")


def test_memory_info_v1_and_v2_shapes(clock):
    at(clock, 200)
    v1 = nv.nvmlDeviceGetMemoryInfo(handle(0))
    v2 = nv.nvmlDeviceGetMemoryInfo(handle(0), version=nv.nvmlMemory_v2)
    assert isinstance(v1, pynvml.c_nvmlMemory_t) and isinstance(v2, pynvml.c_nvmlMemory_v2_t)
    used = 10 * GiB + 100 * MiB + 1 * GiB  # worker + Xorg + late
    assert (v2.total, v2.reserved, v2.used) == (80 * GiB, 512 * MiB, used)
    assert v2.free == 80 * GiB - 512 * MiB - used and v2.version == pynvml.nvmlMemory_v2
    assert v1.used == used + 512 * MiB and v1.free == v2.free and v1.total == v2.total


def test_memory_info_wrong_struct_version(clock):
    with pytest.raises(pynvml.NVMLError_ArgumentVersionMismatch):
        nv.nvmlDeviceGetMemoryInfo(handle(0), version=0x01000018)


def test_memory_v2_missing_falls_back_to_v1(clock):
    at(clock, 1550)
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        nv.nvmlDeviceGetMemoryInfo(handle(0), version=nv.nvmlMemory_v2)
    assert nv.nvmlDeviceGetMemoryInfo(handle(0)).total == 80 * GiB
    assert nv.nvmlDeviceGetMemoryInfo(handle(1), version=nv.nvmlMemory_v2).total == 80 * GiB  # other GPU
    at(clock, 1650)
    with pytest.raises(pynvml.NVMLError_NoPermission):
        nv.nvmlDeviceGetMemoryInfo(handle(1))
    assert nv.nvmlDeviceGetMemoryInfo(handle(1), version=nv.nvmlMemory_v2).total == 80 * GiB


def test_unified_memory_device(clock):
    h = handle(3)
    for version in (None, nv.nvmlMemory_v2):
        with pytest.raises(pynvml.NVMLError_NotSupported):
            nv.nvmlDeviceGetMemoryInfo(h, version=version)
    assert nv.nvmlDeviceGetAddressingMode(h) == pynvml.NVML_DEVICE_ADDRESSING_MODE_ATS
    assert nv.nvmlDeviceGetAddressingMode(handle(0)) == pynvml.NVML_DEVICE_ADDRESSING_MODE_NONE
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nv.nvmlDeviceGetMigMode(h)
    assert [p.pid for p in nv.nvmlDeviceGetComputeRunningProcesses_v3(h)] == [30]


def test_addressing_mode_missing_on_older_drivers(clock):
    at(clock, 1750)
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        nv.nvmlDeviceGetAddressingMode(handle(3))


def test_unimplemented_function_is_one_object_that_raises_function_not_found(clock):
    # A module attribute is the same object on every lookup: nvitop logs a failed function once
    # by its identity, and would log (and pay for) a traceback on every tick otherwise.
    assert nv.nvmlDeviceGetFieldValues is nv.nvmlDeviceGetFieldValues
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        nv.nvmlDeviceGetFieldValues(handle(0), [])


# ---- processes and their fall-backs ------------------------------------------------------------


def _pids(procs):
    return sorted(p.pid for p in procs)


def test_process_objects(clock):
    at(clock, 200)
    procs = nv.nvmlDeviceGetComputeRunningProcesses_v3(handle(0))
    assert _pids(procs) == [10, 12]
    p10 = next(p for p in procs if p.pid == 10)
    assert p10.usedGpuMemory == 10 * GiB
    assert p10.gpuInstanceId == 0xFFFFFFFF and p10.computeInstanceId == 0xFFFFFFFF
    assert _pids(nv.nvmlDeviceGetGraphicsRunningProcesses_v3(handle(0))) == [11]
    not_available = {p.pid: p.usedGpuMemory for p in nv.nvmlDeviceGetComputeRunningProcesses_v2(handle(1))}
    assert not_available == {12: GiB, 13: None}


def test_processes_follow_the_clock(clock):
    at(clock, 99)
    assert _pids(nv.nvmlDeviceGetComputeRunningProcesses(handle(0))) == [10]
    at(clock, 100)
    assert _pids(nv.nvmlDeviceGetComputeRunningProcesses(handle(0))) == [10, 12]


def fetch_processes(h):
    """The exporter's documented fall-back chain: v3, then v2, then the plain call."""
    for name in ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2",
                 "nvmlDeviceGetComputeRunningProcesses"):
        try:
            return name, getattr(nv, name)(h)
        except pynvml.NVMLError_FunctionNotFound:
            continue
    raise AssertionError("unreachable")


def test_process_query_fallbacks(clock):
    at(clock, 200)
    assert fetch_processes(handle(0))[0].endswith("_v3")
    at(clock, 1320)  # v3 missing
    name, procs = fetch_processes(handle(0))
    assert name.endswith("_v2") and _pids(procs) == [10, 12]
    at(clock, 1360)  # v3 and v2 missing: plain maps to v3 and raises what nvidia-ml-py raises
    with pytest.raises(pynvml.NVMLLibraryMismatchError):
        fetch_processes(handle(0))


def test_fault_on_the_plain_call_and_graphics(clock):
    at(clock, 1950)
    with pytest.raises(pynvml.NVMLError_Timeout):
        nv.nvmlDeviceGetComputeRunningProcesses(handle(0))
    assert _pids(nv.nvmlDeviceGetComputeRunningProcesses_v3(handle(0))) == [10, 12]
    at(clock, 1850)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nv.nvmlDeviceGetGraphicsRunningProcesses_v3(handle(0))
    assert _pids(nv.nvmlDeviceGetGraphicsRunningProcesses_v2(handle(0))) == [11]


def test_process_name(clock):
    assert nv.nvmlSystemGetProcessName(10) == "worker"
    assert nv.nvmlSystemGetProcessName(20) == "/usr/bin/python3"
    with pytest.raises(pynvml.NVMLError_NotFound):
        nv.nvmlSystemGetProcessName(999)


# ---- lost GPUs -------------------------------------------------------------------------------


def test_gpu_lost_window(clock):
    h1 = handle(1)  # taken before the loss, as a long-running exporter would
    at(clock, 600)
    for call in (nv.nvmlDeviceGetUUID, nv.nvmlDeviceGetMemoryInfo, nv.nvmlDeviceGetComputeRunningProcesses_v3,
                 nv.nvmlDeviceGetName, nv.nvmlDeviceGetMigMode):
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            call(h1)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        handle(1)
    assert nv.nvmlDeviceGetMemoryInfo(handle(0)).total == 80 * GiB  # GPU 0 keeps reporting
    assert nv.nvmlDeviceGetCount() == 4
    at(clock, 1200)
    nv.nvmlDeviceGetCount()  # a new sampling pass (the one counted at 600 reads that moment)
    assert nv.nvmlDeviceGetUUID(h1).startswith("GPU-")


def test_reset_required(clock):
    h0 = handle(0)
    at(clock, 2050)
    with pytest.raises(pynvml.NVMLError_ResetRequired):
        nv.nvmlDeviceGetMemoryInfo(h0)
    with pytest.raises(pynvml.NVMLError_ResetRequired):
        handle(0)
    assert nv.nvmlDeviceGetMemoryInfo(handle(1)).total == 80 * GiB


def test_global_call_fault(clock):
    at(clock, 2250)
    with pytest.raises(pynvml.NVMLError_Unknown):
        nv.nvmlSystemGetDriverVersion()


# ---- MIG -------------------------------------------------------------------------------------


def test_mig_instances(clock):
    parent = handle(2)
    assert nv.nvmlDeviceGetMigMode(parent) == [pynvml.NVML_DEVICE_MIG_ENABLE] * 2
    assert nv.nvmlDeviceGetMigMode(handle(0)) == [pynvml.NVML_DEVICE_MIG_DISABLE] * 2
    count = nv.nvmlDeviceGetMaxMigDeviceCount(parent)
    found = []
    for i in range(count):
        try:
            found.append(nv.nvmlDeviceGetMigDeviceHandleByIndex(parent, i))
        except pynvml.NVMLError_NotFound:
            continue
    assert len(found) == 2
    a, b = found
    assert bool(nv.nvmlDeviceIsMigDeviceHandle(a)) and not bool(nv.nvmlDeviceIsMigDeviceHandle(parent))
    assert nv.nvmlDeviceGetName(a) == "NVIDIA H100 80GB HBM3 MIG 3g.40gb"
    assert nv.nvmlDeviceGetUUID(a).startswith("MIG-")
    assert nv.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(b) is parent
    mem_a = nv.nvmlDeviceGetMemoryInfo(a, version=nv.nvmlMemory_v2)
    assert (mem_a.total, mem_a.used) == (39 * GiB, 5 * GiB)
    assert nv.nvmlDeviceGetMemoryInfo(parent, version=nv.nvmlMemory_v2).used == 8 * GiB
    pa = nv.nvmlDeviceGetComputeRunningProcesses_v3(a)
    assert [(p.pid, p.usedGpuMemory, p.gpuInstanceId) for p in pa] == [(20, 5 * GiB, nv.nvmlDeviceGetGpuInstanceId(a))]
    assert _pids(nv.nvmlDeviceGetComputeRunningProcesses_v3(parent)) == [20, 21]


# ---- drop-in use -------------------------------------------------------------------------------


def test_installable_as_sys_modules_pynvml(clock, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    mod = importlib.import_module("pynvml")
    assert mod is nv
    mod.nvmlInit()
    assert mod.nvmlDeviceGetTemperature(mod.nvmlDeviceGetHandleByIndex(0), mod.NVML_TEMPERATURE_GPU) > 0
    util = mod.nvmlDeviceGetUtilizationRates(mod.nvmlDeviceGetHandleByIndex(0))
    assert 0 <= util.gpu <= 100
    mod.nvmlShutdown()


def test_functions_it_lacks_raise_function_not_found(clock):
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        nv.nvmlDeviceGetHandleByPciBusId("00000000:18:00.0")
    with pytest.raises(AttributeError):
        nv.nvmlNoSuchThing  # noqa: B018


class CountingNvml:
    """The module seen through a call counter (a test's view of which NVML calls were made)."""

    def __init__(self, module):
        self._module, self._lock, self.counts = module, threading.Lock(), {}

    def __getattr__(self, name):
        attr = getattr(self._module, name)
        if not (name.startswith("nvml") and callable(attr)):
            return attr

        def counted(*args, **kwargs):
            with self._lock:
                self.counts[name] = self.counts.get(name, 0) + 1
            return attr(*args, **kwargs)
        return counted


def test_call_counts(clock):
    mod = CountingNvml(nv)
    mod.nvmlDeviceGetUUID(mod.nvmlDeviceGetHandleByIndex(0))
    counts = mod.counts
    assert counts["nvmlDeviceGetUUID"] == 1 and counts["nvmlDeviceGetHandleByIndex"] == 1


def test_thread_safe_under_concurrent_calls(clock):
    errors, results = [], []
    mod = CountingNvml(nv)

    def worker():
        try:
            for _ in range(200):
                h = mod.nvmlDeviceGetHandleByIndex(0)
                results.append(mod.nvmlDeviceGetMemoryInfo(h, version=nv.nvmlMemory_v2).used)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(results) == 1600 and len(set(results)) == 1
    assert mod.counts["nvmlDeviceGetMemoryInfo"] == 1600


# ---- one sampling pass reads one moment --------------------------------------------------------

LEAKING = """
name: leaking
description: one process outgrowing its GPU by the minute
duration: 1h
gpus:
  - {name: NVIDIA H100 80GB HBM3, memory: 80GiB, reserved: 512MiB}
host: {memory: 512GiB}
processes:
  - {pid: 10, name: leaker, gpu: 0, memory: [{constant: 10GiB}, {linear: {rate: 1GiB/min}}]}
"""


@pytest.fixture
def leaking():
    clk = FixedClock(START, 0.0)
    nv.configure(sc.loads(LEAKING), clk)
    nv.nvmlInit()
    yield clk
    nv.configure(None, None)


def _one_sample(clock, lag):
    """What a sampler reads of GPU 0, with `lag` scenario seconds passing before each call (a
    loaded machine at --speed 120 lags minutes of scenario time between two calls)."""
    def call(f, *args):
        clock.advance(lag)
        return f(*args)
    call(nv.nvmlDeviceGetCount)
    h = call(nv.nvmlDeviceGetHandleByIndex, 0)
    memory = call(nv.nvmlDeviceGetMemoryInfo, h, nv.nvmlMemory_v2)
    [proc] = call(nv.nvmlDeviceGetComputeRunningProcesses_v3, h)
    return memory, proc


def test_a_sampling_pass_reads_one_moment_however_long_the_calls_take(leaking):
    memory, proc = _one_sample(leaking, lag=120)
    # Every call of the pass read the moment nvmlDeviceGetCount began it (scenario time 120).
    assert proc.usedGpuMemory == memory.used == 12 * GiB
    # The next pass reads the clock again.
    memory, proc = _one_sample(leaking, lag=120)
    assert proc.usedGpuMemory == memory.used == 20 * GiB  # counted at 600


def test_without_a_pass_each_call_reads_the_clock(leaking):
    h = handle(0)
    assert nv.nvmlDeviceGetMemoryInfo(h, nv.nvmlMemory_v2).used == 10 * GiB
    leaking.advance(60)
    [proc] = nv.nvmlDeviceGetComputeRunningProcesses_v3(h)
    assert proc.usedGpuMemory == 11 * GiB


def test_a_repeated_call_ends_the_pass(leaking):
    """A tool that asked for the count once and samples again, call by call, sees time pass."""
    nv.nvmlDeviceGetCount()
    h = handle(0)
    assert nv.nvmlDeviceGetMemoryInfo(h, nv.nvmlMemory_v2).used == 10 * GiB
    leaking.advance(60)
    assert nv.nvmlDeviceGetMemoryInfo(h, nv.nvmlMemory_v2).used == 11 * GiB
    leaking.advance(60)
    [proc] = nv.nvmlDeviceGetComputeRunningProcesses_v3(h)
    assert proc.usedGpuMemory == 12 * GiB


def test_a_pass_is_its_own_threads(leaking):
    nv.nvmlDeviceGetCount()
    h = handle(0)
    leaking.advance(60)
    seen = []
    t = threading.Thread(target=lambda: seen.append(nv.nvmlDeviceGetMemoryInfo(h, nv.nvmlMemory_v2).used))
    t.start()
    t.join(60)
    assert seen == [11 * GiB]  # the other thread has no pass: it reads the clock
    assert nv.nvmlDeviceGetMemoryInfo(h, nv.nvmlMemory_v2).used == 10 * GiB  # this one's pass
