"""Load: many concurrent scrapers against a running daemon.

    python bench/load.py [--scrapers 50] [--seconds 60] [--scenario fleet-8x64] [--interval 1]

Starts `python -m exporter run --simulate SCENARIO --interval S` on a free loopback port (a real
process, so the scrapers' threads do not share its interpreter), then `--scrapers` threads each
scrape /metrics back to back for `--seconds`. Reports errors, latency median / p99 / max, and
whether sampling kept pace: gpumem_exporter_samples_total must advance about once per interval
and gpumem_exporter_sample_age_seconds stay under two intervals while the scrapers hammer it.
Ends with the latency and pacing claims checked (see `claims`); exits 1 when one fails.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
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
        # The log goes to a file: a pipe nobody reads would block the daemon once it filled.
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed by stop())
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "exporter", "run", "--simulate", scenario, "--interval", str(interval),
             "--listen", f"127.0.0.1:{self.port}"],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=self.log, text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)})

    def stderr(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited: {self.stderr()[-2000:]}")
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
        self.log.close()


@dataclass
class LoadResult:
    scrapers: int
    seconds: float
    latencies: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    samples_advanced: float = 0.0
    max_sample_age: float = 0.0
    per_scraper: list[int] = field(default_factory=list)  # answers each scraper got

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


def hammer(url: str, scrapers: int, seconds: float, timeout: float = 10.0, min_samples: int = 0,
           hang_bound: float = 60.0) -> LoadResult:
    """`scrapers` threads scraping back to back for `seconds`, each at least once; one more
    watches the sampling counters. `timeout`: per request. `min_samples`: go on hammering past
    `seconds` until gpumem_exporter_samples_total has advanced that much, for at most
    `hang_bound` seconds more (the tests' way to see sampling go on under load on a machine of
    any speed)."""
    result = LoadResult(scrapers, seconds, per_scraper=[0] * scrapers)
    lock = threading.Lock()
    stop = threading.Event()

    def scraper(i: int) -> None:
        with requests.Session() as session:
            while True:  # at least once: every scraper is answered, however loaded the machine
                started = time.perf_counter()
                try:
                    r = session.get(url, timeout=timeout)
                    ok = (r.status_code == 200 and "gpumem_gpu_memory_used_bytes" in r.text
                          and r.text.endswith("\n"))
                    error = None if ok else f"status {r.status_code}"
                except requests.RequestException as exc:
                    error = type(exc).__name__
                elapsed = time.perf_counter() - started
                with lock:
                    if error:
                        result.errors.append(error)
                    else:
                        result.latencies.append(elapsed)
                        result.per_scraper[i] += 1
                if stop.is_set():
                    return

    def samples_total(text: str) -> float:
        return _value(text, "gpumem_exporter_samples_total") or 0.0

    first = samples_total(requests.get(url, timeout=timeout).text)
    threads = [threading.Thread(target=scraper, args=(i,), daemon=True) for i in range(scrapers)]
    for t in threads:
        t.start()
    started = time.monotonic()
    deadline = started + seconds
    while True:
        now = time.monotonic()
        if now >= deadline and (result.samples_advanced >= min_samples or now >= deadline + hang_bound):
            break
        time.sleep(min(0.5, max(0.0, deadline - now)) if now < deadline else 0.5)
        try:
            text = requests.get(url, timeout=timeout).text
            age = _value(text, "gpumem_exporter_sample_age_seconds")
            result.max_sample_age = max(result.max_sample_age, age or 0.0)
            result.samples_advanced = samples_total(text) - first
        except requests.RequestException as exc:
            result.errors.append(f"watcher: {type(exc).__name__}")
    stop.set()
    for t in threads:
        t.join(timeout + hang_bound)
    result.seconds = time.monotonic() - started
    last = requests.get(url, timeout=timeout).text
    result.samples_advanced = samples_total(last) - first
    return result


def claims(result: LoadResult, interval: float) -> list[tuple[str, bool]]:
    """The timing claims this benchmark checks (they were tests/test_load.py's until that test
    kept only what does not depend on the machine's speed)."""
    median = statistics.median(result.latencies) if result.latencies else float("inf")
    p99 = result.pct(0.99) if result.latencies else float("inf")
    return [
        # CPU-bound on 2 cores, so latency is queueing, but never a TCP retransmit (1 s, 3 s,
        # 7 s on a dropped SYN) or a stall: p99 within a few seconds, median well under that.
        (f"latency p99 {p99:.2f} s < 5 s", p99 < 5.0),
        (f"latency median {median:.2f} s < 3.5 s", median < 3.5),
        # Scrapes render the last state; they never hold up the sampling loop.
        (f"samples advanced {result.samples_advanced:g} >= 80% of "
         f"{result.seconds / interval:.0f} intervals", result.samples_advanced >= 0.8 * result.seconds / interval),
        (f"max sample age {result.max_sample_age:.2f} s < 2 intervals + 0.5 s",
         result.max_sample_age < 2 * interval + 0.5),
    ]


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
    checked = claims(result, args.interval)
    for claim, ok in checked:
        print(f"{'ok  ' if ok else 'FAIL'} {claim}")
    if result.errors or not all(ok for _, ok in checked):
        sys.exit(1)


if __name__ == "__main__":
    main()
