"""The exporter's extra cost per sampling tick when processes carry the allocator probe.

    python bench/probe_tick.py [--gpus 8] [--procs 64] [--probed 8] [--ticks 60] [--warmup 70]
                               [--code DIR ...]

A simulated host of GPUS x PROCS processes (the `fleet-8x64` load: 1 GiB each, a sawtooth and
noise) is played through the real sources and the analysis in three variants, side by side in
one run:
  none     no process has the probe (no probe files; the `allocator` source is not built);
  mix      PROBED processes per GPU have it (say the vLLM workers among the GPU's processes);
  all      every process has it (the stress case: GPUS x PROCS probe files).
Each variant runs in its own worker process (the simulated NVML module is process-wide), all
workers built and warmed up first (WARMUP ticks, so the detectors' 5-minute windows are full),
then driven one tick at a time in turn, the order rotated every round, so the machine's drift
falls on every variant alike. Each tick advances the simulated clock by 5 s and measures the
worker thread's CPU time (time.thread_time) of: the sources (NVML through the simulator's
pynvml module, host identity, the `allocator` source reading and matching the probe files), the
`allocator` source alone, and the analysis (History and every detector). The simulator's own
work is done before each tick, outside the timing: the scenario's state at that moment, and the
probe files (on a real host the probes write them).

With `--code DIR ...` every variant runs once per checkout (its `exporter` package on the
path), so an older tree compares with this one in the same run (`git worktree add /tmp/base
<commit>` then `--code /tmp/base .`). Prints medians in ms, the ratios to `none` of the same
tree, the ratios to the first tree's same variant, and each cycle's share of one core at 5 s.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
INTERVAL = 5.0
VARIANTS = ("none", "mix", "all")
MEMORY = [{"constant": "1GiB"}, {"sawtooth": {"period": 60, "amplitude": "64MiB"}},
          {"noise": {"stddev": "8MiB"}}]
# A serving process's allocator: a steady CUDA context/NCCL share, a noisy cache with some of it
# in splits, no retries (the healthy case: every process is examined, none raises a finding).
ALLOCATOR = {"non_torch": "600MiB", "cached": [{"constant": "128MiB"}, {"noise": {"stddev": "4MiB"}}],
             "inactive_split": "32MiB", "alloc_retries": 0, "interval": 5,
             "alloc_conf": "expandable_segments:True"}


def scenario(gpus: int, procs: int, probed: int) -> dict[str, object]:
    processes: list[dict[str, object]] = []
    for g in range(gpus):
        base = 20000 + g * 1000
        common = {"name": "python3", "gpu": g, "memory": MEMORY,
                  "rss": [{"constant": "512MiB"}, {"noise": {"stddev": "4MiB"}}]}
        if probed:
            processes.append({"pid": base, "replicas": probed, **common, "allocator": ALLOCATOR})
        if procs - probed:
            processes.append({"pid": base + probed, "replicas": procs - probed, **common})
    return {"name": f"probe-tick-{gpus}x{procs}-{probed}",
            "description": f"{gpus} GPUs x {procs} processes, {probed} per GPU probed",
            "duration": "6h",
            "gpus": [{"name": "NVIDIA H100 80GB HBM3", "memory": "81559MiB", "reserved": "527MiB",
                      "count": gpus}],
            "host": {"memory": "2015GiB", "available": [{"constant": "1500GiB"}]},
            "processes": processes}


# ------------------------------------------------------------------ worker (one variant, one tree)

def worker(scenario_file: str, warmup: int) -> None:
    from exporter.cli import make_analyzer
    from exporter.config import build as build_config
    from exporter.daemon import Sampler
    from exporter.model import Snapshot
    from exporter.runtime import build as build_runtime
    from exporter.sources.source import collect

    logging.disable(logging.WARNING)  # findings raised while playing are not the point here
    config = build_config()
    runtime = build_runtime(config, simulate=scenario_file, at=600.0)
    analyzer = make_analyzer(config)
    probes = runtime.host.sim_probes
    # The sampler's sources, with the simulated probes' writing taken out of the timed tick.
    sources = [getattr(s, "source", s) if probes is not None and s is not None
               and getattr(s, "probes", None) is probes else s for s in runtime.sampler.sources]
    sampler = Sampler(sources, now=runtime.clock.now)

    def tick() -> dict[str, float]:
        runtime.clock.advance(INTERVAL)
        # The simulator's own work, outside the timing: the scenario's state at this moment
        # (memoised for the tick; otherwise the first source to ask would pay for it) ...
        runtime.host.view.scenario.state_for(runtime.clock)
        if probes is not None:  # ... and the probe files a real host's probes would write
            probes.write()
        allocator = 0.0
        t0 = time.thread_time()
        snap = Snapshot(timestamp=sampler.now())
        for source in sampler.sources:
            s0 = time.thread_time()
            snap = collect(source, snap)
            if source.name == "allocator":
                allocator = time.thread_time() - s0
        t1 = time.thread_time()
        analyzer.update(snap)
        t2 = time.thread_time()
        return {"sample": t1 - t0, "allocator": allocator, "analysis": t2 - t1,
                "probed": sum(p.allocator is not None for g in snap.gpus for p in g.processes),
                "processes": sum(len(g.processes) for g in snap.gpus)}

    try:
        for _ in range(warmup):
            tick()
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            if line.strip() != "tick":
                break
            print(json.dumps(tick()), flush=True)
    finally:
        runtime.close()


# ------------------------------------------------------------------ driver

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--procs", type=int, default=64, help="processes per GPU")
    ap.add_argument("--probed", type=int, default=8, help="probed processes per GPU in the mix")
    ap.add_argument("--ticks", type=int, default=60, help="measured ticks per variant")
    ap.add_argument("--warmup", type=int, default=70, help="ticks before measuring (70 x 5 s "
                    "fills the detectors' 5-minute windows)")
    ap.add_argument("--code", nargs="+", default=[str(ROOT)], metavar="DIR",
                    help="checkouts whose exporter package to measure (default: this one)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.warmup)
        return
    if not 0 < args.probed < args.procs:
        ap.error("--probed must be between 1 and --procs - 1")

    codes = [str(Path(c).resolve()) for c in args.code]
    probed = {"none": 0, "mix": args.probed, "all": args.procs}
    with tempfile.TemporaryDirectory(prefix="probe-tick-") as tmp:
        workers = {}
        for code in codes:
            for variant in VARIANTS:
                path = Path(tmp, f"{variant}.yaml")
                # JSON is YAML: the scenario loader reads it as is.
                path.write_text(json.dumps(scenario(args.gpus, args.procs, probed[variant])))
                env = dict(os.environ, PYTHONPATH=code)
                workers[(code, variant)] = subprocess.Popen(
                    [sys.executable, str(Path(__file__).resolve()), "--worker", str(path),
                     "--warmup", str(args.warmup)],
                    cwd=code, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            for key, proc in workers.items():  # all built and warmed up before any is timed
                assert proc.stdout is not None
                ready = proc.stdout.readline()
                if not ready:
                    raise SystemExit(f"worker {key} failed")
            times: dict[tuple[str, str], list[dict[str, float]]] = {k: [] for k in workers}
            order = list(workers)
            for i in range(args.ticks):
                rotated = order[i % len(order):] + order[:i % len(order)]
                for key in rotated:
                    proc = workers[key]
                    assert proc.stdin is not None and proc.stdout is not None
                    proc.stdin.write("tick\n")
                    proc.stdin.flush()
                    times[key].append(json.loads(proc.stdout.readline()))
        finally:
            for proc in workers.values():
                if proc.stdin:
                    proc.stdin.close()
                proc.wait(timeout=60)

    def med(key: tuple[str, str], what: str) -> float:
        rows = times[key]
        if what == "cycle":
            return statistics.median(r["sample"] + r["analysis"] for r in rows) * 1e3
        return statistics.median(r[what] for r in rows) * 1e3

    print(f"{args.gpus} GPUs x {args.procs} processes, {args.ticks} ticks per variant after "
          f"{args.warmup} warm-up ticks, {INTERVAL:g} s interval; CPU ms (medians), side by side")
    print()
    head = "| tree | variant | probed | sources | of which allocator | analysis | sample + analysis " \
           "| vs none | share of a core |"
    if len(codes) > 1:
        head += " vs first tree |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for code in codes:
        for variant in VARIANTS:
            key = (code, variant)
            cycle = med(key, "cycle")
            row = (f"| {Path(code).name} | {variant} | {int(times[key][-1]['probed'])}/"
                   f"{int(times[key][-1]['processes'])} | {med(key, 'sample'):.2f} | "
                   f"{med(key, 'allocator'):.2f} | {med(key, 'analysis'):.2f} | {cycle:.2f} | "
                   f"{cycle / med((code, 'none'), 'cycle'):.2f}x | {cycle / (INTERVAL * 1e3):.2%} |")
            if len(codes) > 1:
                row += f" {cycle / med((codes[0], variant), 'cycle'):.2f}x |"
            print(row)


if __name__ == "__main__":
    main()
