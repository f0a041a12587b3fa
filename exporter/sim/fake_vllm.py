"""A vLLM `/metrics` endpoint driven by a scenario, on a real HTTP server.

It serves the vLLM V1 exposition (as vllm/v1/metrics/loggers.py registers it) with the values
of the scenario's server at the clock's time: `vllm:kv_cache_usage_perc`,
`vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:num_preemptions_total`,
`vllm:prefix_cache_queries_total`, `vllm:prefix_cache_hits_total` (each labelled
model_name, engine="0") and `vllm:cache_config_info`. prometheus_client renders it.

Around them it serves what a real server's page also carries, so that a scrape costs what it
costs against vLLM: the token and request counters, the fourteen request histograms with
vLLM's own buckets, the API server's `http_*` families (prometheus-fastapi-instrumentator) and
the Python process and GC collectors. Their values grow with the server's uptime, a minute
at a time (that bulk is rendered once a minute: most of a page's cost is there).

If the scenario restarts a server on the same port, the endpoint serves whichever one is alive,
as a real port would. While none is, and during the scenario's vLLM faults, it answers the way
a sick server does: 503, an error status, a slow answer or unparseable text.
"""
from __future__ import annotations

import math
import socket
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)

from .scenario import Scenario, ScenarioClock
from .scenario.evaluate import SLEEP_STATES
from .scenario.state import State, VllmState

LABELS = ["model_name", "engine"]
MAX_MODEL_LEN = 32768
REQUESTS_PER_SECOND = 2.0  # the simulated traffic behind the counters and histograms
TRAFFIC_STEP_SECONDS = 60.0  # the traffic counters and histograms advance once a minute


def _one_two_five(max_value: int) -> list[float]:
    """vLLM's build_1_2_5_buckets: 1, 2, 5, 10, 20, 50, ... up to max_value."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(float(m * scale))
        scale *= 10


_LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
            120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
# (name, help, buckets, mean observation) as vllm/v1/metrics/loggers.py registers them.
HISTOGRAMS = (
    ("vllm:request_prompt_tokens", "Number of prefill tokens processed.", _one_two_five(MAX_MODEL_LEN), 900.0),
    ("vllm:request_generation_tokens", "Number of generation tokens processed.", _one_two_five(MAX_MODEL_LEN), 250.0),
    ("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
     [1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0], 96.0),
    ("vllm:request_max_num_generation_tokens", "Histogram of maximum number of requested generation tokens.",
     _one_two_five(MAX_MODEL_LEN), 1024.0),
    ("vllm:request_params_n", "Histogram of the n request parameter.", [1.0, 2.0, 5.0, 10.0, 20.0], 1.0),
    ("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.",
     _one_two_five(MAX_MODEL_LEN), 1024.0),
    ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
     [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
      40.0, 80.0, 160.0, 640.0, 2560.0], 0.2),
    ("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds.",
     [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
      40.0, 80.0], 0.03),
    ("vllm:time_per_prefill_token_request_seconds", "Time spent per token during prefill  phase in seconds",
     [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0], 0.0004),
    ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", _LATENCY, 7.5),
    ("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", _LATENCY, 0.05),
    ("vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.",
     _LATENCY, 7.4),
    ("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", _LATENCY, 0.2),
    ("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", _LATENCY, 7.2),
)
HANDLERS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")
HIGHR_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0,
                 7.5, 10.0, 30.0, 60.0]


def _histogram(name: str, doc: str, labels: Sequence[str], values: Sequence[str], buckets: Sequence[float],
               count: int, mean: float, created: float | None = None) -> HistogramMetricFamily:
    """A histogram of `count` observations spread around `mean` (half below it, the rest
    thinning out over the larger buckets)."""
    h = HistogramMetricFamily(name, doc, labels=labels)
    cumulative = [(str(le), float(round(count * le / (le + mean)))) for le in buckets]
    h.add_metric(values, cumulative + [("+Inf", float(count))], sum_value=count * mean)
    if created is not None:  # prometheus_client has no created= for histograms: add the sample
        h.samples.append(h.samples[-1]._replace(name=f"{name}_created", value=created))
    return h


def _traffic(labels: list[str], created: float, uptime: float) -> Iterator[Metric]:
    """Token and request counters and request histograms: a real page's bulk."""
    requests = int(REQUESTS_PER_SECOND * max(uptime, 0.0))
    for name, doc, per_request in (("vllm:prompt_tokens", "Number of prefill tokens processed.", 900),
                                   ("vllm:generation_tokens", "Number of generation tokens processed.", 250)):
        c = CounterMetricFamily(name, doc, labels=LABELS)
        c.add_metric(labels, requests * per_request, created=created)
        yield c
    c = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                            labels=LABELS + ["finished_reason"])
    for reason, share in (("stop", 0.9), ("length", 0.09), ("abort", 0.01)):
        c.add_metric(labels + [reason], int(requests * share), created=created)
    yield c
    for name, doc, buckets, mean in HISTOGRAMS:
        yield _histogram(name, doc, LABELS, labels, buckets, requests, mean, created)


