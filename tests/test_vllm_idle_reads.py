"""An idle vLLM server's page is read less often (#18 item 5, sources/vllm_idle.py): a real HTTP
server on loopback serves a real vLLM 0.32 page at rest and counts the reads; a host double
says how much CPU the server's processes have used. Ticks are played (5 s each), never waited."""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from exporter.model import GpuSample, HostMemory, ProcessSample, Snapshot, VllmSample
from exporter.sources.hostview import ProcessInfo
from exporter.sources.vllm import VllmEndpoint, VllmSource
from helpers.flood import PageServer
from helpers.timeline import T0, GiB

AT_REST = (Path(__file__).parent / "fixtures" / "vllm" / "v0_32_cpu_idle.prom").read_bytes()
RUNNING = b'vllm:num_requests_running{engine="0",model_name="tiny-llama"} '
# The same page with three requests running (a real server's ramp showed 7 to 160).
WORKING = AT_REST.replace(RUNNING + b"0.0", RUNNING + b"3.0")
assert WORKING != AT_REST
API, ENGINE, WORKER = 100, 101, 102
TICK = 5.0
RESTING_CPU = 0.08  # seconds a 5 s tick at rest: a real vLLM 0.32 CPU server's, 60-80 ms
REQUEST_CPU = 1.2  # seconds: one 16-token request on that server


@pytest.fixture
def page() -> Iterator[tuple[PageServer, int]]:
    """The page the server answers with, and how many times it was read."""
    served = PageServer(AT_REST)
    try:
        yield served, served.server.server_port
    finally:
        served.close()


class Host:
    """The server's processes: the API server listening on the port, its engine and worker. Their
    CPU time is what the test says (None: unreadable)."""

    def __init__(self, port: int):
        self.port = port
        self.listener = API
        self.cpu: float | None = 0.0
        self.gone: set[int] = set()
        self.asked: list[tuple[int, ...]] = []

    def process(self, pid: int, with_cmdline: bool = False) -> ProcessInfo | None:
        return ProcessInfo(pid=pid, name="VLLM::Worker" if pid == WORKER else "python", rss_bytes=GiB,
                           start_time=T0 - 600, ppid={API: 1, ENGINE: API, WORKER: ENGINE}.get(pid, 1))

    def parent(self, pid: int) -> int | None:
        info = self.process(pid)
        return info.ppid if info else None

    def children(self, pid: int) -> tuple[int, ...]:
        return (ENGINE, WORKER) if pid == API else ()

    def pid_listening_on(self, port: int) -> int | None:
        return self.listener if port == self.port else None

    def cpu_seconds(self, pids: Sequence[int]) -> float | None:
        self.asked.append(tuple(pids))
        return None if self.gone.intersection(pids) else self.cpu

    def memory(self) -> HostMemory:
        return HostMemory(total_bytes=24 * GiB, available_bytes=12 * GiB)

    def top_processes(self, limit: int) -> tuple[ProcessInfo, ...]:
        return ()


class Run:
    def __init__(self, port: int, **endpoint: object):
        self.host = Host(port)
        self.source = VllmSource([VllmEndpoint(f"http://127.0.0.1:{port}/metrics", name="tiny", **endpoint)],
                                 host=self.host)
        self.t = T0

    def tick(self, cpu_used: float = RESTING_CPU, gpus: tuple[GpuSample, ...] = ()) -> VllmSample:
        """One tick, the server's processes having used `cpu_used` seconds since the last."""
        self.t += TICK
        if self.host.cpu is not None:
            self.host.cpu += cpu_used
        self.snapshot = self.source.collect(Snapshot(timestamp=self.t, gpus=gpus)).snapshot
        (sample,) = self.snapshot.vllm
        return sample

    def close(self) -> None:
        self.source.close()


@pytest.fixture
def run(page: tuple[PageServer, int]) -> Iterator[Run]:
    r = Run(page[1])
    yield r
    r.close()


