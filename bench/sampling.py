"""Cost of one sampling cycle and one scrape on a simulated host (default 8 GPUs x 64 processes).

    python bench/sampling.py [--scenario fleet-8x64] [--ticks 60]

Each tick advances the simulated clock by the sampling interval, then times, side by side in the
same run: the sources (NVML through the simulator's pynvml module, host identity, vLLM scrape),
the analysis (history + detectors), and rendering /metrics. Prints medians and p90 in ms.
"""
from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prometheus_client import generate_latest

from exporter.cli import make_analyzer
from exporter.config import build as build_config
from exporter.model import State
from exporter.runtime import build as build_runtime
from exporter.serve.exposition import build_registry


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenario", default="fleet-8x64")
    ap.add_argument("--ticks", type=int, default=60)
    ap.add_argument("--start", type=float, default=1800.0, help="scenario time of the first tick")
    ap.add_argument("--interval", type=float, default=5.0)
    args = ap.parse_args()

    config = build_config()
    runtime = build_runtime(config, simulate=args.scenario, at=args.start)
    analyzer = make_analyzer(config)
    # The findings the scenario raises are logged as the daemon logs them (its cost is in the
    # figures), but not printed: this prints a table.
    logging.getLogger("exporter.findings").addHandler(logging.NullHandler())
    logging.getLogger("exporter.findings").propagate = False
    times = {"sample": [], "analysis": [], "scrape": []}
    state = State()
    registry = build_registry(lambda: state, runtime.clock.now)
    try:
        for i in range(args.ticks):
            runtime.clock.advance(args.interval)
            t0 = time.perf_counter()
            snap = runtime.sampler.sample()
            t1 = time.perf_counter()
            analysis = analyzer.update(snap)
            t2 = time.perf_counter()
            state = State(snapshot=snap, analysis=analysis, last_sample_at=snap.timestamp, samples_total=i + 1)
            body = generate_latest(registry)
            t3 = time.perf_counter()
            if i >= 5:  # warm-up: first ticks fill caches and history
                times["sample"].append(t1 - t0)
                times["analysis"].append(t2 - t1)
                times["scrape"].append(t3 - t2)
    finally:
        runtime.close()
    gpus = len(snap.gpus)
    procs = sum(len(g.processes) for g in snap.gpus)
    series = body.count(b"\n") - body.count(b"\n#")
    print(f"scenario {args.scenario}: {gpus} GPUs, {procs} GPU processes, {series} series, "
          f"{len(body)} bytes per scrape, {len(times['sample'])} ticks measured")
    print("| step | median ms | p90 ms |")
    print("|---|---|---|")
    for name, values in times.items():
        print(f"| {name} | {statistics.median(values) * 1e3:.2f} | {pct(values, 0.9) * 1e3:.2f} |")
    cycle = [a + b for a, b in zip(times["sample"], times["analysis"], strict=True)]
    print(f"| sample + analysis (one cycle) | {statistics.median(cycle) * 1e3:.2f} | {pct(cycle, 0.9) * 1e3:.2f} |")
    share = statistics.median(cycle) / args.interval * 100
    print(f"\nOne cycle every {args.interval:g} s costs {share:.2f} % of one core (median).")


if __name__ == "__main__":
    main()
