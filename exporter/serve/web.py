"""The exporter's endpoints as one WSGI app: /metrics, /healthz, /admission, /api/findings and
the status page at /, behind optional basic auth (auth.py); server.py serves it."""
from __future__ import annotations

import gzip
import json
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

from prometheus_client.exposition import choose_encoder, gzip_accepted
from prometheus_client.registry import CollectorRegistry

from ..model import State
from . import status as status_page
from .auth import AuthBusy, BasicAuth

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIApplication, WSGIEnvironment

# What the health listener (`health_listen`) serves, without auth: what probes need and no more.
HEALTH_PATHS = ("/healthz", "/admission")


class MetricsCache:
    """Renders /metrics once per published state (and format), not once per scrape: many
    scrapers (HA Prometheus pairs, federation, a curl loop) then cost one rendering between two
    samples. A rendering is reused for at most `max_age` seconds, so the sample age and the
    exporter's own process metrics stay current."""

    max_age = 1.0

    def __init__(self, registry: CollectorRegistry, get_state: Callable[[], State]):
        self.registry = registry
        self.get_state = get_state
        self._lock = threading.Lock()
        self._entries: dict[tuple[str, bool, tuple[str, ...]], tuple[State, float, bytes]] = {}

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        encoder, content_type = choose_encoder(environ.get("HTTP_ACCEPT", ""))
        gzip_ok = gzip_accepted(environ.get("HTTP_ACCEPT_ENCODING", ""))
        # Only name[] changes the answer: other query strings (a cache-buster) share the rendering.
        names = tuple(sorted(set(parse_qs(environ.get("QUERY_STRING", "")).get("name[]", ()))))
        key = (content_type, gzip_ok, names)
        state = self.get_state()
        with self._lock:  # one rendering at a time; the others wait for it and reuse it
            entry = self._entries.get(key)
            if entry is None or entry[0] is not state or time.monotonic() - entry[1] > self.max_age:
                body = encoder(self.registry.restricted_registry(names) if names else self.registry)
                if gzip_ok:
                    body = gzip.compress(body, compresslevel=6)
                if len(self._entries) > 16:  # odd Accept headers or name[] lists must not grow it
                    self._entries.clear()
                entry = self._entries[key] = (state, time.monotonic(), body)
        headers = [("Content-Type", content_type), ("Content-Length", str(len(entry[2])))]
        if gzip_ok:
            headers.append(("Content-Encoding", "gzip"))
        start_response("200 OK", headers)
        return [entry[2]]


def make_app(registry: CollectorRegistry, get_state: Callable[[], State], now: Callable[[], float],
             stale_after: float | Callable[[], float], auth: BasicAuth | None = None, *,
             host: Callable[[], str] = lambda: "unknown", paths: tuple[str, ...] | None = None) -> WSGIApplication:
    """`stale_after`: seconds, or a callable giving them (it follows configuration reloads).
    `host`: how the host is sampled now, for the status page. `paths`: serve only these (404 else)."""
    stale_limit: Callable[[], float] = stale_after if callable(stale_after) else (lambda: stale_after)
    metrics_app = MetricsCache(registry, get_state)

    def respond(start_response: StartResponse, status: str, body: bytes, ctype: str = "application/json",
                extra: Iterable[tuple[str, str]] = ()) -> list[bytes]:
        start_response(status, [("Content-Type", ctype), ("Content-Length", str(len(body))),
                                ("Cache-Control", "no-store"), *extra])
        return [body]

    def as_json(obj: object) -> bytes:
        return (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode()

    def app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        if auth is not None:
            try:
                allowed = auth.check(environ.get("HTTP_AUTHORIZATION"))
            except AuthBusy:  # wrong passwords are flooding in: say so, never queue behind them
                return respond(start_response, "503 Service Unavailable", b"authentication busy, retry\n",
                               "text/plain", [("Retry-After", "1")])
            if not allowed:
                return respond(start_response, "401 Unauthorized", b"Unauthorized\n", "text/plain",
                               [("WWW-Authenticate", 'Basic realm="gpu-memory-exporter"')])
        if environ.get("REQUEST_METHOD") not in ("GET", "HEAD"):
            return respond(start_response, "405 Method Not Allowed", b"GET only\n", "text/plain")
        path = environ.get("PATH_INFO", "/")
        if paths is not None and path not in paths:
            return respond(start_response, "404 Not Found", b"not found\n", "text/plain")
        state = get_state()
        if path == "/metrics":
            return metrics_app(environ, start_response)
        if path == "/healthz":
            age = sample_age(state)
            limit = stale_limit()
            healthy = age is not None and age <= limit
            sources = {s.source: s.up for s in state.snapshot.sources} if state.snapshot else {}
            body = {"status": "ok" if healthy else "stale", "sample_age_seconds": age,
                    "stale_after_seconds": limit, "sources_up": sources}
            return respond(start_response, "200 OK" if healthy else "503 Service Unavailable", as_json(body))
        if path == "/admission":
            return respond(start_response, *admission(state, parse_qs(environ.get("QUERY_STRING", ""))))
        if path == "/api/findings":
            findings = [f.to_json() for f in state.analysis.findings] if state.analysis else []
            return respond(start_response, "200 OK", as_json({"findings": findings}))
        if path == "/":
            page = status_page.render(state, host(), sample_age(state), stale_limit())
            return respond(start_response, "200 OK", page.encode(), "text/html; charset=utf-8")
        return respond(start_response, "404 Not Found", b"not found\n", "text/plain")

    def sample_age(state: State) -> float | None:
        return None if state.last_sample_at is None else now() - state.last_sample_at

    def admission(state: State, query: dict[str, list[str]]) -> tuple[str, bytes]:
        """503 while any GPU (or the one asked for with ?gpu=N) has admission closed. With no
        analysis yet the answer is 200 "unknown" whatever is asked: closing on no evidence would
        drain a host. Once the GPUs are known, asking for one that does not exist is a 400."""
        wanted = set(query.get("gpu", []))
        known = {g.gpu: g.admission_open for g in (state.analysis.gpus if state.analysis else ())}
        unknown = sorted(wanted - set(known))
        if known and unknown:
            return "400 Bad Request", as_json({"error": f"no such GPU: {', '.join(unknown)}",
                                               "gpus": sorted(known)})
        gpus = {g: is_open for g, is_open in known.items() if not wanted or g in wanted}
        closed = sorted(g for g, is_open in gpus.items() if not is_open)
        body: dict[str, Any] = {"open": not closed, "closed_gpus": closed,
                "gpus": {g: ("open" if o else "closed") for g, o in sorted(gpus.items())},
                "known": bool(gpus)}
        return ("503 Service Unavailable" if closed else "200 OK"), as_json(body)

    return app
