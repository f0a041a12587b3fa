"""One bounded GET against a server we do not control (vLLM, the kubelet, Prometheus), the
one vocabulary of its failures, and the one way to keep credentials out of what we print.

Every hop of a request, redirects included, runs under one total deadline, and no redirect's
body is ever read: the connection of a 3xx answer is dropped at once, so a 302 carrying
gigabytes (chunked, or a gzip bomb) costs nothing. requests' Session.send reads a redirect's
whole body, outside any size bound and deadline, even with allow_redirects=False (it prepares
the next hop), so requests go straight to the session's transport adapter instead. Redirects
are followed only to the same origin (scheme, host and port), so a bearer token is never sent
to another host, and at most `max_redirects` times.

The deadline is hard. Socket timeouts bound each read, not the exchange: a server that drips its
headers a byte at a time holds a read for ever (#21 M7: every reload left a thread and a socket
behind, and SIGTERM waited for them, L2). Sessions from new_session() send through
BoundedAdapter, which knows the connection each thread is using: at the deadline, or when the
session is closed, that connection's socket is shut down and the blocked read returns. One
watchdog thread keeps every exchange's deadline (a thread per request was a quarter of a vLLM
scrape's CPU).

The session is the configuration (TLS, client certificate, proxies, mounted adapter); the
exchange itself goes to the adapter's urllib3 pool, with keep-alive: requests' Response
wrapping (cookies, header copies) was another sixth of a scrape, for nothing we use (#18).
"""
from __future__ import annotations

import contextlib
import heapq
import itertools
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import urljoin, urlsplit, urlunsplit

import requests
import urllib3.exceptions
from requests.adapters import HTTPAdapter
from requests.utils import requote_uri, resolve_proxies
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool
from urllib3.poolmanager import PoolManager
from urllib3.response import BaseHTTPResponse

from .httpbody import BodyError, read_body

# Stable tokens for error counters, shared by every HTTP client of the exporter.
KINDS = ("refused", "timeout", "tls", "connection", "http_status", "too_large", "parse", "truncated")
MAX_MESSAGE_CHARS = 300
MIN_SECRET_FRAGMENT = 8  # a value holding this many characters of a secret in a row is redacted
REDACTED = "<redacted>"
# Past the deadline, the cooperative checks get this long to say "timeout" before the socket is
# shut down under the exchange.
CUT_OFF_GRACE_SECONDS = 0.5
COMPACT_ABOVE = 1024  # alarms kept by the watchdog before cancelled ones are swept out


