"""Scrape vLLM `/metrics` endpoints: bounded in time and size, never raising.

`scrape` enforces a total deadline on the whole exchange, redirects included (a server dripping
bytes cannot hold it past `timeout_seconds`), and never reads a redirect's body
(sources/httpclient.py); `VllmSource` runs every endpoint on its own worker and stops waiting at
the deadline whatever the worker is doing, so one stuck endpoint never delays the others; a server
whose last read ran out of time is read in the background and not waited for until it answers, so
a hung server holds the sampling loop for one tick, not for every tick while it hangs.
Values a sane vLLM cannot send (negative counters, NaN, a KV usage of -5) are
dropped and named in the sample, never passed on.

A `PageReader` asks each server for only the few families it reads, where the server honours
`name[]` as vLLM does, and for the whole page where it does not.

`VllmSource` is the `vllm` source: each tick it scrapes every endpoint (an idle server's less
often: vllm_idle.py), attaches each server's
start-up memory profile (vllm_log.ProfileCache, from the endpoint's log file) and marks the GPU
processes that serve it (role "vllm", its endpoint; vllm_procs.assign_roles).
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from urllib.parse import urlencode, urlsplit, urlunsplit

import requests

from ..model import GpuSample, ProcessSample, Snapshot, VllmSample
from .hostview import HostView
from .httpclient import HttpFailure, get, new_session, public_url
from .source import GPUS, HOST_MEMORY, PROCESS_IDENTITY, VLLM, Reading, announce_recovery
from .vllm_endpoint import DEFAULT_MAX_RESPONSE_BYTES, VllmEndpoint
from .vllm_idle import IdleReads
from .vllm_log import ProfileCache
from .vllm_normalise import SAMPLE_NAMES, ParseError, normalise
from .vllm_procs import ServerPids, ServerProcesses, StickyRoles, assign_roles

__all__ = [
    "DEFAULT_MAX_RESPONSE_BYTES",
    "ERROR_KINDS",
    "MAX_REDIRECTS",
    "PageReader",
    "VllmEndpoint",
    "VllmSource",
    "only_read_url",
    "prepare",
    "public_url",
    "redact",
    "scrape",
]

log = logging.getLogger(__name__)

MAX_ERROR_CHARS = 300
# vLLM's /metrics does not redirect: its Starlette Mount has its path regex patched ("Workaround
# for 307 Redirect for /metrics", entrypoints/serve/instrumentator/metrics.py in 0.33) and the
# instrumentator also serves it as a route. A proxy in front may add a hop or two.
MAX_REDIRECTS = 3
# Stable tokens, counted as gpumem_vllm_scrape_errors_total{kind}. out_of_range: the page
# parsed but held impossible values, which were dropped (the scrape still counts as up).
ERROR_KINDS = ("refused", "timeout", "tls", "http_status", "too_large", "parse", "truncated",
               "connection", "out_of_range")


def scrape(endpoint: VllmEndpoint, session: requests.Session,
           request: requests.PreparedRequest | None = None,
           clock: Callable[[], float] = time.monotonic) -> VllmSample:
    """Fetch and normalise one endpoint. Never raises; a failure is a VllmSample with up=False.
    `request` is the endpoint's GET from prepare(), reused from scrape to scrape."""
    return _scrape(endpoint, session, request, clock, MAX_REDIRECTS)[0]


