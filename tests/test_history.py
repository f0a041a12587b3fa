import itertools

import pytest

from exporter.analysis.history import History, SeriesView
from exporter.model import GpuSample, ProcessSample, Snapshot

T0 = 1_700_000_000.0
MiB = 1024 * 1024


def snap(t, procs=(), uuid="GPU-a", used=None, extra_gpus=()):
    gpu = GpuSample(index="0", uuid=uuid, total_bytes=80 * 1024 * MiB, used_bytes=used,
                    processes=tuple(procs))
    return Snapshot(timestamp=t, gpus=(gpu,) + tuple(extra_gpus))


def proc(pid=10, used=1000, start=T0 - 100, name="python3", rss=None):
    return ProcessSample(pid=pid, used_bytes=used, start_time=start, name=name, host_rss_bytes=rss)


def test_bucket_tier_holds_medians_and_minima():
    h = History(bucket_seconds=60)
    values = []
    for k in range(12 * 6 + 1):  # six full minutes at 5 s, plus one sample to close the last
        v = 1000 + k
        if k % 12 == 5:
            v += 10_000  # one spike per bucket: the median ignores it
        values.append(v)
        h.update(snap(T0 + 5 * k, [proc(used=v)]))
    view = h.process_memory("GPU-a", (10, T0 - 100))
    assert len(view) >= 5
    for t, med, lo in zip(view.times, view.values, view.lows, strict=True):
        in_bucket = [v for k, v in enumerate(values) if abs(T0 + 5 * k - t) < 30]
        assert lo == min(in_bucket)
        assert med < 2000  # spike removed
    assert list(view.times) == sorted(view.times)


def test_tier_view_is_reused_until_a_bucket_closes():
    h = History(bucket_seconds=60)
    seen = set()
    for k in range(200):
        h.update(snap(T0 + 5 * k, [proc(used=k)]))
        seen.add(id(h.process_memory("GPU-a", (10, T0 - 100))))
    # a new view object at most once per bucket (plus the first), not once per tick
    assert len(seen) <= 200 * 5 / 60 + 2


def test_raw_and_retention_windows_are_bounded():
    h = History(raw_seconds=300, retention_seconds=1800, bucket_seconds=60)
    for k in range(12 * 120):  # two hours
        h.update(snap(T0 + 5 * k, [proc(used=k)], used=k))
    raw = h.process_memory("GPU-a", (10, T0 - 100), raw=True)
    tier = h.process_memory("GPU-a", (10, T0 - 100))
    assert raw.times[-1] - raw.times[0] <= 300
    assert len(raw) == 61
    assert tier.times[-1] - tier.times[0] <= 1800
    assert 25 <= len(tier) <= 31
    assert len(h.gpu_used("GPU-a")) == len(tier)
    assert h.point_count() < 3 * (61 + 31)
    recent = h.recent(T0 + 5 * (12 * 120 - 1) - 100)
    assert [s.timestamp for s in recent] == [T0 + 5 * k for k in range(12 * 120 - 21, 12 * 120)]
    assert len(h.recent(0)) == 61  # snapshots kept for raw_seconds only


def test_pid_reuse_does_not_inherit_history():
    h = History(bucket_seconds=60)
    for k in range(120):
        h.update(snap(T0 + 5 * k, [proc(pid=7, start=T0 - 50, used=5000 + k)]))
    # PID 7 exits; a new process gets PID 7
    for k in range(120, 240):
        h.update(snap(T0 + 5 * k, [proc(pid=7, start=T0 + 600, used=10)]))
    old = h.process_memory("GPU-a", (7, T0 - 50))
    new = h.process_memory("GPU-a", (7, T0 + 600))
    assert all(v >= 5000 for v in old.values)
    assert all(v == 10 for v in new.values)
    assert new.times[0] > old.times[-1]
    assert h.process_memory("GPU-a", (7, T0 + 600), raw=True).times[0] == T0 + 5 * 120
    assert h.process_memory("GPU-a", (7, T0 - 50), raw=True).times[0] == T0


def test_pid_reuse_without_start_time_is_told_apart_by_name():
    h = History(bucket_seconds=60)
    for k in range(60):
        h.update(snap(T0 + 5 * k, [proc(pid=9, start=None, name="old", used=5000)]))
    for k in range(60, 120):
        h.update(snap(T0 + 5 * k, [proc(pid=9, start=None, name="new", used=10)]))
    view = h.process_memory("GPU-a", (9, None), raw=True)
    assert set(view.values) == {10}
    assert view.times[0] == T0 + 5 * 60


