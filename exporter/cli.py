"""Command line: `gpu-memory-exporter run|snapshot|explain|analyze|scenarios|check-config`."""
from __future__ import annotations

import dataclasses
import errno
import json
import logging
import signal
import sys
import threading
from typing import TYPE_CHECKING, NoReturn

import click
import yaml

from . import __version__
from .config import Config, ConfigError, file_form
from .config import load as load_config

if TYPE_CHECKING:  # imported where used, so each command loads only what it needs
    from .analysis.engine import Analyzer
    from .clock import Clock
    from .postmortem.alloc_history import HistoryRequester
    from .postmortem.recorder import FlightRecorder
    from .runtime import Runtime

log = logging.getLogger("exporter")

_COMMON_ENV = {"auto_envvar_prefix": "GPUMEM"}


def _setup_logging(level: str) -> None:
    chosen = getattr(logging, level.upper(), logging.INFO)
    logging.basicConfig(level=chosen, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    # urllib3's debug lines carry whole request URLs, an endpoint's query token included (#21 L10).
    logging.getLogger("urllib3").setLevel(max(chosen, logging.INFO))


def _fail(message: str) -> NoReturn:
    """Bad input files (logs, traces): a one-line error and exit status 2, as for bad usage."""
    click.echo(f"Error: {message}", err=True)
    sys.exit(2)


# run's and snapshot's flags, as the key paths they override (their environment variables too)
_FLAG_KEYS = {"vllm_endpoints": "vllm.endpoints"}


def _load(config_file: str | None, **flags: object) -> Config:
    """The one validation `run`, `check-config` and a reload share: the file, the flags and
    environment over it, the files it names, and the detectors' own needs."""
    try:
        return load_config(config_file, {_FLAG_KEYS.get(k, k): v for k, v in flags.items()})
    except ConfigError as exc:
        where = f" in {config_file}" if config_file else ""
        raise click.ClickException(f"invalid configuration{where}:\n  " + str(exc).replace("\n", "\n  ")) from None


def make_analyzer(config: Config) -> Analyzer:
    from .analysis.engine import Analyzer

    return Analyzer(config.analysis())  # already checked against the detectors' needs by _load


def _build_runtime(config: Config, simulate: str | None, speed: float = 1.0, at: float | None = None,
                   one_shot: bool = False) -> Runtime:
    from .runtime import build
    from .sim.scenario import ScenarioError

    try:
        return build(config, simulate=simulate, speed=speed, at=at, one_shot=one_shot)
    except (ConfigError, ScenarioError) as exc:
        raise click.ClickException(str(exc)) from exc


def _make_recorder(config: Config, clock: Clock) -> FlightRecorder | None:
    if not config.recorder.directory:
        return None
    from .postmortem.recorder import FlightRecorder

    r = config.recorder
    try:
        return FlightRecorder(r.directory, r.window_seconds, r.max_files, r.max_total_bytes,
                              r.debounce_seconds, now=clock.now, tail_seconds=r.tail_seconds)
    except ValueError as exc:
        raise click.ClickException(f"invalid configuration: recorder: {exc}") from exc


def _make_alloc_history(config: Config, clock: Clock, simulated: bool) -> HistoryRequester | None:
    h = config.allocator.history
    if not h.enabled or not config.allocator.probe_dir:
        return None
    if simulated:  # the simulated probes record nothing
        log.info("allocator.history: not used while simulating")
        return None
    from .postmortem.alloc_history import HistoryRequester

    return HistoryRequester(config.allocator.probe_dir, h.record_seconds, h.max_entries,
                            h.min_interval_seconds, now=clock.now)


@click.group(context_settings={"help_option_names": ["-h", "--help"], **_COMMON_ENV})
@click.version_option(__version__, prog_name="gpu-memory-exporter")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False))
def main(log_level: str) -> None:
    """Prometheus exporter and alerting daemon for GPU memory on LLM serving hosts."""
    _setup_logging(log_level)


