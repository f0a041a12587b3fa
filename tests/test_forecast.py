"""The GPU's "full in" forecast (GpuAnalysis.time_to_full_seconds, the status page's "full in"
column, gpumem_gpu_time_to_full_seconds): shown only for a clear trend, and steady while the
trend lasts (#19 item 6)."""
from __future__ import annotations

import math

import pytest

from helpers.timeline import T0, GiB, MiB, gpu, proc, replay_all, snap, timeline, vllm_proc, vllm_server


def sawtooth(e: float, period: float = 300, amplitude: float = 256 * MiB) -> float:
    return amplitude * ((e % period) / period - 0.5)


def forecasts(snapshots):
    _, results = replay_all(snapshots)
    return [(r.timestamp - T0, r.gpus[0].time_to_full_seconds) for r in results]


def test_no_forecast_through_a_staircase():
    """A notebook loads a model, then a second one: two steps, then flat. A line through the
    staircase forecast 19 min to full at 95 % used and swung from 8 h to 19 min to 28 h."""
    def make(e):
        notebook = 0.6 * GiB + (5 * GiB if e >= 1920 else 0) + (3 * GiB if e >= 3300 else 0)
        procs = [vllm_proc(10, 67 * GiB + sawtooth(e)), proc(555, notebook if e >= 1800 else 0)]
        return snap(T0 + e, [gpu(procs)], vllm=[vllm_server(0, 0.4)])
    shown = [(e, ttf) for e, ttf in forecasts(timeline(3 * 3600, 30, make)) if ttf is not None]
    assert shown == []


def test_a_steady_climb_is_forecast_and_the_forecast_holds_steady():
    """Growth of 300 MiB/min: the forecast appears, says about (free / rate), and moves from one
    minute to the next by what a minute takes off it, never by orders of magnitude."""
    total = 80 * GiB
    rate = 300 * MiB / 60

    def make(e):
        return snap(T0 + e, [gpu([proc(20, 20 * GiB + rate * e + sawtooth(e))], total=total)])
    series = forecasts(timeline(2 * 3600, 30, make))
    shown = [(e, ttf) for e, ttf in series if ttf is not None]
    assert shown and shown[0][0] < 30 * 60, "a clear climb is forecast within half an hour"
    for e, ttf in shown:
        expected = (total - 20 * GiB - 400 * MiB - rate * e) / rate
        assert ttf == pytest.approx(expected, rel=0.25), e
    by_time = dict(series)
    for e, ttf in shown:
        before = by_time.get(e - 60)
        if before is not None:
            assert math.isclose(ttf, before, rel_tol=0.2, abs_tol=120), (e, before, ttf)
