"""A stand-in for a vLLM server's /metrics: an HTTP/1.1 keep-alive server answering every GET
with one file's body (a fixture's first line, its provenance comment, aside), as uvicorn serves
a page, and as late as a real server answers. Used by overhead.py and vllm_page_cost.py.

    python bench/pageserver.py FILE [DELAY_MS]    # prints its port, serves until killed

The delay matters to the client's CPU, not only to its wall time: against a real vLLM 0.32 API
server (scripts/vllm_cpu.py, 581 lines), which took 7.7 ms to answer on the project's 2-core
machine, one scrape cost the exporter 1.08-1.19 ms of CPU (medians of two runs); against this
server answering at once, 0.64-0.74 ms; answering 8 ms late, 1.08-1.33 ms. A thread that waits
for its answer wakes on a cold cache, and the daemon's scrapes, 5 s apart, always do.
"""
from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

# How late a real vLLM 0.32's API server answered /metrics here: rendering the page (its
# prometheus_client registry, every request histogram) takes it that long.
REAL_DELAY_MS = 8.0


def _server(path: str, delay_ms: float) -> ThreadingHTTPServer:
    body = Path(path).read_bytes().partition(b"\n")[2]

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # As uvicorn (asyncio sets TCP_NODELAY): headers and body written apart would otherwise
        # wait on the client's delayed ACK, 40 ms an exchange.
        disable_nagle_algorithm = True

        def do_GET(self) -> None:
            time.sleep(delay_ms / 1000)
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    return ThreadingHTTPServer(("127.0.0.1", 0), Handler)


@contextlib.contextmanager
def page_server(path: str, delay_ms: float = REAL_DELAY_MS) -> Iterator[str]:
    """Serve `path` on a thread of this process; yields its /metrics URL."""
    server = _server(path, delay_ms)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    finally:
        server.shutdown()
        server.server_close()


if __name__ == "__main__":
    server = _server(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else REAL_DELAY_MS)
    print(server.server_address[1], flush=True)
    server.serve_forever()
