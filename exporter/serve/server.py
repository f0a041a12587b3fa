"""The listener's sockets: no thread ever waits on a client.

One event-loop thread accepts connections, does the TLS handshake and gathers each request head
under one total deadline; a small fixed pool of worker threads turns complete heads into answers
(the standard library's HTTP parser and WSGI handler, run in memory); the loop sends the answer
under a second deadline. A slow or silent client costs a socket and a few kilobytes, never a
thread, and the sampler (its own thread) never competes with a crowd of handler threads.

Who may hold a connection is admission.py's: limits per peer and in all, with a much smaller one
for unfinished TLS handshakes; a connection past them is closed at once.

TLS runs over memory buffers (ssl.MemoryBIO), not asyncio's SSL transport, which gives every
connection a 256 KiB read buffer from its first byte (1,000 half-finished handshakes: +300 MiB
resident, never given back; #21 H1). Here the socket is read only when OpenSSL asks for more, at
most 4 KiB at a time, so what a connection holds beyond OpenSSL's own state (a record buffer)
is bounded by that. docs/architecture.md has the worst case.
"""
from __future__ import annotations

import asyncio
import functools
import io
import logging
import resource
import socket
import ssl
import struct
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from socketserver import BaseServer
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, TypeVar, cast
from wsgiref.simple_server import ServerHandler, WSGIRequestHandler

from .admission import ANSWER, HANDSHAKE, HEAD, LINGER, WRITE, Admission, Slot, peer_of
from .webconfig import WebConfig, ssl_context

if TYPE_CHECKING:
    from _typeshed import OptExcInfo
    from _typeshed.wsgi import StartResponse, WSGIApplication, WSGIEnvironment

log = logging.getLogger("exporter.serve.server")
_T = TypeVar("_T")

# Request line + headers. Prometheus sends well under 1 KiB; http.server alone bounds each line
# (64 KiB) and the count (100), which still lets one request hold 6 MB. 16 KiB, as Node.js: every
# open connection may hold one, so it is most of what a full listener costs (docs/architecture.md).
MAX_REQUEST_HEAD_BYTES = 16 << 10
# A connection waiting on its client costs a socket and about 12 KiB, not a thread (1,000 held
# ones: +13 MiB resident in bench/listener_attack.py): the cap bounds memory and file descriptors
# (a quarter of the process's limit at most).
_FD_LIMIT = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
MAX_CONNECTIONS = min(1024, _FD_LIMIT // 4) if _FD_LIMIT > 0 else 1024  # -1: unlimited
# One peer (an address; an IPv6 /64) holds at most this many: a Prometheus server holds one per
# scrape, for milliseconds; bench/load.py's 50 concurrent scrapers share one address. Past it the
# peer's new connections are refused, never another's.
MAX_CONNECTIONS_PER_PEER = 128
# An unfinished TLS handshake can make OpenSSL hold a client's announced handshake message
# (up to 128 KiB) and a record buffer each way: far more than a finished connection.
MAX_HANDSHAKES = 64
MAX_HANDSHAKES_PER_PEER = 16
HEAD_TIMEOUT_SECONDS = 10.0  # from accept to the end of the head, TLS handshake included
WRITE_TIMEOUT_SECONDS = 10.0  # to hand the whole answer to the kernel
WORKERS = 4
LINGER_SECONDS = 2.0  # after the answer, what the client still sends is read for this long ...
READ_BYTES = 16 << 10  # one read of a request head
# One read of a TLS stream, taken only when OpenSSL wants more. Small: OpenSSL's memory buffer
# keeps the largest size it was ever given (its record buffer, 18 KiB, is OpenSSL's own).
TLS_READ_BYTES = 4 << 10
PLAIN_HTTP_TO_TLS = (b"HTTP/1.0 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\nConnection: close\r\n"
                     b"\r\nClient sent an HTTP request to an HTTPS server.\n")
ACCEPT_BATCH = 256  # connections accepted in a row before the others run
BACKLOG = 1024
_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends a reset, no TIME_WAIT left

# Control characters (ESC, CR, ...) from request lines must not reach a terminal or a log as is.
_ESCAPE = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7f)}


