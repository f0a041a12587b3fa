"""Scraping through a real HTTP server on 127.0.0.1: every failure mode, bounded in time.

Time is the server's: slow routes move a ServerClock (the scraper's injected clock) instead of
sleeping, and a route that hangs holds for far longer than any deadline here (until the test
ends), so a scrape that waited for it could only fail, never pass slowly. How long a source holds
its caller is read off the waits it asks for (the `source_waits` fixture), not a wall clock."""
from __future__ import annotations

import itertools
import logging
import socket
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
import requests

from exporter.sources import httpclient
from exporter.sources.vllm import MAX_REDIRECTS, VllmEndpoint, VllmSource, public_url, scrape
from helpers.clocks import ServerClock
from helpers.httpserver import QuietOnHangUp
from helpers.tools import HANG

FIXTURE = (Path(__file__).parent / "fixtures" / "vllm" / "current_v1_engines.prom").read_bytes()
TOKEN = "s3cret-t0ken-for-tests"
LATE_TIMEOUT = 60.0  # clock seconds; the server sends its headers 0.2 s before the deadline
HUGE = 400 << 20  # what a hostile redirect offers: far more than any limit
# 256 MiB of zeros in about 256 KiB of gzip: a decompression bomb on a redirect.
GZIP_BOMB = zlib.compressobj(1, zlib.DEFLATED, 31).compress(bytes(256 << 20)) + b""


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # keep test output quiet
        pass

    def do_GET(self):
        server = self.server
        server.seen.append((self.path, self.headers.get("Authorization")))
        route = getattr(self, "route_" + self.path.strip("/").split("?")[0].replace("/", "_"), None)
        if route is None:
            self.reply(404, b"not found")
        else:
            route()

    def reply(self, status, body, content_type="text/plain; version=0.0.4"):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def route_metrics(self):
        self.reply(200, FIXTURE)

    def route_auth_metrics(self):
        if self.headers.get("Authorization") == f"Bearer {TOKEN}":
            self.reply(200, FIXTURE)
        else:
            self.reply(401, b'{"error": "Unauthorized"}', "application/json")

    def route_redirect(self):
        # some vLLM releases answer /metrics with a 307 to /metrics/
        self.send_response(307)
        self.send_header("Location", "/auth/metrics")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def redirect_with_body(self, location, body_chunks, headers=()):
        """A redirect that also streams a body; counts what it managed to send before the
        client hung up (a client that reads the body takes it all)."""
        self.send_response(302)
        self.send_header("Location", location)
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()
        sent = 0
        try:
            for chunk in body_chunks:
                self.wfile.write(chunk)
                sent += len(chunk)
        except OSError:
            pass  # the scraper dropped the connection: what a bounded client does
        finally:
            self.server.sent.append(sent)
            self.close_connection = True

    def route_redirect_huge_chunked(self):
        piece = b"x" * (1 << 20)
        chunk = b"%x\r\n%s\r\n" % (len(piece), piece)
        self.redirect_with_body("/metrics", (chunk for _ in range(HUGE >> 20)),
                                [("Transfer-Encoding", "chunked")])

    def route_redirect_gzip_bomb(self):
        self.redirect_with_body("/metrics", [GZIP_BOMB], [("Content-Encoding", "gzip"),
                                                          ("Content-Length", str(len(GZIP_BOMB)))])

    def route_redirect_to_huge(self):
        self.send_response(307)
        self.send_header("Location", "/huge_chunked")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def route_redirect_loop(self):
        self.send_response(302)
        self.send_header("Location", "/redirect_loop")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def route_redirect_elsewhere(self):
        # same server, another host name: a different origin, so the token must not follow
        self.send_response(302)
        self.send_header("Location", f"http://localhost:{self.server.server_address[1]}/auth/metrics")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def route_echo_split(self):
        # echoes the bearer token into two labels, half in each
        token = (self.headers.get("Authorization") or "").removeprefix("Bearer ")
        half = len(token) // 2
        page = (f'vllm:num_requests_running{{model_name="{token[:half]}",engine="{token[half:]}"}} 3\n'
                f'vllm:cache_config_info{{cache_dtype="fp8-{token[2:12]}",block_size="16"}} 1\n')
        self.reply(200, page.encode())

    def route_impossible(self):
        self.reply(200, b'vllm:kv_cache_usage_perc{model_name="m",engine="0"} -5\n'
                        b'vllm:num_preemptions_total{model_name="m",engine="0"} -1e308\n'
                        b'vllm:num_requests_running{model_name="m",engine="0"} 4\n')

    def route_error(self):
        self.reply(500, b"Internal Server Error")

    def route_html(self):
        self.reply(200, b"<html><body><h1>Welcome</h1></body></html>", "text/html")

    def route_slow(self):
        self.server.release.wait(60)  # answers only when the test tears down
        self.reply(200, FIXTURE)

    def route_truncated(self):
        self.send_response(200)
        self.send_header("Content-Length", str(len(FIXTURE)))
        self.end_headers()
        self.wfile.write(FIXTURE[:200])
        self.wfile.flush()
        self.close_connection = True
        self.connection.shutdown(socket.SHUT_WR)

    def route_huge(self):
        self.reply(200, FIXTURE * 4)

    def route_huge_chunked(self):
        # no Content-Length: only counting what arrives can catch it
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for _ in range(8):
            self.wfile.write(b"%x\r\n%s\r\n" % (len(FIXTURE), FIXTURE))
        self.wfile.write(b"0\r\n\r\n")

    def route_chunked(self):
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for start in range(0, len(FIXTURE), 1000):
            piece = FIXTURE[start:start + 1000]
            self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
        self.wfile.write(b"0\r\n\r\n")

    def route_drip(self):
        self.send_response(200)
        self.send_header("Content-Length", str(len(FIXTURE)))
        self.end_headers()
        for i in range(len(FIXTURE)):
            self.wfile.write(FIXTURE[i:i + 1])
            self.wfile.flush()
            self.server.clock.pass_time(0.2)
            if self.server.release.is_set():
                return

    def route_late_then_silent(self):
        # headers near the deadline, then nothing: one blocking read must not outlive it. The
        # silence outlasts the request's own per-read timeout, then the server hangs up: a read
        # not cut to what is left of the deadline ends "truncated", never "timeout".
        self.server.clock.advance(LATE_TIMEOUT - 0.2)
        self.send_response(200)
        self.send_header("Content-Length", str(len(FIXTURE)))
        self.end_headers()
        self.wfile.write(FIXTURE[:100])
        self.wfile.flush()
        self.server.release.wait(LATE_TIMEOUT + 10)
        self.close_connection = True

    def route_drip_headers(self):
        # the status line itself arrives one byte at a time: below the HTTP client's reach; the
        # headers never end until the test lets go
        head = itertools.chain(b"HTTP/1.1 200 OK\r\nX-Drip: ", itertools.repeat(ord("a")))
        for byte in head:
            self.wfile.write(bytes([byte]))
            self.wfile.flush()
            if self.server.release.wait(0.1):
                return


