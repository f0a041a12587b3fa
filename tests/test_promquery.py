"""`analyze --prometheus`: fetch the exporter's series from a REAL Prometheus that scraped a
simulated leak run, in chunks, with clear errors (server message, no credentials)."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import yaml

from exporter.postmortem.promquery import PromQueryError, chunks, fetch, parse_time, redact
from exporter.postmortem.trace import TraceError, read_trace
from helpers.tools import HANG

REPO = Path(__file__).resolve().parents[1]
SCRAPE = 0.5  # seconds between Prometheus scrapes (and the query step)
METRICS = ("gpumem_process_memory_used_bytes", "gpumem_process_host_rss_bytes",
           "gpumem_gpu_memory_total_bytes", "gpumem_gpu_memory_used_bytes",
           # the vLLM series the live findings read (budget, preemptions, sleep)
           "gpumem_vllm_up", "gpumem_vllm_kv_cache_usage_ratio", "gpumem_vllm_requests_running",
           "gpumem_vllm_requests_waiting", "gpumem_vllm_preemptions_total",
           "gpumem_vllm_cache_config_info", "gpumem_vllm_engine_sleep_state",
           "gpumem_vllm_memory_used_bytes")
H100_TOTAL = 81559 << 20  # the leak scenario's GPU


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(check, deadline: float, what: str, procs=()):
    while True:
        for proc in procs:
            if proc.poll() is not None:
                pytest.fail(f"{what}: {proc.args[0]} exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            if check():
                return
        except (OSError, requests.RequestException, KeyError, ValueError):
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"{what} in time")
        time.sleep(0.1)


class CountingSession(requests.Session):
    """A real session that counts the requests it sends (at its transport adapter)."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        session = self

        class Counting(requests.adapters.HTTPAdapter):
            # httpclient sends through the adapter's pool, which it asks for once a request
            def get_connection_with_tls_context(self, *args, **kwargs):
                session.calls += 1
                return super().get_connection_with_tls_context(*args, **kwargs)
        self.mount("http://", Counting())


