"""`gpu-memory-exporter run` with the leak detector's time constants scaled down, for the
real_vllm leak test: a real daemon (a real process, real /proc, its real HTTP listener) whose
leak detector is the shipped one with every duration and window multiplied by SCALE (and the
slope it needs divided by it), so a leak it would find in 20 minutes it finds in two at SCALE 0.1.

    python -m helpers.scaled_exporter SCALE run [run's arguments]   (with tests/ on PYTHONPATH)

Nothing but the leak statistics' durations, the history's bucket and contention's window (its
baseline is that old) change; the other detectors run as shipped.
"""
from __future__ import annotations

import sys
from dataclasses import replace

from exporter import service
from exporter.analysis.engine import AnalysisConfig, Analyzer
from exporter.analysis.history import History
from exporter.analysis.leak import LeakConfig
from exporter.cli import main as cli_main
from exporter.config import Config

DURATIONS = ("settle_seconds", "max_tooth_seconds", "slope_window_seconds", "stale_seconds", "young_seconds",
             "first_tooth_seconds", "earlier_level_seconds", "noise_refresh_seconds", "staircase_max_gap_seconds",
             "refill_seconds")


def scaled_leak(scale: float, base: LeakConfig | None = None) -> LeakConfig:
    base = base or LeakConfig()
    return replace(base, windows_minutes=tuple(w * scale for w in base.windows_minutes),
                   half_kink_minutes=base.half_kink_minutes * scale,
                   min_slope_bytes_per_second=base.min_slope_bytes_per_second / scale,
                   **{name: getattr(base, name) * scale for name in DURATIONS})


def main() -> int:
    scale = float(sys.argv[1])
    shipped = service.make_analyzer

    def make_analyzer(config: Config) -> Analyzer:
        analyzer = shipped(config)
        c: AnalysisConfig = analyzer.config
        detectors = dict(c.detectors)
        detectors["leak"] = scaled_leak(scale, detectors["leak"])
        detectors["contention"] = replace(detectors["contention"],
                                          window_seconds=detectors["contention"].window_seconds * scale)
        analyzer.config = replace(c, detectors=detectors)
        h = analyzer.history
        analyzer.history = History(raw_seconds=h.raw_seconds, retention_seconds=h.retention_seconds,
                                   dead_grace_seconds=h.dead_grace_seconds, bucket_seconds=h.bucket_seconds * scale,
                                   max_raw_samples=c.history_max_raw_samples)
        return analyzer

    service.make_analyzer = make_analyzer  # type: ignore[assignment]
    cli_main(sys.argv[2:], prog_name="gpu-memory-exporter")  # exits
    return 0


if __name__ == "__main__":
    sys.exit(main())