@main.command()
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="YAML configuration file.")
@click.option("--listen", help="HOST:PORT to serve on (default 0.0.0.0:9842).")
@click.option("--interval", type=float, help="Seconds between samples (default 5).")
@click.option("--simulate", metavar="SCENARIO", help="Run against a built-in simulated host (see `scenarios`).")
@click.option("--speed", type=float, default=1.0, show_default=True,
              help="With --simulate: how many times faster than real time the scenario runs.")
@click.option("--vllm-endpoint", "vllm_endpoints", multiple=True, metavar="URL",
              help="A vLLM /metrics URL to scrape; repeatable.")
@click.option("--web-config", "web_config_file", type=click.Path(dir_okay=False),
              help="TLS and basic auth, in Prometheus exporter-toolkit's web config format.")
@click.option("--health-listen", help="HOST:PORT of a plain-HTTP listener for /healthz and /admission "
              "only, without auth (for probes when basic auth is on).")
def run(config_file: str | None, listen: str | None, interval: float | None, simulate: str | None, speed: float,
        vllm_endpoints: tuple[str, ...], web_config_file: str | None, health_listen: str | None) -> None:
    """Run the daemon: sample, analyse and serve /metrics."""
    from .config import parse_listen
    from .daemon import Daemon
    from .serve.auth import BasicAuth
    from .serve.exposition import build_registry
    from .serve.server import HttpServer
    from .serve.web import HEALTH_PATHS, make_app
    from .serve.webconfig import load_web_config

    overrides = {"listen": listen, "interval_seconds": interval, "web_config_file": web_config_file,
                 "vllm_endpoints": vllm_endpoints, "health_listen": health_listen}
    config = _load(config_file, **overrides)
    web = None
    if config.web_config_file:
        try:
            web = load_web_config(config.web_config_file)
        except ConfigError as exc:
            raise click.ClickException(f"invalid web config: {exc}") from exc
    analyzer = make_analyzer(config)
    runtime = _build_runtime(config, simulate, speed=speed)
    clock = runtime.clock
    recorder = None
    servers = []
    try:  # a failure from here on must not leave simulated servers or threads behind
        recorder = _make_recorder(config, clock)
        daemon = Daemon(runtime.sampler, clock, config.interval_seconds, analyzer=analyzer, recorder=recorder,
                        alloc_history=_make_alloc_history(config, clock, bool(simulate)))
        registry = build_registry(lambda: daemon.state, clock.now)
        current = {"config": config}  # what a reload changes
        app_args = (registry, lambda: daemon.state, clock.now, lambda: current["config"].effective_stale_after)
        sampled = f"simulated: scenario {simulate}" if simulate else "real"
        app = make_app(*app_args, auth=BasicAuth(web.basic_auth_users) if web and web.basic_auth_users else None,
                       host=sampled)
        listeners = [(config.listen, app, web)]
        if config.health_listen:  # probes keep working when basic auth is on
            listeners.append((config.health_listen, make_app(*app_args, paths=HEALTH_PATHS), None))
        for where, served, web_config in listeners:
            try:
                servers.append(HttpServer(served, *parse_listen(where), web_config).start())
            except OSError as exc:
                hint = (" (another exporter on that port? choose one with --listen HOST:PORT, or "
                        "`make run LISTEN=127.0.0.1:9843`)") if exc.errno == errno.EADDRINUSE else ""
                raise click.ClickException(f"cannot listen on {where}: {exc.strerror or exc}{hint}") from exc
    except BaseException:
        for server in servers:
            server.stop()
        if recorder is not None:
            recorder.close()
        runtime.close()
        raise
    server = servers[0]
    host = parse_listen(config.listen)[0]
    log.info("serving on %s://%s:%d/metrics, sampling every %g s", "https" if server.tls else "http",
             host, server.port, config.interval_seconds)
    if config.health_listen:
        log.info("serving /healthz and /admission without auth on http://%s", config.health_listen)

    stopping = threading.Event()

    reloading = {"busy": False, "again": False}

    def reload(*_: object) -> None:
        """SIGHUP: re-read the configuration and rebuild the sources over the same host (its
        clock, NVML and simulated servers carry on). A reload that fails in any way keeps the
        running configuration and says why: the daemon never dies of one. The listener, web
        config, host, kubelet, history and recorder settings change only on restart."""
        if reloading["busy"]:  # a signal during a reload: run once more when it is done
            reloading["again"] = True
            return
        reloading["busy"] = True
        try:
            while True:
                reloading["again"] = False
                _reload_once()
                if not reloading["again"]:
                    break
        finally:
            reloading["busy"] = False

    def _reload_once() -> None:
        from .runtime import make_sampler

        sampler = None
        try:
            new_config = _load(config_file, **overrides)
            sampler = make_sampler(new_config, runtime.host)
            analyzer.reconfigure(new_config.analysis())
            daemon.replace_sampler(sampler)  # swapped (and the old one closed) between two ticks
        except click.ClickException as exc:  # one log line, every problem in it
            header, *problems = exc.message.splitlines()
            log.error("reload failed, keeping the running configuration: %s %s", header,
                      "; ".join(p.strip() for p in problems))
            return
        except Exception as exc:  # building sources can fail in ways no check foresees
            log.error("reload failed, keeping the running configuration: %s: %s", type(exc).__name__, exc,
                      exc_info=log.isEnabledFor(logging.DEBUG))
            if sampler is not None:
                sampler.close()
            return
        old = current["config"]
        current["config"] = new_config
        daemon.interval = new_config.interval_seconds
        changed = [k for k in ("listen", "health_listen", "web_config_file", "host", "history", "recorder",
                               "kubelet") if getattr(old, k) != getattr(new_config, k)]
        if old.allocator.history != new_config.allocator.history:
            changed.append("allocator.history")
        if changed:
            log.warning("changed settings that take effect only on restart: %s", ", ".join(changed))
        log.info("configuration reloaded")

    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    signal.signal(signal.SIGINT, lambda *_: stopping.set())
    if hasattr(signal, "SIGHUP"):
        signal.signal(signal.SIGHUP, reload)
    daemon.start()
    try:
        while not stopping.wait(0.5):
            pass
    finally:
        log.info("stopping")
        daemon.stop()
        for server in servers:
            server.stop()
        daemon.sampler.close()  # the sampler in use, which a reload may have replaced
        runtime.host.close()


