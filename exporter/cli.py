"""Command line: `gpu-memory-exporter run|snapshot|explain|analyze|scenarios|check-config`."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import shlex
import shutil
import signal
import sys
import threading
from typing import TYPE_CHECKING, NoReturn

import click
import yaml

from . import __version__
from .config import Config, ConfigError, file_form
from .service import StartError, make_analyzer  # make_analyzer: also imported from here by tests and benches

if TYPE_CHECKING:
    from .analysis.engine import AnalysisConfig

__all__ = ["main", "make_analyzer"]

log = logging.getLogger("exporter")

_COMMON_ENV = {"auto_envvar_prefix": "GPUMEM"}


def _setup_logging(level: str) -> None:
    chosen = getattr(logging, level.upper(), logging.INFO)
    logging.basicConfig(level=chosen, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    # urllib3's debug lines carry whole request URLs, an endpoint's query token included (#21 L10).
    logging.getLogger("urllib3").setLevel(max(chosen, logging.INFO))


def _self_command() -> str:
    """This program as a command that works in the user's shell: its bare name where PATH finds
    this very program, else the path it was run by (`make run` installs it in .venv/bin, not on
    PATH), else `python -m exporter` with this interpreter."""
    argv0 = sys.argv[0]
    if os.path.basename(argv0) != "gpu-memory-exporter" or not os.path.isfile(argv0):
        return f"{shlex.quote(sys.executable)} -m exporter"
    on_path = shutil.which("gpu-memory-exporter")
    if on_path is not None and os.path.realpath(on_path) == os.path.realpath(argv0):
        return "gpu-memory-exporter"
    return shlex.quote(os.path.abspath(argv0))


def _fail(message: str) -> NoReturn:
    """Bad input files (logs, traces): a one-line error and exit status 2, as for bad usage."""
    click.echo(f"Error: {message}", err=True)
    sys.exit(2)


def _invalid(config_file: str | None, exc: ConfigError) -> click.ClickException:
    where = f" in {config_file}" if config_file else ""
    return click.ClickException(f"invalid configuration{where}:\n  " + str(exc).replace("\n", "\n  "))


def _analysis_settings(config_file: str) -> AnalysisConfig:
    """The detector, history and admission settings of the daemon's file, for a replay: its
    other sections (and the files they name) are not read."""
    from .config import load
    from .config.loading import ANALYSIS_SECTIONS

    try:
        return load(config_file, sections=ANALYSIS_SECTIONS).analysis()
    except ConfigError as exc:
        raise _invalid(config_file, exc) from None


def _load(config_file: str | None, **flags: object) -> Config:
    """service.load, its problems as click's error (exit status 1)."""
    from .service import load

    try:
        return load(config_file, flags)
    except ConfigError as exc:
        error = _invalid(config_file, exc)
        if flags.get("vllm_endpoints") and any(p.startswith("vllm.endpoints[") for p in exc.problems):
            # The key path names a file the user never wrote, and a flag takes no `name`.
            raise click.ClickException(error.message + "\n  (vllm.endpoints[0] is the first --vllm-endpoint "
                                       "given, and so on; to name endpoints, list them under vllm.endpoints "
                                       "in a --config file)") from None
        raise error from None


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
    from .service import Service

    flags = {"listen": listen, "interval_seconds": interval, "web_config_file": web_config_file,
             "vllm_endpoints": vllm_endpoints, "health_listen": health_listen}
    try:
        service = Service.open(config_file, flags, simulate=simulate, speed=speed)
    except ConfigError as exc:
        raise _invalid(config_file, exc) from None
    except StartError as exc:
        raise click.ClickException(str(exc)) from exc
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    signal.signal(signal.SIGINT, lambda *_: stopping.set())
    if hasattr(signal, "SIGHUP"):
        signal.signal(signal.SIGHUP, service.reloader.request)
    service.start()
    try:
        while not stopping.wait(0.5):
            pass
    finally:
        service.daemon.request_stop()  # first: a tick still running announces no recovery after the line
        log.info("stopping")
        service.close()


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
    from .service import build_runtime

    config = _load(config_file, vllm_endpoints=vllm_endpoints)
    try:
        runtime = build_runtime(config, simulate, at=at if simulate else None, one_shot=True)
    except StartError as exc:
        raise click.ClickException(str(exc)) from exc
    try:
        daemon = Daemon(runtime.sampler, runtime.clock, config.interval_seconds,
                        analyzer=make_analyzer(config))
        state = daemon.tick()
    finally:
        runtime.close()
    if state.snapshot is None:
        _fail("sampling failed; see the log above")
    no_gpu = state.snapshot.source_up(runtime.host.gpu.name) is False or not state.snapshot.gpus
    if no_gpu and not simulate:
        me = _self_command()
        click.echo("No GPU could be read on this host. To see what the exporter reports, sample "
                   f"a simulated one: {me} snapshot --simulate steady "
                   f"(`{me} scenarios` lists them all).", err=True)
    if fmt == "json":
        out = {"snapshot": dataclasses.asdict(state.snapshot),
               "analysis": dataclasses.asdict(state.analysis) if state.analysis else None}
        click.echo(json.dumps(out, indent=2, default=str))
    else:
        click.echo(generate_latest(build_registry(lambda: state, runtime.clock.now)).decode(), nl=False)
    if no_gpu:  # what was read is printed, but a script must not take it for a GPU's sample
        sys.exit(1)


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
@click.option("--merge-runs", is_flag=True,
              help="Merge traces of different runs (another host or boot, another exporter run, "
              "or more than an hour apart), which are refused otherwise.")
