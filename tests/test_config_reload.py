"""check-config, run and SIGHUP reload share one validation: random configurations get the same
answer from check-config and from run's own start-up steps, and a real daemon survives every
reload, good or bad, keeping its configuration when the new one fails."""
import copy
from pathlib import Path

import bcrypt
import click
import pytest
import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exporter import cli, service
from exporter.config import build, load, parse_listen
from exporter.config.web import load_web_config, ssl_context
from exporter.runtime import make_sampler, open_host
from helpers.daemon import Daemon

HASH = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(4)).decode()
BOMB = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' + "".join(
    f"{c}: &{c} [*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p}]\n" for p, c in zip("abcdefgh", "bcdefghi", strict=True))


# -- random configurations: a well-formed one with up to two values made bad -------------------
def section(**keys):
    return st.fixed_dictionaries({}, optional=keys)


def one_of(*values):
    return st.sampled_from(values)


NUM = one_of(0.2, 1, 5, 60, 900, 1800, 3600, 7200, 21600)
SIZE = one_of(1024, "8MiB", "1GiB", "64KiB", "10MB")
RATIO = one_of(0.5, 0.8, 0.9, 0.95, 1)
URL = one_of("http://127.0.0.1:1/metrics", "http://[::1]:2/metrics", "https://example.invalid:8443/x")
FILE = one_of("", "@token")
ENDPOINT = st.one_of(URL, st.fixed_dictionaries({"url": URL}, optional=dict(
    name=one_of("", "a"), bearer_token_file=FILE, timeout_seconds=NUM, max_response_bytes=SIZE,
    process_pattern=one_of("", "vllm"), container_id=one_of("", "abc"), pid_file=FILE, log_file=FILE,
    by_name=st.booleans())))
WELL_FORMED = section(
    interval_seconds=NUM, stale_after_seconds=NUM, health_listen=one_of("", "127.0.0.1:0", "[::1]:0"),
    web_config_file=one_of("", "@web", "@tls_web"),
    history=section(raw_seconds=NUM, retention_seconds=NUM),
    gpu=section(retry_initial_seconds=NUM, retry_max_seconds=NUM),
    host=section(read_cmdline=st.booleans()),
    logs=section(files=st.lists(FILE, max_size=2)),
    admission=section(close_above=RATIO, open_below=RATIO),
    recorder=section(directory=one_of("", "@dir"), window_seconds=NUM, tail_seconds=NUM, max_files=one_of(1, 20),
                     max_total_bytes=SIZE, debounce_seconds=NUM),
    kubelet=section(enabled=one_of("auto", True, False), url=st.one_of(st.just(""), URL), token_file=FILE,
                    ca_file=FILE, insecure_skip_verify=st.booleans(), refresh_seconds=NUM,
                    unknown_pod_refresh_seconds=NUM, max_response_bytes=SIZE),
    vllm=section(endpoints=st.lists(ENDPOINT, max_size=3)))
# Values that got through before, or that a parser might: wrong types, edges, hostile text.
BAD_VALUES = (0, -1, "0", 10**400, "9" * 400, 1e12, float("nan"), "5", True, None, "", "  ", "(", "1KiB", 2.5,
             "nowhere", ":99999", "http://[::1/metrics", "http://h:99999/m", "ftp://x", "x" * 5000, [], {},
             "@empty", "@missing", "@dir", "@bomb", "@bad_web")
BAD = st.sampled_from(BAD_VALUES)


def _leaves(node, path=()):
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _leaves(value, path + (key,))
    elif isinstance(node, list) and node:
        for i, value in enumerate(node):
            yield from _leaves(value, path + (i,))
    else:
        yield path


@st.composite
def configs(draw):
    doc = draw(WELL_FORMED)
    leaves = [path for path in _leaves(doc) if path]
    for _ in range(draw(st.integers(0, 2)) if leaves else 0):
        *parents, last = draw(st.sampled_from(leaves))
        node = doc
        for key in parents:
            node = node[key]
        if isinstance(node, list) and isinstance(node[last], str) and draw(st.booleans()):
            node[last] = {"url": node[last]}  # a bare URL made a mapping, so its keys can go bad too
        else:
            node[last] = draw(BAD)
    return doc


CONFIGS = configs()


