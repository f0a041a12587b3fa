"""A vLLM `/metrics` endpoint driven by a scenario, on a real HTTP server.

It serves the vLLM V1 exposition (as vllm/v1/metrics/loggers.py registers it) with the values
of the scenario's server at the clock's time: `vllm:kv_cache_usage_perc`,
`vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:num_preemptions_total`,
`vllm:prefix_cache_queries_total`, `vllm:prefix_cache_hits_total` (each labelled
model_name, engine="0") and `vllm:cache_config_info`. prometheus_client renders it.

If the scenario restarts a server on the same port, the endpoint serves whichever one is alive,
as a real port would. While none is, and during the scenario's vLLM faults, it answers the way
a sick server does: 503, an error status, a slow answer or unparseable text.
"""
from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .scenario import Scenario, State, VllmState

LABELS = ["model_name", "engine"]


def _pick(state: State, port: int, index: int) -> VllmState:
    """The server alive on this port now, else the configured one (reported as down)."""
    for server in state.vllm:
        if server.port == port and server.up:
            return server
    return state.vllm[index]


def cache_config_labels(server: VllmState) -> dict[str, str]:
    """The labels vLLM's CacheConfig.metrics_info() gives: every field, str()-ed."""
    c = server.cache_config
    return {
        "block_size": str(c.block_size),
        "cache_dtype": c.cache_dtype,
        "calculate_kv_scales": "False",
        "cpu_offload_gb": "0",
        "enable_prefix_caching": str(c.enable_prefix_caching),
        "gpu_memory_utilization": str(c.gpu_memory_utilization),
        "is_attention_free": "False",
        "kv_cache_memory_bytes": str(c.kv_cache_memory_bytes),
        "num_cpu_blocks": "None",
        "num_gpu_blocks": str(c.num_gpu_blocks),
        "num_gpu_blocks_override": "None",
        "prefix_caching_hash_algo": "sha256",
        "sliding_window": "None",
        "swap_space": "4",
        "engine": "0",
    }


class _VllmCollector:
    def __init__(self, server: "FakeVllmServer"):
        self.server = server

    def collect(self):
        s = self.server.current()
        labels = [s.model, "0"]
        created = self.server.clock.start + s.started_at

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=LABELS)
            g.add_metric(labels, value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=LABELS)
            c.add_metric(labels, value, created=created)
            return c

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                    s.requests_running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                    s.requests_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                    s.kv_cache_usage)
        yield counter("vllm:prefix_cache_queries",
                      "Prefix cache queries, in terms of number of queried tokens.",
                      s.prefix_cache_queries_total)
        yield counter("vllm:prefix_cache_hits",
                      "Prefix cache hits, in terms of number of cached tokens.",
                      s.prefix_cache_hits_total)
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                      s.preemptions_total)
        info = cache_config_labels(s)
        g = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                              labels=list(info))
        g.add_metric(list(info.values()), 1)
        yield g


class _Handler(BaseHTTPRequestHandler):
    server_version = "uvicorn"  # what vLLM's API server answers with
    sim: "FakeVllmServer"

    def do_GET(self):  # noqa: N802 (http.server's naming)
        path = self.path.split("?", 1)[0]
        if path not in ("/metrics", "/health"):
            return self._send(404, b'{"detail":"Not Found"}', "application/json")
        state = self.sim.state()
        server = _pick(state, self.sim.port_in_scenario, self.sim.server_index)
        if not server.up:
            return self._send(503, b"server not running\n", "text/plain")
        for fault in state.faults:
            if fault.server is not None and fault.server != server.index:
                continue
            if fault.kind == "vllm_slow":
                time.sleep(fault.delay)  # real seconds: the client's timeout is what is tested
            elif fault.kind == "vllm_http_error":
                return self._send(fault.status, b"Internal Server Error\n", "text/plain")
            elif fault.kind == "vllm_garbage":
                return self._send(200, b"<html>\x00\xff not metrics {{{\n", CONTENT_TYPE_LATEST)
        if path == "/health":
            return self._send(200, b"", "application/json")
        return self._send(200, self.sim.render(), CONTENT_TYPE_LATEST)

    def _send(self, status: int, body: bytes, ctype: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format, *args):  # noqa: A002 - keep test output quiet
        pass


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        pass  # a scraper that gave up mid-answer (its deadline) is normal, not a traceback


