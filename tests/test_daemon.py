"""The sampling loop over a simulated host: publishing, fault counting, isolation, timing."""
import threading

import pytest

from exporter.cli import make_analyzer
from exporter.clock import VirtualClock
from exporter.config import build as build_config
from exporter.daemon import MAX_COUNTER_SERIES, Daemon, _bounded_add
from exporter.runtime import build as build_runtime


@pytest.fixture
def runtime_at():
    made = []

    def build(scenario, at):
        rt = build_runtime(build_config(), simulate=scenario, at=at)
        made.append(rt)
        return rt
    yield build
    for rt in made:
        rt.close()


def test_tick_publishes_a_new_state_and_counts_faults(runtime_at):
    rt = runtime_at("gpu-lost", 700)  # GPU 1 is lost from 600 s to 1200 s
    daemon = Daemon(rt.sampler, rt.clock, 5.0, analyzer=make_analyzer(build_config()))
    first = daemon.tick()
    rt.clock.advance(5)
    second = daemon.tick()
    assert second is not first and second.samples_total == 2
    assert second.errors_total[("nvml", "gpu_is_lost")] == 2
    assert [g.up for g in second.snapshot.gpus] == [True, False]
    assert second.last_sample_at == rt.clock.now()
    assert second.analysis is not None and second.analysis.budgets


class BrokenAnalyzer:
    detector_errors: dict[str, int] = {}  # noqa: RUF012 (read-only stand-in for the analyzer's counter)

    def update(self, snapshot):
        raise RuntimeError("bug in a detector")


def test_a_failing_analysis_never_stops_sampling(runtime_at):
    rt = runtime_at("steady", 600)
    daemon = Daemon(rt.sampler, rt.clock, 5.0, analyzer=BrokenAnalyzer())
    state = daemon.tick()
    assert state.snapshot is not None and state.analysis is None
    assert state.errors_total[("analysis", "exception")] == 1


def test_error_counters_are_bounded():
    from collections import Counter
    counter = Counter()
    for i in range(MAX_COUNTER_SERIES + 50):
        _bounded_add(counter, ("src", f"kind{i}"))
    assert len(counter) == MAX_COUNTER_SERIES + 1 and counter[("overflow", "overflow")] == 50


class GatedClock:
    """The simulation's own (fixed) clock, advanced by the run loop's waits: each wait is one
    interval of clock time, taken at once, until `ticks` waits have passed; the next wait holds
    until stop() (so how fast the machine runs decides nothing, and a loop that ignored stop
    would hang there instead of ending)."""

    def __init__(self, clock, ticks):
        self.clock, self.ticks, self.waits = clock, ticks, 0
        self.speed = clock.speed
        self.gate = threading.Event()

    def now(self):
        return self.clock.now()

    def wait(self, seconds, stop):
        if self.waits >= self.ticks:
            self.gate.set()
            return stop.wait()
        self.waits += 1
        self.clock.advance(seconds)
        return stop.is_set()


def test_run_loop_keeps_time_on_the_clock_and_stops_promptly():
    config = build_config()
    accelerated = build_runtime(config, simulate="steady", speed=200.0)
    accelerated.close()
    rt = build_runtime(config, simulate="steady", at=0)
    clock = GatedClock(rt.clock, ticks=20)  # 100 simulated seconds: 20 ticks of 5 s
    daemon = Daemon(rt.sampler, clock, 5.0, analyzer=make_analyzer(config))
    try:
        daemon.start()
        assert clock.gate.wait(60), "the run loop never reached its 20th tick"  # bounds a hang only
        daemon.stop(timeout=60)
        # Stopped while waiting out an interval, not after it: the gate's wait never ends alone.
        assert not daemon._thread.is_alive()
    finally:
        rt.close()
    assert 8 <= daemon.state.samples_total <= 25
    assert daemon.state.samples_total == clock.waits + 1 == 21
    assert daemon.state.last_sample_at == rt.clock.now()  # every interval on the clock, none skipped
    assert isinstance(accelerated.clock, VirtualClock)


def test_a_serving_process_keeps_its_role_while_its_server_shuts_down():
    from exporter.model import GpuSample, ProcessSample
    from exporter.sources.vllm_procs import StickyRoles

    roles = StickyRoles()

    def gpus(role, endpoint="", start=100.0):
        return (GpuSample(index="0", uuid="GPU-a", processes=(
            ProcessSample(pid=7, used_bytes=1, role=role, endpoint=endpoint, start_time=start),)),)

    assert roles.apply(gpus("vllm", "sim-0"))[0].processes[0].role == "vllm"
    # The listener is gone, the worker still holds its memory: still the server's.
    kept = roles.apply(gpus("other"))[0].processes[0]
    assert (kept.role, kept.endpoint) == ("vllm", "sim-0")
    # The same PID reused by another process is not.
    assert roles.apply(gpus("other", start=200.0))[0].processes[0].role == "other"
    assert roles.apply(gpus("other"))[0].processes[0].role == "other"  # forgotten once gone


