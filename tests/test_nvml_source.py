"""The real NVML code path (exporter/sources/nvml.py) against the simulator's pynvml module:
every fall-back and error path, driven by scenario faults."""
import textwrap
from types import SimpleNamespace

import pynvml
import pytest

from exporter.clock import FixedClock
from exporter.model import HostMemory, Snapshot
from exporter.sim import fake_nvml
from exporter.sim.scenario import SCENARIO_DIR, load
from exporter.sources.nvml import NvmlSource

GiB = 1 << 30
BASE = """
name: t
description: test host
duration: 1h
gpus:
  - {name: NVIDIA H100 80GB HBM3, memory: 80GiB, reserved: 512MiB, count: 2}
host: {memory: 512GiB, available: 400GiB}
processes:
  - {pid: 100, name: vllm, gpu: 0, memory: 30GiB, rss: 2GiB}
  - {pid: 200, name: python3, gpu: 1, memory: 10GiB, rss: 1GiB}
"""
HOST = HostMemory(total_bytes=128 * GiB, available_bytes=100 * GiB)


@pytest.fixture
def make(tmp_path):
    """Scenario text (+ faults) → (NvmlSource over fake_nvml, clock)."""
    def build(extra="", base=BASE, at=0.0):
        path = tmp_path / "s.yaml"
        path.write_text(textwrap.dedent(base) + textwrap.dedent(extra))
        clock = FixedClock(1_700_000_000.0, at)
        build.scenario = load(str(path))
        fake_nvml.configure(build.scenario, clock)
        source = NvmlSource(fake_nvml, lambda: HOST, now=clock.now, retry_initial_seconds=5, retry_max_seconds=40)
        return source, clock
    yield build
    fake_nvml.configure(None, None)


def sample(source):
    """One tick of the source alone: what it read, whether it is up, the faults it saw."""
    r = source.collect(Snapshot(timestamp=0.0))
    return SimpleNamespace(up=r.up, gpus=r.snapshot.gpus, errors=r.errors,
                           driver_version=r.snapshot.driver_version)


def kinds(reading):
    return [e.kind for e in reading.errors]


def test_reads_gpus_and_processes(make):
    source, _ = make()
    r = sample(source)
    assert r.up and not r.errors
    assert [g.index for g in r.gpus] == ["0", "1"]
    g0 = r.gpus[0]
    assert g0.total_bytes == 80 * GiB and g0.reserved_bytes == 512 << 20
    assert g0.used_bytes + g0.free_bytes + g0.reserved_bytes == g0.total_bytes
    assert [(p.pid, p.used_bytes) for p in g0.processes] == [(100, 30 * GiB)]
    assert g0.uuid.startswith("GPU-") and g0.name == "NVIDIA H100 80GB HBM3"
    assert r.driver_version


def test_no_driver_is_source_down_and_retried_with_backoff(make):
    source, clock = make()
    fake_nvml.configure(None, None)  # a host with no NVIDIA driver
    r = sample(source)
    assert not r.up and r.gpus == () and kinds(r) == ["library_not_found"]
    clock.advance(1)
    assert kinds(sample(source)) == []  # waiting for the back-off, not hammering the library
    clock.advance(5)
    assert kinds(sample(source)) == ["library_not_found"]  # retried; next wait doubles to 10 s
    clock.advance(6)
    assert kinds(sample(source)) == []
    # The driver appears (installed, or the container got the GPU): recovered without restart.
    fake_nvml.configure(make.scenario, clock)
    clock.advance(10)
    r = sample(source)
    assert r.up and len(r.gpus) == 2


def test_init_failure_window_then_recovery(make):
    source, clock = make("faults:\n  - {kind: init_failure, error: driver_not_loaded, at: 0, until: 30}\n")
    r = sample(source)
    assert not r.up and kinds(r) == ["driver_not_loaded"]
    clock.advance(40)
    r = sample(source)
    assert r.up and len(r.gpus) == 2


