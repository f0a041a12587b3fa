"""The fault matrix, at the daemon level: the simulator's NVML faults, hostile vLLM endpoints on
loopback, log files that move under the tailer, processes that vanish mid-read and PIDs reused.

Each case checks the same four things: the daemon keeps sampling what still works, the fault
shows in the exporter's own series (errors_total / source_up / gpu_up), no other data is lost,
and it recovers without a restart.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from exporter.analysis.engine import Analyzer
from exporter.clock import FixedClock
from exporter.daemon import Daemon, Sampler
from exporter.serve.exposition import build_registry
from exporter.sim import fake_nvml
from exporter.sim.host import SimulatedHost
from exporter.sim.scenario import loads
from exporter.sources.host import HostSource, LocalHost, enrich
from exporter.sources.logs import LogSource
from exporter.sources.nvml import NvmlSource
from exporter.sources.vllm import VllmEndpoint, VllmSource
from helpers.e2e_stack import wait_until
from helpers.tools import HANG

GiB = 1 << 30
INTERVAL = 5.0
FIXTURES = Path(__file__).parent / "fixtures"
VLLM_PAGE = (FIXTURES / "vllm" / "current_v1_engines.prom").read_bytes()
BASE = """
name: faults
duration: 2h
gpus:
  - {name: NVIDIA H100 80GB HBM3, memory: 80GiB, reserved: 512MiB, count: 2}
host: {memory: 512GiB, available: 400GiB}
processes:
  - {pid: 100, name: vllm, gpu: 0, memory: 30GiB, rss: 2GiB}
  - {pid: 200, name: python3, gpu: 1, memory: 10GiB, rss: 1GiB}
  - {pid: 300, name: python3, gpu: 1, memory: 5GiB, rss: 1GiB}
"""


# ---------------------------------------------------------------------------------------------
# A daemon over the simulator


class Rig:
    """Daemon + exposition over a scenario, on a FixedClock that ticks 5 s at a time."""

    def __init__(self, extra: str = "", base: str = BASE, vllm=None, logs=None, host_class=SimulatedHost):
        self.scenario = loads(textwrap.dedent(base) + textwrap.dedent(extra))
        self.clock = FixedClock(1_700_000_000.0)
        fake_nvml.configure(self.scenario, self.clock)
        self.host = host_class(self.scenario, self.clock)
        self.nvml = NvmlSource(fake_nvml, self.host.memory, now=self.clock.now,
                               retry_initial_seconds=5, retry_max_seconds=20)
        sources = [self.nvml, HostSource(self.host)]
        if vllm is not None:
            sources.append(vllm)
        if logs is not None:
            sources.append(logs)
        self.sampler = Sampler(sources, now=self.clock.now)
        self.analyzer = Analyzer(log_findings=False)
        self.daemon = Daemon(self.sampler, self.clock, INTERVAL, analyzer=self.analyzer)
        self.registry = build_registry(lambda: self.daemon.state, self.clock.now)

    def tick(self):
        self.clock.advance(INTERVAL)
        return self.daemon.tick()

    def metrics(self) -> dict:
        text = generate_latest(self.registry).decode()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

    def truth(self):
        return self.scenario.state_for(self.clock)

    def complete(self, state, gpu: int) -> bool:
        """The snapshot holds GPU `gpu` exactly as the simulated host has it."""
        truth = self.truth()
        want = truth.gpus[gpu]
        got = next((g for g in state.snapshot.gpus if g.index == str(gpu)), None)
        if got is None or not got.up or got.used_bytes != want.used_bytes or got.total_bytes != want.total_bytes:
            return False
        procs = {p.pid: b for p in truth.processes for k, b in p.gpu_bytes.items() if k == str(gpu)}
        return {p.pid: p.used_bytes for p in got.processes} == procs

    def host_intact(self, state) -> bool:
        h = self.truth().host
        snap = state.snapshot
        return (snap.source_up("host") is True and snap.host is not None
                and (snap.host.total_bytes, snap.host.available_bytes) == (h.total_bytes, h.available_bytes))


def nvml_errors(metrics: dict) -> float:
    return sum(v for (name, labels), v in metrics.items()
               if name == "gpumem_exporter_errors_total" and ("source", "nvml") in labels)


def visible(metrics: dict, before: float, gpu: int) -> bool:
    """The fault shows in the exporter's own series: source down, GPU down, or errors counted."""
    source_down = metrics.get(("gpumem_exporter_source_up", (("source", "nvml"),))) == 0
    gpu_down = any(v == 0 for (name, labels), v in metrics.items()
                   if name == "gpumem_gpu_up" and ("gpu", str(gpu)) in labels)
    return source_down or gpu_down or nvml_errors(metrics) > before


