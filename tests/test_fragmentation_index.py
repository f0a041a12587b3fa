"""The fragmentation detector reads a server's frames for preemptions only when its preemptions
counter moved within the window (History.preemptions_run says when it last did, without reading
the frames): its verdicts are those of reading the window every tick (#18: four servers' frames
read every tick were a cost at the steady state)."""
from __future__ import annotations

import random

import pytest

from exporter.analysis import fragmentation
from exporter.analysis.budget import memory_budgets
from exporter.analysis.fragmentation import FragmentationConfig, detect_fragmentation
from exporter.analysis.history import History
from exporter.model import VllmSample
from helpers.timeline import T0, GiB, gpu, snap, vllm_proc, vllm_server

ENDPOINTS = ("http://127.0.0.1:8000", "http://127.0.0.1:8001")


class EveryFrameRead(History):
    """A history without the index: the detector reads the window every tick, as before it."""

    def preemptions_run(self, endpoint, model, engine):
        return None


def random_servers(rng: random.Random, n: int):
    """Two servers whose preemption counters mostly stand still, now and then rise, reset (a
    restart), go unreported or the server down; sampled at uneven intervals (some thinned)."""
    t, counters, out = T0, dict.fromkeys(ENDPOINTS, 5.0), []
    for _ in range(n):
        t += rng.choice((0.2, 5.0, 5.0, 10.0, 60.0))
        servers = []
        for endpoint in ENDPOINTS:
            r = rng.random()
            if r < 0.05:
                counters[endpoint] += rng.choice((1, 3, 12))
            elif r < 0.07:
                counters[endpoint] = rng.choice((0.0, 5.0))
            if rng.random() < 0.05:
                servers.append(VllmSample(endpoint=endpoint, up=False))
                continue
            value = None if rng.random() < 0.05 else counters[endpoint]
            servers.append(vllm_server(value, rng.choice((0.3, 0.6, 0.97)), endpoint=endpoint,
                                       util=0.5, pids=(10 + ENDPOINTS.index(endpoint),)))
        procs = [vllm_proc(10 + i, 20 * GiB, endpoint=e) for i, e in enumerate(ENDPOINTS)]
        out.append(snap(t, [gpu(procs)], vllm=servers))
    return out


@pytest.mark.parametrize("seed", range(5))
def test_its_verdicts_are_those_of_reading_every_frame(seed):
    rng = random.Random(seed)
    config = FragmentationConfig(window_seconds=rng.choice((60.0, 300.0)))
    kept = rng.choice((16, 4096))  # raw frames kept: 16 thins them
    ours, every = History(raw_seconds=900, max_raw_samples=kept), EveryFrameRead(raw_seconds=900, max_raw_samples=kept)
    raised = 0
    for s in random_servers(rng, 500):
        budgets = memory_budgets(s)
        ours.update(s, budgets)
        every.update(s, budgets)
        got = detect_fragmentation(ours, s, config, budgets)
        assert got == detect_fragmentation(every, s, config, budgets)
        raised += len(got)
    assert raised  # preemptions with the GPU free do raise


def test_a_counter_that_stands_still_has_no_frame_read(monkeypatch):
    read = []
    monkeypatch.setattr(fragmentation, "_engine_stats", lambda s, e, f=fragmentation._engine_stats: read.append(
        s.timestamp) or f(s, e))
    history, config = History(), FragmentationConfig()
    for i in range(200):
        s = snap(T0 + 5 * i, [gpu([vllm_proc(10, 20 * GiB)])], vllm=[vllm_server(7.0, 0.4)])
        history.update(s, memory_budgets(s))
        read.clear()
        assert detect_fragmentation(history, s, config, memory_budgets(s)) == []
    assert read == [s.timestamp]  # the tick's own snapshot only
    s = snap(T0 + 1000, [gpu([vllm_proc(10, 20 * GiB)])], vllm=[vllm_server(9.0, 0.4)])
    history.update(s, memory_budgets(s))
    read.clear()
    detect_fragmentation(history, s, config, memory_budgets(s))
    assert len(read) > 2  # it moved: the window's frames are read
