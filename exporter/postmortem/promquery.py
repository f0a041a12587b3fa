"""`analyze --prometheus URL`: fetch the exporter's own series from a Prometheus server.

The series a replay needs come from `/api/v1/query_range`, one query per metric name so every
result carries `__name__`: the memory series (process memory, GPU total and used, host RSS)
and the vLLM series the live findings read (trace.VLLM_PROMETHEUS_METRICS: up, KV usage,
running/waiting, preemptions, cache config with the budget inputs, sleep state, and each
server's memory per GPU, which ties serving processes to their server for the budget).
A series the server does not have (an older exporter, no vLLM) is an empty result, no error. A long
range is cut into chunks of at most `max_points` steps, because Prometheus refuses a query
returning more than 11,000 points per series. Each response is bounded in size and time.
The JSON is turned into rows by the same functions that read a saved range-query file
(`trace.py`), so a live query and a saved one replay identically.

The HTTP exchange is sources/httpclient.py's, as for vLLM and the kubelet. Every failure is a
PromQueryError (a TraceError, so `analyze` reports it like a bad file) naming the URL without
its credentials and, where the server said why, the server's message.
"""
from __future__ import annotations

import math
import re
from datetime import datetime, timezone
from typing import Any

import requests

from ..model import Snapshot
from ..sources.httpclient import HttpFailure, describe, get, new_session, printable, public_url
from .promtrace import (
    MAX_ROWS,
    PROMETHEUS_METRICS,
    VLLM_PROMETHEUS_METRICS,
    PrometheusRows,
    parse_json,
)
from .trace import TraceError, snapshots_from_rows

PROMETHEUS_MAX_POINTS = 11_000  # Prometheus's limit per series per range query
DEFAULT_STEP_SECONDS = 15.0  # Prometheus's default scrape interval
# One chunk of one metric. Python's objects for parsed JSON take about six times the text, and
# each response is turned into rows (promtrace.PrometheusRows) and let go before the next one
# is asked for, so this bounds the memory a server's answer can take (bench/trace_cost.py).
MAX_RESPONSE_BYTES = 16 << 20
DEFAULT_TIMEOUT_SECONDS = 60.0  # for each chunk's whole exchange, redirects included
MAX_REDIRECTS = 3  # same host only: a session's credentials never go elsewhere
_REQUIRED = ("gpumem_process_memory_used_bytes",)  # without it there is nothing to replay


class PromQueryError(TraceError):
    """A Prometheus query that did not give usable data; the message says which and why."""


def redact(url: str) -> str:
    """The URL without user:password (and without a query string, which may hold a token)."""
    return public_url(url)


def parse_time(text: str | float, now: float | None = None) -> float:
    """Unix seconds from a command-line time: Unix seconds, RFC 3339 (`2024-05-01T12:00:00Z`),
    `now`, or `now-6h` / `-90m` (units s, m, h, d)."""
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        s = text.strip()
        rel = re.fullmatch(r"(now)?\s*(?:-\s*(\d+(?:\.\d+)?)\s*([smhd]))?", s)
        if s and rel and (rel.group(1) or rel.group(2)):
            base = datetime.now(timezone.utc).timestamp() if now is None else now
            back = float(rel.group(2) or 0) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[rel.group(3) or "s"]
            value = base - back
        else:
            try:
                value = float(s)
            except ValueError:
                try:
                    when = datetime.fromisoformat(s.replace("Z", "+00:00").replace("z", "+00:00"))
                except ValueError:
                    raise ValueError(f"not a time: {s[:40]!r} (Unix seconds, RFC 3339, now-6h)") from None
                if when.tzinfo is None:
                    when = when.replace(tzinfo=timezone.utc)  # a post-mortem speaks UTC
                value = when.timestamp()
    if not math.isfinite(value):
        raise ValueError(f"not a finite time: {text!r}")
    return value


def chunks(start: float, end: float, step: float,
           max_points: int = PROMETHEUS_MAX_POINTS) -> list[tuple[float, float]]:
    """[(start, end)] pieces of at most max_points points each on one grid (start + k*step):
    each piece starts one step after the previous one ended, so no point comes twice."""
    if max_points < 1:
        raise ValueError("max_points must be at least 1")
    span = step * (max_points - 1)
    pieces: list[tuple[float, float]] = []
    t = start
    while t <= end:
        pieces.append((t, min(end, t + span)))
        t = t + span + step
    return pieces


