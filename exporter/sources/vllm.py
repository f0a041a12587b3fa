"""Scrape vLLM `/metrics` endpoints: bounded in time and size, never raising.

`scrape` enforces a total deadline on the body (a server dripping bytes cannot hold it past
`timeout_seconds`); `VllmSource` runs every endpoint on its own worker and stops waiting at the
deadline whatever the worker is doing, so one stuck endpoint never delays the others or the
sampling loop.
"""
from __future__ import annotations

import concurrent.futures
import logging
import math
import re
import socket
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Sequence
from urllib.parse import urlsplit, urlunsplit

import requests
import urllib3.exceptions

from .httpbody import BodyError, read_body
from ..model import VllmSample
from .hostview import HostView
from .vllm_normalise import ParseError, normalise

log = logging.getLogger(__name__)

DEFAULT_MAX_RESPONSE_BYTES = 8 * 1024 * 1024
MAX_ERROR_CHARS = 300
# Stable tokens, counted as gpumem_vllm_scrape_errors_total{kind}.
ERROR_KINDS = ("refused", "timeout", "http_status", "too_large", "parse", "truncated", "connection")


@dataclass(frozen=True)
class VllmEndpoint:
    """One vLLM server to scrape, and how to find its processes."""

    url: str  # the /metrics URL; a bare http://host:port gets /metrics appended
    name: str = ""
    bearer_token: str | None = field(default=None, repr=False)  # never printed
    timeout_seconds: float = 2.0
    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES
    pid_file: str | None = None
    container_id: str | None = None
    process_pattern: str | None = None  # regex searched in the process name (comm)
    log_file: str | None = None

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"vLLM endpoint {self.label!r}: URL must be http(s)://host[:port][/path]")
        try:
            parts.port
        except ValueError:
            raise ValueError(f"vLLM endpoint {self.label!r}: invalid port") from None
        if not (isinstance(self.timeout_seconds, (int, float)) and math.isfinite(self.timeout_seconds)
                and self.timeout_seconds > 0):
            raise ValueError(f"vLLM endpoint {self.label!r}: timeout_seconds must be a positive number")
        if not isinstance(self.max_response_bytes, int) or self.max_response_bytes <= 0:
            raise ValueError(f"vLLM endpoint {self.label!r}: max_response_bytes must be a positive integer")
        if self.process_pattern is not None:
            try:
                re.compile(self.process_pattern)
            except re.error as exc:
                raise ValueError(f"vLLM endpoint {self.label!r}: bad process_pattern: {exc}") from None
        if self.container_id is not None and not self.container_id.strip():
            raise ValueError(f"vLLM endpoint {self.label!r}: container_id must not be empty")

    @property
    def label(self) -> str:
        """The `endpoint` label: the name, else the URL without credentials or query."""
        return self.name or public_url(self.url)

    @property
    def metrics_url(self) -> str:
        parts = urlsplit(self.url)
        if parts.path in ("", "/"):
            parts = parts._replace(path="/metrics")
        return urlunsplit(parts)

    @property
    def hostname(self) -> str:
        return urlsplit(self.url).hostname or ""

    @property
    def port(self) -> int:
        parts = urlsplit(self.url)
        return parts.port or (443 if parts.scheme == "https" else 80)


def public_url(url: str) -> str:
    """scheme://host[:port]/path: no user, password, query or fragment."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        if ":" in host:
            host = f"[{host}]"
        port = f":{parts.port}" if parts.port else ""
        return urlunsplit((parts.scheme, host + port, parts.path, "", ""))
    except ValueError:
        return "<invalid url>"


def scrape(endpoint: VllmEndpoint, session: requests.Session,
           request: requests.PreparedRequest | None = None) -> VllmSample:
    """Fetch and normalise one endpoint. Never raises; a failure is a VllmSample with up=False.
    `request` is the endpoint's GET from prepare(), reused from scrape to scrape."""
    started = time.monotonic()
    try:
        body = _fetch(endpoint, session, request or prepare(endpoint, session),
                      started + endpoint.timeout_seconds)
        metrics = normalise(body.decode("utf-8", errors="replace"))
    except _ScrapeFailure as failure:
        return _failed(endpoint, failure.kind, failure.message, started)
    except ParseError as exc:
        return _failed(endpoint, "parse", str(exc), started)
    except Exception as exc:  # a bug or an exotic library error must not stop sampling
        return _failed(endpoint, "connection", f"{type(exc).__name__}: {exc}", started)
    # A server that echoes our credentials into its labels must not make us export them.
    engines = tuple(replace(e, model=_scrub(e.model, endpoint), engine=_scrub(e.engine, endpoint))
                    for e in metrics.engines)
    cache_config = metrics.cache_config
    if cache_config is not None:
        cache_config = replace(cache_config, cache_dtype=_scrub(cache_config.cache_dtype, endpoint))
    return VllmSample(
        endpoint=endpoint.label, up=True, scrape_duration_seconds=time.monotonic() - started,
        engines=engines, cache_config=cache_config,
    )


