"""The listener's sockets: no thread ever waits on a client.

One event-loop thread accepts connections, does the TLS handshake and gathers each request head
under one total deadline; a small fixed pool of worker threads turns complete heads into answers
(the standard library's HTTP parser and WSGI handler, run in memory); the loop sends the answer
under a second deadline. A slow or silent client costs a socket and a few kilobytes, never a
thread, and the sampler (its own thread) never competes with a crowd of handler threads.

At `max_connections` a new connection evicts the oldest one that is only waiting on its client
(its head or its answer is still in flight), so clients that trickle bytes cannot lock out a
scraper that sends its request at once; when every connection is being answered, the new one is
closed at once.
"""
from __future__ import annotations

import asyncio
import io
import logging
import resource
import socket
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from socketserver import BaseServer
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, cast
from wsgiref.simple_server import ServerHandler, WSGIRequestHandler

from .webconfig import WebConfig, ssl_context

if TYPE_CHECKING:
    from _typeshed import OptExcInfo
    from _typeshed.wsgi import StartResponse, WSGIApplication, WSGIEnvironment

log = logging.getLogger("exporter.serve.server")

# Request line + headers. Prometheus sends well under 1 KiB; http.server alone bounds each line
# (64 KiB) and the count (100), which still lets one request hold 6 MB.
MAX_REQUEST_HEAD_BYTES = 64 << 10
# A connection waiting on its client costs a socket and about 12 KiB, not a thread (1,000 held
# ones: +13 MiB resident in bench/listener_attack.py): the cap bounds memory and file descriptors
# (a quarter of the process's limit at most). Past it, held connections are dropped and an
# attacker's reconnects turn into a connection flood, which costs far more than holding them.
_FD_LIMIT = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
MAX_CONNECTIONS = min(1024, _FD_LIMIT // 4) if _FD_LIMIT > 0 else 1024  # -1: unlimited
HEAD_TIMEOUT_SECONDS = 10.0  # from accept to the end of the head, TLS handshake included
WRITE_TIMEOUT_SECONDS = 10.0  # to hand the whole answer to the kernel
WORKERS = 4
LINGER_SECONDS = 2.0  # after the answer, what the client still sends is read for this long ...

# Control characters (ESC, CR, ...) from request lines must not reach a terminal or a log as is.
_ESCAPE = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7f)}


def _printable(value: object) -> object:
    return value.translate(_ESCAPE) if isinstance(value, str) else value


class _Handler(ServerHandler):
    def log_exception(self, exc_info: OptExcInfo) -> None:  # a bug in the app: logged, not printed raw
        log.error("request failed", exc_info=exc_info)


class _Exchange(WSGIRequestHandler):
    """One request answered in memory by the standard library's parser and WSGI handler: the
    event loop gathered the head and sends `reply`, so this never touches a socket."""

    def __init__(self, head: bytes, client_address: Any, app: WSGIApplication,
                 base_environ: dict[str, str]) -> None:  # not super().__init__: it does socket I/O
        self.client_address = client_address
        self.server = cast(BaseServer, SimpleNamespace(base_environ=base_environ))  # for get_environ
        self.head, self.app = head, app
        self.rfile, self.wfile = self._in, self._out = io.BytesIO(head), io.BytesIO()
        self.handle()
        self.reply = self._out.getvalue()

    def handle(self) -> None:
        self.raw_requestline = self._in.readline(65537)
        if len(self.raw_requestline) > 65536:
            self.requestline = self.request_version = self.command = ""
            self.send_error(414)
            return
        if len(self.head) > MAX_REQUEST_HEAD_BYTES:  # the head did not end within the limit
            self.requestline, self.request_version, self.command = "", "HTTP/1.0", ""
            self.send_error(431, "Request header fields too large")
            return
        if not self.parse_request():
            return
        handler = _Handler(self._in, self._out, sys.stderr, self.get_environ(), multithread=True)
        handler.request_handler = self  # type: ignore[attr-defined]  # its close() logs the request
        handler.run(self.app if self.command != "HEAD" else _without_body(self.app))

    def parse_request(self) -> bool:
        ok = super().parse_request()
        if ok and self.request_version == "HTTP/0.9":  # "GET /": an answer needs a status line
            self.request_version = "HTTP/1.0"
            self.send_error(400, "Bad request: no HTTP version")
            return False
        return ok

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.client_address[0], *map(_printable, args))


async def _discard_until_eof(reader: asyncio.StreamReader) -> None:
    """... and dropped, until it closes: closing with unread data would send a reset, which can
    destroy the answer before the client reads it (a client sending a head far past the limit)."""
    while await reader.read(64 << 10):
        pass


def _without_body(app: WSGIApplication) -> WSGIApplication:
    """HEAD: the GET answer's status and headers (Content-Length included), no body."""
    def head(environ: WSGIEnvironment, start_response: StartResponse) -> list[bytes]:
        result = app(environ, start_response)
        if hasattr(result, "close"):
            result.close()
        return []
    return head


