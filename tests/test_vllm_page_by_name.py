"""The `vllm` source asks a server by name for only the families it reads (`/metrics/?name[]=...`, served
by prometheus_client's own app, as vLLM mounts it) and reads the whole page where the server does
not serve that. Real HTTP on loopback; the filtering is prometheus_client's, multiprocess mode
included (a real MultiProcessCollector over files a real child process wrote)."""
from __future__ import annotations

import logging
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from urllib.parse import parse_qs, urlsplit
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import pytest
from prometheus_client import CollectorRegistry, generate_latest, make_wsgi_app
from prometheus_client.multiprocess import MultiProcessCollector

from exporter.sources.httpclient import new_session
from exporter.sources.vllm import PageReader, VllmEndpoint, only_read_url
from exporter.sources.vllm_normalise import SAMPLE_NAMES, normalise

LABELS = ["engine", "model_name"]
# vLLM's families as vLLM defines them (v1/metrics/loggers.py): two the exporter reads, and a
# histogram of the kind that makes up most of a real page, which it does not read.
DEFINE = """
from prometheus_client import Counter, Gauge, Histogram
def define(registry=None):
    kw = {} if registry is None else {"registry": registry}
    running = Gauge("vllm:num_requests_running", "Requests running.", ["engine", "model_name"],
                    multiprocess_mode="livemostrecent", **kw)
    preempted = Counter("vllm:num_preemptions", "Preemptions.", ["engine", "model_name"], **kw)
    latency = Histogram("vllm:e2e_request_latency_seconds", "Latency.", ["engine", "model_name"], **kw)
    running.labels("0", "m").set(3)
    preempted.labels("0", "m").inc(5)
    for i in range(50):
        latency.labels("0", "m").observe(i / 10)
"""


def described_registry() -> CollectorRegistry:
    """vLLM's default: its metrics registered in one process's registry."""
    namespace: dict[str, object] = {}
    exec(DEFINE, namespace)
    registry = CollectorRegistry()
    namespace["define"](registry)  # type: ignore[operator]
    return registry


def multiprocess_registry(directory) -> CollectorRegistry:
    """vLLM with several API servers (PROMETHEUS_MULTIPROC_DIR): a child process writes the
    values, the page is a MultiProcessCollector over its files (v1/metrics/prometheus.py)."""
    subprocess.run([sys.executable, "-c", DEFINE + "\ndefine()\n"], check=True,
                   env={"PROMETHEUS_MULTIPROC_DIR": str(directory), "PATH": ""})
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(directory))
    return registry


class _Quiet(WSGIRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


class Served:
    """A /metrics server on loopback: `/metrics` answers the whole page whatever the query (as
    vLLM's instrumentator route does), `/metrics/` is `route` (by default prometheus_client's
    app, which honours name[]). Every request's path and query are kept."""

    def __init__(self, registry: CollectorRegistry,
                 route: Callable[[dict, Callable], list[bytes]] | None = None):
        self.seen: list[tuple[str, dict[str, list[str]]]] = []
        self.failing = False  # every path answers 500 while set
        filtered = route or make_wsgi_app(registry)

        def app(environ: dict, start_response: Callable) -> list[bytes]:
            path, query = environ["PATH_INFO"], parse_qs(environ.get("QUERY_STRING", ""))
            self.seen.append((path, query))
            if self.failing:
                start_response("500 Internal Server Error", [("Content-Type", "text/plain")])
                return [b"boom\n"]
            if path == "/metrics":
                start_response("200 OK", [("Content-Type", "text/plain; version=0.0.4")])
                return [generate_latest(registry)]
            return filtered(environ, start_response)

        self.httpd: WSGIServer = make_server("127.0.0.1", 0, app, handler_class=_Quiet)
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_port}/metrics"

    def paths(self) -> list[str]:
        return [path + ("?name[]" if "name[]" in query else "") for path, query in self.seen]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def serve() -> Iterator[Callable[..., Served]]:
    servers: list[Served] = []

    def start(registry: CollectorRegistry, route=None) -> Served:
        servers.append(Served(registry, route))
        return servers[-1]
    yield start
    for server in servers:
        server.close()


def reader(server: Served, by_name: bool = True) -> PageReader:
    return PageReader(VllmEndpoint(server.url, name="llm", timeout_seconds=10, by_name=by_name), new_session())


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def engine_values(sample) -> tuple[float | None, float | None]:
    assert sample.up, sample.error
    (engine,) = sample.engines
    return engine.requests_running, engine.preemptions_total