def _printable(value: object) -> object:
    return value.translate(_ESCAPE) if isinstance(value, str) else value


# What the `Server` header says: the product, not the Python version the standard library names
# by default (a version is what an attacker looks up).
SERVER = "gpu-memory-exporter"


class _Handler(ServerHandler):
    server_software = SERVER

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
        self.raw_requestline = self._in.readline()  # the head is at most MAX_REQUEST_HEAD_BYTES + 1
        if len(self.head) > MAX_REQUEST_HEAD_BYTES and not self.raw_requestline.endswith(b"\n"):
            # the request line alone is past the limit
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

    # Errors found before the version is read (a bad or unsupported version: "HTTP/9.9", an
    # HTTP/2 preface) are answered in this version, never bare as HTTP/0.9 would be.
    default_request_version = "HTTP/1.0"

    def version_string(self) -> str:  # the `Server` header of the answers sent before the app runs
        return SERVER

    def parse_request(self) -> bool:
        ok = super().parse_request()
        if ok and len(self.requestline.split()) == 2:  # "GET /" (HTTP/0.9): an answer needs a status line
            self.send_error(400, "Bad request: no HTTP version")
            return False
        return ok

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.client_address[0], *map(_printable, args))


def _end_of_head(head: bytearray, start: int, first_line_seen: bool) -> tuple[int, bool]:
    """The head's length if it is complete, else 0 (looking from `start` on), and whether its
    first line has ended. A request line without a version ("GET /") is complete: HTTP/0.9
    sends no headers, and it is answered 400 at once."""
    ends = [i + len(blank) for blank in (b"\n\r\n", b"\n\n") if (i := head.find(blank, start)) >= 0]
    if ends:
        return min(ends), True
    end = -1 if first_line_seen else head.find(b"\n", start)
    if end < 0:
        return 0, first_line_seen
    words = head[:end].split()
    return (0 if words and words[-1].startswith(b"HTTP/") else end + 1), True


def _without_body(app: WSGIApplication) -> WSGIApplication:
    """HEAD: the GET answer's status and headers (Content-Length included), no body."""
    def head(environ: WSGIEnvironment, start_response: StartResponse) -> list[bytes]:
        result = app(environ, start_response)
        if hasattr(result, "close"):
            result.close()
        return []
    return head