def test_series_of_dead_processes_are_dropped_and_churn_is_bounded():
    h = History(dead_grace_seconds=600, bucket_seconds=60)
    # 10,000 processes, each alive for 30 s, one starting every 5 s (about 14 hours)
    peak = 0
    for k in range(10_000):
        t = T0 + 5 * k
        alive = [proc(pid=100_000 + i, start=T0 + 5 * i, used=i, rss=i)
                 for i in range(max(0, k - 5), k + 1)]
        h.update(snap(t, alive, used=1))
        peak = max(peak, h.series_count())
    # per kind (memory, rss): 6 live + 120 dead within the 600 s grace + 12 more between two
    # sweeps (one per 60 s bucket); plus the GPU's own series
    assert peak <= 2 * (6 + 120 + 12) + 1
    assert h.series_count() <= 2 * (6 + 120 + 12) + 1
    assert h.point_count() < 100_000


def test_max_series_caps_memory_even_within_the_grace_period():
    h = History(dead_grace_seconds=10**6, max_series=50)
    for k in range(2000):
        h.update(snap(T0 + 5 * k, [proc(pid=k, start=T0 + k, used=1)]))
        assert h.series_count() <= 50
    # the newest survive
    assert len(h.process_memory("GPU-a", (1999, T0 + 1999), raw=True)) == 1
    assert len(h.process_memory("GPU-a", (0, T0), raw=True)) == 0


def test_rss_recorded_once_for_a_process_on_two_gpus_and_none_values_skipped():
    h = History()
    for k in range(3):
        p = proc(pid=5, used=None, rss=4096 + k)
        other = GpuSample(index="1", uuid="GPU-b", used_bytes=None, processes=(proc(pid=5, used=7, rss=4096 + k),))
        h.update(snap(T0 + 5 * k, [p], extra_gpus=[other]))
    assert h.process_rss((5, T0 - 100), raw=True).values == (4096.0, 4097.0, 4098.0)
    assert len(h.process_memory("GPU-a", (5, T0 - 100), raw=True)) == 0  # used_bytes None
    assert len(h.process_memory("GPU-b", (5, T0 - 100), raw=True)) == 3
    assert len(h.gpu_used("GPU-b", raw=True)) == 0


def test_out_of_order_snapshots_are_ignored():
    h = History()
    h.update(snap(T0 + 10, [proc(used=1)]))
    h.update(snap(T0 + 5, [proc(used=2)]))
    h.update(snap(T0 + 10, [proc(used=3)]))
    assert h.process_memory("GPU-a", (10, T0 - 100), raw=True).values == (1.0,)
    assert h.dropped_out_of_order == 2


def test_unknown_series_and_bad_arguments():
    h = History()
    assert h.process_memory("nope", (1, None)) == SeriesView((), ())
    assert h.process_memory("nope", (1, None), raw=True) == SeriesView((), ())
    assert h.recent(0) == []
    with pytest.raises(ValueError):
        History(raw_seconds=0)
    with pytest.raises(ValueError):
        History(max_series=0)
    with pytest.raises(ValueError):
        History(max_raw_samples=1)


def test_fast_sampling_is_bounded_by_samples_not_only_by_seconds():
    """At 0.2 s a raw window of 3600 s would hold 18,000 snapshots per series; with
    max_raw_samples 400 it holds about 400, still spanning the whole window, the newest kept,
    and no snapshot with a log event thinned away."""
    from exporter.model import OomEvent
    h = History(raw_seconds=3600, max_raw_samples=400)
    event = OomEvent(kind="torch_cuda_oom", klass="shortage", line=1)
    n = 2 * 18_000  # two hours at 0.2 s
    for k in range(n):
        t = T0 + 0.2 * k
        events = (event,) if k % 5000 == 0 else ()
        h.update(Snapshot(timestamp=t, gpus=snap(t, [proc(used=k)], used=k).gpus, log_events=events))
    last = T0 + 0.2 * (n - 1)
    raw = h.process_memory("GPU-a", (10, T0 - 100), raw=True)
    frames = h.recent(0)
    assert len(raw) <= 400 + 2 and len(frames) <= 400 + 2 + 4  # + the snapshots with events
    assert raw.times[-1] == last and frames[-1].timestamp == last  # the newest is always kept
    assert raw.times[0] - (last - 3600) < 10 and frames[0].timestamp - (last - 3600) < 10
    gaps = [b - a for a, b in itertools.pairwise(raw.times[:-1])]
    assert min(gaps) >= 3600 / 400
    kept_events = [f.timestamp for f in frames if f.log_events]
    assert kept_events == [T0 + 0.2 * k for k in range(0, n, 5000) if T0 + 0.2 * k >= last - 3600]
    tier = h.process_memory("GPU-a", (10, T0 - 100))
    assert tier.times[-1] > last - 120 and tier.values[-1] > n - 1 - 600  # medians keep up


def test_sampling_slower_than_the_bound_keeps_every_sample():
    h = History(raw_seconds=3600, max_raw_samples=4096)
    for k in range(800):
        h.update(snap(T0 + 5 * k, [proc(used=k)]))
    assert len(h.recent(0)) == 721 and len(h.process_memory("GPU-a", (10, T0 - 100), raw=True)) == 721
