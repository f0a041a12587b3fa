"""Command line: `gpu-memory-exporter run|snapshot|explain|analyze|scenarios|check-config`."""
from __future__ import annotations

import dataclasses
import json
import logging
import signal
import sys
import threading

import click

from . import __version__
from .config import Config, ConfigError
from .config import load as load_config

log = logging.getLogger("exporter")

_COMMON_ENV = {"auto_envvar_prefix": "GPUMEM"}


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)


def _fail(message: str) -> None:
    """Bad input files (logs, traces): a one-line error and exit status 2, as for bad usage."""
    click.echo(f"Error: {message}", err=True)
    sys.exit(2)


def _load(config_file, **overrides) -> Config:
    try:
        return load_config(config_file, overrides)
    except ConfigError as exc:
        raise click.ClickException(f"invalid configuration: {exc}") from exc


def make_analyzer(config: Config):
    from .analysis.engine import AnalysisConfig, Analyzer

    try:
        return Analyzer(AnalysisConfig(admission_close_above=config.admission.close_above,
                                       admission_open_below=config.admission.open_below,
                                       history_raw_seconds=config.history_raw_seconds,
                                       history_retention_seconds=config.history_retention_seconds))
    except ValueError as exc:  # settings that conflict with what the detectors need
        raise click.ClickException(f"invalid configuration: {exc}") from exc


def _build_runtime(config: Config, simulate, speed=1.0, at=None):
    from .runtime import build
    from .sim.scenario import ScenarioError

    try:
        return build(config, simulate=simulate, speed=speed, at=at)
    except (ConfigError, ScenarioError) as exc:
        raise click.ClickException(str(exc)) from exc


def _make_recorder(config: Config, clock):
    if not config.recorder.directory:
        return None
    from .recorder import FlightRecorder

    r = config.recorder
    try:
        return FlightRecorder(r.directory, r.window_seconds, r.max_files, r.max_total_bytes,
                              r.debounce_seconds, now=clock.now)
    except ValueError as exc:
        raise click.ClickException(f"invalid configuration: recorder: {exc}") from exc


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
def run(config_file, listen, interval, simulate, speed, vllm_endpoints, web_config_file) -> None:
    """Run the daemon: sample, analyse and serve /metrics."""
    from .config import parse_listen
    from .daemon import Daemon
    from .exposition import build_registry
    from .web import BasicAuth, HttpServer, load_web_config, make_app

    overrides = dict(listen=listen, interval_seconds=interval, web_config_file=web_config_file,
                     vllm_endpoints=vllm_endpoints)
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
    try:  # a failure from here on must not leave simulated servers or threads behind
        recorder = _make_recorder(config, clock)
        daemon = Daemon(runtime.sampler, clock, config.interval_seconds, analyzer=analyzer, recorder=recorder)
        registry = build_registry(lambda: daemon.state, clock.now)
        current = {"config": config}  # what a reload changes
        app = make_app(registry, lambda: daemon.state, clock.now,
                       lambda: current["config"].effective_stale_after,
                       auth=BasicAuth(web.basic_auth_users) if web and web.basic_auth_users else None)
        host, port = parse_listen(config.listen)
        try:
            server = HttpServer(app, host, port, web).start()
        except OSError as exc:
            raise click.ClickException(f"cannot listen on {config.listen}: {exc.strerror or exc}") from exc
    except BaseException:
        if recorder is not None:
            recorder.close()
        runtime.close()
        raise
    log.info("serving on %s://%s:%d/metrics (%s host, every %.1f s)", "https" if server.tls else "http",
             host, server.port, f"simulated '{simulate}' x{speed:g}" if simulate else "real",
             config.interval_seconds)

    stopping = threading.Event()

    def reload(*_):
        """SIGHUP: re-read the configuration and rebuild the sources over the same host (its
        clock, NVML and simulated servers carry on); a bad file keeps the running one. The
        listener, web config, kubelet, history and recorder settings change only on restart."""
        from .runtime import make_sampler

        try:
            new_config = _load(config_file, **overrides)
            thresholds = make_analyzer(new_config).config  # checked against the detectors' needs
            sampler = make_sampler(new_config, runtime.host)
        except (click.ClickException, ConfigError) as exc:
            log.error("reload failed, keeping the running configuration: %s",
                      getattr(exc, "message", None) or exc)
            return
        current["config"] = new_config
        analyzer.reconfigure(thresholds)
        daemon.replace_sampler(sampler)  # swapped (and the old one closed) between two ticks
        daemon.interval = new_config.interval_seconds
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
def snapshot(config_file, simulate, at, vllm_endpoints, fmt) -> None:
    """Sample once and print the result."""
    from prometheus_client import generate_latest

    from .daemon import Daemon
    from .exposition import build_registry

    config = _load(config_file, vllm_endpoints=vllm_endpoints)
    runtime = _build_runtime(config, simulate, at=at if simulate else None)
    try:
        daemon = Daemon(runtime.sampler, runtime.clock, config.interval_seconds,
                        analyzer=make_analyzer(config))
        state = daemon.tick()
    finally:
        runtime.close()
    if state.snapshot is None:
        _fail("sampling failed; see the log above")
    if fmt == "json":
        out = {"snapshot": dataclasses.asdict(state.snapshot),
               "analysis": dataclasses.asdict(state.analysis) if state.analysis else None}
        click.echo(json.dumps(out, indent=2, default=str))
    else:
        click.echo(generate_latest(build_registry(lambda: state, runtime.clock.now)).decode(), nl=False)


@main.command()
@click.argument("logfiles", nargs=-1, required=True, type=click.Path())
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
def explain(logfiles, fmt) -> None:
    """Find every out-of-memory event in server logs and explain it."""
    from .explain import ExplainError
    from .explain import explain as do_explain

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
              help="Server logs whose out-of-memory events go into the report; repeatable.")
def analyze(traces, fmt, prometheus_url, start, end, step, selector, report_path, log_files) -> None:
    """Replay recorded samples (trace CSV or Prometheus range-query JSON) through the detectors."""
    from .analyze import analyze_snapshots
    from .explain import ExplainError, read_events
    from .trace import TraceError, read_traces

    if bool(traces) == bool(prometheus_url):
        raise click.UsageError("give TRACE files or --prometheus URL (one of them)")
    try:
        if prometheus_url:
            from .promquery import fetch, parse_time

            if start is None:
                raise click.UsageError("--prometheus needs --start")
            try:
                t0, t1 = parse_time(start), parse_time(end)
            except ValueError as exc:
                raise click.UsageError(str(exc)) from None
            snapshots = fetch(prometheus_url, t0, t1, step=step, selector=selector)
        else:
            snapshots = read_traces(list(traces))
        events = [e for path in log_files for e in read_events(path)[0]]
        click.echo(analyze_snapshots(snapshots, fmt, report_path=report_path, oom_events=events), nl=False)
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
def check_config(file) -> None:
    """Validate a configuration file and print it as understood."""
    config = _load(file)
    make_analyzer(config)  # the detectors' own constraints (e.g. how much raw history they need)
    click.echo(f"{file}: OK")
    out = dataclasses.asdict(config)
    click.echo(json.dumps(out, indent=2, default=str))