class HttpFailure(Exception):
    """kind: one of KINDS; message: what went wrong, without URLs or credentials."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind
        self.message = message


@dataclass(frozen=True)
class Answer:
    status: int
    reason: str
    body: bytes  # b"" for a status other than 200 unless the caller asked for error bodies


def get(session: requests.Session, request: requests.PreparedRequest, *, timeout: float,
        max_bytes: int, max_redirects: int = 0, read_error_body: bool = False,
        clock: Callable[[], float] = time.monotonic) -> Answer:
    """Send `request` and read its answer, all of it within `timeout` seconds and `max_bytes`
    (counted after decompression). Raises HttpFailure."""
    deadline = clock() + timeout
    late = f"no complete response within {timeout:g}s"
    with _cut_off_after(session, request.url or "", timeout + CUT_OFF_GRACE_SECONDS, late):
        return _get(session, request, deadline, late, timeout, max_bytes, max_redirects, read_error_body, clock)


def _get(session: requests.Session, request: requests.PreparedRequest, deadline: float, late: str,
         timeout: float, max_bytes: int, max_redirects: int, read_error_body: bool,
         clock: Callable[[], float]) -> Answer:
    for hop in range(max_redirects + 1):
        remaining = deadline - clock()
        if remaining <= 0:
            raise HttpFailure("timeout", late)
        response = _send(session, request, min(timeout, remaining), late)
        try:
            location = _redirect_target(response)
            if location is not None:
                request = _next_hop(request, location, response.status, hop < max_redirects, max_redirects)
                continue
            if response.status != 200 and not read_error_body:
                return Answer(response.status, response.reason or "", b"")
            declared = _content_length(response)
            if declared is not None and declared > max_bytes:
                raise HttpFailure("too_large", f"response of {declared} bytes exceeds the {max_bytes}-byte limit")
            try:
                body = read_body(response, max_bytes, deadline, timeout, clock)
            except BodyError as exc:
                raise HttpFailure(exc.kind, describe(exc.cause) if exc.cause is not None else exc.detail) from None
            return Answer(response.status, response.reason or "", body)
        finally:
            # A body read to its end has already given its connection back for the next
            # exchange (keep-alive); an unread one's connection is dropped, never read.
            response.close()
            response.release_conn()
    raise AssertionError("unreachable: the last hop returns or raises")


@contextlib.contextmanager
def _cut_off_after(session: requests.Session, url: str, seconds: float, late: str) -> Iterator[None]:
    """Shut the exchange's socket down if it is still running after `seconds` (real time)."""
    adapter = session.get_adapter(url) if url else None
    if not isinstance(adapter, BoundedAdapter):
        yield  # a session from elsewhere (a test's): socket timeouts only
        return
    thread, fired = threading.get_ident(), threading.Event()

    def cut_off() -> None:
        fired.set()
        adapter.abort(thread)
    alarm = WATCHDOG.arm(seconds, cut_off)
    try:
        yield
    except HttpFailure:
        if fired.is_set():  # that is why it failed
            raise HttpFailure("timeout", late) from None
        raise
    finally:
        alarm.cancel()


class _Alarm:
    __slots__ = ("action", "cancelled")

    def __init__(self, action: Callable[[], None]):
        self.action = action
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True  # the watchdog drops it when its time comes (no wake-up now)


class Watchdog:
    """One thread that runs each armed action once its time has come, unless it was cancelled
    first. Arming wakes the thread only when the new alarm is due before the one it sleeps
    towards, so exchanges that end in time cost a heap push and a flag, not a thread."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._due: list[tuple[float, int, _Alarm]] = []
        self._order = itertools.count()  # ties: the earlier armed first, and alarms never compared
        self._changed = threading.Condition(threading.Lock())
        self._thread: threading.Thread | None = None

    def arm(self, seconds: float, action: Callable[[], None]) -> _Alarm:
        alarm = _Alarm(action)
        when = self._clock() + seconds
        with self._changed:
            if len(self._due) > COMPACT_ABOVE:  # long deadlines, cancelled early: bound the heap
                self._due = [entry for entry in self._due if not entry[2].cancelled]
                heapq.heapify(self._due)
            wake = not self._due or when < self._due[0][0]
            heapq.heappush(self._due, (when, next(self._order), alarm))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="http-deadline", daemon=True)
                self._thread.start()
            elif wake:
                self._changed.notify()
        return alarm

    def pending(self) -> int:
        """Alarms neither run nor dropped yet (cancelled ones included until their time)."""
        with self._changed:
            return len(self._due)

    def _run(self) -> None:
        while True:
            with self._changed:
                while True:
                    now = self._clock()
                    while self._due and self._due[0][2].cancelled:  # nothing to do for these
                        heapq.heappop(self._due)
                    if self._due and self._due[0][0] <= now:
                        alarm = heapq.heappop(self._due)[2]
                        break
                    self._changed.wait(self._due[0][0] - now if self._due else None)
            try:
                alarm.action()
            except Exception:  # an action must never end the watchdog: every deadline rests on it
                pass


WATCHDOG = Watchdog()


class _InFlight:
    """The connection each thread is using (taken from its pool, not yet given back)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_thread: dict[int, Any] = {}

    def taken(self, connection: Any) -> None:
        with self._lock:
            self._by_thread[threading.get_ident()] = connection

    def given_back(self) -> None:
        with self._lock:
            self._by_thread.pop(threading.get_ident(), None)

    def abort(self, thread: int | None = None) -> None:
        """Shut down the socket of `thread`'s connection (every thread's: None). The thread's
        blocked read returns at once; the connection is then closed, never reused."""
        with self._lock:
            connections = [c for t, c in self._by_thread.items() if thread is None or t == thread]
        for connection in connections:
            sock = getattr(connection, "sock", None)  # a raw socket while TLS shakes hands
            if sock is not None:
                with contextlib.suppress(OSError):
                    socket.socket.shutdown(sock, socket.SHUT_RDWR)  # not SSLSocket's: it drops its state