def _api_server(uptime: float) -> Iterator[Metric]:
    """The API server's own families, as prometheus-fastapi-instrumentator exports them."""
    requests = int(REQUESTS_PER_SECOND * max(uptime, 0.0))
    total = CounterMetricFamily("http_requests", "Total number of requests by method, status and handler.",
                                labels=["handler", "method", "status"])
    size = SummaryMetricFamily("http_request_size_bytes", "Content length of incoming requests by handler. "
                               "Only value of header is respected. Otherwise ignored. No percentile calculated. ",
                               labels=["handler"])
    response = SummaryMetricFamily("http_response_size_bytes", "Content length of outgoing responses by handler. "
                                   "Only value of header is respected. Otherwise ignored. No percentile calculated. ",
                                   labels=["handler"])
    latency = HistogramMetricFamily("http_request_duration_seconds",
                                    "Latency with only few buckets by handler. Made to be only used if aggregation "
                                    "by handler is important. ", labels=["handler", "method"])
    for i, handler in enumerate(HANDLERS):
        n = requests // (i + 1)
        method = "POST" if handler.startswith("/v1/c") else "GET"
        total.add_metric([handler, method, "2xx"], n)
        total.add_metric([handler, method, "4xx"], n // 100)
        size.add_metric([handler], n, n * 2048.0)
        response.add_metric([handler], n, n * 4096.0)
        latency.add_metric([handler, method], [(str(le), float(n * le / (le + 1))) for le in (0.1, 0.5, 1.0)]
                           + [("+Inf", float(n))], sum_value=n * 1.0)
    yield from (total, size, response, latency)
    yield _histogram("http_request_duration_highr_seconds",
                     "Latency with many buckets but no API specific labels. Made for more accurate percentile "
                     "calculations. ", [], [], HIGHR_BUCKETS, requests, 1.0)


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


def _serving(s: VllmState, created: float) -> Iterator[Metric]:
    """The families the exporter reads: the server's state at this moment."""
    labels = [s.model, "0"]

    def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=LABELS)
        g.add_metric(labels, value)
        return g

    def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=LABELS)
        c.add_metric(labels, value, created=created)
        return c

    yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", s.requests_running)
    yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", s.requests_waiting)
    yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_cache_usage)
    yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                  s.prefix_cache_queries_total)
    yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                  s.prefix_cache_hits_total)
    yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", s.preemptions_total)
    if s.sleep_state:  # sleep mode: one 0/1 series per state, as vLLM's V1 engine exports them
        sleep = GaugeMetricFamily("vllm:engine_sleep_state", "Engine sleep state.",
                                  labels=[*LABELS, "sleep_state"])
        for state in SLEEP_STATES:
            sleep.add_metric([*labels, state], 1 if state == s.sleep_state else 0)
        yield sleep
    info = cache_config_labels(s)
    g = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=list(info))
    g.add_metric(list(info.values()), 1)
    yield g