def test_an_idle_server_is_read_every_30_seconds_and_its_page_shown_meanwhile(page, run):
    served, _ = page
    ages, reads = [], []
    for _ in range(15):
        sample = run.tick()
        ages.append(sample.page_age_seconds)
        reads.append(served.reads)
        assert sample.up and sample.pids == (API,)
        assert sample.engines[0].requests_running == 0 and sample.engines[0].kv_cache_usage_ratio is not None
    # Three ticks read while the resting rate is learnt, then one in six.
    assert ages == [0, 0, 0, 5, 10, 15, 20, 25, 0, 5, 10, 15, 20, 25, 0]
    assert reads == [1, 2, 3, 3, 3, 3, 3, 3, 4, 4, 4, 4, 4, 4, 5]
    # The processes whose CPU is read are the server's own: its API server and, from the host's
    # look-up of a CPU server, its engine and worker.
    assert set(run.host.asked[-1]) == {API, ENGINE, WORKER}


def test_a_request_s_cpu_makes_the_next_tick_read_the_page(page, run):
    served, _ = page
    for _ in range(4):
        run.tick()
    assert run.tick().page_age_seconds == 10
    served.body = WORKING  # a request arrives: the server's processes work
    sample = run.tick(cpu_used=RESTING_CPU + REQUEST_CPU)
    assert sample.page_age_seconds == 0 and sample.engines[0].requests_running == 3
    # While requests run, every tick reads, whatever the CPU says.
    before = served.reads
    for _ in range(3):
        assert run.tick().page_age_seconds == 0
    assert served.reads == before + 3
    served.body = AT_REST
    run.tick()
    assert run.tick().page_age_seconds == 5  # at rest again: read less often at once


def test_cpu_just_above_rest_does_not_read_and_a_tenth_of_a_second_more_does(page, run):
    for _ in range(4):
        run.tick()
    assert run.tick(cpu_used=RESTING_CPU + 0.05).page_age_seconds == 10  # under 2 % of a core more
    assert run.tick(cpu_used=RESTING_CPU + 0.15).page_age_seconds == 0


def test_a_failed_read_is_not_shown_again_and_the_next_tick_reads(page, run):
    served, _ = page
    for _ in range(4):
        run.tick()
    served.status = 500
    before = served.reads
    sample = run.tick(cpu_used=RESTING_CPU + REQUEST_CPU)
    assert not sample.up and sample.error_kind == "http_status" and served.reads > before
    before = served.reads
    assert not run.tick().up and served.reads > before  # at rest, read again (by name, then whole)
    served.status = 200
    sample = run.tick()
    assert sample.up and sample.page_age_seconds == 0


def test_a_restarted_server_is_read_at_once(page, run):
    for _ in range(4):
        run.tick()
    run.host.gone.add(API)  # the server exited, and another process listens on the port now
    run.host.listener = 200
    sample = run.tick()
    assert sample.page_age_seconds == 0 and sample.pids == (200,)


def test_a_host_that_cannot_tell_the_cpu_reads_every_tick(page, run):
    served, _ = page
    run.host.cpu = None
    for _ in range(6):
        assert run.tick().page_age_seconds == 0
    assert served.reads == 6


def test_idle_read_seconds_0_reads_every_tick(page):
    served, port = page
    r = Run(port, idle_read_seconds=0)
    try:
        assert [r.tick().page_age_seconds for _ in range(6)] == [0] * 6
    finally:
        r.close()
    assert served.reads == 6


def test_a_gpu_server_s_cpu_is_read_from_the_gpu_processes_it_owns(page, run):
    on_gpu = (GpuSample(index="0", uuid="GPU-0", total_bytes=80 * GiB, used_bytes=40 * GiB, processes=(
        ProcessSample(pid=WORKER, used_bytes=30 * GiB, ppid=ENGINE),)),)
    for _ in range(4):
        sample = run.tick(gpus=on_gpu)
    assert sample.page_age_seconds == 5
    assert sample.processes == ()  # a GPU server's processes are NVML's list
    assert set(run.host.asked[-1]) == {API, WORKER}


def test_the_page_s_age_is_exported_and_shown(page, run):
    from prometheus_client import generate_latest
    from prometheus_client.registry import CollectorRegistry

    from exporter.model import State
    from exporter.serve.exposition import StateCollector

    for _ in range(5):
        run.tick()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StateCollector(lambda: State(snapshot=run.snapshot), lambda: run.t))
    assert 'gpumem_vllm_page_age_seconds{endpoint="tiny"} 10.0' in generate_latest(registry).decode()
    # The status page says so too: the figures beside it are that old.
    from exporter.serve.status import render
    assert "up</span> (idle: page read 10 s ago)" in render(State(snapshot=run.snapshot), "host", 0.0, 15.0)