class _TrackedPool(HTTPConnectionPool):
    in_flight: _InFlight

    def _get_conn(self, timeout: float | None = None) -> Any:
        connection = super()._get_conn(timeout)
        self.in_flight.taken(connection)
        return connection

    def _put_conn(self, conn: Any) -> None:
        self.in_flight.given_back()
        super()._put_conn(conn)


class _TrackedTlsPool(_TrackedPool, HTTPSConnectionPool):
    pass


class _TrackedPools(PoolManager):
    def __init__(self, in_flight: _InFlight, **kwargs: Any):
        super().__init__(**kwargs)
        self.in_flight = in_flight
        self.pool_classes_by_scheme = {"http": _TrackedPool, "https": _TrackedTlsPool}

    def _new_pool(self, scheme: str, host: str, port: int,
                  request_context: dict[str, Any] | None = None) -> HTTPConnectionPool:
        pool = super()._new_pool(scheme, host, port, request_context)
        if isinstance(pool, _TrackedPool):
            pool.in_flight = self.in_flight
        return pool


class BoundedAdapter(HTTPAdapter):
    """requests' transport adapter that can cut an exchange short (abort), and closes with
    nothing left running. `ssl_context`: verify servers with it (a CA read through the bounded
    reader, tlsfiles.ca_context) instead of a CA path that OpenSSL would open itself."""

    def __init__(self, ssl_context: ssl.SSLContext | None = None):
        self._in_flight = _InFlight()
        self._ssl_context = ssl_context
        super().__init__()

    def init_poolmanager(self, connections: int, maxsize: int, block: bool = False, **pool_kwargs: Any) -> None:
        self._pool_connections, self._pool_maxsize, self._pool_block = connections, maxsize, block
        if self._ssl_context is not None:
            pool_kwargs["ssl_context"] = self._ssl_context
        self.poolmanager = _TrackedPools(self._in_flight, num_pools=connections, maxsize=maxsize, block=block,
                                         **pool_kwargs)

    def cert_verify(self, conn: Any, url: str, verify: Any, cert: Any) -> None:
        super().cert_verify(conn, url, verify, cert)  # type: ignore[no-untyped-call]
        if self._ssl_context is not None and verify is True:  # its CA, not certifi's bundle as well
            conn.ca_certs = conn.ca_cert_dir = None

    def abort(self, thread: int | None = None) -> None:
        self._in_flight.abort(thread)

    def close(self) -> None:
        self._in_flight.abort()
        super().close()


def new_session(ssl_context: ssl.SSLContext | None = None) -> requests.Session:
    """A session for get(): hard deadlines, no proxy from the environment (it would see bearer
    tokens) and no ~/.netrc."""
    session = requests.Session()
    session.trust_env = False
    adapter = BoundedAdapter(ssl_context)
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    return session