def fetch(url: str, start: float, end: float, step: float | None = None,
          session: requests.Session | None = None, *, selector: str = "",
          timeout: float = DEFAULT_TIMEOUT_SECONDS, max_points: int = PROMETHEUS_MAX_POINTS,
          max_response_bytes: int = MAX_RESPONSE_BYTES, max_rows: int = MAX_ROWS) -> list[Snapshot]:
    """The exporter's memory series between start and end (Unix s) as time-ordered Snapshots.

    url: the Prometheus base URL (`http://prom:9090`, a path prefix is kept). step: seconds
    between points (default 15). selector: label matchers added to every query, e.g.
    `instance="gpu-host-1:9842"`, needed when several exporters report to the server.
    session: a requests.Session carrying authentication (headers, certificates)."""
    step = DEFAULT_STEP_SECONDS if step is None else float(step)
    where = redact(url)
    if not (math.isfinite(start) and math.isfinite(end) and math.isfinite(step)):
        raise PromQueryError(f"{where}: start, end and step must be finite numbers")
    if step <= 0:
        raise PromQueryError(f"{where}: step must be positive, not {step:g}")
    if end < start:
        raise PromQueryError(f"{where}: end ({end:g}) is before start ({start:g})")
    if not re.fullmatch(r"[^{}]*", selector):
        raise PromQueryError(f"{where}: selector is label matchers without braces, "
                             f"like instance=\"host:9842\"")
    own = session is None
    if session is None:
        # A hard deadline per answer (a Prometheus that drips its answer cannot hold analyze);
        # the operator's proxy settings apply, as for any command they run by hand.
        session = new_session()
        session.trust_env = True
    rows = PrometheusRows(max_rows)
    try:
        for metric in (*PROMETHEUS_METRICS, *VLLM_PROMETHEUS_METRICS):
            query = f"{metric}{{{selector}}}" if selector else metric
            for i, (a, b) in enumerate(chunks(start, end, step, max_points)):
                response = _query_range(session, url, query, a, b, step, timeout, max_response_bytes)
                rows.add(f"{where}: {metric} chunk {i}", response, metric)
                del response  # rows now: the JSON's objects go before the next query
        _check(rows, where)
        return snapshots_from_rows(rows.finish())
    except PromQueryError:
        raise
    except TraceError as exc:  # conflicting series, say: same message, one error type
        raise PromQueryError(str(exc)) from None
    finally:
        if own:
            session.close()


def _query_range(session: requests.Session, url: str, query: str, start: float, end: float,
                 step: float, timeout: float, max_bytes: int) -> dict[str, Any]:
    api = url.rstrip("/") + "/api/v1/query_range"
    where = f"{redact(url)} query {query!r} [{start:.3f}, {end:.3f}] step {step:g}s"
    params = {"query": query, "start": repr(start), "end": repr(end), "step": repr(step)}
    try:
        request = session.prepare_request(requests.Request("GET", api, params=params))
        answer = get(session, request, timeout=timeout, max_bytes=max_bytes,
                     max_redirects=MAX_REDIRECTS, read_error_body=True)
    except HttpFailure as exc:
        if exc.kind == "too_large":
            raise PromQueryError(f"{where}: response is over the {max_bytes} byte limit; "
                                 "use a larger --step or a shorter range") from None
        raise PromQueryError(f"{where}: cannot query Prometheus: {exc.message}") from None
    except (requests.RequestException, ValueError) as exc:  # a URL requests cannot prepare
        raise PromQueryError(f"{where}: cannot query Prometheus: {describe(exc)}") from None
    body, status = answer.body, answer.status
    try:
        doc = parse_json(body, where)
    except TraceError:
        doc = None
    if status != 200 or not isinstance(doc, dict) or doc.get("status") != "success":
        if isinstance(doc, dict) and doc.get("error"):
            said = f"{doc.get('errorType', 'error')}: {doc['error']}"
        else:
            said = body[:200].decode("utf-8", "replace") or "empty response"
        raise PromQueryError(f"{where}: HTTP {status}: {printable(said)[:500]}")
    return doc


def _check(rows: PrometheusRows, where: str) -> None:
    """The responses are of one exporter, and hold process memory to replay."""
    if len(rows.instances) > 1:
        shown = ", ".join(sorted(i or '""' for i in rows.instances)[:5])
        raise PromQueryError(f"{where}: the series come from several exporters ({shown}); "
                             "choose one with a selector such as instance=\"HOST:PORT\"")
    if not any(r.pid is not None for r in rows.rows):
        raise PromQueryError(f"{where}: no {_REQUIRED[0]} samples in this range "
                             "(is the exporter scraped, and the range right?)")


__all__ = [
    "DEFAULT_STEP_SECONDS",
    "PROMETHEUS_MAX_POINTS",
    "PromQueryError",
    "chunks",
    "fetch",
    "parse_time",
    "redact",
]
