"""vLLM's CPU backend as a target (#18 item 3): no GPU lists its processes, its model and KV cache
are host memory. The exporter finds the server's own processes (API server, engine core, worker)
from its listener, reads their host memory, judges it for leaks, and reads the CPU backend's
start-up lines (tests/fixtures/vllm/v0_32_cpu_main.log, a real server's)."""
from __future__ import annotations

import socket
from pathlib import Path

from exporter.analysis.engine import Analyzer
from exporter.model import GpuSample, HostMemory, ProcessSample, Snapshot, VllmSample
from exporter.serve.exposition import StateCollector
from exporter.sources.hostview import ProcessInfo
from exporter.sources.vllm import VllmEndpoint, VllmSource
from exporter.sources.vllm_log import read_profile
from exporter.sources.vllm_procs import ServerProcesses
from exporter.units import bytes_in_message
from helpers.timeline import T0, GiB, MiB

FIXTURES = Path(__file__).parent / "fixtures" / "vllm"
EP = "tiny-llama"
API, ENGINE, WORKER, TRACKER = 100, 101, 102, 103
NAMES = {API: "python", ENGINE: "VLLM::EngineCor", WORKER: "VLLM::Worker", TRACKER: "python"}
PARENTS = {API: 1, ENGINE: API, WORKER: ENGINE, TRACKER: API}


class Host:
    """A real CPU server's process tree (names as /proc/<pid>/comm shows them), its RSS."""

    def __init__(self, port: int | None = None):
        self.port = port
        self.alive = set(NAMES)
        self.rss = {API: 620 * MiB, ENGINE: 600 * MiB, WORKER: 680 * MiB, TRACKER: 15 * MiB}
        self.children_calls = 0

    def process(self, pid, with_cmdline=False):
        if pid not in self.alive:
            return None
        return ProcessInfo(pid=pid, name=NAMES[pid], rss_bytes=self.rss[pid], start_time=T0 - 600,
                           ppid=PARENTS[pid])

    def parent(self, pid):
        info = self.process(pid)
        return info.ppid if info else None

    def children(self, pid):
        self.children_calls += 1
        found, todo = [], [pid]
        while todo:
            parent = todo.pop()
            kids = [p for p in sorted(self.alive) if PARENTS[p] == parent]
            found += kids
            todo += kids
        return tuple(sorted(found))

    def pid_listening_on(self, port):
        return API if port == self.port else None

    def memory(self):
        return HostMemory(total_bytes=24 * GiB, available_bytes=12 * GiB)


def test_a_servers_processes_and_their_roles():
    host = Host()
    now = [0.0]
    processes = ServerProcesses(lambda: now[0])
    sample = VllmSample(endpoint=EP, up=True, pids=(API,))
    got = processes(sample, host)
    assert [(p.pid, p.name, p.role, p.endpoint, p.server_role, p.host_rss_bytes) for p in got] == [
        (API, "python", "vllm", EP, "api_server", 620 * MiB),
        (ENGINE, "VLLM::EngineCor", "vllm", EP, "engine_core", 600 * MiB),
        (WORKER, "VLLM::Worker", "vllm", EP, "worker", 680 * MiB),
        (TRACKER, "python", "vllm", EP, "", 15 * MiB),  # multiprocessing's resource tracker
    ]
    # The process table is walked again only after a while, or when a known process is gone.
    now[0] = 10.0
    processes(sample, host)
    assert host.children_calls == 1
    host.alive.discard(WORKER)
    assert [p.pid for p in processes(sample, host)] == [API, ENGINE, TRACKER]
    processes(sample, host)
    assert host.children_calls == 2