class _ScrapeFailure(Exception):
    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind
        self.message = message


def prepare(endpoint: VllmEndpoint, session: requests.Session) -> requests.PreparedRequest:
    """The endpoint's GET, built once: preparing it anew was a third of a scrape's HTTP cost."""
    headers = {"Accept": "text/plain;version=0.0.4", "Accept-Encoding": "identity"}
    if endpoint.bearer_token:
        headers["Authorization"] = f"Bearer {endpoint.bearer_token}"
    return session.prepare_request(requests.Request("GET", endpoint.metrics_url, headers=headers))


def _fetch(endpoint: VllmEndpoint, session: requests.Session, request: requests.PreparedRequest,
           deadline: float) -> bytes:
    label = endpoint.label
    timeout = endpoint.timeout_seconds
    try:
        response = session.send(request, stream=True, timeout=(timeout, timeout))
    except requests.exceptions.Timeout:
        raise _ScrapeFailure("timeout", f"{label}: no response within {timeout:g}s") from None
    except requests.exceptions.ConnectionError as exc:
        if _caused_by(exc, ConnectionRefusedError):
            raise _ScrapeFailure("refused", f"{label}: connection refused") from None
        if _caused_by(exc, TimeoutError, socket.timeout, urllib3.exceptions.TimeoutError):
            raise _ScrapeFailure("timeout", f"{label}: no response within {timeout:g}s") from None
        raise _ScrapeFailure("connection", f"{label}: {_describe(exc, endpoint)}") from None
    except requests.exceptions.RequestException as exc:
        raise _ScrapeFailure("connection", f"{label}: {_describe(exc, endpoint)}") from None
    try:
        if response.status_code != 200:
            raise _ScrapeFailure("http_status", f"{label}: HTTP {response.status_code} {response.reason or ''}".rstrip())
        declared = _content_length(response)
        if declared is not None and declared > endpoint.max_response_bytes:
            raise _ScrapeFailure("too_large", f"{label}: response of {declared} bytes exceeds the "
                                              f"{endpoint.max_response_bytes}-byte limit")
        return _read_body(response, endpoint, deadline)
    finally:
        response.close()  # also drops a half-read connection instead of reusing it


def _read_body(response: requests.Response, endpoint: VllmEndpoint, deadline: float) -> bytes:
    try:
        return read_body(response, endpoint.max_response_bytes, deadline, endpoint.timeout_seconds)
    except BodyError as exc:
        detail = _describe(exc.cause, endpoint) if exc.cause is not None else exc.detail
        raise _ScrapeFailure(exc.kind, f"{endpoint.label}: {detail}") from None


def _content_length(response: requests.Response) -> int | None:
    try:
        value = int(response.headers.get("Content-Length", ""))
    except ValueError:
        return None
    return value if value >= 0 else None


def _caused_by(exc: BaseException, *types: type) -> bool:
    """Walk the chain requests -> urllib3 -> socket error (bounded: chains can loop)."""
    seen: BaseException | None = exc
    for _ in range(10):
        if seen is None:
            return False
        if isinstance(seen, types):
            return True
        reason = getattr(seen, "reason", None)
        nxt = reason if isinstance(reason, BaseException) else None
        if nxt is None and seen.args and isinstance(seen.args[0], BaseException):
            nxt = seen.args[0]
        seen = nxt or seen.__cause__ or seen.__context__
    return False


def _describe(exc: BaseException, endpoint: VllmEndpoint) -> str:
    return redact(f"{type(exc).__name__}: {exc}", endpoint)


def redact(text: str, endpoint: VllmEndpoint) -> str:
    """Remove the bearer token and any URL credentials from a message, and bound its length."""
    return _scrub(text, endpoint)[:MAX_ERROR_CHARS]


def _scrub(text: str, endpoint: VllmEndpoint) -> str:
    parts = urlsplit(endpoint.url)
    for secret in (endpoint.bearer_token, parts.password, parts.username):
        if secret:
            text = text.replace(secret, "<redacted>")
    return text


