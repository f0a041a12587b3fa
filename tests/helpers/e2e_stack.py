"""A real monitoring stack on loopback for the end-to-end tests: the exporter on a simulated,
time-accelerated host, Prometheus scraping it with the shipped rules, Alertmanager receiving
Prometheus' alerts and a webhook standing in for the pager and ticket integrations.

Every service gets a free port on 127.0.0.1 and a directory under the test's tmp dir; every
wait polls with a deadline; `Stack.close()` terminates (then kills) every process it started.
"""
from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import requests
import yaml

from helpers.rules import ALERTMANAGER_CONFIG
from helpers.tools import HANG, REPO, tool
from helpers.tools import free_port as _free_port

# Bounds on what we read from the services (outside input, even on loopback).
MAX_RESPONSE_BYTES = 5_000_000
MAX_WEBHOOK_BYTES = 1_000_000
LOG_TAIL_CHARS = 3000

_FOR_LINE = re.compile(r"^(?P<indent>\s+)for:\s*\S+\s*$", re.MULTILINE)


def fast_rules(source: Path, target: Path, for_: str = "2s") -> Path:
    """Copy the rule file with every `for:` set to `for_`; nothing else changes (text substitution,
    so expressions, labels and annotations stay byte for byte the shipped ones)."""
    text, count = _FOR_LINE.subn(lambda m: f"{m['indent']}for: {for_}", source.read_text())
    if count == 0:
        raise ValueError(f"{source} has no `for:` to shorten")
    original, fast = yaml.safe_load(source.read_text()), yaml.safe_load(text)
    for group in original["groups"]:  # the only difference must be the durations
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = for_
    if original != fast:
        raise ValueError("shortening `for:` changed more than the durations")
    target.write_text(text)
    return target


def wait_until(check: Callable[[], object], timeout: float, what: str, interval: float = 0.25,
               alive: Callable[[], None] | None = None):
    """Poll `check` until it returns something truthy; fail with `what` after `timeout` seconds.
    `alive` is called on each round and raises when a process we depend on has died."""
    deadline = time.monotonic() + timeout
    last_error = None
    while True:
        if alive is not None:
            alive()
        try:
            result = check()
            if result:
                return result
        except (requests.RequestException, ValueError, KeyError) as exc:
            last_error = exc  # not up yet, or an answer we could not read: try again
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}"
                                 + (f" (last error: {last_error})" if last_error else ""))
        time.sleep(interval)


def get_json(url: str, **params) -> object:
    with requests.get(url, params=params, timeout=HANG, stream=True) as response:
        body = response.raw.read(MAX_RESPONSE_BYTES + 1, decode_content=True)
        if len(body) > MAX_RESPONSE_BYTES:
            raise ValueError(f"{url} answered more than {MAX_RESPONSE_BYTES} bytes")
        if response.status_code >= 500:
            raise ValueError(f"{url} answered {response.status_code}")
        return json.loads(body)


