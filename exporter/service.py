"""The daemon of `run`, put together: the host and its sources (runtime.py), the analysis, the
sampling loop with its live reactions (reactions/), the listeners, and the reload machine
(reload.py). The command line only turns its arguments into a `Service` and waits for a signal.

`Service.open` builds everything or nothing: a failure part-way closes what was already
started (simulated servers, threads, sockets) and raises StartError, one message for the
operator. `start()` starts sampling; `reloader.request` is SIGHUP's; `close()` stops it all.
"""
from __future__ import annotations

import dataclasses
import errno
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from .config import Config, ConfigError, parse_listen
from .config import load as load_config
from .model import ListenerStats, ReloadStats, State
from .reload import Reloader

if TYPE_CHECKING:  # imported where used, so `snapshot` and `check-config` load only what they need
    from .analysis.engine import Analyzer
    from .clock import Clock
    from .config.web import WebConfig
    from .daemon import Daemon
    from .reactions.alloc_history import HistoryRequester
    from .reactions.recorder import FlightRecorder
    from .runtime import Runtime
    from .serve.server import HttpServer

log = logging.getLogger("exporter")

# run's and snapshot's flags, as the key paths they override (their environment variables too)
FLAG_KEYS = {"vllm_endpoints": "vllm.endpoints"}


class StartError(Exception):
    """Why the daemon cannot start (or sample), in one message for the operator."""


def load(config_file: str | None, flags: Mapping[str, Any]) -> Config:
    """The one validation `run`, `check-config` and a reload share: the file, the flags and
    environment over it, the files it names, and the detectors' own needs. Raises ConfigError."""
    return load_config(config_file, {FLAG_KEYS.get(k, k): v for k, v in flags.items()})


def make_analyzer(config: Config) -> Analyzer:
    from .analysis.engine import Analyzer

    return Analyzer(config.analysis())  # already checked against the detectors' needs by load()


def build_runtime(config: Config, simulate: str | None, speed: float = 1.0, at: float | None = None,
                  one_shot: bool = False) -> Runtime:
    from .runtime import build
    from .sim.scenario import ScenarioError

    try:
        return build(config, simulate=simulate, speed=speed, at=at, one_shot=one_shot)
    except (ConfigError, ScenarioError) as exc:
        raise StartError(str(exc)) from exc


def make_recorder(config: Config, clock: Clock) -> FlightRecorder | None:
    if not config.recorder.directory:
        return None
    from .reactions.recorder import FlightRecorder

    r = config.recorder
    try:
        return FlightRecorder(r.directory, r.window_seconds, r.max_files, r.max_total_bytes,
                              r.debounce_seconds, now=clock.now, tail_seconds=r.tail_seconds)
    except ValueError as exc:
        raise StartError(f"invalid configuration: recorder: {exc}") from exc


def make_alloc_history(config: Config, clock: Clock, simulated: bool) -> HistoryRequester | None:
    h = config.allocator.history
    if not h.enabled or not config.allocator.probe_dir:
        return None
    if simulated:  # the simulated probes record nothing
        log.info("allocator.history: not used while simulating")
        return None
    from .reactions.alloc_history import HistoryRequester

    return HistoryRequester(config.allocator.probe_dir, h.record_seconds, h.max_entries,
                            h.min_interval_seconds, now=clock.now)


def _web_config(config: Config) -> WebConfig | None:
    if not config.web_config_file:
        return None
    from .serve.webconfig import load_web_config

    try:
        return load_web_config(config.web_config_file)
    except ConfigError as exc:
        raise StartError(f"invalid web config: {exc}") from exc


