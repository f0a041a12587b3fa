"""The HTTP listener: /metrics, /healthz, /admission, /api/findings and an index page, with
optional TLS and basic auth configured like Prometheus exporter-toolkit's web config file."""
from __future__ import annotations

import base64
import binascii
import gzip
import hashlib
import hmac
import http.client
import json
import logging
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from socketserver import ThreadingMixIn
from typing import Callable
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import bcrypt
from prometheus_client.exposition import choose_encoder, gzip_accepted

from .config import ConfigError, load_file
from .daemon import State

log = logging.getLogger("exporter.web")

_TLS_VERSIONS = {"TLS10": ssl.TLSVersion.TLSv1, "TLS11": ssl.TLSVersion.TLSv1_1,
                 "TLS12": ssl.TLSVersion.TLSv1_2, "TLS13": ssl.TLSVersion.TLSv1_3}
_CLIENT_AUTH = {"NoClientCert": ssl.CERT_NONE, "RequestClientCert": ssl.CERT_OPTIONAL,
                "RequireAnyClientCert": ssl.CERT_REQUIRED, "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
                "RequireAndVerifyClientCert": ssl.CERT_REQUIRED}
_TLS_KEYS = {"cert_file", "key_file", "client_auth_type", "client_ca_file", "min_version", "max_version"}


@dataclass(frozen=True)
class WebConfig:
    cert_file: str = ""
    key_file: str = ""
    client_auth_type: str = "NoClientCert"
    client_ca_file: str = ""
    min_version: str = "TLS12"
    max_version: str = ""
    basic_auth_users: dict = field(default_factory=dict)  # user -> bcrypt hash

    @property
    def tls(self) -> bool:
        return bool(self.cert_file)


def load_web_config(path: str) -> WebConfig:
    data = load_file(path)
    unknown = set(data) - {"tls_server_config", "basic_auth_users", "http_server_config"}
    if unknown:
        raise ConfigError(f"{path}: {sorted(unknown)[0]}: unknown key "
                          "(known: tls_server_config, basic_auth_users, http_server_config)")
    tls = data.get("tls_server_config") or {}
    if not isinstance(tls, dict):
        raise ConfigError(f"{path}: tls_server_config: expected a mapping")
    for key, value in tls.items():
        if key not in _TLS_KEYS:
            raise ConfigError(f"{path}: tls_server_config.{key}: unknown or unsupported key")
        if not isinstance(value, str):
            raise ConfigError(f"{path}: tls_server_config.{key}: expected a string")
    users = data.get("basic_auth_users") or {}
    if not isinstance(users, dict):
        raise ConfigError(f"{path}: basic_auth_users: expected a mapping of user: bcrypt-hash")
    for user, hashed in users.items():
        if not isinstance(hashed, str) or not hashed.startswith(("$2a$", "$2b$", "$2y$")):
            raise ConfigError(f"{path}: basic_auth_users.{user}: expected a bcrypt hash ($2y$...), "
                              "never a plain password")
    cfg = WebConfig(basic_auth_users={str(u): h for u, h in users.items()}, **tls)
    if bool(cfg.cert_file) != bool(cfg.key_file):
        raise ConfigError(f"{path}: tls_server_config: cert_file and key_file go together")
    if cfg.client_auth_type not in _CLIENT_AUTH:
        raise ConfigError(f"{path}: tls_server_config.client_auth_type: one of {', '.join(_CLIENT_AUTH)}")
    for key in ("min_version", "max_version"):
        value = getattr(cfg, key)
        if value and value not in _TLS_VERSIONS:
            raise ConfigError(f"{path}: tls_server_config.{key}: one of {', '.join(_TLS_VERSIONS)}")
    if cfg.tls:
        ssl_context(cfg, path)  # fail now, not at the first connection
    return cfg


def ssl_context(cfg: WebConfig, where: str = "web config") -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(cfg.cert_file, cfg.key_file)
        if cfg.client_ca_file:
            ctx.load_verify_locations(cfg.client_ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"{where}: tls_server_config: cannot load certificate or key: {exc}") from exc
    ctx.minimum_version = _TLS_VERSIONS[cfg.min_version or "TLS12"]
    if cfg.max_version:
        ctx.maximum_version = _TLS_VERSIONS[cfg.max_version]
    ctx.verify_mode = _CLIENT_AUTH[cfg.client_auth_type]
    if ctx.verify_mode != ssl.CERT_NONE and not cfg.client_ca_file:
        raise ConfigError(f"{where}: tls_server_config.client_ca_file: needed for {cfg.client_auth_type}")
    return ctx


