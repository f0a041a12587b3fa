"""The stale-memory detector reads its frames for a serving process's exit only when one seen
within its lookback is gone (History.serving_seen says so without reading them): its verdicts are
those of reading the frames every tick (#18: that was most of its cost at the steady state)."""
from __future__ import annotations

import random

import pytest

from exporter.analysis import stale
from exporter.analysis.history import History
from exporter.analysis.stale import StaleConfig, detect_stale
from helpers.timeline import T0, GiB, gpu, proc, snap, vllm_proc


class EveryFrameRead(History):
    """A history whose index claims every serving process it ever saw: the detector then reads
    its frames every tick, as it did before the index."""

    def serving_seen(self, since):
        return [(uuid, identity) for uuid, identity in self._ever] + [("gone", (0, None))]

    def update(self, snapshot, budgets=()):
        self._ever = getattr(self, "_ever", set()) | {(g.uuid, p.identity) for g in snapshot.gpus
                                                      for p in g.processes if p.role == "vllm"}
        super().update(snapshot, budgets)


def random_host(rng: random.Random, n: int):
    """Two GPUs whose serving processes start, exit (sometimes leaving their memory behind) and
    restart under new PIDs, with other processes beside them."""
    t, pid, out = T0, 100, []
    serving = {"0": [(10, T0 - 60)], "1": [(20, T0 - 60)]}
    stuck = {"0": 0, "1": 0}
    for _ in range(n):
        t += rng.choice((1.0, 5.0, 5.0, 15.0, 60.0))
        gpus = []
        for index in ("0", "1"):
            if serving[index] and rng.random() < 0.04:
                serving[index].pop()
                stuck[index] = rng.choice((0, 20 * GiB))  # what the exit left behind
            if not serving[index] and rng.random() < 0.1:
                pid += 1
                serving[index].append((pid, t))
                stuck[index] = 0 if rng.random() < 0.5 else stuck[index]
            procs = [vllm_proc(p, 30 * GiB, start=start) for p, start in serving[index]]
            procs.append(proc(5, 2 * GiB))
            gpus.append(gpu(procs, index=index, extra=(400 << 20) + stuck[index]))
        out.append(snap(t, gpus))
    return out


@pytest.mark.parametrize("seed", range(5))
def test_its_verdicts_are_those_of_reading_every_frame(seed):
    rng = random.Random(seed)
    config = StaleConfig()
    ours, every = History(), EveryFrameRead()
    raised = 0
    for s in random_host(rng, 600):
        ours.update(s)
        every.update(s)
        got = detect_stale(ours, s, config)
        assert got == detect_stale(every, s, config)
        raised += len(got)
    assert raised  # the timelines do raise findings (exits whose memory stayed among them)


def test_serving_seen_holds_every_process_of_the_frames_since():
    rng = random.Random(7)
    history = History(raw_seconds=300, max_raw_samples=16)
    for s in random_host(rng, 400):
        history.update(s)
        for window in (0.0, 60.0, 900.0):
            in_frames = {(g.uuid, p.identity) for f in history.recent(s.timestamp - window) for g in f.gpus
                         for p in g.processes if p.role == "vllm"}
            assert in_frames <= set(history.serving_seen(s.timestamp - window))
        # bounded by the frames kept: nothing older than the oldest frame is remembered
        assert len(history.serving_seen(float("-inf"))) <= len({(g.uuid, p.identity) for f in history.recent(
            float("-inf")) for g in f.gpus for p in g.processes if p.role == "vllm"}) + 1


def test_while_no_serving_process_is_gone_no_frame_is_read_for_exits(monkeypatch):
    scanned = []
    monkeypatch.setattr(stale, "exited_servers", lambda snapshot, past: scanned.append(len(past)) or {})
    history = History()
    for i in range(300):
        s = snap(T0 + 5 * i, [gpu([vllm_proc(10, 30 * GiB)])])
        history.update(s)
        detect_stale(history, s, StaleConfig())
    assert scanned == []
    s = snap(T0 + 1500, [gpu([], extra=30 * GiB)])  # it exits, its memory stays
    history.update(s)
    detect_stale(history, s, StaleConfig())
    assert scanned and scanned[0] > 1