class _Plain:
    """A client's socket, read and written by the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket):
        self.loop, self.sock = loop, sock

    async def handshake(self) -> None:
        pass

    async def recv(self, max_bytes: int) -> bytes:
        return await self.loop.sock_recv(self.sock, max_bytes)

    async def send(self, data: bytes) -> None:
        await self.loop.sock_sendall(self.sock, data)

    async def finish(self) -> None:
        """The answer is complete: say so before the socket is half-closed."""

    async def discard_until_eof(self) -> None:
        """After the answer, what the client still sends is dropped until it closes: closing with
        unread data would send a reset, which can destroy the answer before the client reads it
        (a client sending a head far past the limit)."""
        while await self.loop.sock_recv(self.sock, 64 << 10):
            pass

    def close(self) -> None:
        self.sock.close()


class _Tls(_Plain):
    """TLS through memory buffers: the socket is read only when OpenSSL asks for more, 4 KiB at a
    time, so the incoming buffer never holds more."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, context: ssl.SSLContext):
        super().__init__(loop, sock)
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._buffers: tuple[ssl.MemoryBIO, ssl.MemoryBIO] | None = (incoming, outgoing)
        self._tls: ssl.SSLObject | None = context.wrap_bio(incoming, outgoing, server_side=True)

    async def handshake(self) -> None:
        # A TLS client opens with a handshake record (0x16); a request line in plain text is a
        # scraper set to http:// (Prometheus' `scheme`), told so in plain text as Go's servers do,
        # where a dropped connection would leave it guessing.
        first = await super().recv(TLS_READ_BYTES)
        if first[:1].isalpha():
            await super().send(PLAIN_HTTP_TO_TLS)
            raise ssl.SSLError("a plain HTTP request on the TLS listener")
        self._feed(first)
        await self._until_done(lambda: self._open().do_handshake())

    async def recv(self, max_bytes: int) -> bytes:
        try:
            return await self._until_done(lambda: self._open().read(max_bytes))
        except (ssl.SSLZeroReturnError, ssl.SSLEOFError):  # close_notify, or the socket closed
            return b""

    async def send(self, data: bytes) -> None:
        chunks = [memoryview(data)[i:i + (64 << 10)] for i in range(0, len(data), 64 << 10)]
        for chunk in chunks:  # one at a time: the outgoing buffer holds at most one chunk's records
            while chunk:
                chunk = chunk[await self._until_done(functools.partial(self._write, chunk)):]

    async def finish(self) -> None:
        try:
            self._open().unwrap()  # close_notify; the client's own is not waited for
        except ssl.SSLError:
            pass
        await self._flush()

    def close(self) -> None:
        # OpenSSL's state (up to a 128 KiB hello and a record buffer each way) goes now. No frame
        # holds it (the operations reach it through self): the exception that ended a connection
        # keeps its frames in a reference cycle, which the garbage collector, counting Python
        # objects only, may leave alone for a long time.
        self._tls = self._buffers = None
        super().close()

    def _open(self) -> ssl.SSLObject:
        if self._tls is None:
            raise ssl.SSLZeroReturnError("connection closed")
        return self._tls

    def _write(self, chunk: memoryview) -> int:
        return self._open().write(chunk)

    async def _until_done(self, operation: Callable[[], _T]) -> _T:
        while True:
            # Nothing is awaited while an exception from OpenSSL is being handled, and the one
            # raised carries no traceback from ssl.py, whose frames hold the SSLObject (close()).
            failure: ssl.SSLError | None = None
            more = False
            try:
                result = operation()
            except ssl.SSLWantReadError:
                more = True
            except ssl.SSLError as exc:
                failure = exc.with_traceback(None)
            await self._flush()  # what OpenSSL has to say: its hello, a ticket, an alert
            if failure is not None:
                raise failure
            if not more:
                return result
            self._feed(await super().recv(TLS_READ_BYTES))

    def _feed(self, data: bytes) -> None:
        """What the socket gave, to OpenSSL (nothing: the client closed its side)."""
        if self._buffers is None:
            raise ssl.SSLZeroReturnError("connection closed")
        if data:
            self._buffers[0].write(data)
        else:
            self._buffers[0].write_eof()

    async def _flush(self) -> None:
        if self._buffers is not None and self._buffers[1].pending:
            await super().send(self._buffers[1].read())


