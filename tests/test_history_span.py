"""History.process_allocator_span against the view it sums up (process_allocator with since):
the same first and last times and least value, and `flat` only when every value is alike,
through thinning (sampling faster than max_raw_samples allows), trimming, compaction and
out-of-order samples. `flat` may be False for alike values (it is conservative), never True for
values that differ."""
import random

import pytest

from exporter.analysis.history import History
from exporter.model import AllocatorStats, GpuSample, ProcessSample, Snapshot

T0 = 1_700_000_000.0
IDENTITY = (10, T0 - 100)


def snap(t: float, retries: int, split: int) -> Snapshot:
    p = ProcessSample(pid=10, used_bytes=10_000, start_time=T0 - 100, name="python3",
                      allocator=AllocatorStats(allocated_bytes=4000, reserved_bytes=6000,
                                               inactive_split_bytes=split, alloc_retries=retries))
    return Snapshot(timestamp=t, gpus=(GpuSample(index="0", uuid="GPU-a", processes=(p,)),))


@pytest.mark.parametrize("seed", range(12))
def test_span_matches_the_view(seed: int) -> None:
    rng = random.Random(seed)
    h = History(raw_seconds=600, max_raw_samples=rng.choice((8, 64, 4096)))
    t, retries, split = T0, 0, 1000
    flats = 0
    for _ in range(400):
        t += rng.choice((0.5, 1, 5, 5, 5, 30, -3))  # a step back is dropped by History
        if rng.random() < 0.05:
            retries += rng.choice((1, 2)) if rng.random() < 0.8 else -retries  # rises, resets
        if rng.random() < 0.1:
            split = rng.choice((1000, 2000, 500))
        h.update(snap(t, retries, split))
        for name in ("alloc_retries", "inactive_split"):
            since = t - rng.choice((0, 10, 60, 300, 900))
            view = h.process_allocator(name, "GPU-a", IDENTITY, since=since)
            span = h.process_allocator_span(name, "GPU-a", IDENTITY, since)
            assert span is not None and view.times
            assert (span.first_time, span.last_time, span.low) == \
                (view.times[0], view.times[-1], min(view.values))
            if span.flat:
                assert len(set(view.values)) == 1
                flats += 1
    assert flats > 50  # the shortcut was taken


def test_span_of_unknown_series() -> None:
    h = History()
    assert h.process_allocator_span("alloc_retries", "GPU-a", IDENTITY, T0) is None
    with pytest.raises(ValueError):
        h.process_allocator_span("mem", "GPU-a", IDENTITY, T0)