class Service:
    """A running `run`: its runtime (host and sources), analyzer, sampling loop, listeners and
    reload machine. Build it with `open`."""

    def __init__(self, config: Config, runtime: Runtime, analyzer: Analyzer, daemon: Daemon,
                 reload_config: Callable[[], Config], where: str = ""):
        self.config = config  # as started: the listeners' settings (a reload never changes them)
        self.runtime = runtime
        self.analyzer = analyzer
        self.daemon = daemon
        self.reloader = Reloader(config, reload_config, self._apply, runtime.clock.now, where=where)
        self.servers: list[HttpServer] = []
        self._merged: tuple[State, ReloadStats, State] | None = None

    @classmethod
    def open(cls, config_file: str | None, flags: Mapping[str, Any], simulate: str | None = None,
             speed: float = 1.0) -> Service:
        """Everything `run` needs, listening but not yet sampling. Raises ConfigError (the
        configuration) or StartError (what it names cannot be used)."""
        from .daemon import Daemon

        config = load(config_file, flags)
        web = _web_config(config)
        analyzer = make_analyzer(config)
        runtime = build_runtime(config, simulate, speed=speed)
        clock, recorder = runtime.clock, None
        try:  # a failure from here on must not leave simulated servers or threads behind
            recorder = make_recorder(config, clock)
            daemon = Daemon(runtime.sampler, clock, config.interval_seconds, analyzer=analyzer, recorder=recorder,
                            alloc_history=make_alloc_history(config, clock, bool(simulate)))
            service = cls(config, runtime, analyzer, daemon, lambda: load(config_file, flags), config_file or "")
            service._listen(web, runtime.host.sampled)
        except BaseException:
            if recorder is not None:
                recorder.close()
            runtime.close()
            raise
        return service

    def _listen(self, web: WebConfig | None, sampled: Callable[[], str]) -> None:
        """The listeners: `listen` (with TLS and basic auth when the web config says so), and
        `health_listen` (plain, /healthz and /admission only) when set. Stops those already
        started when one fails."""
        from .serve.auth import BasicAuth
        from .serve.exposition import build_registry
        from .serve.server import HttpServer
        from .serve.web import HEALTH_PATHS, make_app

        clock = self.runtime.clock
        args = (build_registry(self.state, clock.now, self._listener_stats), self.state, clock.now,
                lambda: self.reloader.config.effective_stale_after)
        auth = BasicAuth(web.basic_auth_users) if web and web.basic_auth_users else None
        listeners = [("listen", self.config.listen, make_app(*args, auth=auth, host=sampled), web)]
        if self.config.health_listen:  # probes keep working when basic auth is on
            listeners.append(("health_listen", self.config.health_listen, make_app(*args, paths=HEALTH_PATHS),
                              None))
        try:
            for name, where, app, web_config in listeners:
                try:
                    self.servers.append(HttpServer(app, *parse_listen(where), web_config, name=name).start())
                except OSError as exc:
                    hint = (" (another exporter on that port? choose one with --listen HOST:PORT, or "
                            "`make run LISTEN=127.0.0.1:9843`)") if exc.errno == errno.EADDRINUSE else ""
                    raise StartError(f"cannot listen on {where}: {exc.strerror or exc}{hint}") from exc
        except BaseException:
            self._stop_servers()
            raise

    def state(self) -> State:
        """The published State with the reload's outcome: the same object until either changes
        (the /metrics cache keys on it)."""
        base, stats = self.daemon.state, self.reloader.stats
        merged = self._merged
        if merged is None or merged[0] is not base or merged[1] is not stats:
            merged = self._merged = (base, stats, dataclasses.replace(base, reload=stats))
        return merged[2]

    def _apply(self, config: Config) -> None:
        """A reload's configuration, from the next tick: new sources over the same host (its
        clock, GPU library and simulated servers carry on), the detectors' settings, the
        interval. Raises, with nothing changed, when the sources cannot be built."""
        from .runtime import make_sampler

        sampler = make_sampler(config, self.runtime.host)
        try:
            self.analyzer.reconfigure(config.analysis())
        except BaseException:
            sampler.close()
            raise
        self.daemon.replace_sampler(sampler)  # swapped (and the old one closed) between two ticks
        self.daemon.interval = config.interval_seconds

    def start(self) -> None:
        """Start sampling, and say where it serves."""
        self.daemon.start()
        server = self.servers[0]
        log.info("serving on %s://%s:%d/metrics, sampling every %g s", "https" if server.tls else "http",
                 parse_listen(self.config.listen)[0], server.port, self.config.interval_seconds)
        if self.config.health_listen:
            log.info("serving /healthz and /admission without auth on http://%s", self.config.health_listen)

    def _listener_stats(self) -> tuple[ListenerStats, ...]:
        return tuple(ListenerStats(s.name, s.admission.open, dict(s.admission.refused_by), s.admission.evicted)
                     for s in self.servers)

    def _stop_servers(self) -> None:
        for server in self.servers:
            server.stop()
        self.servers = []

    def close(self) -> None:
        """Stop sampling, then the listeners, then close the sources in use (a reload may have
        replaced them) and the host."""
        self.daemon.stop()
        self._stop_servers()
        self.daemon.sampler.close()
        self.runtime.host.close()
