"""Cost of evaluating a simulated host's state at one moment (`Scenario.state_at`).

    python bench/scenario_eval.py [--scenario fleet-8x64] [--repeats 200]

Every sampling tick of a simulated host evaluates the scenario once (the fake NVML module, the
host view and the fake vLLM servers then share that state), so this is the simulator's own
share of a tick. Each repetition evaluates a new moment (the state is memoised per moment) and
the one after it is read again to show the memoised cost. Prints medians and p90 in ms.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from exporter.sim.scenario import load


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenario", default="fleet-8x64")
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()

    scenario = load(args.scenario)
    fresh, memoised = [], []
    for i in range(args.repeats):
        t = 100.0 + i
        t0 = time.perf_counter()
        state = scenario.state_at(t)
        t1 = time.perf_counter()
        scenario.state_at(t)
        t2 = time.perf_counter()
        fresh.append(t1 - t0)
        memoised.append(t2 - t1)
    ms = 1000.0
    print(f"scenario {args.scenario}: {len(state.gpus)} GPUs, {len(state.processes)} processes, "
          f"{args.repeats} moments")
    print("| evaluation | median ms | p90 ms |\n|---|---|---|")
    print(f"| new moment | {statistics.median(fresh) * ms:.3f} | {pct(fresh, 0.9) * ms:.3f} |")
    print(f"| same moment (memoised) | {statistics.median(memoised) * ms:.4f} | {pct(memoised, 0.9) * ms:.4f} |")


if __name__ == "__main__":
    main()