def test_the_source_reads_the_processes_of_a_server_no_gpu_lists_only():
    with socket.socket() as s:  # a port nobody listens on: the scrape fails, the pids stay
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    host = Host(port)
    source = VllmSource([VllmEndpoint(f"http://127.0.0.1:{port}/metrics", name=EP)], host=host)
    try:
        cpu = source.collect(Snapshot(timestamp=T0)).snapshot.vllm[0]
        on_gpu = GpuSample(index="0", uuid="GPU-0", total_bytes=80 * GiB, used_bytes=40 * GiB, processes=(
            ProcessSample(pid=WORKER, used_bytes=30 * GiB, ppid=ENGINE),))
        gpu = source.collect(Snapshot(timestamp=T0, gpus=(on_gpu,))).snapshot.vllm[0]
    finally:
        source.close()
    assert not cpu.up and cpu.pids == (API,)
    assert [p.server_role for p in cpu.processes] == ["api_server", "engine_core", "worker", ""]
    assert gpu.processes == ()  # its processes are on a GPU: NVML's list has them


def server(t: float, worker_rss: float) -> Snapshot:
    procs = tuple(ProcessSample(pid=pid, used_bytes=None, name=NAMES[pid], role="vllm", endpoint=EP,
                                start_time=T0 - 600, host_rss_bytes=int(worker_rss if pid == WORKER else rss),
                                server_role=role)
                  for pid, rss, role in ((API, 620 * MiB, "api_server"), (ENGINE, 600 * MiB, "engine_core"),
                                         (WORKER, 0, "worker")))
    return Snapshot(timestamp=t, host=HostMemory(total_bytes=24 * GiB, available_bytes=12 * GiB),
                    vllm=(VllmSample(endpoint=EP, up=True, pids=(API,), processes=procs),))


def run(seconds: int, worker_rss) -> Analyzer:
    analyzer = Analyzer(log_findings=False)
    for e in range(0, seconds + 1, 15):
        analyzer.update(server(T0 + e, worker_rss(e)))
    return analyzer


def test_a_leaking_worker_is_named_with_its_role_and_the_api_server_is_not():
    analyzer = run(3 * 3600, lambda e: 680 * MiB + e / 60 * 8 * MiB)  # 8 MiB a minute
    (leak,) = [f for f in analyzer.all_findings if f.kind == "leak"]
    ev = dict(leak.evidence)
    assert (leak.pid, leak.process, leak.role, leak.endpoint, leak.gpu) == (WORKER, "VLLM::Worker", "vllm", EP, None)
    assert ev["server_role"] == "worker" and ev["cpu_backend"] == 1
    assert "the server's worker" in leak.summary and "CPU backend" in leak.summary
    assert any("VLLM_CPU_KVCACHE_SPACE" in a for a in leak.advice)


def test_flat_host_memory_raises_nothing():
    analyzer = run(3 * 3600, lambda e: 680 * MiB + (e % 120) * 64 * 1024)  # a small saw-tooth
    assert analyzer.all_findings == ()


def test_the_servers_processes_are_exported_with_their_host_memory():
    from prometheus_client import generate_latest
    from prometheus_client.registry import CollectorRegistry

    from exporter.model import State

    snap = server(T0, 700 * MiB)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StateCollector(lambda: State(snapshot=snap), lambda: T0))
    text = generate_latest(registry).decode()
    assert ('gpumem_process_host_rss_bytes{container="",namespace="",pid="102",pod="",process="VLLM::Worker",'
            'role="vllm"} 7.340032e+08') in text


def test_the_cpu_backends_start_up_lines_are_the_profile():
    """`Explicitly set (0.03/10.96) GiB for KV cache on node 0.`: the KV size (vLLM's two
    decimals of GiB; the page's kv_cache_memory_bytes is exact) of the memory node's total."""
    p = read_profile(str(FIXTURES / "v0_32_cpu_main.log"))
    assert p.kv_cache_bytes == bytes_in_message("0.03", "GiB") and p.total_gpu_bytes == bytes_in_message("10.96", "GiB")
    assert p.kv_cache_tokens == 32_768 and p.max_model_len == 512
    # 1 MiB prints as 0.0 GiB: unknown, not zero.
    assert read_profile(str(FIXTURES / "v0_32_cpu_kv_cache_too_small_sub_gib.log")).kv_cache_bytes is None