@pytest.fixture()
def server():
    httpd = QuietOnHangUp(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    httpd.block_on_close = False
    httpd.release = threading.Event()
    httpd.seen = []
    httpd.sent = []
    httpd.clock = ServerClock()
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    yield httpd
    httpd.release.set()
    httpd.shutdown()
    httpd.server_close()


def url(server, path):
    return f"http://127.0.0.1:{server.server_address[1]}{path}"


def closed_port() -> int:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return port


def answering(address: str, **kwargs) -> VllmEndpoint:
    """An endpoint on a route that answers. Its deadline runs on the real clock, and the default
    2 s could pass on a loaded machine before a loopback answer arrives: it gets HANG instead."""
    return VllmEndpoint(address, timeout_seconds=HANG, **kwargs)


def timed_scrape(endpoint, clock=time.monotonic):
    """The sample and how long it took on the scraper's clock (pass the server's to time it)."""
    with requests.Session() as session:
        started = clock()
        sample = scrape(endpoint, session, clock=clock)
        return sample, clock() - started


def test_success_normalises_the_page(server):
    sample, _ = timed_scrape(answering(url(server, "/metrics"), name="llama"))
    assert sample.up and sample.error_kind == "" and sample.endpoint == "llama"
    assert [e.engine for e in sample.engines] == ["0", "1"]
    assert sample.engines[0].kv_cache_usage_ratio == 0.9134
    assert sample.cache_config.gpu_memory_utilization == 0.92
    assert sample.scrape_duration_seconds > 0


def test_bare_base_url_gets_metrics_path(server):
    sample, _ = timed_scrape(answering(url(server, "")))
    assert sample.up
    assert server.seen[-1][0] == "/metrics"


def test_chunked_body_is_read_whole(server):
    sample, _ = timed_scrape(answering(url(server, "/chunked")))
    assert sample.up and len(sample.engines) == 2


def test_refused():
    endpoint = VllmEndpoint(f"http://127.0.0.1:{closed_port()}/metrics", bearer_token=TOKEN)
    sample, elapsed = timed_scrape(endpoint, ServerClock())
    assert (sample.up, sample.error_kind) == (False, "refused")
    assert TOKEN not in sample.error and elapsed < 2


def test_timeout_when_server_does_not_answer(server):
    sample, elapsed = timed_scrape(VllmEndpoint(url(server, "/slow"), timeout_seconds=0.3), server.clock)
    assert sample.error_kind == "timeout"
    assert elapsed < 0.3 + 0.5


def test_http_500(server):
    sample, _ = timed_scrape(answering(url(server, "/error")))
    assert sample.error_kind == "http_status" and "500" in sample.error


def test_body_not_exposition_format(server):
    sample, _ = timed_scrape(answering(url(server, "/html")))
    assert sample.error_kind == "parse" and not sample.up


def test_truncated_body(server):
    sample, _ = timed_scrape(answering(url(server, "/truncated")))
    assert sample.error_kind == "truncated"
    assert "200 bytes" in sample.error


def test_declared_size_over_limit(server):
    sample, _ = timed_scrape(answering(url(server, "/huge"), max_response_bytes=len(FIXTURE)))
    assert sample.error_kind == "too_large"


def test_streamed_size_over_limit(server):
    sample, _ = timed_scrape(answering(url(server, "/huge_chunked"), max_response_bytes=len(FIXTURE) * 2))
    assert sample.error_kind == "too_large"


def test_slow_drip_is_cut_at_the_deadline(server):
    sample, elapsed = timed_scrape(VllmEndpoint(url(server, "/drip"), timeout_seconds=1.0), server.clock)
    assert sample.error_kind == "timeout"
    assert elapsed < 1.0 + 0.4


def test_silent_body_after_late_headers_is_cut_at_the_deadline(server):
    sample, elapsed = timed_scrape(VllmEndpoint(url(server, "/late_then_silent"), timeout_seconds=LATE_TIMEOUT),
                                   server.clock)
    assert sample.error_kind == "timeout"
    assert elapsed < LATE_TIMEOUT + 0.25


def test_bearer_token_is_sent_and_never_shown(server):
    good, _ = timed_scrape(answering(url(server, "/auth/metrics"), bearer_token=TOKEN))
    assert good.up
    assert server.seen[-1][1] == f"Bearer {TOKEN}"
    bad_endpoint = answering(url(server, "/auth/metrics"), bearer_token="wrong-" + TOKEN)
    bad, _ = timed_scrape(bad_endpoint)
    assert bad.error_kind == "http_status" and "401" in bad.error
    assert TOKEN not in bad.error and TOKEN not in repr(bad_endpoint) and TOKEN not in repr(bad)


def test_redirect_on_the_same_host_is_followed_with_the_token(server):
    sample, _ = timed_scrape(answering(url(server, "/redirect"), bearer_token=TOKEN))
    assert sample.up
    assert server.seen[-1] == ("/auth/metrics", f"Bearer {TOKEN}")


def test_label_hides_credentials_and_query():
    endpoint = VllmEndpoint("http://user:pa55@10.0.0.7:8000/metrics?token=abc#x")
    assert endpoint.label == "http://10.0.0.7:8000/metrics"
    assert public_url("http://[::1]:8000/metrics") == "http://[::1]:8000/metrics"
    assert VllmEndpoint("http://h:1/metrics", name="chat").label == "chat"


def test_url_password_never_reaches_the_error():
    endpoint = VllmEndpoint(f"http://admin:hunter2@127.0.0.1:{closed_port()}/metrics")
    sample, _ = timed_scrape(endpoint)
    assert "hunter2" not in sample.error and "hunter2" not in sample.endpoint


@pytest.mark.parametrize("kwargs, message", [
    ({"url": "ftp://host/metrics"}, "http"),
    ({"url": "http://host:99999/metrics"}, "port"),
    ({"url": "http://host/metrics", "timeout_seconds": 0}, "timeout"),
    ({"url": "http://host/metrics", "max_response_bytes": -1}, "max_response_bytes"),
    ({"url": "http://host/metrics", "process_pattern": "("}, "process_pattern"),
])
def test_bad_endpoint_config_is_a_clear_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        VllmEndpoint(**kwargs)


def test_source_does_not_let_a_slow_endpoint_delay_the_others(server):
    source = VllmSource([VllmEndpoint(url(server, "/slow"), name="slow", timeout_seconds=0.5),
                         answering(url(server, "/metrics"), name="fast")], clock=server.clock)
    try:
        started, wall = server.clock(), time.monotonic()
        slow, fast = source.sample()
        elapsed = server.clock() - started
        # bounds a hang only: /slow holds its answer 60 s, so a source that waited for it fails
        assert time.monotonic() - wall < 30
    finally:
        source.close()
    assert (slow.endpoint, slow.error_kind) == ("slow", "timeout")
    assert fast.up and fast.scrape_duration_seconds < 0.5
    assert elapsed < 0.5 + 0.5


def test_source_bounds_the_caller_even_when_headers_drip(server, source_waits, monkeypatch):
    # The stuck request is cut off long after this test is over (tests/test_http_deadline.py
    # has the cut-off), so the second sample certainly finds it still running.
    monkeypatch.setattr(httpclient, "CUT_OFF_GRACE_SECONDS", HANG)
    # Each byte comes 0.1 s after the last: 2 s per read is time enough on a loaded machine.
    source = VllmSource([VllmEndpoint(url(server, "/drip_headers"), name="drip", timeout_seconds=2)],
                        clock=server.clock)
    try:
        (first,) = source.sample()
        first_elapsed = sum(source_waits)
        (second,) = source.sample()  # the first request is still being dripped
    finally:
        source.close()
    assert first.error_kind == "timeout" and first_elapsed < 2 + 0.5
    assert second.error_kind == "timeout" and "still running" in second.error
    assert [path for path, _ in server.seen].count("/drip_headers") == 1


class FakeHost:
    def __init__(self, listeners):
        self.listeners = listeners

    def process(self, pid, with_cmdline=False):
        return None

    def parent(self, pid):
        return None

    def pid_listening_on(self, port):
        return self.listeners.get(port)

    def memory(self):
        return None


def test_source_resolves_server_pids_even_when_down(server):
    down_port = closed_port()
    host = FakeHost({server.server_address[1]: 100, down_port: 200})
    source = VllmSource([answering(url(server, "/metrics")),
                         VllmEndpoint(f"http://127.0.0.1:{down_port}/metrics")], host=host)
    try:
        up, down = source.sample()
    finally:
        source.close()
    assert up.pids == (100,)
    assert not down.up and down.pids == (200,)


def test_source_ignores_a_proxy_from_the_environment(server, monkeypatch):
    """A proxy named in the environment would see the bearer token: it is never used."""
    proxy = socket.socket()
    proxy.bind(("127.0.0.1", 0))
    proxy.listen()
    proxy.setblocking(False)
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(name, f"http://127.0.0.1:{proxy.getsockname()[1]}")
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    source = VllmSource([answering(url(server, "/auth/metrics"), bearer_token=TOKEN)])
    try:
        (sample,) = source.sample()
    finally:
        source.close()
    assert sample.up and server.seen[-1] == ("/auth/metrics", f"Bearer {TOKEN}")
    with pytest.raises(BlockingIOError):
        proxy.accept()  # nobody connected to the proxy
    proxy.close()


# -- redirects: bounded like the answer itself, never read, never to another host -------------
class ReadCountingAdapter(requests.adapters.HTTPAdapter):
    """Counts the body bytes the client takes out of each response, per path (after
    decompression: what ends up in memory), and the (connect, read) timeouts each request is
    sent with, at the urllib3 pool the client sends through."""

    def __init__(self):
        super().__init__()
        self.read: dict[str, int] = {}
        self.timeouts: list = []

    def get_connection_with_tls_context(self, request, verify, proxies=None, cert=None):
        return _CountingPool(super().get_connection_with_tls_context(request, verify, proxies, cert), self)


class _CountingPool:
    def __init__(self, pool, adapter):
        self._pool, self._adapter = pool, adapter

    def __getattr__(self, name):
        return getattr(self._pool, name)

    def urlopen(self, method, url, **kwargs):
        timeout = kwargs.get("timeout")
        self._adapter.timeouts.append((timeout.connect_timeout, timeout.read_timeout))
        resp = self._pool.urlopen(method, url, **kwargs)
        path = requests.utils.urlparse(url).path
        counts = self._adapter.read
        counts.setdefault(path, 0)

        def add(data):
            counts[path] += len(data)
            return data
        for name in ("read", "read1"):
            original = getattr(resp, name)
            setattr(resp, name, lambda *a, _original=original, **k: add(_original(*a, **k)))
        chunked = resp.read_chunked  # a chunked body bypasses read()
        resp.read_chunked = lambda *a, **k: (add(piece) for piece in chunked(*a, **k))
        return resp


def counting_scrape(endpoint, **kwargs):
    adapter = ReadCountingAdapter()
    with requests.Session() as session:
        session.mount("http://", adapter)
        return scrape(endpoint, session, **kwargs), adapter


@pytest.mark.parametrize("path", ["/redirect_huge_chunked", "/redirect_gzip_bomb"])
def test_a_redirect_body_is_never_read(server, path):
    """A 302 carrying 400 MiB (chunked) or a 256 MiB gzip bomb: the client drops it unread and
    follows the redirect; the HTTP library would have read it all before following."""
    sample, adapter = counting_scrape(VllmEndpoint(url(server, path), timeout_seconds=30))
    assert sample.up, sample.error
    assert adapter.read[path] == 0
    assert adapter.read["/metrics"] == len(FIXTURE)
    if path == "/redirect_huge_chunked":
        deadline = time.monotonic() + 30  # the server notices the hang-up on its next write
        while not server.sent and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.sent[0] < 64 << 20, "only what fits in socket buffers left the server"


def test_a_redirect_to_a_huge_answer_is_too_large_not_a_timeout(server):
    endpoint = answering(url(server, "/redirect_to_huge"), max_response_bytes=len(FIXTURE) * 2)
    sample, adapter = counting_scrape(endpoint)
    assert sample.error_kind == "too_large"
    assert adapter.read["/huge_chunked"] <= len(FIXTURE) * 2 + (16 << 10)


class StepClock:
    """Each reading is `step` seconds after the last: hops that take time, without waiting."""

    def __init__(self, step):
        self.t, self.step = 0.0, step

    def __call__(self):
        self.t += self.step
        return self.t


def test_every_hop_shares_one_deadline(server):
    sample, adapter = counting_scrape(VllmEndpoint(url(server, "/redirect_loop"), timeout_seconds=50),
                                      clock=StepClock(20))
    # deadline 70 on the clock: hop 1 is sent at 40 with 30 s left, hop 2 at 60 with 10 s, and at
    # 80 there is no time for a third (real seconds enough for a loaded machine to answer in)
    assert sample.error_kind == "timeout"
    assert [t[0] for t in adapter.timeouts] == pytest.approx([30, 10])
    assert [p for p, _ in server.seen] == ["/redirect_loop"] * 2


def test_redirects_stop_after_a_few_hops(server):
    sample, _ = counting_scrape(VllmEndpoint(url(server, "/redirect_loop"), timeout_seconds=30))  # 4 hops
    assert sample.error_kind == "http_status" and f"more than {MAX_REDIRECTS} redirects" in sample.error
    assert len(server.seen) == MAX_REDIRECTS + 1


def test_a_redirect_to_another_host_is_not_followed_and_gets_no_token(server):
    sample, _ = counting_scrape(answering(url(server, "/redirect_elsewhere"), bearer_token=TOKEN))
    assert sample.error_kind == "http_status" and "another host" in sample.error
    assert server.seen == [("/redirect_elsewhere", f"Bearer {TOKEN}")]  # nothing sent to localhost
    assert TOKEN not in sample.error


# -- what the server sends back ------------------------------------------------------------
def test_a_token_echoed_in_pieces_is_redacted_in_every_label(server):
    sample, _ = timed_scrape(answering(url(server, "/echo_split"), bearer_token=TOKEN))
    assert sample.up
    (engine,) = sample.engines
    assert (engine.model, engine.engine) == ("<redacted>", "<redacted>")
    assert sample.cache_config.cache_dtype == "fp8-<redacted>"
    exported = repr(sample)
    for i in range(len(TOKEN) - 7):
        assert TOKEN[i:i + 8] not in exported


def test_impossible_values_are_dropped_named_and_logged_once(server, caplog):
    source = VllmSource([answering(url(server, "/impossible"), name="odd")])
    try:
        with caplog.at_level(logging.WARNING, logger="exporter.sources.vllm"):
            first, = source.sample()
            second, = source.sample()
    finally:
        source.close()
    assert first.up and first.error_kind == ""
    (engine,) = first.engines
    assert engine.kv_cache_usage_ratio is None and engine.preemptions_total is None
    assert engine.requests_running == 4.0  # the sane values of the page are kept
    assert first.rejected_metrics == second.rejected_metrics == ("vllm:kv_cache_usage_perc",
                                                                 "vllm:num_preemptions")
    assert len([r for r in caplog.records if "impossible values" in r.getMessage()]) == 2
