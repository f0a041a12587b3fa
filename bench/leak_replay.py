"""One trace of bench/leak_corpus.py replayed through History and LeakDetector.detect tick by tick,
as the daemon runs them: the one replay both bench/leak_quality.py and the leak tests
(tests/helpers/leak_replay.py) read their verdicts from.

The `exporter` imported is whichever is first on the path: the bench's workers put the tree
they measure there."""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from leak_corpus import T0, TOTAL

PID = 4242


@dataclass
class Replayed:
    starts: list[float] = field(default_factory=list)  # Unix seconds each leak-finding episode began
    first: list[Any] = field(default_factory=list)  # the finding that began each episode
    cpu_seconds: float = 0.0  # History.update + LeakDetector.detect, this thread's CPU
    ticks: int = 0


def replay(times: Sequence[float], values: Sequence[int], uuid: str = "GPU-bench",
           allocated: Sequence[int] | None = None, reserved: Sequence[int] | None = None) -> Replayed:
    """The episodes of leak findings on one process, pid PID, alone on GPU `uuid`. History's minute
    buckets begin at an offset drawn from the series' key: another UUID reads the same samples
    through buckets of another phase. With `allocated` and `reserved` (a probed trace's), the
    process carries the allocator probe's numbers too."""
    from exporter.analysis.history import History
    from exporter.analysis.leak import LeakConfig
    from exporter.analysis.leak_detector import LeakDetector
    from exporter.model import AllocatorStats, GpuSample, ProcessSample, Snapshot

    history, detector, config = History(), LeakDetector(), LeakConfig()
    out = Replayed(ticks=len(times))
    active = False
    for k, (t, v) in enumerate(zip(times, values, strict=True)):
        probe = None
        if allocated is not None and reserved is not None:
            probe = AllocatorStats(allocated_bytes=allocated[k], reserved_bytes=reserved[k])
        proc = ProcessSample(pid=PID, used_bytes=v, name="python3", start_time=T0 - 1.0, role="vllm",
                             allocator=probe)
        snap = Snapshot(timestamp=float(t), gpus=(GpuSample(index="0", uuid=uuid, total_bytes=TOTAL,
                                                            used_bytes=v, processes=(proc,)),))
        started = time.thread_time()
        history.update(snap)
        result = detector.detect(history, snap, (), config, 3600.0)
        out.cpu_seconds += time.thread_time() - started
        leaks = [f for f in result.findings if f.kind == "leak" and f.gpu is not None]
        if leaks and not active:
            out.starts.append(float(t))
            out.first.append(leaks[0])
        active = bool(leaks)
    return out
