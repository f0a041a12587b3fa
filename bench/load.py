"""Load: many concurrent scrapers against a running daemon.

    python bench/load.py [--scrapers 50] [--seconds 60] [--scenario fleet-8x64] [--interval 1]

Starts `python -m exporter run --simulate SCENARIO --interval S` on a free loopback port (a real
process, so the scrapers' threads do not share its interpreter), then `--scrapers` threads each
scrape /metrics back to back for `--seconds`. Reports errors, latency median / p99 / max, and
whether sampling kept pace: gpumem_exporter_samples_total must advance about once per interval
and gpumem_exporter_sample_age_seconds stay under two intervals while the scrapers hammer it.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _value(text: str, name: str) -> float | None:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    return None


class DaemonProcess:
    """`gpu-memory-exporter run --simulate` in a child process, on loopback."""

    def __init__(self, scenario: str, interval: float):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}/metrics"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "exporter", "run", "--simulate", scenario, "--interval", str(interval),
             "--listen", f"127.0.0.1:{self.port}"],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)})

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited: {self.proc.stderr.read()[-2000:]}")
            try:
                if requests.get(self.url.replace("/metrics", "/healthz"), timeout=1).status_code == 200:
                    return
            except requests.ConnectionError:
                pass
            time.sleep(0.1)
        raise RuntimeError("daemon never became healthy")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()


@dataclass
class LoadResult:
    scrapers: int
    seconds: float
    latencies: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    samples_advanced: float = 0.0
    max_sample_age: float = 0.0

    @property
    def requests(self) -> int:
        return len(self.latencies) + len(self.errors)

    def pct(self, q: float) -> float:
        values = sorted(self.latencies)
        return values[min(len(values) - 1, int(q * len(values)))]

    def summary(self) -> str:
        return (f"{self.scrapers} scrapers x {self.seconds:g} s: {self.requests} scrapes "
                f"({self.requests / self.seconds:.0f}/s), {len(self.errors)} errors, latency median "
                f"{statistics.median(self.latencies) * 1e3:.1f} ms, p99 {self.pct(0.99) * 1e3:.1f} ms, "
                f"max {max(self.latencies) * 1e3:.1f} ms; samples_total advanced {self.samples_advanced:g}, "
                f"max sample age {self.max_sample_age:.2f} s")


def hammer(url: str, scrapers: int, seconds: float) -> LoadResult:
    """`scrapers` threads scraping back to back; one more watches the sampling counters."""
    result = LoadResult(scrapers, seconds)
    lock = threading.Lock()
    stop = threading.Event()

    def scraper():
        with requests.Session() as session:
            while not stop.is_set():
                started = time.perf_counter()
                try:
                    r = session.get(url, timeout=10)
                    ok = r.status_code == 200 and "gpumem_gpu_memory_used_bytes" in r.text
                    error = None if ok else f"status {r.status_code}"
                except requests.RequestException as exc:
                    error = type(exc).__name__
                elapsed = time.perf_counter() - started
                with lock:
                    (result.errors.append(error) if error else result.latencies.append(elapsed))

    first = requests.get(url, timeout=10).text
    threads = [threading.Thread(target=scraper, daemon=True) for _ in range(scrapers)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
        try:
            age = _value(requests.get(url, timeout=10).text, "gpumem_exporter_sample_age_seconds")
            result.max_sample_age = max(result.max_sample_age, age or 0.0)
        except requests.RequestException as exc:
            result.errors.append(f"watcher: {type(exc).__name__}")
    stop.set()
    for t in threads:
        t.join(15)
    last = requests.get(url, timeout=10).text
    result.samples_advanced = (_value(last, "gpumem_exporter_samples_total")
                               - _value(first, "gpumem_exporter_samples_total"))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scrapers", type=int, default=50)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--scenario", default="fleet-8x64")
    ap.add_argument("--interval", type=float, default=1.0)
    args = ap.parse_args()
    daemon = DaemonProcess(args.scenario, args.interval)
    try:
        daemon.wait_ready()
        result = hammer(daemon.url, args.scrapers, args.seconds)
    finally:
        daemon.stop()
    print(result.summary())
    if result.errors:
        print("errors:", sorted(set(result.errors)))
    print(f"expected samples: {args.seconds / args.interval:.0f} (one per {args.interval:g} s interval)")


if __name__ == "__main__":
    main()