@pytest.fixture(scope="module")
def prom(tmp_path_factory):
    """A simulated leak run (x120) scraped by a real Prometheus under two instance names."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("prometheus not found on PATH (Debian/Ubuntu: apt-get install prometheus)")
    tmp = tmp_path_factory.mktemp("promquery")
    exporter_port, prom_port = free_port(), free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    exporter = subprocess.Popen(
        [sys.executable, "-m", "exporter", "run", "--simulate", "leak", "--speed", "120",
         "--interval", "0.5", "--listen", f"127.0.0.1:{exporter_port}"],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    config = tmp / "prometheus.yml"
    # The same exporter under two names: a server with several exporters, for the selector test.
    config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": f"{int(SCRAPE * 1000)}ms",
                   "scrape_timeout": f"{int(SCRAPE * 1000)}ms"},
        "scrape_configs": [{"job_name": "gpumem", "static_configs": [{"targets": [
            f"127.0.0.1:{exporter_port}", f"localhost:{exporter_port}"]}]}],
    }))
    prometheus = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'data'}",
         f"--web.listen-address=127.0.0.1:{prom_port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{prom_port}"
    started = time.time()
    try:
        deadline = time.monotonic() + HANG

        def enough_points():
            r = requests.get(f"{url}/api/v1/query", timeout=2, params={
                "query": 'count_over_time(gpumem_process_memory_used_bytes{instance=~"127.*"}[1m])'})
            result = r.json()["data"]["result"]
            return result and float(result[0]["value"][1]) >= 10

        wait_for(enough_points, deadline, "prometheus did not scrape the exporter 10 times",
                 (exporter, prometheus))
        yield {"url": url, "start": started, "end": time.time(),
               "selector": f'instance="127.0.0.1:{exporter_port}"'}
    finally:
        for proc in (prometheus, exporter):
            proc.terminate()
        for proc in (prometheus, exporter):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.mark.integration
@pytest.mark.slow
def test_fetch_gives_the_simulated_run(prom):
    snaps = fetch(prom["url"], prom["start"], prom["end"], step=SCRAPE, selector=prom["selector"])
    assert len(snaps) >= 8  # ten scrapes, one grid point per step after the first
    times = [s.timestamp for s in snaps]
    assert times == sorted(times) and prom["start"] <= times[0] and times[-1] <= prom["end"] + 1
    for s in snaps:
        [gpu] = s.gpus
        assert gpu.index == "0" and gpu.uuid.startswith("GPU-") and gpu.total_bytes == H100_TOTAL
        [proc] = gpu.processes
        assert (proc.pid, proc.name, proc.role) == (3150, "VLLM::EngineCore", "vllm")
        assert proc.host_rss_bytes is not None and proc.host_rss_bytes > 1 << 30
        assert 0 < proc.used_bytes <= gpu.used_bytes <= gpu.total_bytes


@pytest.mark.integration
@pytest.mark.slow
def test_fetch_converts_like_a_saved_range_query_file(prom, tmp_path):
    """The live path and `analyze saved.json` give the same snapshots (same row functions)."""
    start, end = prom["start"], prom["end"]
    saved = []
    for metric in METRICS:
        r = requests.get(prom["url"] + "/api/v1/query_range", timeout=HANG, params={
            "query": f"{metric}{{{prom['selector']}}}", "start": repr(start), "end": repr(end),
            "step": repr(SCRAPE)})
        saved.append(r.json())
    path = tmp_path / "saved.json"
    path.write_text(json.dumps(saved))
    assert fetch(prom["url"], start, end, step=SCRAPE, selector=prom["selector"]) == \
        read_trace(str(path))


@pytest.mark.integration
@pytest.mark.slow
def test_long_ranges_are_fetched_in_chunks(prom):
    start, end = prom["start"], prom["end"]
    whole, chunked = CountingSession(), CountingSession()
    one = fetch(prom["url"], start, end, step=SCRAPE, selector=prom["selector"], session=whole)
    many = fetch(prom["url"], start, end, step=SCRAPE, selector=prom["selector"], session=chunked,
                 max_points=3)
    assert many == one  # no point lost or doubled at the seams
    assert whole.calls == len(METRICS)
    assert chunked.calls == len(METRICS) * len(chunks(start, end, SCRAPE, 3)) > 4 * len(METRICS)


@pytest.mark.integration
@pytest.mark.slow
def test_a_query_over_the_server_limit_reports_the_server_message(prom):
    # 20 s at 1 ms steps is 20,000 points a series: Prometheus refuses it unless it is chunked.
    with pytest.raises(PromQueryError) as err:
        fetch(prom["url"], prom["end"] - 20, prom["end"], step=0.001, selector=prom["selector"],
              max_points=10**9)
    text = str(err.value)
    assert "HTTP 400" in text and "11,000 points" in text and prom["url"] in text


@pytest.mark.integration
@pytest.mark.slow
def test_several_exporters_need_a_selector(prom):
    with pytest.raises(PromQueryError, match=r"several exporters.*instance="):
        fetch(prom["url"], prom["start"], prom["end"], step=SCRAPE)


@pytest.mark.integration
@pytest.mark.slow
def test_errors_never_show_credentials(prom):
    parts = prom["url"].split("//")
    url = f"{parts[0]}//alice:s3cret@{parts[1]}"
    with pytest.raises(PromQueryError) as err:  # a bad regex: the server says why
        fetch(url, prom["start"], prom["end"], step=SCRAPE, selector='instance=~"("')
    text = str(err.value)
    assert "bad_data" in text and "s3cret" not in text and "alice" not in text
    with pytest.raises(PromQueryError) as err:  # nobody listens there
        fetch(f"http://alice:s3cret@127.0.0.1:{free_port()}", 0, 10)
    assert "cannot query Prometheus" in str(err.value) and "s3cret" not in str(err.value)


@pytest.mark.integration
@pytest.mark.slow
def test_an_oversized_response_is_refused(prom):
    with pytest.raises(PromQueryError, match="byte limit"):
        fetch(prom["url"], prom["start"], prom["end"], step=SCRAPE, selector=prom["selector"],
              max_response_bytes=200)


@pytest.mark.integration
@pytest.mark.slow
def test_a_range_without_data_says_so(prom):
    with pytest.raises(PromQueryError, match="no gpumem_process_memory_used_bytes samples"):
        fetch(prom["url"], prom["start"] - 7200, prom["start"] - 3600, step=60)


def test_a_server_that_is_not_prometheus(tmp_path):
    import http.server
    import threading

    class NotProm(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b"<html>login required</html>"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotProm)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(PromQueryError, match="HTTP 200: <html>login required"):
            fetch(f"http://127.0.0.1:{server.server_address[1]}", 0, 60)
    finally:
        server.shutdown()


def test_bad_arguments_are_clear_errors():
    with pytest.raises(PromQueryError, match="before start"):
        fetch("http://127.0.0.1:1", 100, 50)
    with pytest.raises(PromQueryError, match="step must be positive"):
        fetch("http://127.0.0.1:1", 0, 50, step=0)
    assert issubclass(PromQueryError, TraceError)  # analyze reports it like a bad trace file


def test_chunks_cover_the_range_on_one_grid():
    pieces = chunks(0.0, 100.0, 1.0, max_points=30)
    assert pieces == [(0.0, 29.0), (30.0, 59.0), (60.0, 89.0), (90.0, 100.0)]
    points = [t for a, b in pieces for t in range(int(a), int(b) + 1)]
    assert points == list(range(101))
    assert chunks(5.0, 5.0, 1.0) == [(5.0, 5.0)]


def test_parse_time_and_redact():
    assert parse_time("1700000000") == 1_700_000_000.0
    assert parse_time("2023-11-14T22:13:20Z") == 1_700_000_000.0
    assert parse_time("2023-11-14T22:13:20") == 1_700_000_000.0  # no zone: UTC
    assert parse_time("now-6h", now=100_000.0) == 100_000.0 - 6 * 3600
    assert parse_time("-90m", now=100_000.0) == 100_000.0 - 5400
    assert parse_time("now", now=5.0) == 5.0
    with pytest.raises(ValueError, match="not a time"):
        parse_time("yesterday")
    assert redact("https://u:p@prom.example:9090/prom?token=x") == "https://prom.example:9090/prom"
