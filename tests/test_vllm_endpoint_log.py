"""The vLLM source says in its log when an endpoint stops answering and when it answers again,
once each (the newcomer's trial: a real server too busy to answer /metrics within its timeout
showed "down timeout" on the status page and nothing in the log for ten minutes)."""
from __future__ import annotations

import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from exporter.model import Snapshot
from exporter.sources.vllm import VllmEndpoint, VllmSource

PAGE = (Path(__file__).parent / "fixtures" / "vllm" / "v0_32_cpu_idle.prom").read_bytes().partition(b"\n")[2]


class _Page(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):
        body = PAGE if self.status == 200 else b"busy"
        self.send_response(self.status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_an_endpoint_going_down_and_coming_back_is_logged_once_each(caplog):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    source = VllmSource([VllmEndpoint(url=f"http://127.0.0.1:{server.server_port}/metrics", name="busy",
                                      timeout_seconds=30)])
    ups = []
    try:
        with caplog.at_level(logging.INFO, logger="exporter.sources.vllm"):
            for status in (503, 200, 503, 503, 503, 200, 200):
                _Page.status = status
                ups.append(source.collect(Snapshot(0.0)).snapshot.vllm[0].up)
    finally:
        source.close()
        server.shutdown()
        server.server_close()
    assert ups == [False, True, False, False, False, True, True]
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if "vLLM endpoint busy" in r.getMessage()]
    assert [level for level, _ in lines] == [logging.WARNING, logging.INFO] * 2
    # Down at the first scrape (a server still starting): its first answer is no "again".
    assert "answers for the first time" in lines[1][1] and "again" not in lines[1][1]
    assert "is down (http_status)" in lines[2][1] and "answers again" in lines[3][1]


def test_an_endpoint_answering_again_in_a_tick_of_a_stopping_loop_is_not_announced(caplog):
    """Shutdown (the daemon's "stopping" line) during the tick in which the endpoint answers
    again: no recovery line after it (daemon.Daemon.run runs its ticks under ticks_until)."""
    from exporter.sources.source import request_stop, ticks_until

    server = ThreadingHTTPServer(("127.0.0.1", 0), _Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    source = VllmSource([VllmEndpoint(url=f"http://127.0.0.1:{server.server_port}/metrics", name="busy",
                                      timeout_seconds=30)])
    stop = threading.Event()
    try:
        with caplog.at_level(logging.INFO, logger="exporter.sources.vllm"), ticks_until(stop):
            for status in (200, 503):
                _Page.status = status
                source.collect(Snapshot(0.0))
            request_stop(stop)
            _Page.status = 200
            assert source.collect(Snapshot(0.0)).snapshot.vllm[0].up
    finally:
        _Page.status = 200
        source.close()
        server.shutdown()
        server.server_close()
    lines = [r.getMessage() for r in caplog.records if "vLLM endpoint busy" in r.getMessage()]
    assert len(lines) == 1 and "is down" in lines[0], lines
