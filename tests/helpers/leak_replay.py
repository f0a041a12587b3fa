"""bench/leak_replay.py's replay of a bench/leak_corpus.py trace, read in minutes: what the leak
tests assert on, from the same replay the bench measures."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from leak_corpus import T0
from leak_replay import replay


def episodes(times, values, uuid="GPU-bench", allocated=None, reserved=None):
    """Minutes from the trace's start at which a leak finding was raised (each episode's start).
    Another GPU's UUID reads the same trace through minute buckets of another phase (the bench's
    is GPU-bench). With `allocated` and `reserved` (a probed trace's), the process carries the
    allocator probe's numbers too."""
    return [(t - T0) / 60 for t in replay(times, values, uuid, allocated, reserved).starts]