class _Families:
    """A collector over families made beforehand: one state read serves the whole page."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def _exposition(families: Iterable[Metric]) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    return generate_latest(registry)


class _Handler(BaseHTTPRequestHandler):
    server_version = "uvicorn"  # what vLLM's API server answers with
    protocol_version = "HTTP/1.1"  # keep-alive, as uvicorn does: scrapers reuse the connection
    disable_nagle_algorithm = True  # TCP_NODELAY, as uvicorn: else a kept-alive answer stalls 40 ms
    sim: FakeVllmServer

    def setup(self) -> None:
        super().setup()
        self.sim._connections.add(self.connection)

    def finish(self) -> None:
        self.sim._connections.discard(self.connection)
        super().finish()

    def do_GET(self) -> None:
        path, _, query = self.path.partition("?")
        if path not in ("/metrics", "/metrics/", "/health"):
            return self._send(404, b'{"detail":"Not Found"}', "application/json")
        self.sim.sync_log()
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
        # vLLM answers `/metrics` from its instrumentator's route, which ignores `name[]`, and
        # `/metrics/` from the prometheus_client app mounted behind it, which honours it.
        names = parse_qs(query).get("name[]", []) if path == "/metrics/" else []
        return self._send(200, self.sim.render(names), CONTENT_TYPE_LATEST)

    def _send(self, status: int, body: bytes, ctype: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: socket.socket | tuple[bytes, socket.socket], client_address: Any) -> None:
        pass  # a scraper that gave up mid-answer (its deadline) is normal, not a traceback


class FakeVllmServer:
    """Serves scenario server `server_index` on host:port (0: any free port) until stop(): or
    whichever server of the scenario is up on the same scenario port (a restart). With
    `log_file`, each server that comes up there appends its start-up lines to it, as a real
    server's log grows with each start."""

    def __init__(self, scenario: Scenario, clock: ScenarioClock, server_index: int = 0,
                 host: str = "127.0.0.1", port: int = 0, log_file: str | None = None) -> None:
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
        self._python = CollectorRegistry(auto_describe=False)
        for collector in (GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR):
            self._python.register(collector)  # the Python families every vLLM page ends with
        self._render_lock = threading.Lock()
        # (what it shows, its families, their exposition)
        self._traffic: tuple[tuple[str, float, float], list[Metric], bytes] | None = None
        self._connections: set[socket.socket] = set()  # open keep-alive connections
        self.log_file = log_file
        self._logged: int | None = None  # the server whose start the log ends with
        self._log_lock = threading.Lock()
        if log_file is not None:
            open(log_file, "a").close()  # there from the start, empty until a server starts
        self.sync_log()

    def state(self) -> State:
        return self.scenario.state_for(self.clock)

    def current(self) -> VllmState:
        return _pick(self.state(), self.port_in_scenario, self.server_index)

    def sync_log(self) -> None:
        """Append the start-up lines of the server up on this port now, once per start."""
        if self.log_file is None:
            return
        with self._log_lock:
            server = self.current()
            if server.up and server.index != self._logged:
                with open(self.log_file, "a") as fh:
                    fh.write(startup_log(self.scenario, server.index))
                self._logged = server.index

    def render(self, names: Sequence[str] = ()) -> bytes:
        """The page: the serving state now, the traffic bulk, then the Python collectors. With
        `names`, only those samples, as vLLM serves `/metrics/?name[]=...` (prometheus_client's
        own filter)."""
        with self._render_lock:
            s = self.current()
            created = self.clock.start + s.started_at
            # The bulk's counters move once a minute: rendering its ~400 samples is most of a
            # page's cost, and a scraper only needs it to be there, real-sized and growing.
            uptime = math.floor(max(self.clock.now() - created, 0.0) / TRAFFIC_STEP_SECONDS) * TRAFFIC_STEP_SECONDS
            key = (s.model, created, uptime)
            if self._traffic is None or self._traffic[0] != key:
                bulk = [*_traffic([s.model, "0"], created, uptime), *_api_server(uptime)]
                self._traffic = (key, bulk, _exposition(bulk))
            if names:
                registry = CollectorRegistry(auto_describe=True)  # described, as vLLM's own metrics are
                registry.register(_Families([*_serving(s, created), *self._traffic[1]]))
                return (generate_latest(registry.restricted_registry(names))
                        + generate_latest(self._python.restricted_registry(names)))
            return _exposition(_serving(s, created)) + self._traffic[2] + generate_latest(self._python)

    def start(self) -> FakeVllmServer:
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
        for connection in list(self._connections):  # a stopped server drops its clients too
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread is not None:
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

    def __enter__(self) -> FakeVllmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
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
    return f"(APIServer pid={server.pid}) INFO 01-01 00:00:00 [api_server.py:1000] vLLM API server version 0.11.0\n" + \
        "".join(f"{prefix} [{where}] {text}\n" for where, text in (
        ("gpu_model_runner.py:2000", f"Model loading took {weights:.4f} GiB and {ramp['load_seconds']:.1f} seconds"),
        ("gpu_worker.py:250", f"Memory profiling takes {ramp['profile_seconds']:.2f} seconds. Total non KV cache "
                              f"memory: {weights + peak + non_torch:.2f}GiB; torch peak memory increase: "
                              f"{peak:.2f}GiB; non-torch forward increase memory: {non_torch:.2f}GiB; "
                              f"weights memory: {weights:.2f}GiB."),
        ("gpu_worker.py:270", f"Available KV cache memory: {kv:.2f} GiB"),
        ("gpu_model_runner.py:2500", f"Graph capturing finished in {ramp['graph_seconds']:.0f} secs, "
                                     f"took {graphs:.2f} GiB"),
    ))