class HttpServer:
    """Binds at construction (an OSError says the address is taken); serves from start()."""

    def __init__(self, app: WSGIApplication, host: str, port: int, web: WebConfig | None = None, *,
                 max_connections: int = MAX_CONNECTIONS, max_connections_per_peer: int = MAX_CONNECTIONS_PER_PEER,
                 max_handshakes: int = MAX_HANDSHAKES, max_handshakes_per_peer: int = MAX_HANDSHAKES_PER_PEER,
                 head_timeout: float = HEAD_TIMEOUT_SECONDS, write_timeout: float = WRITE_TIMEOUT_SECONDS,
                 workers: int = WORKERS, name: str = "listen") -> None:
        self.name = name  # the configuration key it serves (the `listener` label)
        self._ssl = ssl_context(web) if web and web.tls else None  # a bad certificate fails before binding
        self.tls = self._ssl is not None
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # socketserver's default backlog is 5: a burst of connections beyond the backlog has its
        # SYNs dropped, and a scraper among them waits out TCP retransmits (1 s, 3 s, 7 s...).
        # Not more: every connection queued there can hold a receive buffer of kernel memory.
        self._listener = socket.create_server((host, port), family=family, backlog=BACKLOG)
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self.admission = Admission(max_connections, min(max_connections_per_peer, max_connections),
                                   max_handshakes, min(max_handshakes_per_peer, max_handshakes))
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
        return self.admission.open

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
            self._admit(loop, sock, peer)
            # What else is queued is taken now, a batch at a time: a flood of connections to
            # refuse must not fill the kernel's backlog, where a scraper's SYN would be dropped
            # and wait a second for its retransmit. Between batches the others run.
            for _ in range(ACCEPT_BATCH - 1):
                try:
                    sock, peer = self._listener.accept()
                except (BlockingIOError, InterruptedError):
                    break
                except OSError as exc:
                    log.warning("accept failed: %s", exc)
                    break
                sock.setblocking(False)
                self._admit(loop, sock, peer)
            await asyncio.sleep(0)

    def _admit(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, peer: Any) -> None:
        slot = self.admission.admit(peer_of(peer[0]), self.tls)
        if slot is None:  # closed at once, never queued; a reset leaves no TIME_WAIT behind
            log.debug("connection from %s refused: connection limits reached", _printable(peer[0]))
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
            finally:
                sock.close()
            return
        task = loop.create_task(self._connection(sock, peer, slot))
        slot.evict = task.cancel
        self._connections.add(task)
        task.add_done_callback(self._connections.discard)

    async def _connection(self, sock: socket.socket, peer: Any, slot: Slot) -> None:
        loop = asyncio.get_running_loop()
        channel = _Tls(loop, sock, self._ssl) if self._ssl else _Plain(loop, sock)
        try:
            head = await asyncio.wait_for(self._read_head(channel, slot), self.head_timeout)
            if not head:
                return
            self.admission.move(slot, ANSWER)  # holds a worker: never displaced
            exchange = await loop.run_in_executor(self._pool, _Exchange, head, peer, self._app, self._environ)
            self.admission.move(slot, WRITE)
            await asyncio.wait_for(self._answer(channel, exchange.reply), self.write_timeout)
            self.admission.move(slot, LINGER)
            sock.shutdown(socket.SHUT_WR)  # FIN first: a client still sending sees the answer, not a reset
            await asyncio.wait_for(channel.discard_until_eof(), LINGER_SECONDS)
        except (OSError, asyncio.TimeoutError) as exc:  # ssl.SSLError is an OSError
            log.debug("connection from %s dropped: %s", _printable(peer[0]),
                      _printable(str(exc)) or type(exc).__name__)
        finally:
            self.admission.release(slot)
            channel.close()

    @staticmethod
    async def _answer(channel: _Plain, reply: bytes) -> None:
        await channel.send(reply)
        await channel.finish()

    async def _read_head(self, channel: _Plain, slot: Slot) -> bytes:
        """The request line and headers (up to one byte past the limit, so the parser sees it),
        or what came before the client stopped sending."""
        if slot.state == HANDSHAKE:
            await channel.handshake()
            self.admission.move(slot, HEAD)
        head = bytearray()
        first_line_seen = False
        while len(head) <= MAX_REQUEST_HEAD_BYTES:
            before = len(head)
            # Nothing but `head` is held across the wait: the last chunk kept until the next one
            # arrives would double what a trickling client costs.
            head += await channel.recv(min(READ_BYTES, MAX_REQUEST_HEAD_BYTES + 1 - before))
            if len(head) == before:
                break  # the client stopped sending
            start = max(0, before - 3)  # search the new bytes only: one byte at a time stays linear
            end, first_line_seen = _end_of_head(head, start, first_line_seen)
            if end:
                return bytes(head[:end])  # a body, if any, is never read
        return bytes(head)

    def _loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if isinstance(exc, OSError):  # a client that went away mid-handshake: routine
            log.debug("%s: %s", context.get("message"), exc)
        else:
            log.error("listener: %s", context.get("message"), exc_info=exc)

