"""CI's short soak (bench/soak.py): 6 simulated hours at a 10 s interval, 8 GPUs, 3,000 processes
coming and going (about 60 alive at once, PIDs reused). Series counts stay within a bound set by
the churn's width, not its length, and resident memory stops growing after warm-up."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("soak", Path(__file__).parent.parent / "bench" / "soak.py")
soak = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("soak", soak)  # dataclasses look their module up
_spec.loader.exec_module(soak)

HOURS, INTERVAL, PROCESSES, GPUS = 6, 10.0, 3000, 8
MiB = 1 << 20


@pytest.fixture(scope="module")
def result():
    return soak.run(HOURS / 24, INTERVAL, PROCESSES, GPUS, scrape_every=6, rss_every=60, report=lambda *_: None)


@pytest.mark.slow
def test_every_tick_sampled_without_errors(result):
    assert result["ticks"] == HOURS * 3600 / INTERVAL
    assert result["errors_total"] == {}  # churn is normal operation, not a fault


@pytest.mark.slow
def test_exported_series_bounded_by_processes_alive(result):
    # Per live process: GPU memory, host RSS, growth, leak_suspected (+ the odd finding); the
    # rest (GPUs, host, the exporter itself) is a constant.
    alive = result["max_alive"] + GPUS
    assert result["max_series"] <= 100 + 5 * alive
    series = [s for _, s, _ in result["series_samples"]]
    assert max(series[len(series) // 2:]) <= 1.25 * max(series[len(series) // 6:len(series) // 2])  # flat


@pytest.mark.slow
def test_history_forgets_dead_processes(result):
    # History keeps a process's GPU memory and RSS series for dead_grace (900 s), swept every
    # 60 s bucket: bounded by the processes alive within that span, whatever the run's length.
    churn = soak.Churn.generate(PROCESSES, HOURS * 3600, GPUS)
    width = churn.max_alive(900 + 60 + INTERVAL) + GPUS
    assert result["max_history_series"] <= 2 * width + GPUS
    assert result["max_history_series"] < PROCESSES / 5  # far from "one per process ever seen"


@pytest.mark.slow
def test_resident_memory_flat_after_warm_up(result):
    after_warm_up = [rss for t, rss in result["rss_samples"] if t >= 3600]
    assert len(after_warm_up) >= 5
    assert max(after_warm_up) - after_warm_up[0] < 16 * MiB
