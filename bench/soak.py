"""Soak: days of sampling, time-accelerated, on a host with heavy process churn.

    python bench/soak.py [--days 7] [--interval 5] [--processes 100000] [--gpus 8]
                         [--scrape-every 12] [--rss-every 720] [--json FILE]

Drives the daemon's own pieces directly — Sampler (NVML through the simulator's pynvml module,
SimulatedHost), Daemon.tick (Analyzer, error counters, State) and the /metrics exposition — on a
FixedClock that advances `--interval` seconds per tick, so 7 days at 5 s is 120,960 ticks run as
fast as the CPU allows. Over the run, `--processes` short-lived processes (30 s to 10 min each,
PIDs reused from a 32,768-wide range exactly as a busy Linux host does) come and go on the GPUs
next to one long-lived server per GPU.

Measured and printed per simulated day: resident memory (psutil, every `--rss-every` ticks),
exported series count and scrape latency (median per day, one scrape every `--scrape-every`
ticks), History.series_count(). All must stay flat: the bound is stated in the summary.

A scenario file may hold at most MAX_PROCESSES processes and the simulator evaluates every listed
process each tick, so the churn is generated in windows of `--window` simulated seconds with
`exporter.sim.scenario.from_dict`; each window's processes (those alive at any moment of it) are
swapped into the live scenario at the window's start. Scenario time is absolute, so the host
looks continuous to the exporter.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil
from prometheus_client import generate_latest

from exporter.analysis.engine import AnalysisConfig, Analyzer
from exporter.clock import FixedClock
from exporter.daemon import Daemon, Sampler
from exporter.serve.exposition import build_registry
from exporter.sim import fake_nvml
from exporter.sim.host import SimulatedHost
from exporter.sim.scenario import from_dict
from exporter.sources.host import HostSource
from exporter.sources.nvml import NvmlSource

DAY = 86400.0
PID_BASE, PID_RANGE = 10_000, 32_768
NAMES = ("python3", "pt_main_thread", "torchrun", "ray::worker", "jupyter", "triton")


@dataclass(frozen=True)
class Churn:
    """The short-lived processes of the whole run, as (pid, name, gpu, start, stop, grows)."""

    procs: list
    duration: float

    @staticmethod
    def generate(total: int, duration: float, gpus: int, seed: int = 7) -> Churn:
        rng = random.Random(seed)
        gap = duration / total
        procs = []
        for i in range(total):
            start = round(i * gap + rng.uniform(0, gap * 0.5), 1)
            life = rng.uniform(30, 600)
            stop = round(min(start + life, duration + 1), 1)
            if stop <= start:
                continue
            # 5 % grow while they live, so the leak detector works on churned processes too.
            procs.append((PID_BASE + i % PID_RANGE, NAMES[i % len(NAMES)], i % gpus, start, stop,
                          i % 20 == 0))
        return Churn(procs, duration)

    def max_alive(self, within: float = 0.0) -> int:
        """Most short-lived processes alive within any `within`-second span: the churn's width."""
        edges = sorted([(start, 1) for _, _, _, start, _, _ in self.procs]
                       + [(stop + within, -1) for _, _, _, _, stop, _ in self.procs])
        alive = best = 0
        for _, step in edges:
            alive += step
            best = max(best, alive)
        return best


def window_doc(churn: Churn, gpus: int, t0: float, t1: float) -> dict:
    """A scenario document for [t0, t1): the long-lived servers plus every short-lived process
    alive at some moment of the window."""
    processes = [{"pid": 1000 + g, "name": "vllm", "gpu": g, "rss": "3GiB",
                  "memory": [{"constant": "40GiB"}, {"noise": {"stddev": "64MiB", "seed": g}}]}
                 for g in range(gpus)]
    for pid, name, gpu, start, stop, grows in churn.procs:
        if start < t1 and stop > t0:
            memory = [{"constant": "2GiB"}, {"noise": {"stddev": "16MiB", "seed": pid}}]
            if grows:
                memory.append({"linear": {"from": 0, "rate": "200MiB/min"}})
            processes.append({"pid": pid, "name": name, "gpu": gpu, "start": start, "stop": stop,
                              "rss": "1GiB", "memory": memory,
                              "cmdline": f"{name} train.py --token=soak-secret-{pid}"})
    return {"name": "soak", "duration": churn.duration + 1,
            "gpus": [{"name": "NVIDIA H100 80GB HBM3", "memory": "80GiB", "count": gpus}],
            "host": {"memory": "2TiB", "available": "1TiB"}, "processes": processes}