@pytest.fixture(scope="module")
def files(tmp_path_factory, tls_cert):
    d = tmp_path_factory.mktemp("referenced")
    cert, key = tls_cert
    paths = {"@token": d / "token", "@empty": d / "empty", "@web": d / "web.yml", "@tls_web": d / "tls.yml",
             "@bad_web": d / "bad.yml", "@bomb": d / "bomb.yml", "@dir": d / "dir", "@missing": d / "missing",
             "@ca": Path(cert)}
    paths["@token"].write_text("t0ken\n")
    paths["@empty"].write_text("")
    paths["@web"].write_text(yaml.safe_dump({"basic_auth_users": {"prom": HASH}}))
    paths["@tls_web"].write_text(yaml.safe_dump({"tls_server_config": {"cert_file": cert, "key_file": key}}))
    paths["@bad_web"].write_text("tls_server_config: {cert_file: /nonexistent, key_file: /nonexistent}\n")
    paths["@bomb"].write_text(BOMB)
    paths["@dir"].mkdir()
    return {k: str(v) for k, v in paths.items()}


def materialise(value, files):
    """The strategy's placeholders (@token, ...) as real paths."""
    if isinstance(value, dict):
        return {k: materialise(v, files) for k, v in value.items()}
    if isinstance(value, list):
        return [materialise(v, files) for v in value]
    return files.get(value, value) if isinstance(value, str) else value


def write_config(path, doc, files):
    path.write_text(yaml.safe_dump(materialise(doc, files)))
    return str(path)


# -- check-config and run agree ---------------------------------------------------------------
@pytest.fixture(scope="module")
def host():
    h = open_host(build(), simulate="steady")
    yield h
    h.close()


def run_would_start(path, host) -> bool:
    """`run`'s steps up to listening, over an existing simulated host: False where run refuses
    cleanly (a ClickException); anything else it raises is a crash and fails the test."""
    try:
        config = cli._load(path)
    except click.ClickException:
        return False
    if config.web_config_file:
        web = load_web_config(config.web_config_file)
        if web.tls:
            ssl_context(web)
    cli.make_analyzer(config)
    make_sampler(config, host).close()
    recorder = service.make_recorder(config, host.clock)
    if recorder is not None:
        recorder.close()
    parse_listen(config.listen)
    return True


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=CONFIGS)
@pytest.mark.integration
def test_check_config_accepts_exactly_what_run_starts_with(doc, files, host):
    path = write_config(Path(files["@dir"]).parent / "c.yml", doc, files)
    result = CliRunner().invoke(cli.main, ["check-config", path])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert (result.exit_code == 0) == run_would_start(path, host), result.output


# Every key of a complete configuration, one at a time, with each bad value: none gets past
# check-config's validation into a crash of run's start-up.
COMPLETE = {
    "listen": "127.0.0.1:0", "health_listen": "127.0.0.1:0", "interval_seconds": 5, "stale_after_seconds": 0,
    "web_config_file": "@web", "history": {"raw_seconds": 3600, "retention_seconds": 21600},
    "gpu": {"backend": "nvml", "retry_initial_seconds": 5, "retry_max_seconds": 300},
    "host": {"proc_root": "/proc", "read_cmdline": False}, "logs": {"files": ["@token"]},
    "admission": {"close_above": 0.9, "open_below": 0.8},
    "recorder": {"directory": "@dir", "window_seconds": 3600, "tail_seconds": 300, "max_files": 20,
                 "max_total_bytes": "512MiB", "debounce_seconds": 300},
    "kubelet": {"enabled": True, "url": "https://127.0.0.1:10250/pods", "token_file": "@token", "ca_file": "@ca",
                "insecure_skip_verify": False, "refresh_seconds": 60, "unknown_pod_refresh_seconds": 10,
                "timeout_seconds": 2, "max_response_bytes": "32MiB"},
    "vllm": {"endpoints": ["http://127.0.0.1:1/metrics", {
        "url": "http://127.0.0.1:2/metrics", "name": "a", "bearer_token_file": "@token", "timeout_seconds": 2,
        "max_response_bytes": "8MiB", "pid_file": "@token", "container_id": "abc", "process_pattern": "vllm",
        "log_file": "@token", "by_name": False}]},
}