class HttpServer:
    """Binds at construction (an OSError says the address is taken); serves from start()."""

    def __init__(self, app: WSGIApplication, host: str, port: int, web: WebConfig | None = None, *,
                 max_connections: int = MAX_CONNECTIONS, head_timeout: float = HEAD_TIMEOUT_SECONDS,
                 write_timeout: float = WRITE_TIMEOUT_SECONDS, workers: int = WORKERS) -> None:
        self._ssl = ssl_context(web) if web and web.tls else None  # a bad certificate fails before binding
        self.tls = self._ssl is not None
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # socketserver's default backlog is 5: a burst of connections beyond the backlog has its
        # SYNs dropped, and a scraper among them waits out TCP retransmits (1 s, 3 s, 7 s...).
        self._listener = socket.create_server((host, port), family=family, backlog=1024)
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self.max_connections = max_connections
        self.head_timeout = head_timeout
        self.write_timeout = write_timeout
        self._app = app
        self._environ = {"SERVER_NAME": host, "GATEWAY_INTERFACE": "CGI/1.1", "SERVER_PORT": str(self.port),
                         "REMOTE_HOST": "", "CONTENT_LENGTH": "", "SCRIPT_NAME": "",
                         "HTTPS": "on" if self.tls else "off"}
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="http-worker")
        self._loop = asyncio.new_event_loop()
        self._loop.set_exception_handler(self._loop_error)
        self._stopping = asyncio.Event()  # bound to the loop that first waits on it
        self._connections: set[asyncio.Task[None]] = set()
        self._waiting: dict[asyncio.Task[None], None] = {}  # waiting on their client, oldest first
        self._thread = threading.Thread(target=lambda: self._loop.run_until_complete(self._serve()),
                                        name="http", daemon=True)

    def start(self) -> HttpServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stopping.set)
            self._thread.join(10)
        self._pool.shutdown(wait=False, cancel_futures=True)
        if not self._thread.is_alive():
            self._loop.close()
        self._listener.close()

    @property
    def open_connections(self) -> int:
        return len(self._connections)

    async def _serve(self) -> None:
        accepting = asyncio.create_task(self._accept())
        await self._stopping.wait()
        for task in (accepting, *self._connections):
            task.cancel()
        await asyncio.gather(accepting, *self._connections, return_exceptions=True)

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, peer = await loop.sock_accept(self._listener)
            except OSError as exc:  # out of file descriptors, a connection reset before accept
                log.warning("accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            if len(self._connections) >= self.max_connections and not self._evict_one():
                sock.close()  # every connection is being answered: refused at once, never queued
                continue
            task = loop.create_task(self._connection(sock, peer))
            self._connections.add(task)
            self._waiting[task] = None
            task.add_done_callback(self._connections.discard)
            # Let it read what its client already sent before the next accept can evict it: in
            # a burst of connections, a scraper's request is in the kernel's buffer already.
            await asyncio.sleep(0)

    def _evict_one(self) -> bool:
        """Drop the connection that has waited longest on its client."""
        for task in self._waiting:
            del self._waiting[task]
            self._connections.discard(task)
            task.cancel()
            log.debug("connection limit (%d) reached: dropped the oldest waiting connection",
                      self.max_connections)
            return True
        return False

    async def _connection(self, sock: socket.socket, peer: Any) -> None:
        task = asyncio.current_task()
        assert task is not None  # this coroutine always runs as its own task
        loop = asyncio.get_running_loop()
        streams: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        done = False
        try:
            head = await asyncio.wait_for(self._read_head(sock, streams), self.head_timeout)
            if not head:
                return
            self._waiting.pop(task, None)  # being answered: not evicted
            exchange = await loop.run_in_executor(self._pool, _Exchange, head, peer, self._app, self._environ)
            reply = exchange.reply
            self._waiting[task] = None
            reader, writer = streams[0]
            writer.transport.set_write_buffer_limits(high=0)  # drain() waits for the last byte
            writer.write(reply)
            await asyncio.wait_for(writer.drain(), self.write_timeout)
            done = True
            if writer.can_write_eof():  # plain TCP: a lingering close, as HTTP servers do
                writer.write_eof()  # FIN first: a client still sending sees the answer, not a reset
                await asyncio.wait_for(_discard_until_eof(reader), LINGER_SECONDS)
        except (OSError, asyncio.TimeoutError) as exc:  # ssl.SSLError is an OSError
            log.debug("connection from %s dropped: %s", peer[0], _printable(str(exc)) or type(exc).__name__)
        finally:
            self._waiting.pop(task, None)
            if not streams:
                sock.close()
            elif done:
                streams[0][1].close()
            else:
                streams[0][1].transport.abort()

    async def _read_head(self, sock: socket.socket,
                         streams: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]) -> bytes:
        """The request line and headers (up to one byte past the limit, so the parser sees it),
        or what came before the client stopped sending."""
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=MAX_REQUEST_HEAD_BYTES + 1)
        protocol = asyncio.StreamReaderProtocol(reader)
        transport, _ = await loop.connect_accepted_socket(
            lambda: protocol, sock, ssl=self._ssl, ssl_handshake_timeout=self.head_timeout if self._ssl else None)
        streams.append((reader, asyncio.StreamWriter(transport, protocol, reader, loop)))
        head = bytearray()
        first_line_seen = False
        while len(head) <= MAX_REQUEST_HEAD_BYTES:
            chunk = await reader.read(MAX_REQUEST_HEAD_BYTES + 1 - len(head))
            if not chunk:
                break
            start = max(0, len(head) - 3)  # search the new bytes only: one byte at a time stays linear
            head += chunk
            ends = [i + len(blank) for blank in (b"\n\r\n", b"\n\n") if (i := head.find(blank, start)) >= 0]
            if ends:
                return bytes(head[:min(ends)])  # a body, if any, is never read
            end = -1 if first_line_seen else head.find(b"\n", start)
            if end >= 0:
                first_line_seen = True
                words = head[:end].split()
                if not words or not words[-1].startswith(b"HTTP/"):
                    return bytes(head[:end + 1])  # "GET /" has no headers to wait for: answered 400 at once
        return bytes(head)

    def _loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if isinstance(exc, OSError):  # a client that went away mid-handshake: routine
            log.debug("%s: %s", context.get("message"), exc)
        else:
            log.error("listener: %s", context.get("message"), exc_info=exc)

