"""The exporter's daemon and a real Prometheus with the shipped rules, watching a real vLLM, for
the real_vllm tests of findings and alerts (KV saturation, a leak, contention).

Prometheus scrapes the daemon every second and evaluates the shipped rules with every `for:`
shortened to 2 s (e2e_stack.fast_rules: the expressions, labels and annotations are the shipped
ones byte for byte; the shipped `for:` durations are pinned by the promtool tests).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import requests

from .daemon import Daemon
from .e2e_stack import Prometheus, Stack, fast_rules
from .real_vllm import Server, wait_until
from .rules import RULES
from .tools import HANG, REPO

FAST_FOR = "2s"


class Watch:
    def __init__(self, daemon: Daemon, prometheus: Prometheus, target: str):
        self.daemon, self.prometheus, self.target = daemon, prometheus, target

    def findings(self) -> list[dict[str, Any]]:
        # Once, under the KV ramp's load (160 client threads in this process, vLLM on both
        # cores), the listener closed a new connection unanswered: this process, starved of its
        # interpreter lock, sent its request after the listener's slow-client guard (10 s from
        # accept to the request's head) had given up on it. Reproduced with the guard at 1 s and
        # 160 busy threads in the client (5 of 8 requests). Asking again is what a client of a
        # guarded server does; a second refusal fails the test.
        try:
            return list(self.daemon.get("/api/findings").json()["findings"])
        except requests.ConnectionError:
            return list(self.daemon.get("/api/findings").json()["findings"])

    def firing(self, alertname: str) -> list[dict[str, Any]]:
        return [a for a in self.prometheus.alerts()
                if a["labels"].get("alertname") == alertname and a["state"] == "firing"]


@contextmanager
def watching(server: Server, workdir: Path, interval: float = 0.5, scale: float | None = None,
             extra: str = "") -> Iterator[Watch]:
    """The daemon (`scale`: its leak detector's durations scaled, helpers.scaled_exporter) on
    `server`'s page and log, and Prometheus on the daemon."""
    config = workdir / "exporter.yml"
    config.write_text(f"vllm:\n  endpoints:\n    - url: {server.metrics_url}\n      name: real\n"
                      f"      log_file: {server.log_path}\n{extra}")
    command = ("-m", "helpers.scaled_exporter", str(scale)) if scale else ("-m", "exporter")
    env = {"PYTHONPATH": str(REPO / "tests")} if scale else None
    daemon = Daemon("--config", str(config), "--interval", str(interval), env=env, command=command)
    stack = Stack(workdir)
    try:
        daemon.wait_healthy()
        target = daemon.url.removeprefix("http://")
        prometheus = stack.prometheus([target], None, fast_rules(RULES, workdir / "rules.yml", FAST_FOR))
        yield Watch(daemon, prometheus, target)
    finally:
        stack.close()
        daemon.stop()


def poll(check: Callable[[], Any], timeout: float, what: str, every: float = 0.5) -> Any:
    return wait_until(check, timeout, what, interval=every)


__all__ = ["HANG", "Watch", "poll", "watching"]
