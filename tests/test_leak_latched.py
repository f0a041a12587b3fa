"""A leak finding the latch holds through quiet minutes tells the verdict that raised it. The
trial of 5d3e341 saw `leak [critical -> warning] ... grows -0.2 MiB/min`, then back to critical a
tick later: the finding was rebuilt each tick from that tick's slope, flat or falling between
a leak's verdicts, which has no time to full and so no critical severity."""
import random

from exporter.analysis.history import History
from exporter.analysis.leak import LeakConfig
from exporter.analysis.leak_detector import LeakDetector
from exporter.model import GpuSample, ProcessSample, Snapshot

MiB = 1024 * 1024
GiB = 1024 * MiB
T0 = 1_700_000_000
TOTAL = 80 * GiB


def _run(level_at, minutes):
    """Replays `level_at(t)` (bytes, t in s from T0) for `minutes` every 5 s; yields each tick's
    leak findings with its time."""
    rng = random.Random(7)
    history, detector, config = History(), LeakDetector(), LeakConfig()
    for k in range(minutes * 12):
        t = T0 + 5 * k
        used = int((level_at(5 * k) + rng.gauss(0, 2 * MiB)) // (2 * MiB) * (2 * MiB))
        proc = ProcessSample(pid=4242, used_bytes=used, name="python3", start_time=T0 - 1.0, role="vllm")
        snap = Snapshot(timestamp=float(t), gpus=(GpuSample(index="0", uuid="GPU-latch", total_bytes=TOTAL,
                                                            used_bytes=used, processes=(proc,)),))
        history.update(snap)
        # critical while a day from full at the rate found
        yield t, [f for f in detector.detect(history, snap, (), config, 86400.0).findings if f.kind == "leak"]


def test_a_latched_leak_finding_keeps_the_rate_and_severity_it_was_raised_with():
    # 76 GiB used, growing 64 MiB/min from minute 40 (4 GiB from full: about an hour, critical);
    # at minute 70 the growth stops and a 2 GiB cache is freed: the latch holds the finding for
    # its quiet period, in which each minute's own slope is flat or falling.
    def level(s):
        m = s / 60
        grown = 64 * MiB * (min(m, 70) - 40) if m > 40 else 0
        return 74 * GiB + grown - (2 * GiB if m >= 70 else 0)
    raised, held = [], []
    for t, leaks in _run(level, 90):
        if leaks:
            (held if t >= T0 + 71 * 60 else raised).append(leaks[0])
    assert raised, "the leak was not found before it stopped"
    assert held, "the latch did not hold the finding after the leak stopped"
    assert {f.severity for f in raised} == {"critical"}
    for f in held:
        evidence = dict(f.evidence)
        assert evidence["slope_bytes_per_second"] > 0, f.summary
        assert "grows -" not in f.summary and f.severity == "critical", f.summary