def test_driver_upgrade_under_us_reinitialises(make):
    source, clock = make("faults:\n"
                         "  - {kind: call_error, call: nvmlDeviceGetCount, error: LibRmVersionMismatch,"
                         " at: 10, until: 20}\n")
    assert sample(source).up
    clock.advance(10)
    r = sample(source)
    assert not r.up and kinds(r) == ["lib_rm_version_mismatch"]
    clock.advance(15)
    assert sample(source).up


def test_lost_gpu_is_down_while_the_other_reports(make):
    source, clock = make("faults:\n  - {kind: gpu_lost, gpu: 1, at: 10, until: 20}\n")
    uuid1 = sample(source).gpus[1].uuid
    clock.advance(10)
    r = sample(source)
    g0, g1 = r.gpus
    assert g0.up and g0.used_bytes > 0
    assert not g1.up and g1.error == "gpu_is_lost" and g1.uuid == uuid1 and g1.used_bytes is None
    assert "gpu_is_lost" in kinds(r) and r.up
    clock.advance(10)
    assert sample(source).gpus[1].up


def test_a_lost_gpu_is_logged_once_and_the_source_state_says_which(make, caplog):
    """The library answers, one GPU does not: the source stays up, its state (the status page's
    "sources" table) names the GPU, and the log says so once, then once when it is back (#19)."""
    from exporter.sources.source import collect
    source, clock = make("faults:\n  - {kind: gpu_lost, gpu: 1, at: 10, until: 30}\n")
    states = []
    with caplog.at_level("INFO", logger="exporter.nvml"):
        for _ in range(4):
            [status] = collect(source, Snapshot(timestamp=clock.now())).sources
            states.append((status.up, status.error))
            clock.advance(10)
    assert states == [(True, ""), (True, "GPU 1 down: gpu_is_lost"), (True, "GPU 1 down: gpu_is_lost"), (True, "")]
    lost = [r for r in caplog.records if "does not answer" in r.getMessage()]
    assert len(lost) == 1 and lost[0].levelname == "ERROR" and "GPU 1" in lost[0].getMessage()
    assert sum("GPU 1 answers again" in r.getMessage() for r in caplog.records) == 1


def test_reset_required(make):
    source, _ = make("faults:\n  - {kind: reset_required, gpu: 0, at: 0}\n")
    r = sample(source)
    assert r.gpus[0].error == "reset_required" and r.gpus[1].up


def test_memory_info_v2_missing_falls_back_to_v1(make):
    source, _ = make("faults:\n"
                     "  - {kind: call_error, call: nvmlDeviceGetMemoryInfo, version: 2, error: FunctionNotFound,"
                     " at: 0}\n")
    r = sample(source)
    g0 = r.gpus[0]
    assert g0.up and g0.total_bytes == 80 * GiB and g0.reserved_bytes is None
    assert g0.used_bytes is not None and not r.errors


def test_process_list_v3_missing_falls_back_to_v2(make):
    source, _ = make("faults:\n"
                     "  - {kind: call_error, call: nvmlDeviceGetComputeRunningProcesses_v3, error: FunctionNotFound,"
                     " at: 0}\n")
    r = sample(source)
    assert [(p.pid, p.used_bytes) for p in r.gpus[0].processes] == [(100, 30 * GiB)]
    assert not r.errors


def test_no_process_list_at_all_keeps_memory(make):
    # nvidia-ml-py's unversioned call is v3 behind a version check: with v3 and v2 both missing it
    # raises NVMLLibraryMismatchError (not an NVMLError). The GPU must still report its memory.
    source, _ = make("faults:\n"
                     "  - {kind: call_error, call: nvmlDeviceGetComputeRunningProcesses_v3, error: FunctionNotFound,"
                     " at: 0}\n"
                     "  - {kind: call_error, call: nvmlDeviceGetComputeRunningProcesses_v2, error: FunctionNotFound,"
                     " at: 0}\n")
    r = sample(source)
    g0 = r.gpus[0]
    assert g0.up and g0.processes == () and g0.used_bytes >= 30 * GiB and r.up