@main.command()
@click.option("--config", "config_file", type=click.Path(dir_okay=False))
@click.option("--simulate", metavar="SCENARIO", help="Sample a built-in simulated host.")
@click.option("--at", "at", type=float, default=0.0, show_default=True,
              help="With --simulate: the scenario time (seconds) to sample at.")
@click.option("--vllm-endpoint", "vllm_endpoints", multiple=True, metavar="URL")
@click.option("--format", "fmt", type=click.Choice(["prometheus", "json"]), default="prometheus",
              show_default=True)
def snapshot(config_file: str | None, simulate: str | None, at: float, vllm_endpoints: tuple[str, ...],
             fmt: str) -> None:
    """Sample once and print the result."""
    from prometheus_client import generate_latest

    from .daemon import Daemon
    from .serve.exposition import build_registry

    config = _load(config_file, vllm_endpoints=vllm_endpoints)
    runtime = _build_runtime(config, simulate, at=at if simulate else None, one_shot=True)
    try:
        daemon = Daemon(runtime.sampler, runtime.clock, config.interval_seconds,
                        analyzer=make_analyzer(config))
        state = daemon.tick()
    finally:
        runtime.close()
    if state.snapshot is None:
        _fail("sampling failed; see the log above")
    if not simulate and state.snapshot.source_up("nvml") is False:
        click.echo("No GPU could be read on this host. To see what the exporter reports, sample "
                   "a simulated one: gpu-memory-exporter snapshot --simulate steady "
                   "(`gpu-memory-exporter scenarios` lists them all).", err=True)
    if fmt == "json":
        out = {"snapshot": dataclasses.asdict(state.snapshot),
               "analysis": dataclasses.asdict(state.analysis) if state.analysis else None}
        click.echo(json.dumps(out, indent=2, default=str))
    else:
        click.echo(generate_latest(build_registry(lambda: state, runtime.clock.now)).decode(), nl=False)