@dataclass
class Soak:
    """The exporter's pieces wired over a simulated host whose process list changes per window."""

    gpus: int = 8
    interval: float = 5.0
    days: float = 7.0
    processes: int = 100_000
    window: float = 3600.0
    ticks: int = 0
    clock: FixedClock = field(default_factory=lambda: FixedClock(1_700_000_000.0))

    def __post_init__(self):
        self.duration = self.days * DAY
        self.churn = Churn.generate(self.processes, self.duration, self.gpus)
        self.scenario = from_dict(window_doc(self.churn, self.gpus, 0, self.window))
        self._window_end = self.window
        fake_nvml.configure(self.scenario, self.clock)
        self.host = SimulatedHost(self.scenario, self.clock)
        self.nvml = NvmlSource(fake_nvml, self.host.memory, now=self.clock.now)
        self.sampler = Sampler([self.nvml, HostSource(self.host)], now=self.clock.now)
        self.analyzer = Analyzer(AnalysisConfig(), log_findings=False)
        self.daemon = Daemon(self.sampler, self.clock, self.interval, analyzer=self.analyzer)
        self.registry = build_registry(lambda: self.daemon.state, self.clock.now)

    def _roll_window(self) -> None:
        t = self.clock.elapsed()
        if t < self._window_end:
            return
        start = self._window_end
        self._window_end = start + self.window
        nxt = from_dict(window_doc(self.churn, self.gpus, start, self._window_end))
        self.scenario.replace_processes(nxt.processes)

    def tick(self):
        self.clock.advance(self.interval)
        self._roll_window()
        return self.daemon.tick()

    def scrape(self) -> tuple[float, int]:
        started = time.perf_counter()
        body = generate_latest(self.registry)
        elapsed = time.perf_counter() - started
        return elapsed, body.count(b"\n") - body.count(b"\n#")

    def close(self) -> None:
        self.nvml.close()
        fake_nvml.configure(None, None)


def run(days: float, interval: float, processes: int, gpus: int, scrape_every: int, rss_every: int,
        window: float = 3600.0, report=print) -> dict:
    soak = Soak(gpus=gpus, interval=interval, days=days, processes=processes, window=window)
    me = psutil.Process()
    ticks = int(days * DAY / interval)
    per_day: dict[int, dict] = {}
    rss_samples: list[tuple[float, int]] = []
    series_samples: list[tuple[float, int, int]] = []  # (scenario time, exported, history)
    max_history = max_series = 0
    started = time.perf_counter()
    try:
        for i in range(1, ticks + 1):
            state = soak.tick()
            day = int(soak.clock.elapsed() // DAY)
            d = per_day.setdefault(day, {"scrape_s": [], "series": [], "history": [], "rss": []})
            if i % scrape_every == 0:
                latency, series = soak.scrape()
                d["scrape_s"].append(latency)
                d["series"].append(series)
                max_series = max(max_series, series)
                series_samples.append((soak.clock.elapsed(), series, soak.analyzer.history.series_count()))
            if i % rss_every == 0:
                rss = me.memory_info().rss
                d["rss"].append(rss)
                rss_samples.append((soak.clock.elapsed(), rss))
                hist = soak.analyzer.history.series_count()
                d["history"].append(hist)
                max_history = max(max_history, hist)
        wall = time.perf_counter() - started
    finally:
        soak.close()
    assert state.samples_total == ticks
    days_out = []
    for day, d in sorted(per_day.items()):
        days_out.append({
            "day": day,
            "scrape_median_ms": statistics.median(d["scrape_s"]) * 1e3 if d["scrape_s"] else None,
            "series_max": max(d["series"], default=None),
            "history_series_max": max(d["history"], default=None),
            "rss_max_mib": max(d["rss"]) / 2**20 if d["rss"] else None,
        })
    result = {"days": days, "interval": interval, "ticks": ticks, "gpus": gpus,
              "processes": len(soak.churn.procs), "wall_seconds": wall,
              "max_series": max_series, "max_history_series": max_history,
              "rss_samples": rss_samples, "series_samples": series_samples, "per_day": days_out,
              "max_alive": soak.churn.max_alive(interval),
              "errors_total": dict(state.errors_total)}
    report(f"{days:g} simulated days, {ticks} ticks of {interval:g} s, {gpus} GPUs, "
           f"{len(soak.churn.procs)} short-lived processes: {wall:.0f} s wall "
           f"({wall / ticks * 1e3:.2f} ms per tick incl. scrapes)")
    report("| day | scrape median ms | series (max) | history series (max) | RSS max MiB |")
    report("|---|---|---|---|---|")
    for d in days_out:
        fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
        report(f"| {d['day']} | {fmt(d['scrape_median_ms'], '.2f')} | {fmt(d['series_max'], 'd')} | "
               f"{fmt(d['history_series_max'], 'd')} | {fmt(d['rss_max_mib'], '.1f')} |")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--days", type=float, default=7.0, help="simulated days (7 = 120,960 ticks at 5 s)")
    ap.add_argument("--interval", type=float, default=5.0)
    ap.add_argument("--processes", type=int, default=None,
                    help="short-lived processes over the run (default 100,000 per 7 days, scaled)")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--scrape-every", type=int, default=12, help="ticks between scrapes")
    ap.add_argument("--rss-every", type=int, default=720, help="ticks between RSS samples")
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args()
    processes = args.processes if args.processes is not None else int(100_000 * args.days / 7)
    result = run(args.days, args.interval, processes, args.gpus, args.scrape_every, args.rss_every)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
