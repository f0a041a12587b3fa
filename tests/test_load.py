"""CI's short load test (bench/load.py): 50 concurrent scrapers for 10 s against a real
`run --simulate fleet-8x64` process. Every scrape is answered in full and sampling goes on
under the load. How fast (latency, sample age, samples per interval) is bench/load.py's to
measure: on a loaded machine it is the machine's speed, not the daemon's behaviour."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("load_bench", Path(__file__).parent.parent / "bench" / "load.py")
load_bench = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("load_bench", load_bench)  # dataclasses look their module up
_spec.loader.exec_module(load_bench)

SCRAPERS, SECONDS, INTERVAL = 50, 10.0, 1.0
HANG = 180.0  # bounds a hang only: a request, the start-up, the wait for samples
SAMPLES = 3  # samples taken while the scrapers hammer


@pytest.mark.integration
@pytest.mark.slow
def test_fifty_scrapers_for_ten_seconds():
    daemon = load_bench.DaemonProcess("fleet-8x64", INTERVAL)
    try:
        daemon.wait_ready(timeout=HANG)
        result = load_bench.hammer(daemon.url, SCRAPERS, SECONDS, timeout=HANG, min_samples=SAMPLES,
                                   hang_bound=HANG)
    finally:
        daemon.stop()
    # Every scrape answered 200 with a whole page (the watcher's too).
    assert result.errors == [], sorted(set(result.errors))
    assert len(result.latencies) >= SCRAPERS  # every scraper got answers
    assert all(n >= 1 for n in result.per_scraper), result.per_scraper
    # Scrapes render the last state; they never stop the sampling loop.
    assert result.samples_advanced >= SAMPLES