@main.command()
@click.argument("logfiles", nargs=-1, required=True, type=click.Path())
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
def explain(logfiles: tuple[str, ...], fmt: str) -> None:
    """Find every out-of-memory event in server logs and explain it."""
    from .postmortem.explain import ExplainError
    from .postmortem.explain import explain as do_explain

    try:
        click.echo(do_explain(list(logfiles), fmt), nl=False)
    except ExplainError as exc:
        _fail(str(exc))


@main.command()
@click.argument("traces", nargs=-1, type=click.Path())
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
@click.option("--prometheus", "prometheus_url", metavar="URL",
              help="Pull the exporter's series from this Prometheus instead of TRACE files.")
@click.option("--start", help="With --prometheus: Unix seconds, RFC 3339, or relative like now-6h.")
@click.option("--end", default="now", show_default=True, help="With --prometheus: end of the range.")
@click.option("--step", type=float, help="With --prometheus: resolution in seconds (default 15).")
@click.option("--selector", default="", help='With --prometheus: label matchers, e.g. instance="gpu1:9842".')
@click.option("--report", "report_path", type=click.Path(dir_okay=False),
              help="Also write a self-contained HTML incident report (plots need the `report` extra).")
@click.option("--log", "log_files", multiple=True, type=click.Path(),
              help="Server logs whose out-of-memory events are listed (with their class and time) "
              "and go into the report; repeatable.")
def analyze(traces: tuple[str, ...], fmt: str, prometheus_url: str | None, start: str | None, end: str,
            step: float | None, selector: str, report_path: str | None, log_files: tuple[str, ...]) -> None:
    """Replay recorded samples (trace CSV or Prometheus range-query JSON) through the detectors."""
    from .postmortem.analyze import analyze_snapshots, read_log_events
    from .postmortem.explain import ExplainError
    from .postmortem.trace import TraceError, load_traces

    if bool(traces) == bool(prometheus_url):
        raise click.UsageError("give TRACE files or --prometheus URL (one of them)")
    try:
        if prometheus_url:
            from .postmortem.promquery import fetch, parse_time

            if start is None:
                raise click.UsageError("--prometheus needs --start")
            try:
                t0, t1 = parse_time(start), parse_time(end)
            except ValueError as exc:
                raise click.UsageError(str(exc)) from None
            snapshots = fetch(prometheus_url, t0, t1, step=step, selector=selector)
            triggers: list[tuple[float, str]] = []
        else:
            trace = load_traces(list(traces))
            snapshots, triggers = trace.snapshots, trace.triggers
        events = read_log_events(log_files, snapshots[-1].timestamp if snapshots else None)
        click.echo(analyze_snapshots(snapshots, fmt, report_path=report_path, oom_events=events,
                                     triggers=triggers), nl=False)
    except (TraceError, ExplainError) as exc:  # PromQueryError is a TraceError
        _fail(str(exc))
    except OSError as exc:
        _fail(f"{report_path}: cannot write the report: {exc.strerror or exc}")


@main.command()
def scenarios() -> None:
    """List the built-in simulation scenarios."""
    from .sim.scenario import builtin

    items = builtin()
    width = max(len(name) for name, _ in items)
    for name, description in items:
        click.echo(f"{name.ljust(width)}  {description}")


@main.command("check-config")
@click.argument("file", type=click.Path(dir_okay=False))
def check_config(file: str) -> None:
    """Validate a configuration file, and the files it names, as `run` would; print every
    problem, or the configuration as understood (a file `check-config` accepts again)."""
    config = _load(file)
    click.echo(f"# {file}: OK\n" + yaml.safe_dump(file_form(config), sort_keys=False), nl=False)
