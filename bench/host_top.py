"""Cost of finding the host's largest processes (unified memory only: sources/host.py reads them
where a GPU shares the host's memory), on this machine's real /proc.

    python bench/host_top.py [--extra 0 1000] [--rounds 30]

For each count of extra idle processes (`sleep`s spawned here, so the walk has that many more
/proc entries to read), times side by side in the same run: one full walk of /proc (every
TOP_RESCAN_SECONDS), a tick between walks (the RSS of the few largest only), and what that
amounts to per 5 s sampling tick. Prints medians in ms.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from exporter.sources.host import TOP_PROCESSES, TOP_RESCAN_SECONDS, LocalHost

INTERVAL = 5.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--extra", type=int, nargs="+", default=[0, 1000])
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()
    print("| extra processes | /proc entries | full walk median ms | tick between walks median ms "
          "| per 5 s tick, amortised, ms |")
    print("|---|---|---|---|---|")
    for extra in args.extra:
        sleepers = [subprocess.Popen(["sleep", "600"]) for _ in range(extra)]
        try:
            clock = [0.0]
            host = LocalHost(monotonic=lambda clock=clock: clock[0])
            walks, ticks = [], []
            for _ in range(args.rounds):
                clock[0] += TOP_RESCAN_SECONDS  # due for a walk
                t0 = time.perf_counter()
                host.top_processes(TOP_PROCESSES)
                t1 = time.perf_counter()
                clock[0] += INTERVAL  # the next tick, between walks
                host.top_processes(TOP_PROCESSES)
                t2 = time.perf_counter()
                walks.append(t1 - t0)
                ticks.append(t2 - t1)
            entries = sum(1 for name in os.listdir("/proc") if name.isdigit())
        finally:
            for p in sleepers:
                p.kill()
            for p in sleepers:
                p.wait()
        walk, tick = statistics.median(walks) * 1e3, statistics.median(ticks) * 1e3
        per_tick = (walk * INTERVAL + tick * (TOP_RESCAN_SECONDS - INTERVAL)) / TOP_RESCAN_SECONDS
        print(f"| {extra} | {entries} | {walk:.2f} | {tick:.3f} | {per_tick:.3f} |")


if __name__ == "__main__":
    main()