@pytest.fixture(autouse=True)
def _unbind_fake_nvml():
    yield
    fake_nvml.configure(None, None)


# ---------------------------------------------------------------------------------------------
# NVML: every call the source makes, failing with every relevant error, then recovering

ERRORS = ["Uninitialized", "NotSupported", "NoPermission", "Timeout", "GpuIsLost", "ResetRequired",
          "LibRmVersionMismatch", "Unknown"]
DEVICE_CALLS = ["nvmlDeviceGetMemoryInfo", "nvmlDeviceGetComputeRunningProcesses_v3",
                "nvmlDeviceGetGraphicsRunningProcesses_v3", "nvmlDeviceGetUUID", "nvmlDeviceGetName",
                "nvmlDeviceGetMigMode", "nvmlDeviceGetAddressingMode"]
GLOBAL_CALLS = ["nvmlDeviceGetCount", "nvmlDeviceGetHandleByIndex", "nvmlSystemGetDriverVersion"]
FAULT_END = 40.0


@pytest.mark.parametrize("error", ERRORS)
@pytest.mark.parametrize("call", DEVICE_CALLS + GLOBAL_CALLS)
def test_nvml_call_failing_then_recovering(call, error):
    scoped = call in DEVICE_CALLS
    gpu = ", gpu: 1" if scoped else ""
    rig = Rig(f"faults:\n  - {{call: {call}, error: {error}, at: 0, until: {FAULT_END:g}{gpu}}}\n")
    errors_before = 0.0
    while rig.clock.elapsed() + INTERVAL < FAULT_END:
        state = rig.tick()
        metrics = rig.metrics()
        assert state.samples_total == rig.clock.elapsed() / INTERVAL  # never stops sampling
        assert rig.host_intact(state)  # host memory is never collateral damage
        if scoped:
            assert rig.complete(state, 0), "GPU 0 has no fault and must lose nothing"
        for g in ((1,) if scoped else (0, 1)):
            if rig.complete(state, g):
                continue
            got = next((s for s in state.snapshot.gpus if s.index == str(g)), None)
            if error == "NotSupported" and got is not None and got.up:
                # Documented: an unsupported field is left out (memory info: the device is taken
                # for a unified-memory one and says so in gpumem_gpu_info{unified="1"}).
                assert got.unified or not got.processes
                continue
            assert visible(metrics, errors_before, g), f"GPU {g} lost data silently at {rig.clock.elapsed()}"
        errors_before = nvml_errors(metrics)

    # Recovery without restart: within the back-off cap (20 s here) everything is back, for good.
    for _ in range(6):
        state = rig.tick()
    for _ in range(4):
        state = rig.tick()
        metrics = rig.metrics()
        assert rig.complete(state, 0) and rig.complete(state, 1), rig.clock.elapsed()
        assert metrics[("gpumem_exporter_source_up", (("source", "nvml"),))] == 1
        assert all(v == 1 for (name, _), v in metrics.items() if name == "gpumem_gpu_up")
        assert nvml_errors(metrics) == errors_before  # no more errors once recovered
        errors_before = nvml_errors(metrics)
        assert not any(f.kind == "leak" for f in state.analysis.findings)