def test_only_read_url_asks_for_every_family_normalise_reads_at_the_mounted_app():
    url = only_read_url("https://user:pw@gpu-7:8000/metrics")
    parts = urlsplit(url)
    assert (parts.scheme, parts.netloc, parts.path) == ("https", "user:pw@gpu-7:8000", "/metrics/")
    assert tuple(parse_qs(parts.query)["name[]"]) == SAMPLE_NAMES
    assert urlsplit(only_read_url("http://h:8000/vllm-a/metrics/")).path == "/vllm-a/metrics/"
    # A URL with its own query, or a page that is not vLLM's /metrics, is read as configured.
    assert only_read_url("http://h:8000/metrics?x=1") is None
    assert only_read_url("http://h:8000/federate") is None


def test_a_server_that_filters_by_name_is_asked_for_the_families_read_only(serve):
    registry = described_registry()
    server = serve(registry)
    page = reader(server)
    for _ in range(3):
        assert engine_values(page.read()) == (3, 5)
    assert server.paths() == ["/metrics/?name[]"] * 3
    # What it answered is what normalise() makes of the whole page, at a fraction of its size.
    whole = generate_latest(registry).decode()
    only = generate_latest(registry.restricted_registry(SAMPLE_NAMES)).decode()
    assert normalise(only) == normalise(whole)
    assert "vllm:e2e_request_latency_seconds" not in only and len(only) * 4 < len(whole)


def test_several_api_servers_whose_registry_cannot_filter_are_read_whole_and_asked_again_an_hour_later(
        serve, tmp_path, caplog):
    server = serve(multiprocess_registry(tmp_path))
    page, clock = reader(server), Clock()
    with caplog.at_level(logging.INFO, logger="exporter.sources.vllm"):
        assert engine_values(page.read(clock)) == (3, 5)  # the empty answer, then the whole page
        clock.now += PageReader.BY_NAME_RETRY_SECONDS - 1
        assert engine_values(page.read(clock)) == (3, 5)
        clock.now += 1
        assert engine_values(page.read(clock)) == (3, 5)  # by name again: still empty, whole page
    assert server.paths() == ["/metrics/?name[]", "/metrics", "/metrics", "/metrics/?name[]", "/metrics"]
    said = [r.getMessage() for r in caplog.records if "by name" in r.getMessage()]
    assert said == ["vLLM endpoint llm: its page by name failed (no vllm: metrics in the response) while the "
                    "whole page reads: reading the whole page, by name again in an hour (by_name: false reads "
                    "it whole always)"]


def not_found(environ, start_response):
    start_response("404 Not Found", [("Content-Type", "application/json")])
    return [b'{"detail":"Not Found"}']


def bad_gateway(environ, start_response):
    start_response("502 Bad Gateway", [("Content-Type", "text/plain")])
    return [b"bad gateway\n"]


def html(environ, start_response):
    start_response("200 OK", [("Content-Type", "text/html")])
    return [b"<!doctype html><title>sign in</title>\n"]


def redirect_to_metrics(environ, start_response):
    start_response("307 Temporary Redirect", [("Location", "/metrics?" + environ["QUERY_STRING"])])
    return [b""]


@pytest.mark.parametrize("route", [not_found, bad_gateway, html, redirect_to_metrics])
def test_a_server_whose_page_by_family_fails_while_its_whole_page_answers_is_read_whole(serve, route):
    """A proxy in front that allows /metrics alone, answers anything else with an error or its
    own HTML page, or sends it back to /metrics."""
    server = serve(described_registry(), route)
    page = reader(server)
    assert engine_values(page.read()) == (3, 5)
    assert engine_values(page.read()) == (3, 5)
    # A redirect back to /metrics is not followed (it would take two exchanges at every scrape):
    # the whole page is asked for by its own URL.
    assert server.paths() == ["/metrics/?name[]", "/metrics", "/metrics"]


def test_a_server_failing_both_ways_is_reported_by_its_whole_page_and_asked_by_family_again(serve):
    server = serve(described_registry())
    server.failing = True
    page = reader(server)
    first = page.read()
    assert (first.up, first.error_kind, first.error) == (False, "http_status", "llm: HTTP 500 Internal Server Error")
    page.read()
    assert server.paths() == ["/metrics/?name[]", "/metrics"] * 2
    server.failing = False  # the server is back: asked by name at once
    assert engine_values(page.read()) == (3, 5)
    assert server.paths()[4:] == ["/metrics/?name[]"]


def test_an_endpoint_with_by_name_off_is_read_whole(serve):
    server = serve(described_registry())
    page = reader(server, by_name=False)
    assert engine_values(page.read()) == (3, 5)
    assert server.paths() == ["/metrics"]


def test_by_name_in_the_configuration_reaches_the_endpoint():
    from exporter.config import build
    from exporter.runtime import _endpoint

    config = build({"vllm": {"endpoints": ["http://h:8000/metrics", {"url": "http://h:8001/metrics",
                                                                      "by_name": False}]}})
    assert [_endpoint(ep, "e").by_name for ep in config.vllm.endpoints] == [True, False]