class FakeVllmServer:
    """Serves scenario server `server_index` on host:port (0: any free port) until stop()."""

    def __init__(self, scenario: Scenario, clock, server_index: int = 0,
                 host: str = "127.0.0.1", port: int = 0):
        if not 0 <= server_index < len(scenario.vllm):
            raise ValueError(f"scenario {scenario.name!r} has no vLLM server {server_index}")
        self.scenario = scenario
        self.clock = clock
        self.server_index = server_index
        self.port_in_scenario = scenario.vllm[server_index].port
        self.host = host
        self._requested_port = port
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(_VllmCollector(self))
        self._render_lock = threading.Lock()

    def state(self) -> State:
        return self.scenario.state_for(self.clock)

    def current(self) -> VllmState:
        return _pick(self.state(), self.port_in_scenario, self.server_index)

    def render(self) -> bytes:
        with self._render_lock:
            return generate_latest(self._registry)

    def start(self) -> "FakeVllmServer":
        if self._httpd is not None:
            return self
        handler = type("Handler", (_Handler,), {"sim": self})
        self._httpd = _QuietServer((self.host, self._requested_port), handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="fake-vllm",
                                        kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is None:
            return
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)
        self._httpd = self._thread = None

    @property
    def port(self) -> int:
        if self._httpd is None:
            raise RuntimeError("server not started")
        return self._httpd.server_address[1]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def __enter__(self) -> "FakeVllmServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def startup_log(scenario: Scenario, server_index: int) -> str:
    """The start-up lines a current (V1) vLLM server logs about its memory, with the figures of
    the `ramp` of the server's first worker process (the server's pid or a descendant), so the
    exporter can read the simulated server's memory profile from a log as it would a real one."""
    server = scenario.vllm[server_index]
    family, grew = {server.pid}, True
    while grew:  # the server's process tree, whatever order the scenario lists it in
        before = len(family)
        family |= {p.pid for p in scenario.processes if p.ppid in family}
        grew = len(family) > before
    ramp = next((c.startup for p in scenario.processes if p.pid in family
                 for c in p.memory.values() if c.startup), None)
    if ramp is None:
        return ""
    gib = float(1 << 30)
    weights, peak, kv = ramp["weights"] / gib, ramp["profile_peak"] / gib, ramp["kv_cache"] / gib
    non_torch, graphs = ramp["non_torch"] / gib, ramp["cuda_graphs"] / gib
    prefix = f"(EngineCore_DP0 pid={server.pid}) INFO 01-01 00:00:00"
    return "".join(f"{prefix} [{where}] {text}\n" for where, text in (
        ("gpu_model_runner.py:2000", f"Model loading took {weights:.4f} GiB and {ramp['load_seconds']:.1f} seconds"),
        ("gpu_worker.py:250", f"Memory profiling takes {ramp['profile_seconds']:.2f} seconds. Total non KV cache "
                              f"memory: {weights + peak + non_torch:.2f}GiB; torch peak memory increase: "
                              f"{peak:.2f}GiB; non-torch forward increase memory: {non_torch:.2f}GiB; "
                              f"weights memory: {weights:.2f}GiB."),
        ("gpu_worker.py:270", f"Available KV cache memory: {kv:.2f} GiB"),
        ("gpu_model_runner.py:2500", f"Graph capturing finished in {ramp['graph_seconds']:.0f} secs, took {graphs:.2f} GiB"),
    ))