@pytest.mark.parametrize("fault, error", [
    ("library_not_found", "library_not_found"), ("driver_not_loaded", "driver_not_loaded"),
    ("version_mismatch", "lib_rm_version_mismatch"),
    ("lib_rm_version_mismatch", "lib_rm_version_mismatch"),  # the fault's old spelling, still read
])
def test_nvml_unavailable_at_start_then_appearing(fault, error):
    """No driver yet (or a driver upgraded under a running library: LibRmVersionMismatch)."""
    rig = Rig(f"faults:\n  - {{kind: init_failure, error: {fault}, at: 0, until: 60}}\n")
    for _ in range(11):
        state = rig.tick()
        assert state.snapshot.gpus == () and rig.host_intact(state)
    metrics = rig.metrics()
    assert metrics[("gpumem_exporter_source_up", (("source", "nvml"),))] == 0
    assert metrics[("gpumem_exporter_errors_total", (("kind", error), ("source", "nvml")))] >= 2
    assert not any(name == "gpumem_gpu_memory_used_bytes" for name, _ in metrics)  # absent, not 0
    for _ in range(6):
        state = rig.tick()
    assert rig.complete(state, 0) and rig.complete(state, 1)
    assert rig.metrics()[("gpumem_exporter_source_up", (("source", "nvml"),))] == 1


def test_no_driver_module_at_all_then_installed():
    rig = Rig()
    fake_nvml.configure(None, None)  # the library cannot even be loaded
    for _ in range(3):
        state = rig.tick()
        assert state.snapshot.gpus == () and rig.host_intact(state)
    assert rig.metrics()[("gpumem_exporter_errors_total", (("kind", "library_not_found"), ("source", "nvml")))] >= 1
    fake_nvml.configure(rig.scenario, rig.clock)
    for _ in range(6):
        state = rig.tick()
    assert rig.complete(state, 0) and rig.complete(state, 1)


@pytest.mark.parametrize("kind, token", [("gpu_lost", "gpu_is_lost"), ("reset_required", "reset_required")])
def test_gpu_disappearing_and_coming_back(kind, token):
    rig = Rig(f"faults:\n  - {{kind: {kind}, gpu: 1, at: 30, until: 90}}\n")
    lost_seen = False
    for _ in range(30):
        state = rig.tick()
        t = rig.clock.elapsed()
        metrics = rig.metrics()
        assert rig.complete(state, 0)
        labels = (("gpu", "1"), ("uuid", rig.truth().gpus[1].uuid))
        if 30 <= t < 90:
            lost_seen = True
            assert metrics[("gpumem_gpu_up", labels)] == 0
            assert ("gpumem_gpu_memory_used_bytes", labels) not in metrics  # no made-up zero
            assert metrics[("gpumem_exporter_errors_total", (("kind", token), ("source", "nvml")))] >= 1
            g1 = state.snapshot.gpus[1]
            assert (g1.up, g1.error, g1.uuid) == (False, token, rig.truth().gpus[1].uuid)
        elif t >= 95:
            assert rig.complete(state, 1) and metrics[("gpumem_gpu_up", labels)] == 1
    assert lost_seen


# ---------------------------------------------------------------------------------------------
# vLLM endpoints that refuse, hang, drip, answer garbage or gigabytes


class Hostile(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_GET(self):
        mode, release = self.server.mode, self.server.release
        try:
            if mode == "ok":
                self._head(len(VLLM_PAGE))
                self.wfile.write(VLLM_PAGE)
            elif mode == "hang":
                release.wait(60)  # until the test heals it: far beyond any deadline here
            elif mode == "late":  # answers, but only after `delay` seconds
                release.wait(self.server.delay)
                self._head(len(VLLM_PAGE))
                self.wfile.write(VLLM_PAGE)
            elif mode == "drip":
                self._head(len(VLLM_PAGE))
                for b in VLLM_PAGE:
                    if release.wait(0.05):
                        return
                    self.wfile.write(bytes([b]))
                    self.wfile.flush()
            elif mode == "garbage":
                body = bytes(range(256)) * 8
                self._head(len(body))
                self.wfile.write(body)
            elif mode == "gigabytes":
                self._head(4 << 30)  # says 4 GiB and streams until the client gives up
                chunk = b"vllm:num_requests_running 1\n" * 4096
                while not release.is_set():
                    self.wfile.write(chunk)
        except OSError:
            pass  # the scraper hung up: that is the point

    def _head(self, length: int) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(length))
        self.end_headers()


