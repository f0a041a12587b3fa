"""Resident memory of the daemon while each of its inputs is flooded, side by side for several
checkouts in one run (#21 item 1).

    python bench/flood.py [--ticks 40] [--interval 0.5] [--code DIR ...]

For each `--code DIR` (default: this checkout) a real daemon runs that checkout's `exporter`
(`run --simulate leak`: a probed vLLM EngineCore, plus a log file and a vLLM endpoint of our own
on loopback) and its inputs are flooded as the red team of #21 flooded them, each for `--ticks`
of the daemon's samples: at rest; H2, 8,000 one-byte files named for the probed process's pid in
the probe directory; H3, 2,000 distinct OOM lines a second in the tailed log; M6, a 7.6 MB page of
valid text without vLLM series; then all three at once. Peak VmRSS (/proc) per phase, in MiB
("then stalled": the daemon stopped sampling under the flood, and what it had reached).
Memory a phase took and never gave back shows in the phases after it, as it would in the daemon.
To compare with an older version, check it out beside this one:

    git worktree add /tmp/old 350e227 && python bench/flood.py --code . --code /tmp/old

The flooding itself is tests/helpers/flood.py, which tests/test_memory_bound.py runs against the
figure docs/memory.md states.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from helpers.flood import FloodedDaemon, flood_all_at_once, flood_each_in_turn  # noqa: E402

MiB = 1 << 20
PHASES = ("at rest", "probe files (H2)", "log lines (H3)", "vLLM page (M6)", "all at once")


def measure(code: Path, ticks: int, interval: float) -> tuple[dict[str, int | str], float]:
    with tempfile.TemporaryDirectory(prefix="gpumem-flood-") as workdir:
        started = time.monotonic()
        daemon = FloodedDaemon(Path(workdir), code=code, interval=interval)
        readings: list[int] = []
        try:
            peaks: dict[str, int | str] = dict(flood_each_in_turn(daemon, ticks=ticks))
            try:
                peaks["all at once"] = flood_all_at_once(daemon, ticks=ticks, peak=readings)
            except RuntimeError:  # it stopped sampling under the flood: what it had reached
                peaks["all at once"] = f"{max(readings, default=0) / MiB:.0f}, then stalled"
        finally:
            daemon.stop()
        return peaks, time.monotonic() - started


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ticks", type=int, default=40, help="samples each flood lasts")
    ap.add_argument("--interval", type=float, default=0.5, help="the daemon's sampling interval (s)")
    ap.add_argument("--code", type=Path, action="append", help="a checkout to run (repeatable)")
    args = ap.parse_args()
    print(f"Peak resident memory (MiB), {args.ticks} samples per flood at a {args.interval:g} s interval\n")
    print("| code | " + " | ".join(PHASES) + " | took |")
    print("|---|" + "---:|" * (len(PHASES) + 1))
    for code in args.code or [ROOT]:
        peaks, took = measure(code.resolve(), args.ticks, args.interval)
        cells = " | ".join(f"{v / MiB:.0f}" if isinstance(v := peaks[p], int) else v for p in PHASES)
        print(f"| {code} | {cells} | {took:.0f} s |", flush=True)


if __name__ == "__main__":
    main()