def _plain_session() -> requests.Session:
    session = requests.Session()
    # No proxy from the environment (it would see the bearer token) and no ~/.netrc; reading
    # both on every request was also a tenth of a scrape's CPU.
    session.trust_env = False
    return session


def _failed(endpoint: VllmEndpoint, kind: str, message: str, started: float) -> VllmSample:
    return VllmSample(endpoint=endpoint.label, up=False, error_kind=kind,
                      error=redact(message, endpoint),
                      scrape_duration_seconds=time.monotonic() - started)


PidResolver = Callable[[VllmEndpoint, HostView, Sequence[int]], tuple[int, ...]]


class VllmSource:
    """Scrapes all endpoints concurrently, each bounded by its own timeout."""

    # Slack past the endpoint's timeout before we stop waiting for a worker thread.
    WAIT_MARGIN_SECONDS = 0.25

    def __init__(self, endpoints: Iterable[VllmEndpoint], host: HostView | None = None,
                 max_workers: int | None = None, session_factory: Callable[[], requests.Session] | None = None,
                 pid_resolver: PidResolver | None = None):
        self.endpoints = tuple(endpoints)
        self.host = host
        if pid_resolver is None:
            from .vllm_procs import server_pids as pid_resolver
        self._resolve_pids = pid_resolver
        # One session per endpoint: requests sessions are not thread-safe, and the in-flight
        # guard below keeps a single request per endpoint at a time.
        self._sessions = [(session_factory or _plain_session)() for _ in self.endpoints]
        self._requests: list[requests.PreparedRequest | None] = [None] * len(self.endpoints)
        # A worker per endpoint by default, so a stuck endpoint never takes another's thread.
        workers = max_workers if max_workers is not None else min(32, len(self.endpoints))
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(1, workers),
            thread_name_prefix="vllm-scrape")
        self._inflight: dict[int, concurrent.futures.Future] = {}
        self._lock = threading.Lock()

    def sample(self, candidates: Sequence[int] = ()) -> tuple[VllmSample, ...]:
        """Scrape every endpoint; `candidates` (the GPU processes' PIDs) feed the
        container_id / process_pattern look-ups. Returns one sample per endpoint, in order."""
        started = time.monotonic()
        results: dict[int, VllmSample] = {}
        waiting: dict[concurrent.futures.Future, int] = {}
        with self._lock:
            for i, endpoint in enumerate(self.endpoints):
                previous = self._inflight.get(i)
                if previous is not None and not previous.done():
                    # An earlier scrape is still stuck: do not pile up threads on it.
                    results[i] = _failed(endpoint, "timeout", f"{endpoint.label}: previous scrape "
                                         "still running", started)
                    continue
                future = self._pool.submit(scrape, endpoint, self._sessions[i], self._request(i))
                self._inflight[i] = future
                waiting[future] = i
        if waiting:
            longest = max(self.endpoints[i].timeout_seconds for i in waiting.values())
            concurrent.futures.wait(waiting, timeout=longest + self.WAIT_MARGIN_SECONDS)
        for future, i in waiting.items():
            endpoint = self.endpoints[i]
            if future.done():
                results[i] = future.result()  # scrape never raises
            else:
                results[i] = _failed(endpoint, "timeout", f"{endpoint.label}: no complete response "
                                     f"within {endpoint.timeout_seconds:g}s", started)
        return tuple(self._with_pids(self.endpoints[i], results[i], candidates)
                     for i in range(len(self.endpoints)))

    def _request(self, i: int) -> requests.PreparedRequest | None:
        if self._requests[i] is None:
            try:
                self._requests[i] = prepare(self.endpoints[i], self._sessions[i])
            except Exception:  # scrape() tries again and reports what is wrong
                pass
        return self._requests[i]

    def _with_pids(self, endpoint: VllmEndpoint, sample: VllmSample,
                   candidates: Sequence[int]) -> VllmSample:
        # Resolved even when the scrape failed: a hung server still holds GPU memory.
        if self.host is None:
            return sample
        try:
            pids = self._resolve_pids(endpoint, self.host, candidates)
        except Exception as exc:
            log.warning("vLLM endpoint %s: finding its processes failed: %s", endpoint.label,
                        redact(str(exc), endpoint))
            return sample
        return replace(sample, pids=tuple(pids))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for session in self._sessions:
            session.close()