@pytest.fixture
def hostile():
    servers = []

    def start(mode: str):
        server = ThreadingHTTPServer(("127.0.0.1", 0), Hostile)
        server.daemon_threads = True
        server.mode, server.release = mode, threading.Event()
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        servers.append(server)
        return server

    yield start
    for s in servers:
        s.release.set()
        s.shutdown()
        s.server_close()


@pytest.mark.slow
def test_a_hung_server_holds_one_tick_then_is_read_without_holding_any_until_it_answers(hostile, source_waits):
    """A newcomer's trial: a frozen vLLM server held every tick (every source's sampling, and so
    /healthz) for its whole timeout, for as long as it was frozen. Now the tick that finds it hung
    waits its timeout; later ticks read it in the background and wait WAIT_MARGIN_SECONDS only, and
    an answer that comes after its tick stopped waiting is shown at the next tick."""
    timeout, margin = 4.0, VllmSource.WAIT_MARGIN_SECONDS
    server = hostile("hang")
    server.delay = timeout / 2  # "late": more than the margin, less than the timeout
    source = VllmSource([VllmEndpoint(url=f"http://127.0.0.1:{server.server_port}/metrics", name="frozen",
                                      timeout_seconds=timeout, by_name=False)])
    try:
        (first,) = source.sample()
        assert first.error_kind == "timeout" and source_waits == [timeout + margin]
        wait_until(lambda: source._inflight[0].done(), HANG, "the hung read cut at its deadline", interval=0.02)
        server.mode = "late"  # thawed, but slow: its next answer takes longer than the margin
        source_waits.clear()
        (second,) = source.sample()
        assert second.error_kind == "timeout" and "still no complete response" in second.error, second
        assert source_waits == [margin]  # not its timeout again
        wait_until(lambda: source._inflight[0].done(), HANG, "the late answer", interval=0.02)
        source_waits.clear()
        (third,) = source.sample()
        assert third.up and third.engines and source_waits == []  # the late answer, no new read
        server.mode = "ok"
        (fourth,) = source.sample()
        assert fourth.up and source_waits == [timeout + margin]  # answering: waited for in full again
    finally:
        source.close()


def closed_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The good endpoint's every answer must come within it on a loaded machine; the bad one costs it once.
TIMEOUT = 5.0


@pytest.mark.parametrize("mode, kinds", [
    ("refuse", {"refused"}), ("hang", {"timeout"}), ("drip", {"timeout"}),
    ("garbage", {"parse"}), ("gigabytes", {"too_large"}),
])
def test_hostile_vllm_endpoint_does_not_hurt_the_rest(hostile, mode, kinds, source_waits):
    good = hostile("ok")
    bad = hostile("ok" if mode == "refuse" else mode)
    bad_url = f"http://127.0.0.1:{closed_port() if mode == 'refuse' else bad.server_port}/metrics"
    endpoints = [VllmEndpoint(url=f"http://127.0.0.1:{good.server_port}/metrics", name="good",
                              timeout_seconds=TIMEOUT),
                 VllmEndpoint(url=bad_url, name="bad", timeout_seconds=TIMEOUT, max_response_bytes=1 << 20)]
    vllm = VllmSource(endpoints)
    try:
        rig = Rig(vllm=vllm)
        for _ in range(3):
            source_waits.clear()
            state = rig.tick()
            took = sum(source_waits)  # how long the tick may be held: what it waits for, not the wall clock
            # One stuck endpoint costs at most its own timeout, never a pile-up across ticks.
            assert took < TIMEOUT + VllmSource.WAIT_MARGIN_SECONDS + 0.5, took
            assert rig.complete(state, 0) and rig.complete(state, 1) and rig.host_intact(state)
            good_sample, bad_sample = state.snapshot.vllm
            assert good_sample.up and good_sample.engines
            assert not bad_sample.up and bad_sample.error_kind in kinds, bad_sample
        metrics = rig.metrics()
        assert metrics[("gpumem_vllm_up", (("endpoint", "good"),))] == 1
        assert metrics[("gpumem_vllm_up", (("endpoint", "bad"),))] == 0
        assert sum(v for (name, labels), v in metrics.items()
                   if name == "gpumem_vllm_scrape_errors_total" and ("endpoint", "bad") in labels) == 3
        assert metrics[("gpumem_exporter_source_up", (("source", "nvml"),))] == 1
        if mode != "refuse":  # the endpoint heals: scraped again on the next tick, no restart
            bad.mode = "ok"
            bad.release.set()
            # let a stuck scrape see the release and finish (a condition, bounded generously)
            deadline = time.monotonic() + 60
            while not all(f.done() for f in vllm._inflight.values()) and time.monotonic() < deadline:
                time.sleep(0.01)
            for _ in range(3):
                state = rig.tick()
            assert state.snapshot.vllm[1].up
            assert rig.metrics()[("gpumem_vllm_up", (("endpoint", "bad"),))] == 1
    finally:
        vllm.close()