def _send(session: requests.Session, request: requests.PreparedRequest, seconds: float,
          late: str) -> BaseHTTPResponse:
    """Send the request through the session's adapter's urllib3 pool, with the session's TLS
    and proxy settings: what HTTPAdapter.send does, less the requests.Response it builds (and
    Session.send's redirect handling, which reads bodies without bound)."""
    url = request.url or ""
    try:
        adapter = session.get_adapter(url)
        if not isinstance(adapter, HTTPAdapter):
            raise HttpFailure("connection", f"no HTTP transport for {public_url(url)}")
        proxies = resolve_proxies(request, dict(session.proxies), session.trust_env) if session.proxies \
            or session.trust_env else {}
        # verify None (unset) would turn TLS verification off in the adapter: requests' default is True.
        verify = True if session.verify is None else session.verify
        # requests types it ConnectionPool; an HTTPAdapter's is an HTTP(S)ConnectionPool.
        pool = cast(HTTPConnectionPool, adapter.get_connection_with_tls_context(request, verify, proxies=proxies,
                                                                                cert=session.cert))
        adapter.cert_verify(pool, url, verify, session.cert)  # type: ignore[no-untyped-call]
        return pool.urlopen(method=request.method or "GET", url=adapter.request_url(request, proxies),
                            body=request.body, headers=request.headers, redirect=False, assert_same_host=False,
                            preload_content=False, decode_content=False, retries=adapter.max_retries,
                            timeout=urllib3.Timeout(connect=seconds, read=seconds), chunked=False)
    except HttpFailure:
        raise
    except (requests.exceptions.RequestException, urllib3.exceptions.HTTPError, OSError, ValueError) as exc:
        failure = failure_of(exc)
        if failure.kind == "timeout":
            raise HttpFailure("timeout", late) from None
        raise failure from None


def _redirect_target(response: BaseHTTPResponse) -> str | None:
    """Where a 3xx with a Location points (as requests reads it: UTF-8 sent as Latin-1), else None."""
    location = response.get_redirect_location()
    if not location:
        return None
    try:
        return location.encode("latin1").decode("utf8")
    except UnicodeError:
        return location


def _next_hop(request: requests.PreparedRequest, location: str, status: int, allowed: bool,
              max_redirects: int) -> requests.PreparedRequest:
    target = urljoin(request.url or "", location)
    said = f"HTTP {status} redirect to {public_url(target)}"
    if not allowed:
        why = "redirects are not followed" if max_redirects == 0 else f"more than {max_redirects} redirects"
        raise HttpFailure("http_status", f"{said}: {why}")
    if _origin(target) != _origin(request.url or ""):
        raise HttpFailure("http_status", f"{said}: not followed to another host, scheme or port")
    following = request.copy()
    following.url = requote_uri(urlunsplit(urlsplit(target)._replace(fragment="")))
    return following


def _origin(url: str) -> tuple[str, str, int | None]:
    try:
        parts = urlsplit(url)
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    except ValueError:
        return ("", "", None)
    return (parts.scheme, (parts.hostname or "").lower(), port)


def _content_length(response: BaseHTTPResponse) -> int | None:
    try:
        value = int(response.headers.get("Content-Length", ""))
    except ValueError:
        return None
    return value if value >= 0 else None


# What a message calls each kind of failure, before the innermost reason (not the library's
# wrapper type, a MaxRetryError say, which tells an operator nothing).
_FAILED = {"tls": "TLS failed", "refused": "connection refused", "timeout": "timed out", "connection": "cannot connect"}


def failure_of(exc: BaseException) -> HttpFailure:
    """The kind of a failed request (requests, urllib3 and socket errors alike)."""
    if _caused_by(exc, requests.exceptions.SSLError, urllib3.exceptions.SSLError):
        kind = "tls"
    elif _caused_by(exc, ConnectionRefusedError):
        kind = "refused"
    elif _caused_by(exc, urllib3.exceptions.NewConnectionError) and not _caused_by(exc, TimeoutError):
        # urllib3 2 derives every failed connection (a name not resolved, a network unreachable)
        # from its ConnectTimeoutError: only the operating system's time-out is one.
        kind = "connection"
    elif _caused_by(exc, requests.exceptions.Timeout, TimeoutError, socket.timeout,
                    urllib3.exceptions.TimeoutError):
        kind = "timeout"
    else:
        kind = "connection"
    said, reason = _FAILED[kind], _reason(_innermost(exc))
    message = said if reason.lower() in ("", said) else f"{said}: {reason}"
    return HttpFailure(kind, printable(message)[:MAX_MESSAGE_CHARS])