class BasicAuth:
    """bcrypt is slow by design; verified credentials are cached by digest, as exporter-toolkit does."""

    _DUMMY = bcrypt.hashpw(b"x", bcrypt.gensalt(4))

    def __init__(self, users: dict[str, str]):
        self.users = {u: h.encode() for u, h in users.items()}
        self._verified: set[bytes] = set()
        self._lock = threading.Lock()

    def check(self, header: str | None) -> bool:
        if not header or not header.startswith("Basic "):
            return False
        try:
            user, _, password = base64.b64decode(header[6:].strip(), validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return False
        hashed = self.users.get(user)
        digest = hashlib.sha256(f"{user}\0{password}\0".encode() + (hashed or b"")).digest()
        with self._lock:
            if any(hmac.compare_digest(digest, d) for d in self._verified):
                return True
        # Unknown users cost a bcrypt check too, so timing does not reveal who exists.
        ok = bcrypt.checkpw(password.encode(), hashed or self._DUMMY) and hashed is not None
        if ok:
            with self._lock:
                if len(self._verified) < 1024:
                    self._verified.add(digest)
        return ok


INDEX = """<!doctype html><html><head><meta charset="utf-8"><title>gpu-memory-exporter</title></head>
<body><h1>gpu-memory-exporter</h1><p>Prometheus exporter for GPU memory on LLM serving hosts.</p>
<ul><li><a href="metrics">/metrics</a> &mdash; Prometheus metrics</li>
<li><a href="healthz">/healthz</a> &mdash; 503 when the last sample is stale</li>
<li><a href="admission">/admission</a> &mdash; 503 while a GPU's admission is closed</li>
<li><a href="api/findings">/api/findings</a> &mdash; active findings as JSON</li></ul></body></html>
"""


class MetricsCache:
    """Renders /metrics once per published state (and format), not once per scrape: many
    scrapers (HA Prometheus pairs, federation, a curl loop) then cost one rendering between two
    samples. A rendering is reused for at most `max_age` seconds, so the sample age and the
    exporter's own process metrics stay current."""

    def __init__(self, registry, get_state: Callable[[], State], max_age: float = 1.0):
        self.registry = registry
        self.get_state = get_state
        self.max_age = max_age
        self._lock = threading.Lock()
        self._entries: dict[tuple, tuple[object, float, bytes]] = {}

    def __call__(self, environ, start_response):
        encoder, content_type = choose_encoder(environ.get("HTTP_ACCEPT", ""))
        gzip_ok = gzip_accepted(environ.get("HTTP_ACCEPT_ENCODING", ""))
        key = (content_type, gzip_ok, environ.get("QUERY_STRING", ""))
        state = self.get_state()
        with self._lock:  # one rendering at a time; the others wait for it and reuse it
            entry = self._entries.get(key)
            if entry is None or entry[0] is not state or time.monotonic() - entry[1] > self.max_age:
                registry = self.registry
                names = parse_qs(environ.get("QUERY_STRING", "")).get("name[]")
                if names:
                    registry = registry.restricted_registry(names)
                body = encoder(registry)
                if gzip_ok:
                    body = gzip.compress(body, compresslevel=6)
                if len(self._entries) > 16:  # odd Accept headers must not grow it
                    self._entries.clear()
                entry = self._entries[key] = (state, time.monotonic(), body)
        headers = [("Content-Type", content_type), ("Content-Length", str(len(entry[2])))]
        if gzip_ok:
            headers.append(("Content-Encoding", "gzip"))
        start_response("200 OK", headers)
        return [entry[2]]


def make_app(registry, get_state: Callable[[], State], now: Callable[[], float],
             stale_after: float | Callable[[], float], auth: BasicAuth | None = None):
    """`stale_after`: seconds, or a callable giving them (it follows configuration reloads)."""
    stale_limit = stale_after if callable(stale_after) else (lambda: stale_after)
    metrics_app = MetricsCache(registry, get_state)

    def respond(start_response, status: str, body: bytes, ctype: str = "application/json"):
        start_response(status, [("Content-Type", ctype), ("Content-Length", str(len(body))),
                                ("Cache-Control", "no-store")])
        return [body]

    def as_json(obj) -> bytes:
        return (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode()

    def app(environ, start_response):
        if auth is not None and not auth.check(environ.get("HTTP_AUTHORIZATION")):
            start_response("401 Unauthorized", [("WWW-Authenticate", 'Basic realm="gpu-memory-exporter"'),
                                                 ("Content-Type", "text/plain"), ("Content-Length", "13")])
            return [b"Unauthorized\n"]
        if environ.get("REQUEST_METHOD") not in ("GET", "HEAD"):
            return respond(start_response, "405 Method Not Allowed", b"GET only\n", "text/plain")
        path = environ.get("PATH_INFO", "/")
        state = get_state()
        if path == "/metrics":
            return metrics_app(environ, start_response)
        if path == "/healthz":
            age = None if state.last_sample_at is None else now() - state.last_sample_at
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
            return respond(start_response, "200 OK", INDEX.encode(), "text/html; charset=utf-8")
        return respond(start_response, "404 Not Found", b"not found\n", "text/plain")

    def admission(state: State, query: dict) -> tuple[str, bytes]:
        """503 while any GPU (or the one asked for with ?gpu=N) has admission closed. With no
        analysis yet the answer is 200 "unknown": closing on no evidence would drain a host."""
        wanted = set(query.get("gpu", []))
        gpus = {g.gpu: g.admission_open for g in (state.analysis.gpus if state.analysis else ())
                if not wanted or g.gpu in wanted}
        closed = sorted(g for g, is_open in gpus.items() if not is_open)
        body = {"open": not closed, "closed_gpus": closed,
                "gpus": {g: ("open" if o else "closed") for g, o in sorted(gpus.items())},
                "known": bool(gpus)}
        return ("503 Service Unavailable" if closed else "200 OK"), as_json(body)

    return app


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True
    # socketserver's default backlog is 5: a burst of scrapers (or federation) beyond that gets
    # its SYNs dropped and waits out TCP retransmits (1 s, 3 s, 7 s...) or fails.
    request_queue_size = 128

    def handle_error(self, request, client_address):
        # A client that fails the TLS handshake (no or an untrusted certificate) is routine: no
        # traceback on stderr for every such connection.
        log.debug("connection from %s failed", client_address[0], exc_info=True)


class _Server6(_Server):
    address_family = socket.AF_INET6


# Request line + headers. Prometheus sends well under 1 KiB; http.server alone bounds each line
# (64 KiB) and the count (100), which still lets one request hold 6 MB.
MAX_REQUEST_HEAD_BYTES = 64 << 10


class _BoundedHead:
    """The request stream while headers are read: past the byte budget, LineTooLong (431)."""

    def __init__(self, rfile, budget: int):
        self._rfile = rfile
        self._left = budget

    def readline(self, limit: int = -1) -> bytes:
        line = self._rfile.readline(limit)
        self._left -= len(line)
        if self._left < 0:
            raise http.client.LineTooLong("request head")
        return line


class _Handler(WSGIRequestHandler):
    timeout = 10  # a client that stalls (slowloris) loses its connection, not a thread forever

    def parse_request(self):
        rfile = self.rfile
        self.rfile = _BoundedHead(rfile, MAX_REQUEST_HEAD_BYTES - len(self.raw_requestline))
        try:
            return super().parse_request()
        finally:
            self.rfile = rfile

    def setup(self):
        super().setup()
        if isinstance(self.connection, ssl.SSLSocket):
            self.connection.do_handshake()  # in this worker thread, under the timeout

    def handle(self):
        try:
            super().handle()
        except (ssl.SSLError, OSError) as exc:
            log.debug("connection from %s dropped: %s", self.client_address[0], exc)

    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        log.debug("%s " + format, self.client_address[0], *args)


class HttpServer:
    def __init__(self, app, host: str, port: int, web: WebConfig | None = None):
        server_class = _Server6 if ":" in host else _Server
        self.server = make_server(host, port, app, server_class=server_class, handler_class=_Handler)
        self.tls = bool(web and web.tls)
        if self.tls:
            self.server.socket = ssl_context(web).wrap_socket(
                self.server.socket, server_side=True, do_handshake_on_connect=False)
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="http", daemon=True)

    def start(self) -> "HttpServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