# ---------------------------------------------------------------------------------------------
# Log files rotated, truncated, deleted, unreadable


_OOMS = iter(range(1, 1000))


def oom() -> str:
    """A distinct OOM message each time (identical ones close together are one event, by design)."""
    return (f"RuntimeError: CUDA out of memory. Tried to allocate {next(_OOMS)}.00 GiB (GPU 0; 79.10 GiB "
            "total capacity; 70.90 GiB already allocated; 1.20 GiB free; 75.05 GiB reserved in total by PyTorch)\n")


def _append(path: Path, text: str) -> None:
    with open(path, "a") as fh:
        fh.write(text)


def _ooms(rig) -> float:
    return sum(v for (name, _), v in rig.metrics().items() if name == "gpumem_oom_events_total")


def test_log_rotated_truncated_deleted_unreadable(tmp_path):
    log = tmp_path / "vllm.log"
    log.write_text("INFO started\n")
    rig = Rig(logs=LogSource([str(log)]))

    def tick_and_check():
        state = rig.tick()
        assert rig.complete(state, 0) and rig.complete(state, 1) and rig.host_intact(state)
        return state

    tick_and_check()
    _append(log, oom() + "INFO next\n")
    tick_and_check()
    assert _ooms(rig) == 1
    # rotated: the rest of the old file, then the new one
    _append(log, oom())
    log.rename(tmp_path / "vllm.log.1")
    log.write_text("INFO new file\n" + oom() + "INFO after\n")
    tick_and_check()
    tick_and_check()
    assert _ooms(rig) == 3
    # truncated in place (copytruncate): read again from the start
    log.write_text("")
    tick_and_check()
    _append(log, oom() + "INFO after\n")
    tick_and_check()
    assert _ooms(rig) == 4
    # deleted: quiet, then picked up again when it comes back
    log.unlink()
    state = tick_and_check()
    assert _ooms(rig) == 4
    log.write_text(oom() + "INFO back\n")
    tick_and_check()
    assert _ooms(rig) == 5
    # unreadable (a directory where the file was: root can read any mode bits)
    log.unlink()
    log.mkdir()
    state = tick_and_check()
    assert state.snapshot.source_up("logs") is False
    metrics = rig.metrics()
    assert metrics[("gpumem_exporter_source_up", (("source", "logs"),))] == 0
    assert sum(v for (name, labels), v in metrics.items()
               if name == "gpumem_exporter_errors_total" and ("source", "logs") in labels) >= 1
    log.rmdir()
    log.write_text(oom() + "INFO healed\n")
    state = tick_and_check()
    tick_and_check()
    assert _ooms(rig) == 6
    assert rig.daemon.state.snapshot.source_up("logs") is True


# ---------------------------------------------------------------------------------------------
# /proc entries vanishing mid-read