def test_no_permission_on_processes_keeps_gpu_up(make):
    source, _ = make("faults:\n"
                     "  - {kind: call_error, call: nvmlDeviceGetComputeRunningProcesses_v3, error: NoPermission,"
                     " at: 0}\n")
    r = sample(source)
    assert r.gpus[0].up and r.gpus[0].processes == () and r.gpus[0].used_bytes is not None
    assert "no_permission" in kinds(r)


def test_unified_memory_device_reads_host_memory(make):
    source, _ = make(base="""
        name: spark
        description: GB10
        duration: 1h
        gpus: [{name: NVIDIA GB10, memory: 128GiB, unified: true}]
        host: {memory: 128GiB, available: 100GiB}
        processes:
          - {pid: 100, name: vllm, gpu: 0, memory: 20GiB, rss: 1GiB}
        """)
    g = sample(source).gpus[0]
    assert g.unified and g.total_bytes == HOST.total_bytes and g.free_bytes == HOST.available_bytes
    assert g.used_bytes == HOST.total_bytes - HOST.available_bytes
    assert [(p.pid, p.used_bytes) for p in g.processes] == [(100, 20 * GiB)]


def test_used_memory_not_available(make):
    source, _ = make(base=BASE.replace("{pid: 200, name: python3, gpu: 1, memory: 10GiB, rss: 1GiB}",
                                       "{pid: 200, name: python3, gpu: 1, memory: 10GiB, rss: 1GiB,"
                                       " memory_not_available: true}"))
    procs = sample(source).gpus[1].processes
    assert [(p.pid, p.used_bytes) for p in procs] == [(200, None)]


def test_process_vanishing_is_normal(make):
    source, clock = make(base=BASE.replace("{pid: 200, name: python3, gpu: 1, memory: 10GiB, rss: 1GiB}",
                                           "{pid: 200, name: python3, gpu: 1, memory: 10GiB, rss: 1GiB, stop: 60}"))
    assert sample(source).gpus[1].processes
    clock.advance(61)
    r = sample(source)
    assert r.gpus[1].processes == () and not r.errors


def test_mig_instances(make):
    source, _ = make(base=(SCENARIO_DIR / "mig.yaml").read_text(), at=600)
    gpus = sample(source).gpus
    assert [g.index for g in gpus] == ["0", "0/0", "0/1"]
    parent, a, b = gpus
    assert not parent.mig and a.mig and b.mig
    assert a.total_bytes < parent.total_bytes and a.uuid.startswith("MIG-")
    assert [p.pid for p in a.processes] == [1150] and [p.pid for p in b.processes] == [1250]


def test_errors_are_the_real_pynvml_classes():
    assert fake_nvml.NVMLError_GpuIsLost is pynvml.NVMLError_GpuIsLost


class LaggingClock(FixedClock):
    """Two minutes of scenario time pass between any two NVML calls (a loaded host at --speed
    120 lags a second between calls)."""

    def elapsed(self):
        self.advance(120)
        return super().elapsed()


def test_one_sample_is_consistent_however_much_time_passes_between_calls(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(textwrap.dedent(BASE).replace(
        "memory: 30GiB, rss: 2GiB", "memory: [{constant: 30GiB}, {linear: {rate: 1GiB/min}}], rss: 2GiB"))
    clock = LaggingClock(1_700_000_000.0)
    fake_nvml.configure(load(str(path)), clock)
    try:
        source = NvmlSource(fake_nvml, lambda: HOST, now=clock.now)
        for _ in range(3):
            r = sample(source)
            assert r.up and not r.errors
            for gpu in r.gpus:
                assert sum(p.used_bytes for p in gpu.processes) <= gpu.used_bytes
            g0 = r.gpus[0]
            [proc] = g0.processes
            assert proc.used_bytes == g0.used_bytes > 30 * GiB  # the leaker alone, and growing
    finally:
        fake_nvml.configure(None, None)