def test_impossible_vllm_values_are_counted_as_out_of_range():
    """The vLLM source drops impossible values (a negative KV usage, say); the daemon counts them."""
    from exporter.daemon import Sampler
    from exporter.model import VllmSample
    from exporter.sources.source import Reading

    class Server:
        name, needs, gives = "vllm", (), ("vllm",)

        def collect(self, snapshot):
            sample = VllmSample(endpoint="llama", up=True, rejected_metrics=("vllm:kv_cache_usage_perc",))
            return Reading(snapshot.__class__(timestamp=snapshot.timestamp, vllm=(sample,)))

        def close(self):
            pass

    clock = VirtualClock(1_000_000.0)
    daemon = Daemon(Sampler([Server()], now=clock.now), clock, 5.0)
    daemon.tick()
    assert daemon.tick().vllm_errors_total == {("llama", "out_of_range"): 2}


def test_a_sampler_superseded_before_any_tick_is_closed():
    """Two reloads within one interval: the first new sampler never runs, and is closed."""
    from exporter.daemon import Sampler

    class Closing:
        name, needs, gives = "nvml", (), ("gpus",)
        closed = 0

        def collect(self, snapshot):
            from exporter.sources.source import Reading
            return Reading(snapshot)

        def close(self):
            self.closed += 1

    clock = VirtualClock(1_000_000.0)
    first, second, third = Closing(), Closing(), Closing()
    daemon = Daemon(Sampler([first], now=clock.now), clock, 5.0)
    daemon.replace_sampler(Sampler([second], now=clock.now))
    daemon.replace_sampler(Sampler([third], now=clock.now))
    assert (first.closed, second.closed, third.closed) == (0, 1, 0)
    daemon.tick()
    assert (first.closed, second.closed, third.closed) == (1, 1, 0)
    assert daemon.sampler.sources == (third,)


def test_a_tick_running_when_stop_is_requested_announces_no_recovery_and_none_follows(tmp_path, caplog):
    """SIGTERM during the tick in which a lost GPU answers again: the daemon logs "stopping" as
    the signal arrives, so a recovery that tick then logged read as if sampling went on. The
    tick ends quietly and no tick follows; the same tick without a stop logs the recovery."""
    from exporter.clock import FixedClock
    from exporter.daemon import Sampler
    from exporter.model import HostMemory
    from exporter.sim import fake_nvml
    from exporter.sim.scenario import load
    from exporter.sources.nvml import NvmlSource
    from exporter.sources.source import Reading

    scenario = tmp_path / "lost.yaml"
    scenario.write_text("name: t\ndescription: one GPU lost for 20 s\nduration: 1h\n"
                        "gpus:\n  - {name: NVIDIA H100 80GB HBM3, memory: 80GiB, count: 2}\n"
                        "host: {memory: 512GiB, available: 400GiB}\n"
                        "processes:\n  - {pid: 100, name: vllm, gpu: 1, memory: 30GiB, rss: 2GiB}\n"
                        "faults:\n  - {kind: gpu_lost, gpu: 1, at: 10, until: 30}\n")

    class Signal:
        """Runs first in each tick; at `at` (scenario seconds) the stop arrives, as SIGTERM's."""
        name, needs, gives = "signal", (), ()

        def __init__(self, at):
            self.at, self.daemon = at, None

        def collect(self, snapshot):
            if clock.elapsed() == self.at and self.daemon is not None:
                self.daemon.request_stop()
            elif clock.elapsed() > self.at + 60 and self.daemon is not None:
                self.daemon._stop.set()  # the loop never outlives a stop that failed to end it
            return Reading(snapshot)

        def close(self):
            pass

    def play(stop_at):
        signal = Signal(stop_at)
        source = NvmlSource(fake_nvml, lambda: HostMemory(total_bytes=1 << 40, available_bytes=1 << 39),
                            now=clock.now, retry_initial_seconds=5, retry_max_seconds=40)
        daemon = signal.daemon = Daemon(Sampler([signal, source], now=clock.now), clock, 10.0)
        caplog.clear()
        with caplog.at_level("INFO", logger="exporter"):
            daemon.run()  # on this thread: FixedClock.wait advances the clock, never sleeps
        source.close()
        return daemon.state.samples_total, [r.getMessage() for r in caplog.records]

    try:
        clock = FixedClock(1_700_000_000.0)
        fake_nvml.configure(load(str(scenario)), clock)
        ticks, lines = play(stop_at=30)  # GPU 1 answers again at 30 s: the tick the stop arrives in
        assert ticks == 4  # 0, 10, 20, 30 s: none after the stop
        assert any("GPU 1" in line and "does not answer" in line for line in lines)
        assert not any("answers again" in line for line in lines), lines
        clock = FixedClock(1_700_000_000.0)
        fake_nvml.configure(load(str(scenario)), clock)
        ticks, lines = play(stop_at=40)  # the stop a tick later: the recovery is logged, once
        assert ticks == 5 and sum("GPU 1 answers again" in line for line in lines) == 1
    finally:
        fake_nvml.configure(None, None)
