"""sources/httpclient.py: one watchdog thread keeps every exchange's deadline, and connections are
kept alive from one exchange to the next, with every bound of a single exchange kept (#18).

The deadline itself, against servers that drip headers or bodies, is tested in
tests/test_http_deadline.py and tests/test_vllm_scrape.py; here, what the shared watchdog and
the kept-alive connections change."""
from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler

import pytest
import requests

from exporter.sources import httpclient
from exporter.sources.httpclient import HttpFailure, Watchdog, get, new_session
from helpers.httpserver import QuietOnHangUp
from helpers.tools import HANG

PAGE = b"vllm:num_requests_running 1\n" * 2000  # about 56 KiB: more than one read of the body


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as uvicorn

    def log_message(self, *args):
        pass

    def setup(self):
        super().setup()
        with self.server.lock:
            self.server.connections += 1

    def do_GET(self):
        body = b"not here" if self.path == "/missing" else PAGE
        self.send_response(404 if self.path == "/missing" else 200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture()
def server():
    httpd = QuietOnHangUp(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    httpd.lock = threading.Lock()
    httpd.connections = 0
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def fetch(session, server, path="/metrics", max_bytes=1 << 20):
    request = session.prepare_request(requests.Request("GET", f"http://127.0.0.1:{server.server_address[1]}{path}"))
    return get(session, request, timeout=HANG, max_bytes=max_bytes)


def test_one_connection_serves_exchange_after_exchange(server):
    """Before: requests' layers over the same pool; now the pool itself. Either way a body read
    to its end gives the connection back for the next exchange."""
    with new_session() as session:
        bodies = [fetch(session, server).body for _ in range(5)]
    assert bodies == [PAGE] * 5
    assert server.connections == 1


def test_an_unread_body_drops_its_connection_never_reads_it(server):
    with new_session() as session:
        assert fetch(session, server, "/missing").status == 404  # its body left unread
        assert fetch(session, server).body == PAGE
    assert server.connections == 2


def test_the_size_bound_holds_on_a_kept_alive_connection(server):
    with new_session() as session:
        assert fetch(session, server).body == PAGE
        with pytest.raises(HttpFailure) as failure:
            fetch(session, server, max_bytes=len(PAGE) - 1)
        assert failure.value.kind == "too_large"
        assert fetch(session, server).body == PAGE  # the session still works


def test_exchanges_start_no_thread_of_their_own(server, monkeypatch):
    """Before: a timer thread per exchange. Now one watchdog thread for all of them."""
    started: list[str] = []
    start = threading.Thread.start

    def counted(thread):
        started.append(thread.name)
        start(thread)
    with new_session() as session:
        fetch(session, server)  # the watchdog's thread, if not running yet
        monkeypatch.setattr(threading.Thread, "start", counted)
        for _ in range(20):
            fetch(session, server)
    assert started == []
    assert [t.name for t in threading.enumerate()].count("http-deadline") == 1


class SteppedClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def wait_until(condition, what):
    deadline = time.monotonic() + HANG
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.01)


def test_the_watchdog_runs_what_is_due_and_never_what_was_cancelled():
    clock = SteppedClock()
    watchdog = Watchdog(clock)
    ran: list[str] = []
    cancelled = watchdog.arm(1.0, lambda: ran.append("cancelled"))
    kept = watchdog.arm(2.0, lambda: ran.append("kept"))
    cancelled.cancel()
    clock.t = 5.0
    watchdog.arm(0.0, lambda: ran.append("now"))  # due before what the thread sleeps towards: wakes it
    wait_until(lambda: len(ran) == 2, "the due alarms to run")
    assert ran == ["kept", "now"]  # in order of their time; the cancelled one dropped unrun
    assert watchdog.pending() == 0
    kept.cancel()  # after it ran: nothing happens


def test_the_watchdog_survives_an_action_that_raises():
    watchdog = Watchdog()
    ran = threading.Event()

    def broken():
        raise RuntimeError("a bug in an action")
    watchdog.arm(0.0, broken)
    watchdog.arm(0.0, ran.set)
    assert ran.wait(HANG)


def test_cancelled_alarms_do_not_pile_up(monkeypatch):
    """Deadlines far off, each cancelled at once (every exchange that ends in time): the
    watchdog keeps a bounded number of them, not one per exchange until its time."""
    monkeypatch.setattr(httpclient, "COMPACT_ABOVE", 10)
    watchdog = Watchdog(SteppedClock())
    for _ in range(100):
        watchdog.arm(3600.0, lambda: None).cancel()
    assert watchdog.pending() <= 11


def test_a_failed_connection_is_named_by_its_kind_and_reason_not_the_librarys_wrapper(monkeypatch):
    """What the status page and the logs show: "connection refused", not urllib3's
    "MaxRetryError (Connection refused)"; and a name that does not resolve is no time-out,
    though urllib3 2 derives its NameResolutionError from ConnectTimeoutError."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    listener.close()  # nobody listens there now
    with pytest.raises(requests.ConnectionError) as refused:
        requests.get(f"http://127.0.0.1:{port}/metrics", timeout=HANG)
    failure = httpclient.failure_of(refused.value)
    assert (failure.kind, str(failure)) == ("refused", "connection refused")

    # A name that does not resolve, through requests and urllib3 as they are; the resolver answers
    # at once here (a real one may wait on a DNS server).
    def no_such_name(*args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_such_name)
    with pytest.raises(requests.ConnectionError) as unresolved:
        requests.get("http://vllm.example.invalid:8000/metrics", timeout=HANG)
    failure = httpclient.failure_of(unresolved.value)
    assert (failure.kind, str(failure)) == ("connection", "cannot connect: Name or service not known")