def _scrape(endpoint: VllmEndpoint, session: requests.Session, request: requests.PreparedRequest | None,
            clock: Callable[[], float], max_redirects: int) -> tuple[VllmSample, bool]:
    """scrape(), and whether the server answered, but not with a page we read (an HTTP status or
    redirect, a page that is not vLLM's): another URL of the same server may do."""
    started = clock()
    secrets = endpoint.secrets()
    try:
        answer = get(session, request or prepare(endpoint, session), timeout=endpoint.timeout_seconds,
                     max_bytes=endpoint.max_response_bytes, max_redirects=max_redirects, clock=clock)
        if answer.status != 200:
            raise HttpFailure("http_status", f"HTTP {answer.status} {answer.reason}".rstrip())
        metrics = normalise(answer.body.decode("utf-8", errors="replace"))
    except HttpFailure as failure:
        return (_failed(endpoint, failure.kind, f"{endpoint.label}: {failure.message}", started, clock),
                failure.kind == "http_status")
    except ParseError as exc:
        return _failed(endpoint, "parse", f"{endpoint.label}: {exc}", started, clock), True
    except Exception as exc:  # a bug or an exotic library error must not stop sampling
        return (_failed(endpoint, "connection", f"{endpoint.label}: {type(exc).__name__}: {exc}", started, clock),
                False)
    # A server that echoes our credentials into its labels, whole or in pieces, must not make
    # us export them.
    engines = tuple(replace(e, model=secrets.scrub(e.model), engine=secrets.scrub(e.engine))
                    for e in metrics.engines)
    cache_config = metrics.cache_config
    if cache_config is not None:
        cache_config = replace(cache_config, cache_dtype=secrets.scrub(cache_config.cache_dtype))
    return VllmSample(
        endpoint=endpoint.label, up=True, scrape_duration_seconds=clock() - started,
        engines=engines, cache_config=cache_config, rejected_metrics=metrics.rejected,
        truncated=metrics.truncated,
        admission_rejections=tuple((secrets.scrub(model), secrets.scrub(reason), n)
                                   for model, reason, n in metrics.admission_rejections),
    ), False


def _serving(host_processes: tuple[ProcessSample, ...], samples: tuple[VllmSample, ...]
             ) -> tuple[ProcessSample, ...]:
    """The host's largest processes (unified memory, the CPU backend), a server's own marked as
    vLLM's with its endpoint: the API server is no "other" process beside the model."""
    if not host_processes:
        return host_processes
    owner = {pid: s.endpoint for s in samples for pid in (*s.pids, *(p.pid for p in s.processes))}
    return tuple(replace(p, role="vllm", endpoint=owner[p.pid]) if p.pid in owner and p.role != "vllm" else p
                 for p in host_processes)


def prepare(endpoint: VllmEndpoint, session: requests.Session, url: str | None = None) -> requests.PreparedRequest:
    """The endpoint's GET (of `url`, by default its page), built once: preparing it anew was a
    third of a scrape's HTTP cost."""
    headers = {"Accept": "text/plain;version=0.0.4", "Accept-Encoding": "identity"}
    if endpoint.bearer_token:
        headers["Authorization"] = f"Bearer {endpoint.bearer_token}"
    return session.prepare_request(requests.Request("GET", url or endpoint.metrics_url, headers=headers))


def only_read_url(metrics_url: str) -> str | None:
    """The page of only the families normalise() reads, where the URL ends in /metrics: vLLM
    mounts prometheus_client's app at `/metrics/`, which honours `name[]` (its instrumentator's
    route at `/metrics` ignores it), so the server renders 4 KB instead of 50 (0.32: about 3 ms
    instead of 8 of its API server's event loop). None for a URL with its own query."""
    parts = urlsplit(metrics_url)
    if parts.query or not parts.path.rstrip("/").endswith("/metrics"):
        return None
    return urlunsplit(parts._replace(path=parts.path.rstrip("/") + "/",
                                     query=urlencode([("name[]", name) for name in SAMPLE_NAMES])))


