"""A server that drips its headers a byte at a time, for ever: socket timeouts bound each read,
never the exchange. The scrape must end at its deadline, and closing a source (a reload, SIGTERM)
must end a scrape still running, leaving no thread or socket behind (#21 M7, L2)."""
from __future__ import annotations

import socket
import threading
import time

import pytest

from exporter.sources.vllm import VllmEndpoint, VllmSource
from helpers.daemon import Daemon
from helpers.tools import HANG


class DrippingServer:
    """Answers every request with a status line and then one header byte every 50 ms until the
    client goes away. Counts the connections it is still dripping into."""

    def __init__(self):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/metrics"
        self.lock = threading.Lock()
        self.open = 0
        self.requests = 0
        self.stopping = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self.stopping.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._drip, args=(conn,), daemon=True).start()

    def _drip(self, conn):
        with conn:
            conn.recv(65536)  # the request head (small, in one piece on loopback)
            with self.lock:
                self.open += 1
                self.requests += 1
            try:
                conn.sendall(b"HTTP/1.1 200 OK\r\nX-Drip: ")
                while not self.stopping.wait(0.05):
                    conn.sendall(b"a")
            except OSError:  # the client went away: what the tests wait for
                pass
            finally:
                with self.lock:
                    self.open -= 1

    def close(self):
        self.stopping.set()
        self.listener.close()


@pytest.fixture
def dripping():
    server = DrippingServer()
    yield server
    server.close()


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + HANG
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.02)


def scrape_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("vllm-scrape")]


def test_a_scrape_whose_headers_drip_is_cut_at_its_deadline(dripping):
    """Before: the scrape's thread read the drip for as long as it lasted, and every later
    sample said "previous scrape still running"."""
    source = VllmSource([VllmEndpoint(dripping.url, name="drip", timeout_seconds=0.3)])
    try:
        (sample,) = source.sample()
        assert sample.error_kind == "timeout"
        wait_until(lambda: dripping.open == 0, "the scrape's connection closed")
        wait_until(lambda: not source._inflight[0].running(), "the scrape's thread free again")
        (again,) = source.sample()  # a new attempt, not the old one still hanging
        assert again.error_kind == "timeout" and "still running" not in again.error
        # The retry waits 0.25 s at most: the server may read it after that, under load.
        wait_until(lambda: dripping.requests == 2, "the second attempt reached the server")
    finally:
        source.close()


def test_closing_a_source_ends_the_scrape_it_is_running(dripping):
    """A reload replaces the sources and closes the old ones: their stuck scrape must end with
    them (before: one thread and one socket left behind per reload)."""
    before = len(scrape_threads())
    source = VllmSource([VllmEndpoint(dripping.url, name="drip", timeout_seconds=3600)])
    samples = []
    sampler = threading.Thread(target=lambda: samples.append(source.sample()), daemon=True)
    sampler.start()
    wait_until(lambda: dripping.open == 1, "the scrape to be dripped into")
    source.close()
    wait_until(lambda: dripping.open == 0, "the scrape's connection closed")
    sampler.join(HANG)
    assert not sampler.is_alive() and samples[0][0].up is False
    wait_until(lambda: len(scrape_threads()) <= before, "the scrape's thread gone")


@pytest.mark.slow
@pytest.mark.integration
def test_reloads_and_sigterm_leave_no_scrape_behind(dripping, tmp_path):
    """#21 M7 and L2 through the real entry point: five reloads while an endpoint drips its
    headers leave one connection to it, not six (before: a thread and a socket per reload, each
    reading the drip for as long as it lasted), and SIGTERM ends the daemon without waiting for
    the drip (before: the interpreter's exit waited for those threads)."""
    config = tmp_path / "c.yml"
    # Each tick waits for the endpoint's 2 s deadline: /healthz must not call that stale.
    config.write_text(f"interval_seconds: 0.2\nstale_after_seconds: 600\nvllm:\n  endpoints: "
                      f"[{{url: '{dripping.url}', timeout_seconds: 2}}]\n")
    daemon = Daemon("--config", str(config), "--simulate", "steady")
    try:
        daemon.wait_healthy()
        wait_until(lambda: dripping.open == 1, "the first scrape")
        for reloads in range(1, 6):
            assert "configuration reloaded" in daemon.reload()
            wait_until(lambda n=reloads: dripping.requests > n, "the new sources' scrape")
        wait_until(lambda: dripping.open <= 1, "one connection to the endpoint, the live sources'")
        code, out = daemon.stop()
        assert code == 0, out
    finally:
        daemon.kill()


@pytest.mark.integration
def test_sigterm_does_not_wait_for_a_scrape_stuck_on_dripped_headers(dripping, tmp_path):
    """#21 L2: the interpreter's exit joined the scrape's thread, which read the drip for as long
    as it lasted (59 s in the report; here, for ever)."""
    config = tmp_path / "c.yml"
    config.write_text(f"interval_seconds: 0.2\nstale_after_seconds: 600\nvllm:\n  endpoints: "
                      f"[{{url: '{dripping.url}', timeout_seconds: 2}}]\n")
    daemon = Daemon("--config", str(config), "--simulate", "steady")
    try:
        daemon.wait_healthy()
        wait_until(lambda: dripping.open == 1, "a scrape being dripped into")
        code, out = daemon.stop()  # fails if the daemon is still there after HANG
        assert code == 0, out
    finally:
        daemon.kill()


def test_analyze_prometheus_ends_at_its_deadline_against_a_dripping_server():
    """`analyze --prometheus` against a Prometheus that drips its answer: the query ends at its
    deadline with a clear error, instead of holding the command for as long as the server
    likes."""
    from exporter.postmortem.promquery import PromQueryError, fetch

    server = DrippingServer()
    try:
        done: list[BaseException] = []

        def run():
            try:
                fetch(f"http://127.0.0.1:{server.port}", 1_700_000_000, 1_700_000_600, timeout=1.0)
            except BaseException as exc:  # the test asserts what it was
                done.append(exc)
        worker = threading.Thread(target=run, daemon=True)
        worker.start()
        worker.join(HANG)
        assert not worker.is_alive(), "analyze --prometheus did not end at its deadline"
        assert len(done) == 1 and isinstance(done[0], PromQueryError), done
        assert "no complete response within 1s" in str(done[0]), done[0]
    finally:
        server.close()
