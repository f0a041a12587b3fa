"""Replaying a bench/leak_corpus.py trace through History and LeakDetector.detect tick by tick,
as the daemon and bench/leak_quality.py run it."""
import sys
from pathlib import Path

from exporter.analysis.history import History
from exporter.analysis.leak import LeakConfig
from exporter.analysis.leak_detector import LeakDetector
from exporter.model import AllocatorStats, GpuSample, ProcessSample, Snapshot

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from leak_corpus import T0, TOTAL


def episodes(times, values, uuid="GPU-bench", allocated=None, reserved=None):
    """Minutes from the trace's start at which a leak finding was raised (each episode's start).
    History's minute buckets begin at an offset drawn from the series' key: another GPU's UUID
    reads the same trace through other buckets (the bench's is GPU-bench). With `allocated` and
    `reserved` (a probed trace's), the process carries the allocator probe's numbers too."""
    history, detector, config = History(), LeakDetector(), LeakConfig()
    out, active = [], False
    for k, (t, v) in enumerate(zip(times, values, strict=True)):
        probe = None if allocated is None else AllocatorStats(allocated_bytes=allocated[k],
                                                               reserved_bytes=reserved[k])
        proc = ProcessSample(pid=4242, used_bytes=v, name="python3", start_time=T0 - 1.0, role="vllm",
                             allocator=probe)
        snap = Snapshot(timestamp=float(t), gpus=(GpuSample(index="0", uuid=uuid, total_bytes=TOTAL,
                                                            used_bytes=v, processes=(proc,)),))
        history.update(snap)
        leaks = [f for f in detector.detect(history, snap, (), config, 3600.0).findings if f.kind == "leak"]
        if leaks and not active:
            out.append((t - T0) / 60)
        active = bool(leaks)
    return out
