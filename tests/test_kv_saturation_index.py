"""The KV saturation detector reads an engine's frames only when its KV cache came near full
within two windows (History.kv_usage_peak says so without reading them): its verdicts are those
of reading the frames every tick (#18: four servers' frames read every tick were a cost at the
steady state)."""
from __future__ import annotations

import random

import pytest

from exporter.analysis.history import History
from exporter.analysis.kv_cache import KvSaturationConfig, detect_kv_saturation, kv_caches
from exporter.model import VllmEngineStats, VllmSample
from helpers.timeline import T0, GiB, gpu, snap, vllm_proc

ENDPOINTS = ("http://127.0.0.1:8000", "http://127.0.0.1:8001")


class EveryFrameRead(History):
    """A history without the index: the detector reads its frames every tick, as before it."""

    def kv_usage_peak(self, endpoint, model, engine, since):
        return 1.0


def random_servers(rng: random.Random, n: int):
    """Two servers whose KV usage wanders, saw-tooths at the ceiling under load for a while, with
    requests waiting and preemptions now and then; some samples unreported, a server down."""
    t, loaded, preempted, out = T0, dict.fromkeys(ENDPOINTS, False), 0.0, []
    for _ in range(n):
        t += rng.choice((0.2, 5.0, 5.0, 10.0))
        servers = []
        for endpoint in ENDPOINTS:
            if rng.random() < 0.03:
                loaded[endpoint] = not loaded[endpoint]
            if rng.random() < 0.04:
                servers.append(VllmSample(endpoint=endpoint, up=False))
                continue
            usage = rng.choice((0.97, 1.0, 0.8)) if loaded[endpoint] else rng.uniform(0.1, 0.9)
            preempted += loaded[endpoint] and rng.random() < 0.2
            servers.append(VllmSample(endpoint=endpoint, up=True, engines=(VllmEngineStats(
                model="m", engine="0", kv_cache_usage_ratio=None if rng.random() < 0.05 else usage,
                requests_waiting=rng.choice((0, 3)) if loaded[endpoint] else 0,
                preemptions_total=preempted),)))
        out.append(snap(t, [gpu([vllm_proc(10 + i, 20 * GiB, endpoint=e) for i, e in enumerate(ENDPOINTS)])],
                        vllm=servers))
    return out


@pytest.mark.parametrize("seed", range(5))
def test_its_verdicts_are_those_of_reading_every_frame(seed):
    rng = random.Random(seed)
    config = KvSaturationConfig(window_seconds=rng.choice((60.0, 120.0)))
    kept = rng.choice((128, 4096))  # raw frames kept: 128 thins them (one per 7 s)
    ours, every = History(raw_seconds=900, max_raw_samples=kept), EveryFrameRead(raw_seconds=900, max_raw_samples=kept)
    raised = 0
    for s in random_servers(rng, 600):
        ours.update(s)
        every.update(s)
        got = detect_kv_saturation(ours, s, config, kv_caches(s))
        assert got == detect_kv_saturation(every, s, config, kv_caches(s))
        raised += len(got)
    assert raised


def test_a_cache_never_near_full_has_no_frame_read(monkeypatch):
    reads = []
    original = History.recent
    monkeypatch.setattr(History, "recent", lambda self, since: reads.append(since) or original(self, since))
    history, config = History(), KvSaturationConfig()
    for i in range(300):
        s = snap(T0 + 5 * i, [gpu([vllm_proc(10, 20 * GiB)])], vllm=[VllmSample(
            endpoint=ENDPOINTS[0], up=True, engines=(VllmEngineStats(model="m", engine="0",
                                                                     kv_cache_usage_ratio=0.5 + 0.4 * (i % 2)),))])
        history.update(s)
        assert detect_kv_saturation(history, s, config, kv_caches(s)) == []
    assert reads == []
