"""One bounded GET against a server we do not control (vLLM, the kubelet, Prometheus), the
one vocabulary of its failures, and the one way to keep credentials out of what we print.

Every hop of a request, redirects included, runs under one total deadline, and no redirect's
body is ever read: the connection of a 3xx answer is dropped at once, so a 302 carrying
gigabytes (chunked, or a gzip bomb) costs nothing. requests' Session.send reads a redirect's
whole body, outside any size bound and deadline, even with allow_redirects=False (it prepares
the next hop), so requests go straight to the session's transport adapter instead. Redirects
are followed only to the same origin (scheme, host and port), so a bearer token is never sent
to another host, and at most `max_redirects` times.
"""
from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit, urlunsplit

import requests
import urllib3.exceptions
from requests.utils import requote_uri, resolve_proxies

from .httpbody import BodyError, read_body

# Stable tokens for error counters, shared by every HTTP client of the exporter.
KINDS = ("refused", "timeout", "tls", "connection", "http_status", "too_large", "parse", "truncated")
MAX_MESSAGE_CHARS = 300
MIN_SECRET_FRAGMENT = 8  # a value holding this many characters of a secret in a row is redacted
REDACTED = "<redacted>"


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
    for hop in range(max_redirects + 1):
        remaining = deadline - clock()
        if remaining <= 0:
            raise HttpFailure("timeout", late)
        response = _send(session, request, min(timeout, remaining), late)
        try:
            if response.is_redirect:
                request = _next_hop(session, request, response, hop < max_redirects, max_redirects)
                continue
            if response.status_code != 200 and not read_error_body:
                return Answer(response.status_code, response.reason or "", b"")
            declared = _content_length(response)
            if declared is not None and declared > max_bytes:
                raise HttpFailure("too_large", f"response of {declared} bytes exceeds the {max_bytes}-byte limit")
            try:
                body = read_body(response, max_bytes, deadline, timeout, clock)
            except BodyError as exc:
                raise HttpFailure(exc.kind, describe(exc.cause) if exc.cause is not None else exc.detail) from None
            return Answer(response.status_code, response.reason or "", body)
        finally:
            response.close()  # drops an unread body's connection instead of reading it
    raise AssertionError("unreachable: the last hop returns or raises")


def _send(session: requests.Session, request: requests.PreparedRequest, seconds: float,
          late: str) -> requests.Response:
    """The session's adapter sends it, with the session's TLS and proxy settings: what
    Session.send does, less the redirect handling that reads bodies without bound."""
    try:
        adapter = session.get_adapter(request.url or "")
        proxies = resolve_proxies(request, dict(session.proxies), session.trust_env)
        # verify None (unset) would turn TLS verification off in the adapter: requests' default is True.
        verify = True if session.verify is None else session.verify
        return adapter.send(request, stream=True, timeout=(seconds, seconds), verify=verify,
                            cert=session.cert, proxies=proxies)
    except requests.exceptions.RequestException as exc:
        failure = failure_of(exc)
        if failure.kind == "timeout":
            raise HttpFailure("timeout", late) from None
        raise failure from None


def _next_hop(session: requests.Session, request: requests.PreparedRequest, response: requests.Response,
              allowed: bool, max_redirects: int) -> requests.PreparedRequest:
    target = urljoin(request.url or "", session.get_redirect_target(response) or "")
    status = f"HTTP {response.status_code} redirect to {public_url(target)}"
    if not allowed:
        why = "redirects are not followed" if max_redirects == 0 else f"more than {max_redirects} redirects"
        raise HttpFailure("http_status", f"{status}: {why}")
    if _origin(target) != _origin(request.url or ""):
        raise HttpFailure("http_status", f"{status}: not followed to another host, scheme or port")
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


def _content_length(response: requests.Response) -> int | None:
    try:
        value = int(response.headers.get("Content-Length", ""))
    except ValueError:
        return None
    return value if value >= 0 else None


def failure_of(exc: BaseException) -> HttpFailure:
    """The kind of a failed request (requests, urllib3 and socket errors alike)."""
    if _caused_by(exc, requests.exceptions.SSLError, urllib3.exceptions.SSLError):
        kind = "tls"
    elif _caused_by(exc, ConnectionRefusedError):
        kind = "refused"
    elif _caused_by(exc, requests.exceptions.Timeout, TimeoutError, socket.timeout,
                    urllib3.exceptions.TimeoutError):
        kind = "timeout"
    else:
        kind = "connection"
    return HttpFailure(kind, describe(exc))


def describe(exc: BaseException) -> str:
    """`Type (innermost reason)`, with any URL cut out (it may carry credentials or a token)."""
    inner = exc
    for _ in range(10):  # bounded: exception chains can loop
        nxt = _cause(inner)
        if nxt is None:
            break
        inner = nxt
    reason = str(inner.args[-1] if getattr(inner, "args", None) else inner)
    reason = " ".join(word if "://" not in word else "<url>" for word in reason.split(" "))
    text = f"{type(exc).__name__} ({reason})" if reason and inner is not exc else f"{type(exc).__name__}: {reason}"
    return printable(text)[:MAX_MESSAGE_CHARS]


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