@pytest.mark.slow
@pytest.mark.parametrize("leaf", list(_leaves(COMPLETE)), ids=lambda p: ".".join(map(str, p)))
@pytest.mark.integration
def test_no_bad_value_of_any_key_gets_past_check_config_into_a_crash(leaf, files, host):
    path = Path(files["@dir"]).parent / "c.yml"
    assert run_would_start(write_config(path, COMPLETE, files), host)
    for bad in BAD_VALUES:
        doc = copy.deepcopy(COMPLETE)
        *parents, last = leaf
        node = doc
        for key in parents:
            node = node[key]
        node[last] = bad
        run_would_start(write_config(path, doc, files), host)  # True or False; never a crash


# -- a real daemon and SIGHUP ------------------------------------------------------------------
@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    path = tmp_path_factory.mktemp("daemon") / "c.yml"
    path.write_text("interval_seconds: 0.2\n")
    d = Daemon("--config", str(path), "--simulate", "steady")
    d.wait_healthy()  # healthy means the SIGHUP handler is installed
    d.config_path = path
    yield d
    code, out = d.stop()
    assert code == 0, out


@pytest.mark.parametrize("text, why", [
    ("vllm:\n  endpoints: [{url: 'http://127.0.0.1:1/m', max_response_bytes: 0}]\n",
     "vllm.endpoints[0].max_response_bytes: must be at least 1KiB"),
    ("vllm:\n  endpoints: ['http://127.0.0.1:99999/metrics']\n", "vllm.endpoints[0].url: not a valid URL"),
    ("vllm:\n  endpoints: ['http://[::1/metrics']\n", "vllm.endpoints[0].url: not a valid URL"),
    ("interval_seconds: " + "9" * 400 + "\n", "interval_seconds: expected a finite number"),
    (BOMB, "anchors and aliases"),
    ("vllm:\n  endpoints: [{url: 'http://127.0.0.1:1/m', bearer_token_file: /nonexistent/token}]\n",
     "bearer_token_file: cannot read token file"),
    ("web_config_file: /nonexistent/web.yml\n", "web_config_file: invalid web config file"),
    ("interval_seconds: [broken\n", "not valid YAML"),
])
@pytest.mark.integration
def test_a_bad_reload_keeps_the_running_configuration(daemon, text, why):
    daemon.config_path.write_text(text)
    outcome = daemon.reload()
    assert "reload failed, keeping the running configuration" in outcome and why in outcome, outcome
    assert daemon.get("/healthz").status_code == 200
    assert reload_metrics(daemon)[0] == 0


def reload_metrics(daemon) -> tuple[float, float]:
    """(last reload successful, when the configuration last loaded) as /metrics says."""
    text = daemon.get("/metrics").text
    def value(name):
        return next(float(line.split()[1]) for line in text.splitlines() if line.startswith(name + " "))
    return (value("gpumem_exporter_config_last_reload_successful"),
            value("gpumem_exporter_config_last_reload_success_timestamp_seconds"))


@pytest.mark.integration
def test_a_good_reload_applies_and_names_restart_only_changes(daemon):
    daemon.config_path.write_text("interval_seconds: [broken\n")
    daemon.reload()
    failed, loaded = reload_metrics(daemon)
    assert failed == 0
    daemon.config_path.write_text("interval_seconds: 0.3\nhistory: {raw_seconds: 1800}\n")
    assert "configuration reloaded" in daemon.reload()
    assert any("take effect only on restart: history" in line for line in daemon.lines)
    succeeded, reloaded = reload_metrics(daemon)
    assert succeeded == 1 and reloaded >= loaded
    daemon.config_path.write_text("interval_seconds: 0.2\n")
    assert "configuration reloaded" in daemon.reload()


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=CONFIGS)
@pytest.mark.integration
def test_random_reloads_never_kill_the_daemon_and_agree_with_the_validation(doc, daemon, files):
    path = write_config(daemon.config_path, doc, files)
    try:
        load(path, {"listen": "127.0.0.1:0"})  # what the daemon's own --listen makes of the file
        accepted = True
    except ValueError:
        accepted = False
    outcome = daemon.reload()
    assert ("configuration reloaded" in outcome) == accepted, outcome
    assert daemon.get("/healthz").status_code in (200, 503)