class Service:
    """A subprocess whose output goes to a log file (a pipe nobody reads would block it)."""

    def __init__(self, name: str, args: list[str], workdir: Path, cwd: Path | None = None):
        self.name = name
        self.log_path = workdir / f"{name}.log"
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, cwd=cwd,
                                     stdin=subprocess.DEVNULL)

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:]

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise AssertionError(f"{self.name} exited with status {self.proc.returncode}:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()


class Webhook:
    """Alertmanager's receivers: records every notification POSTed to /<receiver>."""

    def __init__(self):
        self.received: list[tuple[str, dict]] = []  # (receiver path, notification)
        self._lock = threading.Lock()
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                if not 0 < length <= MAX_WEBHOOK_BYTES:
                    self.send_response(413)
                    self.end_headers()
                    return
                try:
                    notification = json.loads(self.rfile.read(length))
                except ValueError:
                    self.send_response(400)
                    self.end_headers()
                    return
                with hook._lock:
                    hook.received.append((self.path.strip("/"), notification))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):  # keep test output quiet
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def alerts(self, receiver: str) -> list[dict]:
        """Every alert in every notification to `receiver`, with the notification's status."""
        with self._lock:
            return [a for path, n in self.received if path == receiver for a in n.get("alerts", [])]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Stack:
    """Starts the services; `close()` stops all of them, whatever state the test left them in."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self._services: list[Service] = []
        self._closers = contextlib.ExitStack()

    def _start(self, name: str, args: list[str], cwd: Path | None = None) -> Service:
        service = Service(name, args, self.workdir, cwd)
        self._services.append(service)
        return service

    def check_alive(self) -> None:
        for service in self._services:
            service.check_alive()

    def webhook(self) -> Webhook:
        hook = Webhook()
        self._closers.callback(hook.close)
        return hook

    def exporter(self, scenario: str, speed: float, interval: float, target: str | None = None) -> str:
        """Start `python -m exporter run --simulate`; returns its host:port once /metrics answers.
        `target`: the host:port to listen on, for a Prometheus started first (see `target()`)."""
        target = target or self.target()
        service = self._start(f"exporter-{Path(scenario).stem}", [
            sys.executable, "-m", "exporter", "run", "--simulate", scenario, "--speed", str(speed),
            "--interval", str(interval), "--listen", target], cwd=REPO)
        wait_until(lambda: requests.get(f"http://{target}/metrics", timeout=2).status_code == 200,
                   HANG, f"the exporter ({scenario}) to serve /metrics", alive=service.check_alive)
        return target

    @staticmethod
    def target() -> str:
        """A free loopback host:port for an exporter not started yet. A simulated scenario runs
        on from the exporter's start, so a test that must see its early moments starts
        Prometheus first, scraping this target, and only then the exporter: the first scrape
        then never depends on how long Prometheus took to start."""
        return f"127.0.0.1:{_free_port()}"

    def alertmanager(self, webhook_url: str) -> str:
        """The example config with each receiver's webhook sent to `webhook_url`/<receiver> and
        the routes' waits shortened to 1 s (routing, grouping and inhibitions stay as shipped)."""
        config = yaml.safe_load(ALERTMANAGER_CONFIG.read_text())
        for receiver in config["receivers"]:
            for hook in receiver.get("webhook_configs", []):
                hook["url"] = f"{webhook_url}/{receiver['name']}"
        for route in [config["route"], *config["route"].get("routes", [])]:
            for key in ("group_wait", "group_interval"):
                if key in route:
                    route[key] = "1s"
        path = self.workdir / "alertmanager.yml"
        path.write_text(yaml.safe_dump(config))
        port = _free_port()
        service = self._start("alertmanager", [
            tool("alertmanager", "prometheus-alertmanager"), f"--config.file={path}",
            f"--storage.path={self.workdir / 'alertmanager-data'}", f"--web.listen-address=127.0.0.1:{port}",
            "--cluster.listen-address="])
        base = f"http://127.0.0.1:{port}"
        wait_until(lambda: requests.get(f"{base}/-/ready", timeout=2).status_code == 200,
                   HANG, "Alertmanager to be ready", alive=service.check_alive)
        return base

    def prometheus(self, targets: list[str], alertmanager: str | None, rules: Path) -> Prometheus:
        """Scrapes `targets` every second as job gpu-memory-exporter (the job the rules name),
        evaluates `rules` every second and sends alerts to `alertmanager` (a base URL)."""
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(rules)],
            "scrape_configs": [{"job_name": "gpu-memory-exporter", "static_configs": [{"targets": targets}]}],
        }
        if alertmanager:
            config["alerting"] = {"alertmanagers": [{"static_configs": [
                {"targets": [alertmanager.removeprefix("http://")]}]}]}
        path = self.workdir / "prometheus.yml"
        path.write_text(yaml.safe_dump(config))
        port = _free_port()
        service = self._start("prometheus", [
            tool("prometheus"), f"--config.file={path}", f"--storage.tsdb.path={self.workdir / 'prometheus-data'}",
            f"--web.listen-address=127.0.0.1:{port}"])
        prometheus = Prometheus(f"http://127.0.0.1:{port}", service)
        wait_until(lambda: requests.get(f"{prometheus.url}/-/ready", timeout=2).status_code == 200,
                   HANG, "Prometheus to be ready", alive=service.check_alive)
        return prometheus

    def close(self) -> None:
        for service in reversed(self._services):
            service.stop()
        self._closers.close()


class Prometheus:
    def __init__(self, url: str, service: Service):
        self.url = url
        self.service = service

    def query(self, expr: str) -> dict:
        """The API's whole answer (status, data or error): a bad query is an answer, not a crash."""
        return get_json(f"{self.url}/api/v1/query", query=expr)

    def result(self, expr: str) -> list[dict]:
        answer = self.query(expr)
        if answer.get("status") != "success":
            raise AssertionError(f"query {expr!r} failed: {answer.get('error')}")
        return answer["data"]["result"]

    def alerts(self) -> list[dict]:
        """Prometheus' own view: every pending and firing alert."""
        return get_json(f"{self.url}/api/v1/alerts")["data"]["alerts"]