@pytest.mark.integration
def test_local_host_process_that_exits_or_is_a_zombie():
    host = LocalHost()
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        info = host.process(child.pid, with_cmdline=True)
        assert info is not None and info.pid == child.pid and info.start_time
    finally:
        child.stdin.close()
    # Exited but not reaped: /proc/<pid> still exists, most of it no longer answers.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _state_of(child.pid) not in ("Z", ""):
        time.sleep(0.01)
    zombie = host.process(child.pid, with_cmdline=True)
    assert zombie is None or zombie.pid == child.pid
    child.wait()
    assert host.process(child.pid) is None
    # ... and the process sampler keeps it, unnamed, rather than dropping its GPU memory.
    from exporter.model import GpuSample, ProcessSample
    gpus = (GpuSample("0", "GPU-x", processes=(ProcessSample(pid=child.pid, used_bytes=GiB),)),)
    (gpu,) = enrich(gpus, host)
    assert [(p.pid, p.used_bytes, p.name) for p in gpu.processes] == [(child.pid, GiB, "")]


def _state_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


@pytest.mark.integration
def test_local_host_races_with_processes_exiting():
    """Real races: look processes up while they exit; never an exception, never a wrong pid."""
    host = LocalHost()
    children = [subprocess.Popen(["true"]) for _ in range(40)]
    for child in children:
        info = host.process(child.pid, with_cmdline=True)
        assert info is None or info.pid == child.pid
    for child in children:
        child.wait()


class StopsMidTick(SimulatedHost):
    """A simulated host on which time moves between the NVML process list and the /proc look-up
    (Sampler reads host memory in between): the process stopping at 10 s is listed, then gone."""

    def memory(self):
        if self.clock.elapsed() == 10 - 1:
            self.clock.advance(1)
        return super().memory()


def test_simulated_process_stopping_between_nvml_list_and_lookup():
    extra = "  - {pid: 400, name: worker, gpu: 0, memory: 3GiB, rss: 1GiB, stop: 10}\n"
    rig = Rig(base=BASE + extra, host_class=StopsMidTick)
    rig.clock.advance(-1)  # ticks land on 4, 9 (the racy one), 14
    rig.tick()
    state = rig.tick()
    assert rig.clock.elapsed() == 10
    p400 = next(p for p in state.snapshot.gpus[0].processes if p.pid == 400)
    assert p400.used_bytes == 3 * GiB and p400.name == "" and p400.start_time is None
    assert rig.host_intact(state) and rig.complete(state, 1)
    state = rig.tick()
    assert rig.complete(state, 0) and 400 not in {p.pid for p in state.snapshot.gpus[0].processes}


# ---------------------------------------------------------------------------------------------
# PID reuse


def test_pid_reuse_does_not_inherit_history_or_leak_verdict():
    leaky = ("  - {pid: 500, name: python3, gpu: 0, stop: 7200, rss: 1GiB,\n"
             "     memory: [{constant: 4GiB}, {linear: {from: 0, rate: 8MiB/min}}]}\n"
             "  - {pid: 500, name: python3, gpu: 0, start: 7205, rss: 1GiB, memory: 4GiB}\n")
    rig = Rig(base=BASE.replace("duration: 2h", "duration: 4h") + leaky)
    while rig.clock.elapsed() < 7200 - INTERVAL:
        state = rig.tick()
    trend = next(t for t in state.analysis.process_trends if t.pid == 500)
    assert trend.leak_suspected, "the first process leaks 8 MiB/min for 2 h and must be flagged"
    assert any(f.kind == "leak" and f.pid == 500 for f in state.analysis.findings)
    old_start = next(p for p in state.snapshot.gpus[0].processes if p.pid == 500).start_time
    for _ in range(4):
        state = rig.tick()
    new = next(p for p in state.snapshot.gpus[0].processes if p.pid == 500)
    assert new.start_time != old_start and new.used_bytes == 4 * GiB
    trend = next(t for t in state.analysis.process_trends if t.pid == 500)
    assert not trend.leak_suspected
    assert trend.growth_bytes_per_second is None  # a new process: too few samples of its own
    assert not any(f.kind == "leak" and f.pid == 500 for f in state.analysis.findings)
    series = rig.analyzer.history.process_memory(rig.truth().gpus[0].uuid, new.identity, raw=True)
    assert len(series) <= 4  # only the new process's own samples
    metrics = rig.metrics()
    assert metrics[("gpumem_leak_suspected", (("gpu", "0"), ("pid", "500"), ("process", "python3"),
                                               ("role", "other")))] == 0