@click.option("--config", "config_file", type=click.Path(dir_okay=False),
              help="The daemon's configuration file: the replay uses its detector, history and admission "
              "settings, as the live daemon did (default: the built-in ones); its other sections are not read.")
def analyze(traces: tuple[str, ...], fmt: str, prometheus_url: str | None, start: str | None, end: str,
            step: float | None, selector: str, report_path: str | None, log_files: tuple[str, ...],
            merge_runs: bool, config_file: str | None) -> None:
    """Replay recorded samples (trace CSV or Prometheus range-query JSON) through the detectors."""
    from .postmortem.analyze import analyze_trace, read_log_events
    from .postmortem.explain import ExplainError
    from .postmortem.trace import Trace, TraceError, load_traces

    if bool(traces) == bool(prometheus_url):
        raise click.UsageError("give TRACE files or --prometheus URL (one of them)")
    # A replay with other thresholds than the daemon's raises other findings, or at other times.
    settings = _analysis_settings(config_file) if config_file else None
    try:
        if prometheus_url:
            from .postmortem.promquery import fetch, parse_time

            if start is None:
                raise click.UsageError("--prometheus needs --start")
            try:
                t0, t1 = parse_time(start), parse_time(end)
            except ValueError as exc:
                raise click.UsageError(str(exc)) from None
            trace = Trace(fetch(prometheus_url, t0, t1, step=step, selector=selector))
        else:
            trace = load_traces(list(traces), merge_runs=merge_runs)
        snapshots = trace.snapshots
        events = read_log_events(log_files, snapshots[-1].timestamp if snapshots else None)
        if report_path and importlib.util.find_spec("matplotlib") is None:
            # The command that fits the Python running this, whatever installed it (.venv, pipx).
            click.echo("The report's plots are left out: matplotlib is not installed. To draw them: "
                       f"{sys.executable} -m pip install 'matplotlib>=3.7'", err=True)
        click.echo(analyze_trace(trace, fmt, settings, report_path=report_path, oom_events=events,
                                 logs=log_files), nl=False)
        if report_path:
            click.echo(f"report written to {report_path}", err=True)  # stderr: stdout may be JSON
    except (TraceError, ExplainError) as exc:  # PromQueryError is a TraceError
        _fail(str(exc))
    except OSError as exc:
        _fail(f"{report_path}: cannot write the report: {exc.strerror or exc}")


@main.command()
def scenarios() -> None:
    """List the built-in simulation scenarios."""
    from .sim.scenario import builtin

    items = builtin()
    width = max(len(listed.name) for listed in items)
    for name, description, duration in items:
        click.echo(f"{name.ljust(width)}  {duration:>5}  {description}")
    click.echo("\nPlay one faster than real time with --speed (make run SCENARIO=leak SPEED=60: "
               "an hour a minute).")


@main.command("check-config")
@click.argument("file", required=False, type=click.Path(dir_okay=False))
@click.option("--config", "config_file", type=click.Path(dir_okay=False),
              help="The YAML configuration file, named as `run --config` names it (or give it as FILE).")
def check_config(file: str | None, config_file: str | None) -> None:
    """Validate a configuration file, and the files it names, as `run` would; print every
    problem, or the configuration as understood (a file `check-config` accepts again)."""
    # FILE came first; --config is the spelling `run` and `snapshot` use, so one works for all.
    if file is not None and config_file is not None:
        raise click.UsageError("give the configuration file once: FILE or --config FILE, not both")
    file = file if file is not None else config_file
    if file is None:
        raise click.UsageError("name the configuration file: check-config FILE (or --config FILE)")
    config = _load(file)
    click.echo(f"# {file}: OK\n" + yaml.safe_dump(file_form(config), sort_keys=False), nl=False)
