"""The history's index of the vLLM servers' sleep states says what reading its frames would say,
as frames come, are thinned and age out; the detectors that ask it every tick (quiet_endpoints,
sleep_leak) give the verdicts a full read of the frames gave, and a host whose servers never
slept has none of its frames read for it (#18: an hour of frames read every tick, per server,
was most of the exporter's CPU at the steady state)."""
from __future__ import annotations

import random

import pytest

from exporter.analysis import sleep
from exporter.analysis.detector import Tick
from exporter.analysis.history import History
from exporter.analysis.sleep import SleepConfig, SleepLeakDetector, quiet_endpoints, sleep_state
from exporter.model import Snapshot, VllmEngineStats, VllmSample
from helpers.timeline import T0, GiB, gpu, snap, vllm_proc

ENDPOINTS = ("a", "b", "c")
STATES = ("awake", "awake", "awake", "weights_offloaded", "discard_all", None, "")  # None: down


def server(endpoint: str, state: str | None) -> VllmSample:
    if state is None:
        return VllmSample(endpoint=endpoint, up=False)
    return VllmSample(endpoint=endpoint, up=True,
                      engines=(VllmEngineStats(model="m", engine="0", sleep_state=state),))


def random_timeline(rng: random.Random, n: int) -> list[Snapshot]:
    """Servers that come and go and change state now and then, sampled at uneven intervals (some
    closer together than the history keeps: thinned)."""
    t, states, out = T0, dict.fromkeys(ENDPOINTS, "awake"), []
    for _ in range(n):
        t += rng.choice((0.1, 0.5, 5.0, 5.0, 5.0, 30.0))
        for e in ENDPOINTS:
            if rng.random() < 0.08:
                states[e] = rng.choice(STATES)
        present = [e for e in ENDPOINTS if rng.random() < 0.95]
        out.append(snap(t, [gpu([vllm_proc(10 + i, GiB, endpoint=e) for i, e in enumerate(present)])],
                        vllm=[server(e, states[e]) for e in present]))
    return out


def read_from_frames(history: History, since: float, before: float) -> dict[str, frozenset[str]]:
    out: dict[str, set[str]] = {}
    for s in history.recent(since):
        if s.timestamp < before:
            for endpoint, state in {v.endpoint: sleep_state(v) for v in s.vllm}.items():
                out.setdefault(endpoint, set()).add(state)
    return {e: frozenset(states) for e, states in out.items()}


def quiet_from_frames(history: History, snapshot: Snapshot, seconds: float) -> frozenset[str]:
    """quiet_endpoints as it was written before the index: every frame of the window read."""
    now = snapshot.timestamp
    current = {v.endpoint: sleep_state(v) for v in snapshot.vllm}
    quiet = {e for e, state in current.items() if state not in ("", "awake")}
    for s in history.recent(now - seconds):
        if s.timestamp >= now:
            continue
        for e, state in {v.endpoint: sleep_state(v) for v in s.vllm}.items():
            if (state and state != current.get(e, state)) or state not in ("", "awake"):
                quiet.add(e)
    return frozenset(quiet)


@pytest.mark.parametrize("seed", range(6))
def test_the_index_says_what_the_frames_say(seed):
    rng = random.Random(seed)
    history = History(raw_seconds=rng.choice((120, 600)), max_raw_samples=rng.choice((8, 64, 4096)),
                      max_log_events=2)
    for s in random_timeline(rng, 400):
        history.update(s)
        now = s.timestamp
        for window in (0.0, 7.0, 60.0, 300.0, 10_000.0):
            assert history.sleep_states(now - window, now) == read_from_frames(history, now - window, now)
            assert quiet_endpoints(history, s, window) == quiet_from_frames(history, s, window)
        # and as asked before the tick's own snapshot joined the history
        assert history.sleep_states(now - 60, now + 1) == read_from_frames(history, now - 60, now + 1)


def test_a_frame_out_of_order_is_not_indexed():
    history = History()
    history.update(snap(T0, vllm=[server("a", "awake")]))
    history.update(snap(T0 - 5, vllm=[server("a", "discard_all")]))  # a clock step back: dropped
    assert history.sleep_states(T0 - 60, T0 + 1) == {"a": frozenset({"awake"})}


def test_servers_that_never_slept_have_no_frame_read(monkeypatch):
    """The index answers; the frames are read only when a server slept within the lookback."""
    reads = []
    original = History.recent

    def counted(self, since):
        reads.append(since)
        return original(self, since)
    monkeypatch.setattr(History, "recent", counted)
    history, detector, config = History(), SleepLeakDetector(), SleepConfig()
    for i in range(200):
        s = snap(T0 + 5 * i, [gpu([vllm_proc(10, 60 * GiB, endpoint=e) for e in ENDPOINTS])],
                 vllm=[server(e, "awake") for e in ENDPOINTS])
        history.update(s)
        assert detector(Tick(snapshot=s, history=history, budgets=(), kv_caches=(), gpus=()), config) == []
        assert quiet_endpoints(history, s, 300) == frozenset()
    assert reads == []
    # one sleeps: from then on its cycle is judged from the frames, as before
    s = snap(T0 + 1000, [gpu([vllm_proc(10, GiB, endpoint=e) for e in ENDPOINTS])],
             vllm=[server("a", "weights_offloaded"), server("b", "awake"), server("c", "awake")])
    history.update(s)
    detector(Tick(snapshot=s, history=history, budgets=(), kv_caches=(), gpus=()), config)
    assert quiet_endpoints(history, s, 300) == frozenset({"a"})
    assert reads
    assert sleep.SLEEPING_STATES == ("weights_offloaded", "discard_all")
