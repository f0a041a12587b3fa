"""The reload machine without signals: coalescing, keeping the running configuration, naming the
settings that need a restart (declared once, in the schema), and the outcome it exports. Then a
whole `Service` (the daemon of `run`, in process, on loopback) reloaded through its Reloader,
its /metrics read over HTTP."""
from __future__ import annotations

import logging
import threading
import time

import pytest
import requests
import yaml

from exporter.clock import FixedClock
from exporter.config import Config, ConfigError, build
from exporter.config.docs import render
from exporter.config.fields import restart_keys
from exporter.reload import RESTART_KEYS, Reloader, restart_only_changes
from exporter.service import Service, StartError
from helpers.tools import HANG


class Calls:
    """A reload's two steps, scripted: each load returns (or raises) the next of `loads`."""

    def __init__(self, *loads):
        self.loads = list(loads)
        self.applied: list[Config] = []
        self.during_load = None  # called inside a load, as a signal arriving mid-reload would be

    def load(self):
        if self.during_load is not None:
            hook, self.during_load = self.during_load, None
            hook()
        item = self.loads.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    def apply(self, config):
        if config.interval_seconds == 13:  # what building the sources cannot survive
            raise OSError("no such device")
        self.applied.append(config)


@pytest.fixture
def clock():
    return FixedClock(1_000_000.0)


def test_a_good_reload_applies_and_says_when(clock):
    new = build({"interval_seconds": 7})
    calls = Calls(new)
    reloader = Reloader(build(), calls.load, calls.apply, clock.now)
    assert reloader.stats.successful and reloader.stats.last_success_at == 1_000_000.0  # the start counts
    clock.advance(60)
    assert reloader.reload_once() is True
    assert calls.applied == [new] and reloader.config is new
    assert reloader.stats.successful and reloader.stats.last_success_at == 1_000_060.0


@pytest.mark.parametrize("failure, said", [
    (ConfigError(["interval_seconds: must be positive, got 0", "listen: expected HOST:PORT"]),
     "invalid configuration in c.yml: interval_seconds: must be positive, got 0; listen: expected HOST:PORT"),
    (build({"interval_seconds": 13}), "OSError: no such device"),  # loads, but cannot be applied
    (RuntimeError("a bug"), "RuntimeError: a bug"),
])
def test_a_failed_reload_keeps_the_running_configuration_and_says_why(clock, caplog, failure, said):
    running = build()
    calls = Calls(failure)
    reloader = Reloader(running, calls.load, calls.apply, clock.now, where="c.yml")
    clock.advance(60)
    with caplog.at_level(logging.ERROR, logger="exporter.reload"):
        assert reloader.reload_once() is False
    assert reloader.config is running and calls.applied == []
    assert not reloader.stats.successful and reloader.stats.last_success_at == 1_000_000.0
    assert [r.getMessage() for r in caplog.records] == [
        f"reload failed, keeping the running configuration: {said}"]


def test_a_request_during_a_reload_runs_once_more_after_it_never_alongside(clock):
    """SIGHUP's handler can be re-entered while a reload runs: the second request is not a
    second reload inside the first, but one more round when the first is done, so the file's
    last version is the one in use."""
    first, second = build({"interval_seconds": 7}), build({"interval_seconds": 9})
    calls = Calls(first, second)
    reloader = Reloader(build(), calls.load, calls.apply, clock.now)
    calls.during_load = reloader.request  # a signal arrives while the first load runs
    reloader.request()
    assert calls.applied == [first, second] and reloader.config is second and calls.loads == []
    reloader.request()  # idle again: a new request reloads at once (and finds nothing left to load)
    assert not reloader.stats.successful


def test_the_settings_that_need_a_restart_are_declared_once_in_the_schema(clock, caplog, tmp_path):
    assert RESTART_KEYS == restart_keys(Config) == (
        "listen", "health_listen", "web_config_file", "history", "gpu.backend", "host", "recorder",
        "kubelet", "allocator.history")
    old = build()
    new = build({"history": {"raw_seconds": 1800},
                 "allocator": {"probe_dir": str(tmp_path), "history": {"enabled": True}},
                 "interval_seconds": 2, "admission": {"close_above": 0.95}})
    assert restart_only_changes(old, new) == ["history", "allocator.history"]
    reloader = Reloader(old, Calls(new).load, lambda config: None, clock.now)
    with caplog.at_level(logging.WARNING, logger="exporter.reload"):
        reloader.reload_once()
    assert "changed settings that take effect only on restart: history, allocator.history" in caplog.text
    # docs/configuration.md says the same, from the same declaration
    docs = render()
    assert all(f"`{key}`" in docs.split("## The configuration file")[0] for key in RESTART_KEYS)
    assert "| `listen` | HOST:PORT | `0.0.0.0:9842` | HOST:PORT to serve /metrics and the rest on. " \
           "Changes only on restart. |" in docs


# -- a whole Service --------------------------------------------------------------------------
def metric(service, name):
    text = requests.get(f"http://127.0.0.1:{service.servers[0].port}/metrics", timeout=HANG).text
    values = [line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")]
    assert len(values) == 1, text
    return float(values[0])


@pytest.mark.integration
def test_a_service_reloads_without_signals_and_exports_the_outcome(tmp_path):
    path = tmp_path / "c.yml"
    path.write_text(yaml.safe_dump({"interval_seconds": 0.2}))
    service = Service.open(str(path), {"listen": "127.0.0.1:0"}, simulate="steady", speed=1.0)
    try:
        service.start()
        started = metric(service, "gpumem_exporter_config_last_reload_success_timestamp_seconds")
        assert metric(service, "gpumem_exporter_config_last_reload_successful") == 1
        path.write_text("interval_seconds: 0\n")
        service.reloader.request()
        assert metric(service, "gpumem_exporter_config_last_reload_successful") == 0
        assert metric(service, "gpumem_exporter_config_last_reload_success_timestamp_seconds") == started
        assert service.daemon.interval == 0.2  # still the running configuration
        path.write_text(yaml.safe_dump({"interval_seconds": 0.3}))
        service.reloader.request()
        assert metric(service, "gpumem_exporter_config_last_reload_successful") == 1
        assert metric(service, "gpumem_exporter_config_last_reload_success_timestamp_seconds") >= started
        assert service.daemon.interval == 0.3 and service.reloader.config.interval_seconds == 0.3
    finally:
        service.close()
    assert not service.daemon._thread.is_alive()


@pytest.mark.integration
def test_a_service_that_cannot_start_says_why_and_leaves_nothing_behind():
    with pytest.raises(ConfigError, match="interval_seconds: must be positive"):
        Service.open(None, {"interval_seconds": 0.0}, simulate="steady")
    with pytest.raises(StartError, match="no-such-scenario"):
        Service.open(None, {"listen": "127.0.0.1:0"}, simulate="no-such-scenario")
    first = Service.open(None, {"listen": "127.0.0.1:0"}, simulate="steady")
    try:
        before = set(threading.enumerate())
        port = first.servers[0].port
        with pytest.raises(StartError, match=f"cannot listen on 127.0.0.1:{port}"):
            Service.open(None, {"listen": f"127.0.0.1:{port}"}, simulate="steady")
        # the second one's simulated vLLM server and the rest it had started are gone again
        deadline = time.monotonic() + HANG
        while set(threading.enumerate()) - before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert set(threading.enumerate()) - before == set()
    finally:
        first.close()