class PageReader:
    """Reads one endpoint's page through its own session, one read at a time (VllmSource's
    in-flight guard). It asks for only the families it reads (only_read_url, unless the endpoint
    says `by_name` false). Where that page fails though the server answered (a status, a
    redirect, a page that is not vLLM's) and the whole page then reads, the whole page is read
    from then on (a proxy that allows /metrics alone; several API servers, whose multiprocess
    registry cannot filter by name), and asked by name again after BY_NAME_RETRY_SECONDS (a
    gateway's error while vLLM restarted). A server that fails both ways is reported by its
    whole page's error, the URL configured."""

    BY_NAME_RETRY_SECONDS = 3600.0

    def __init__(self, endpoint: VllmEndpoint, session: requests.Session):
        self.endpoint = endpoint
        self.session = session
        self.only_read_url = only_read_url(endpoint.metrics_url) if endpoint.by_name else None
        self._whole_until: float | None = None  # reading the whole page until then (monotonic)
        self._prepared: dict[str | None, requests.PreparedRequest] = {}
        self._closed = False

    def close(self) -> None:
        """Cut a read still running short (new_session's adapter); no other URL is tried after."""
        self._closed = True
        self.session.close()

    def read(self, clock: Callable[[], float] = time.monotonic) -> VllmSample:
        by_name = self.only_read_url is not None and (self._whole_until is None or clock() >= self._whole_until)
        if by_name:
            # No redirect followed: one to /metrics would read the whole page at every scrape.
            sample, other_url_may_do = _scrape(self.endpoint, self.session, self._request(self.only_read_url),
                                               clock, 0)
            if sample.up or not other_url_may_do or self._closed:
                self._whole_until = None
                return sample
        whole = _scrape(self.endpoint, self.session, self._request(None), clock, MAX_REDIRECTS)[0]
        if by_name and whole.up:
            if self._whole_until is None:  # said once, not at each hourly try
                log.info("vLLM endpoint %s: its page by name failed (%s) while the whole page reads: "
                         "reading the whole page, by name again in an hour (by_name: false reads it whole "
                         "always)", self.endpoint.label, sample.error.removeprefix(f"{self.endpoint.label}: "))
            self._whole_until = clock() + self.BY_NAME_RETRY_SECONDS
        return whole

    def _request(self, url: str | None) -> requests.PreparedRequest | None:
        if url not in self._prepared:
            try:
                self._prepared[url] = prepare(self.endpoint, self.session, url)
            except Exception:  # scrape() tries again and reports what is wrong
                return None
        return self._prepared[url]


def redact(text: str, endpoint: VllmEndpoint) -> str:
    """Remove the bearer token and any URL credentials (or pieces of them) from a message,
    and bound its length."""
    return endpoint.secrets().scrub(text)[:MAX_ERROR_CHARS]


def _plain_session() -> requests.Session:
    # No proxy from the environment (it would see the bearer token) and no ~/.netrc; reading
    # both on every request was also a tenth of a scrape's CPU. Its close() cuts a scrape that is
    # still running short, so a reload or SIGTERM leaves no thread behind (#21 M7, L2).
    return new_session()


def _failed(endpoint: VllmEndpoint, kind: str, message: str, started: float,
            clock: Callable[[], float] = time.monotonic) -> VllmSample:
    return VllmSample(endpoint=endpoint.label, up=False, error_kind=kind,
                      error=redact(message, endpoint),
                      scrape_duration_seconds=clock() - started)


PidResolver = Callable[[VllmEndpoint, HostView, Sequence[int]], tuple[int, ...]]