def describe(exc: BaseException) -> str:
    """`Type (innermost reason)`, with any URL cut out (it may carry credentials or a token)."""
    inner = _innermost(exc)
    reason = _reason(inner)
    text = f"{type(exc).__name__} ({reason})" if reason and inner is not exc else f"{type(exc).__name__}: {reason}"
    return printable(text)[:MAX_MESSAGE_CHARS]


def _innermost(exc: BaseException) -> BaseException:
    inner = exc
    for _ in range(10):  # bounded: exception chains can loop
        nxt = _cause(inner)
        if nxt is None:
            break
        inner = nxt
    return inner


def _reason(inner: BaseException) -> str:
    """The exception's own message, with any URL cut out (it may carry credentials or a token)."""
    reason = str(inner.args[-1] if getattr(inner, "args", None) else inner)
    return " ".join(word if "://" not in word else "<url>" for word in reason.split(" "))


def _cause(exc: BaseException) -> BaseException | None:
    reason = getattr(exc, "reason", None)
    if isinstance(reason, BaseException) and reason is not exc:
        return reason
    if exc.args and isinstance(exc.args[0], BaseException) and exc.args[0] is not exc:
        return exc.args[0]
    nxt = exc.__cause__ or exc.__context__
    return nxt if nxt is not exc else None


def _caused_by(exc: BaseException, *types: type) -> bool:
    seen: BaseException | None = exc
    for _ in range(10):
        if seen is None:
            return False
        if isinstance(seen, types):
            return True
        seen = _cause(seen)
    return False


def printable(text: str) -> str:
    return "".join(c if c.isprintable() else " " for c in text)


def public_url(url: str) -> str:
    """scheme://host[:port]/path: no user, password, query or fragment; never raises."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<invalid url>"
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"  # IPv6 literal
    try:
        port = parts.port
    except ValueError:
        port = None
    return urlunsplit((parts.scheme, host + (f":{port}" if port is not None else ""), parts.path, "", ""))


class Secrets:
    """The credentials of one endpoint, for taking them out of text we print or export.

    A server can echo a secret back in pieces (a token split across two labels), so any run
    of MIN_SECRET_FRAGMENT characters of a secret is redacted, not only the whole secret."""

    def __init__(self, secrets: Iterable[str | None]):
        self._short = tuple(s for s in secrets if s and len(s) < MIN_SECRET_FRAGMENT)
        self._fragments = frozenset(s[i:i + MIN_SECRET_FRAGMENT] for s in secrets
                                    if s and len(s) >= MIN_SECRET_FRAGMENT
                                    for i in range(len(s) - MIN_SECRET_FRAGMENT + 1))

    def scrub(self, text: str) -> str:
        """`text` with every stretch that repeats a secret (or 8+ characters of one) redacted."""
        for secret in self._short:
            text = text.replace(secret, REDACTED)
        if not self._fragments or len(text) < MIN_SECRET_FRAGMENT:
            return text
        covered = [False] * len(text)
        hit = False
        for i in range(len(text) - MIN_SECRET_FRAGMENT + 1):
            if text[i:i + MIN_SECRET_FRAGMENT] in self._fragments:
                covered[i:i + MIN_SECRET_FRAGMENT] = [True] * MIN_SECRET_FRAGMENT
                hit = True
        if not hit:
            return text
        out, i = [], 0
        while i < len(text):
            if covered[i]:
                out.append(REDACTED)
                while i < len(text) and covered[i]:
                    i += 1
            else:
                out.append(text[i])
                i += 1
        return "".join(out)
