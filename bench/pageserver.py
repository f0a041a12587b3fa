"""A stand-in for a vLLM server's /metrics: an HTTP/1.1 keep-alive server answering every GET
with one file's body (a fixture's first line, its provenance comment, aside), as uvicorn serves
a page, and as late as a real server answers. Used by overhead.py and vllm_page_cost.py.

    python bench/pageserver.py FILE [DELAY_MS]    # prints its port, serves until killed

`/metrics/?name[]=...` answers only the samples named, as vLLM's mounted prometheus_client app
does (the exporter asks for its families so), and as much sooner as the real server answers it:
3.0-3.2 ms for its 4 KB against 8.0-8.9 ms for the 50 KB page (vLLM 0.32 on the project's 2-core
machine, medians of 150 keep-alive reads in each of three rounds).

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
from collections.abc import Iterable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs

# How late a real vLLM 0.32's API server answered /metrics here: rendering the page (its
# prometheus_client registry, every request histogram) takes it that long; the few families
# asked for by name, this long.
REAL_DELAY_MS = 8.0
REAL_BY_NAME_DELAY_MS = 3.0


def only_named(body: bytes, names: Iterable[str]) -> bytes:
    """The page's samples of those names, with their families' HELP and TYPE lines."""
    wanted, kept, family_lines = set(names), [], []
    for line in body.decode().splitlines(keepends=True):
        if line.startswith("# HELP "):
            family_lines = [line]
        elif line.startswith("#"):
            family_lines.append(line)
        elif line.partition("{")[0].partition(" ")[0] in wanted:
            kept.extend(family_lines)
            family_lines = []
            kept.append(line)
    return "".join(kept).encode()


def _server(path: str, delay_ms: float) -> ThreadingHTTPServer:
    body = Path(path).read_bytes().partition(b"\n")[2]
    by_name_delay_ms = delay_ms * REAL_BY_NAME_DELAY_MS / REAL_DELAY_MS

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # As uvicorn (asyncio sets TCP_NODELAY): headers and body written apart would otherwise
        # wait on the client's delayed ACK, 40 ms an exchange.
        disable_nagle_algorithm = True

        def do_GET(self) -> None:
            path, _, query = self.path.partition("?")
            names = parse_qs(query).get("name[]") if path == "/metrics/" else None
            time.sleep((by_name_delay_ms if names else delay_ms) / 1000)
            answer = only_named(body, names) if names else body
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

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