class VllmSource:
    """The `vllm` source. Scrapes all endpoints concurrently, each bounded by its own timeout."""

    name = "vllm"
    # The GPU processes, to find each server's; and the host source's largest host processes,
    # marked as a server's own where they are.
    needs = (GPUS, PROCESS_IDENTITY, HOST_MEMORY)
    gives = (VLLM,)
    # Slack past the endpoint's timeout before we stop waiting for a worker thread.
    WAIT_MARGIN_SECONDS = 0.25

    def __init__(self, endpoints: Iterable[VllmEndpoint], host: HostView | None = None,
                 max_workers: int | None = None, session_factory: Callable[[], requests.Session] | None = None,
                 pid_resolver: PidResolver | None = None, clock: Callable[[], float] = time.monotonic):
        self.endpoints = tuple(endpoints)
        self.clock = clock  # monotonic seconds: each scrape's deadline and duration
        self.host = host
        self._resolve_pids = pid_resolver or ServerPids()
        # One session per endpoint: requests sessions are not thread-safe, and the in-flight
        # guard below keeps a single request per endpoint at a time.
        self._readers = [PageReader(ep, (session_factory or _plain_session)()) for ep in self.endpoints]
        # A worker per endpoint by default, so a stuck endpoint never takes another's thread.
        workers = max_workers if max_workers is not None else min(32, len(self.endpoints))
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(1, workers),
            thread_name_prefix="vllm-scrape")
        self._inflight: dict[int, concurrent.futures.Future[VllmSample]] = {}
        self._lock = threading.Lock()
        self._warned: set[tuple[str, str]] = set()  # (endpoint, metric) already logged
        self._was_up: dict[str, bool] = {}  # endpoint -> up at its last scrape (bounded by the config)
        self._answered: set[str] = set()  # the endpoints that have answered once (bounded likewise)
        logs = {ep.label: ep.log_file for ep in self.endpoints if ep.log_file}
        self.profiles = ProfileCache(logs) if logs else None
        self._roles = StickyRoles()
        self._server_processes = ServerProcesses(time.monotonic)
        self._idle = IdleReads(host)
        self._unanswered: set[int] = set()  # endpoints whose last read ran out of time
        self._given_up: set[int] = set()  # endpoints whose read in flight a tick stopped waiting for

    def collect(self, snapshot: Snapshot) -> Reading:
        samples = self.sample(candidates=[p.pid for g in snapshot.gpus for p in g.processes], now=snapshot.timestamp)
        if self.profiles is not None:
            samples = self.profiles.attach(samples)
        gpus = snapshot.gpus if self.host is None else self._roles.apply(assign_roles(snapshot.gpus, samples,
                                                                                      self.host))
        samples = self._with_processes(samples, gpus)
        self._idle.tick_done(samples, gpus)
        self._log_changes(samples)
        down = [s for s in samples if not s.up]
        cut = sum(s.truncated for s in samples)  # pages past their budget: counted, the rest unread
        return Reading(replace(snapshot, vllm=samples, gpus=gpus, host_processes=_serving(snapshot.host_processes,
                                                                                          samples)),
                       up=not down, error=down[0].error if down else "",
                       dropped=(("vllm_pages", cut),) if cut else ())

    def sample(self, candidates: Sequence[int] = (), now: float | None = None) -> tuple[VllmSample, ...]:
        """Scrape every endpoint; `candidates` (the GPU processes' PIDs) feed the
        container_id / process_pattern look-ups. With `now`, the tick's time, an idle server's
        last page may stand for this tick's (vllm_idle.py). One sample per endpoint, in order."""
        started = self.clock()
        roots: dict[int, tuple[int, ...] | None] = {}  # the server's processes, for every page not idle
        results: dict[int, VllmSample] = {}
        read: list[int] = []  # the endpoints whose page this tick read
        waiting: dict[concurrent.futures.Future[VllmSample], int] = {}
        with self._lock:
            for i, endpoint in enumerate(self.endpoints):
                previous = self._inflight.get(i)
                reading = previous is not None and not previous.done()
                if (now is not None and not reading and i not in self._given_up
                        and not self._idle.due(endpoint, now)):
                    results[i] = self._idle.last_page(endpoint, now)
                    continue
                # Resolved even when the scrape fails: a hung server still holds GPU memory.
                roots[i] = self._roots(endpoint, candidates)
                if reading:
                    # An earlier scrape is still stuck: do not pile up threads on it.
                    results[i] = _failed(endpoint, "timeout", f"{endpoint.label}: previous scrape "
                                         "still running", started, self.clock)
                    continue
                late = previous.result() if previous is not None and i in self._given_up else None
                self._given_up.discard(i)
                if late is not None and late.up:  # it answered after its tick stopped waiting
                    results[i] = late
                else:
                    future = self._pool.submit(self._readers[i].read, self.clock)
                    self._inflight[i] = future
                    waiting[future] = i
                read.append(i)
        if waiting:
            # A server whose last read ran out of time is not waited for until it answers (its reads
            # go on in the background, each within its own deadline): a hung server holds the tick,
            # and every other source's sampling with it, once, not at every tick.
            patient = [f for f, i in waiting.items() if i not in self._unanswered]
            if patient:
                longest = max(self.endpoints[waiting[f]].timeout_seconds for f in patient)
                concurrent.futures.wait(patient, timeout=longest + self.WAIT_MARGIN_SECONDS)
            if len(patient) < len(waiting):
                concurrent.futures.wait(waiting, timeout=self.WAIT_MARGIN_SECONDS)
        for future, i in waiting.items():
            endpoint = self.endpoints[i]
            if future.done():
                results[i] = future.result()  # scrape never raises
                continue
            self._given_up.add(i)
            results[i] = _failed(endpoint, "timeout", f"{endpoint.label}: " + (
                "still no complete response" if i in self._unanswered
                else f"no complete response within {endpoint.timeout_seconds:g}s"), started, self.clock)
        for i, sample in results.items():
            if sample.error_kind == "timeout":
                self._unanswered.add(i)
            else:
                self._unanswered.discard(i)
            pids = roots.get(i)
            if pids is not None:
                results[i] = replace(sample, pids=pids)
        for i in read:
            self._warn_rejected(results[i])
            if now is not None:
                self._idle.read(self.endpoints[i], results[i], now)
        return tuple(results[i] for i in range(len(self.endpoints)))

    def _with_processes(self, samples: tuple[VllmSample, ...], gpus: tuple[GpuSample, ...]) -> tuple[VllmSample, ...]:
        """A server none of whose processes a GPU lists (vLLM's CPU backend, or one still
        loading) gets its own processes from the host, with their memory."""
        if self.host is None:
            return samples
        on_gpu = {p.endpoint for g in gpus for p in g.processes if p.role == "vllm"}
        # A root another endpoint's GPU processes descend from is a GPU server's too (several
        # endpoints of one process: a proxy, a test harness).
        gpu_roots = {pid for s in samples if s.endpoint in on_gpu for pid in s.pids}
        out = []
        for sample in samples:
            if sample.pids and sample.endpoint not in on_gpu and not gpu_roots.intersection(sample.pids):
                try:
                    sample = replace(sample, processes=self._server_processes(sample, self.host))
                except Exception as exc:  # a source never raises on the host's faults
                    log.warning("vLLM endpoint %s: reading its processes failed: %s", sample.endpoint, exc)
            out.append(sample)
        return tuple(out)

    def _log_changes(self, samples: tuple[VllmSample, ...]) -> None:
        """Once when an endpoint stops answering (a timeout under load is the news: a saturated
        server answers its /metrics late), once when it answers again."""
        for sample in samples:
            was = self._was_up.get(sample.endpoint)
            if sample.up and was is False:
                again = "again" if sample.endpoint in self._answered else "for the first time"
                announce_recovery(log, "vLLM endpoint %s answers %s", sample.endpoint, again)
            elif not sample.up and was is not False:
                log.warning("vLLM endpoint %s is down (%s): %s", sample.endpoint, sample.error_kind or "error",
                            sample.error)
            if sample.up:
                self._answered.add(sample.endpoint)
            self._was_up[sample.endpoint] = sample.up

    def _warn_rejected(self, sample: VllmSample) -> None:
        """Impossible values are said once per endpoint and metric, then only counted."""
        for name in sample.rejected_metrics:
            key = (sample.endpoint, name)
            if key not in self._warned and len(self._warned) < 1000:
                self._warned.add(key)
                log.warning("vLLM endpoint %s: impossible values of %s dropped (negative, not "
                            "finite or out of range)", sample.endpoint, name)

    def _roots(self, endpoint: VllmEndpoint, candidates: Sequence[int]) -> tuple[int, ...] | None:
        """The server's root PIDs; None when they cannot be looked up."""
        if self.host is None:
            return None
        try:
            return tuple(self._resolve_pids(endpoint, self.host, candidates))
        except Exception as exc:
            log.warning("vLLM endpoint %s: finding its processes failed: %s", endpoint.label,
                        redact(str(exc), endpoint))
            return None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for reader in self._readers:
            reader.close()
