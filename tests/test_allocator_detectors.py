"""The detectors that read the allocator probe (ProcessSample.allocator): leak attribution to a
component of the process's GPU memory, and live fragmentation from PyTorch's allocator retries
and inactive splits, before any OOM. Without probe data, the leak finding is what it was, plus
`component: unknown`.

Snapshots are hand-built (the timeline helpers of test_detectors) and replayed through the real
Analyzer, causally, as the daemon and `analyze` run it.
"""
from __future__ import annotations

import pytest

from exporter.analysis.engine import AnalysisConfig, Analyzer
from exporter.analysis.fragmentation import FragmentationConfig, counter_rise
from exporter.analysis.history import ALLOCATOR_SERIES, History
from exporter.model import AllocatorStats, HostMemory
from helpers.timeline import T0, GiB, MiB, gpu, snap, timeline, vllm_proc, vllm_server

COMPONENTS = ("torch_allocated", "torch_cached", "non_torch")
RATE_KEYS = tuple(f"{c}_growth_bytes_per_second" for c in COMPONENTS)


def stats(allocated, reserved, split=0, retries=0, **kw) -> AllocatorStats:
    return AllocatorStats(allocated_bytes=int(allocated), reserved_bytes=int(reserved),
                          inactive_split_bytes=int(split), alloc_retries=int(retries), ooms=0,
                          backend="native", **kw)


def replay(snapshots, config=None):
    analyzer = Analyzer(config, log_findings=False)
    results = [analyzer.update(s) for s in snapshots]
    return analyzer, results


def of_kind(analyzer, kind, pid=None):
    return [f for f in analyzer.all_findings if f.kind == kind and (pid is None or f.pid == pid)]


# ------------------------------------------------------------------ leak attribution

def server(growing, per_min=8 * MiB, probe=True, seconds=3600, step=15, pid=10):
    """A vLLM worker: start-up in 90 s to 25 GiB of tensors, 2 GiB of cache and 3 GiB outside
    PyTorch; from 600 s on, `growing` (a component, or None) grows `per_min`. Activations are
    allocated and freed within each minute (allocated up, cache down), so the components'
    medians move while their floors do not."""
    def make(e):
        f = min(1.0, (e + 10) / 90)
        leak = max(0.0, e - 600) / 60 * per_min
        act = 512 * MiB if e % 60 < 30 else 0
        allocated = 25 * GiB * f + act + (leak if growing == "torch_allocated" else 0)
        cached = 2 * GiB * f - act * f + (leak if growing == "torch_cached" else 0)
        non_torch = 3 * GiB * f + (leak if growing == "non_torch" else 0)
        reserved = allocated + cached
        used = reserved + non_torch
        on = probe(e) if callable(probe) else probe
        a = stats(allocated, reserved, split=64 * MiB) if on else None
        p = vllm_proc(pid, used, start=T0, allocator=a)
        return snap(T0 + e, [gpu([p])], host=HostMemory(512 * GiB, 400 * GiB),
                    vllm=[vllm_server(0, 0.5, util=0.9, pids=(pid,))])
    return timeline(seconds, step, make)


@pytest.mark.parametrize("component", COMPONENTS)
def test_a_leak_is_attributed_to_the_component_that_grows(component):
    analyzer, _ = replay(server(component))
    (f,) = of_kind(analyzer, "leak", 10)
    ev = dict(f.evidence)
    assert ev["component"] == component
    rates = {c: ev[f"{c}_growth_bytes_per_second"] for c in COMPONENTS}
    assert rates[component] == pytest.approx(8 * MiB / 60, rel=0.2)
    for other in set(COMPONENTS) - {component}:
        assert abs(rates[other]) < 0.1 * rates[component]
    # Nothing else is raised: the growth is no fragmentation by the allocator's numbers.
    assert {x.kind for x in analyzer.all_findings} == {"leak"}


def test_advice_follows_the_component():
    advice = {}
    for component in COMPONENTS:
        analyzer, _ = replay(server(component))
        (f,) = of_kind(analyzer, "leak", 10)
        advice[component] = " ".join(f.advice)
        assert "At this rate memory runs out" in advice[component]
    assert "_record_memory_history" in advice["torch_allocated"]
    assert "NCCL_CUMEM_ENABLE=0" not in advice["torch_allocated"]
    assert "fragmentation rather than a leak" in advice["torch_cached"]
    assert "expandable_segments:True" in advice["torch_cached"]
    assert "NCCL_CUMEM_ENABLE=0" in advice["non_torch"]
    assert "cudagraph_capture_sizes" in advice["non_torch"]
    assert "Upgrade" in advice["non_torch"]
    assert "expandable_segments" not in advice["non_torch"]


def test_without_probe_the_leak_finding_is_as_before_with_component_unknown():
    analyzer, _ = replay(server("non_torch", probe=False))
    (f,) = of_kind(analyzer, "leak", 10)
    keys = [k for k, _ in f.evidence]
    assert keys[-1] == "component" and dict(f.evidence)["component"] == "unknown"
    assert not set(keys) & set(RATE_KEYS)
    # The evidence, summary and advice a leak finding has without a probe, and only those.
    assert keys[:-1] == ["slope_bytes_per_second", "used_bytes", "total_bytes",
                         "time_to_full_seconds", "signal", "model", "window_seconds",
                         "slope_low_bytes_per_second", "slope_high_bytes_per_second", "z", "threshold_z",
                         "false_alarms_per_day", "growth_bytes", "points", "noise_bytes", "noise_inflation"]
    assert f.summary.startswith("VLLM::EngineCor (pid 10) GPU 0 memory grows ") \
        and "PyTorch" not in f.summary and "95 % interval" in f.summary
    assert [a.split(" ")[0] for a in f.advice] == ["Check", "If", "Upgrade", "At"]
    # The probe's parts are tested too: the finding comes no later, names the part, and the
    # budget is shared among the series tested (a higher threshold).
    probed, _ = replay(server("non_torch", probe=True))
    (g,) = of_kind(probed, "leak", 10)
    assert g.first_detected_at <= f.first_detected_at
    assert (g.gpu, g.pid) == (f.gpu, f.pid) and dict(g.evidence)["component"] == "non_torch"


def test_the_probe_finds_a_leak_under_the_cache_cycles_sooner():
    """NVML's figure carries the cache's sawtooth (torch reserved); the leak is outside torch,
    whose series is quiet: read as a part of its own, it is found sooner."""
    def server_cycles(probe):
        def make(e):
            f = min(1.0, (e + 10) / 90)
            cycle = (e % 420) / 420 * 1536 * MiB if e > 300 else 0.0  # 7-minute teeth of 1.5 GiB
            leak = max(0.0, e - 3600) / 60 * MiB  # 1 MiB/min outside torch from 1 h on
            allocated = 25 * GiB * f
            reserved = allocated + 2 * GiB * f + cycle
            used = reserved + 3 * GiB * f + leak
            a = stats(allocated, reserved) if probe else None
            return snap(T0 + e, [gpu([vllm_proc(10, used, start=T0, allocator=a)])],
                        host=HostMemory(512 * GiB, 400 * GiB), vllm=[vllm_server(0, 0.5, util=0.9, pids=(10,))])
        return timeline(3 * 3600, 15, make)
    found = {}
    for probe in (False, True):
        analyzer, _ = replay(server_cycles(probe))
        leaks = of_kind(analyzer, "leak", 10)
        found[probe] = min((x.first_detected_at for x in leaks), default=None)
    assert found[True] is not None and found[True] >= T0 + 3600
    assert found[False] is None or found[True] < found[False], found


def test_a_host_rss_leak_carries_component_unknown():
    def make(e):
        rss = 6 * GiB + max(0, e - 600) / 60 * 16 * MiB
        p = vllm_proc(10, 30 * GiB, start=T0 - 600, host_rss_bytes=int(rss),
                      allocator=stats(25 * GiB, 27 * GiB))
        return snap(T0 + e, [gpu([p])], host=HostMemory(512 * GiB, 400 * GiB))
    analyzer, _ = replay(timeline(3600, 15, make))
    (f,) = of_kind(analyzer, "leak", 10)
    assert f.gpu is None and dict(f.evidence)["component"] == "unknown"


def test_a_probe_without_history_over_the_window_is_unknown():
    """NVML's figure grows, but the probe only started reporting a minute ago: no rates."""
    analyzer, _ = replay(server("non_torch", probe=lambda e: e >= 3540))
    (f,) = of_kind(analyzer, "leak", 10)
    ev = dict(f.evidence)
    assert ev["component"] == "unknown" and not set(ev) & set(RATE_KEYS)
    assert f.advice[0].startswith("Check CUDA graph")  # the advice without a probe


# ------------------------------------------------------------------ fragmentation: retries

def retrying_server(retries_at, seconds=2400, step=15, start=T0 - 3600, split=256 * MiB,
                    **kw):
    """A steady vLLM worker (60 GiB reserved, 58 GiB allocated) whose allocator's retry
    counter is retries_at(elapsed)."""
    def make(e):
        a = stats(58 * GiB, 60 * GiB, split=split, retries=retries_at(e), **kw)
        p = vllm_proc(10, 61 * GiB, start=start(e) if callable(start) else start, allocator=a)
        return snap(T0 + e, [gpu([p])])
    return timeline(seconds, step, make)


def test_climbing_retries_raise_a_fragmentation_finding_before_any_oom():
    # Quiet for 20 min, then one retry a minute.
    analyzer, results = replay(retrying_server(lambda e: max(0, (e - 1200) // 60)))
    (f,) = of_kind(analyzer, "fragmentation", 10)
    assert f.gpu == "0" and f.uuid == "GPU-0" and f.severity == "warning"
    # Raised at the third retry (three in the window, at three separate samples).
    assert T0 + 1200 + 180 <= f.first_detected_at <= T0 + 1200 + 180 + 15
    assert not any(r.oom_events for r in results)
    assert not of_kind(analyzer, "oom")
    first = next(x for r in results for x in r.findings if x.kind == "fragmentation")
    ev = dict(first.evidence)
    assert ev["alloc_retries_in_window"] == 3 and ev["alloc_retries_total"] == 3
    assert ev["reserved_bytes"] == 60 * GiB and ev["allocated_bytes"] == 58 * GiB
    assert ev["reserved_unallocated_bytes"] == 2 * GiB
    assert ev["inactive_split_bytes"] == 256 * MiB == ev["recoverable_bytes"]
    assert ev["inactive_split_share"] == pytest.approx(256 / (60 * 1024), abs=1e-4)
    assert ev["allocator_ooms_total"] == 0
    assert "retried 3 times in 5 min" in first.summary
    assert dict(f.evidence)["alloc_retries_in_window"] == 5  # the latest: one a minute
    assert "expandable_segments:True" in f.advice[0] and "256.00 MiB" in f.advice[0]
    assert "max_split_size_mb" in f.advice[0]  # and when to use that instead
    assert any("synchronises the GPU" in a for a in f.advice)
    # Still climbing at the end: the finding is active.
    assert any(x.kind == "fragmentation" and x.pid == 10 for x in results[-1].findings)


def test_retries_that_stop_clear_once_the_window_passes():
    analyzer, results = replay(retrying_server(lambda e: min(6, max(0, (e - 600) // 60))))
    assert of_kind(analyzer, "fragmentation", 10)
    assert not any(x.kind == "fragmentation" for x in results[-1].findings)


def test_a_flat_retry_counter_is_no_finding():
    # Retries happened before the exporter looked (a high counter), none since.
    analyzer, _ = replay(retrying_server(lambda e: 40))
    assert of_kind(analyzer, "fragmentation") == []


def test_a_single_burst_of_retries_is_no_trend():
    analyzer, _ = replay(retrying_server(lambda e: 0 if e < 1200 else 10))
    assert of_kind(analyzer, "fragmentation") == []


def test_a_counter_reset_is_not_a_rise():
    # The process restarts under the same PID at 1200 s: a new start time, its counter from 0.
    def start(e):
        return T0 - 3600 if e < 1200 else T0 + 1200
    analyzer, _ = replay(retrying_server(lambda e: 50 if e < 1200 else 0, start=start))
    assert of_kind(analyzer, "fragmentation") == []
    # Without start times (same series key), a drop is a reset too, and the value after it a
    # new baseline: 50, then 2 from the restart on, is no rise.
    analyzer, _ = replay(retrying_server(lambda e: 50 if e < 1200 else 2, start=None))
    assert of_kind(analyzer, "fragmentation") == []
    assert counter_rise((50.0, 2.0, 2.0, 3.0, 5.0)) == (3.0, 2)


# ------------------------------------------------------------------ fragmentation: inactive splits

def split_server(split_at, reserved=20 * GiB, seconds=1800, step=15, **kw):
    def make(e):
        split = split_at(e)
        a = stats(reserved - split - GiB, reserved, split=split, **kw)
        p = vllm_proc(10, reserved + 2 * GiB, start=T0 - 3600, allocator=a)
        return snap(T0 + e, [gpu([p])])
    return timeline(seconds, step, make)


def test_sustained_inactive_splits_are_fragmentation_with_what_it_would_recover():
    # 6 GiB of 20 GiB reserved (30 %) in inactive splits from 600 s on.
    analyzer, results = replay(split_server(lambda e: 6 * GiB if e >= 600 else 256 * MiB))
    (f,) = of_kind(analyzer, "fragmentation", 10)
    assert T0 + 900 <= f.first_detected_at <= T0 + 900 + 15  # after 5 min sustained
    ev = dict(f.evidence)
    assert ev["alloc_retries_in_window"] == 0
    assert ev["inactive_split_bytes"] == ev["recoverable_bytes"] == 6 * GiB
    assert ev["inactive_split_share"] == pytest.approx(0.3)
    assert ev["reserved_unallocated_bytes"] == 7 * GiB
    assert "6.00 GiB of its 20.00 GiB reserved" in f.summary
    assert "give back up to 6.00 GiB" in f.advice[0]
    assert any(x.kind == "fragmentation" for x in results[-1].findings)


def test_inactive_splits_short_lived_small_or_a_small_share_are_no_finding():
    # Splits that come and go within a few minutes.
    analyzer, _ = replay(split_server(lambda e: 6 * GiB if (e // 180) % 2 else 0))
    assert of_kind(analyzer, "fragmentation") == []
    # 40 % of a small process: below the 1 GiB floor.
    analyzer, _ = replay(split_server(lambda e: 800 * MiB, reserved=2 * GiB))
    assert of_kind(analyzer, "fragmentation") == []
    # 3 GiB of 72 GiB: a small share of a large server.
    analyzer, _ = replay(split_server(lambda e: 3 * GiB, reserved=72 * GiB))
    assert of_kind(analyzer, "fragmentation") == []


def test_thresholds_are_configurable():
    cfg = AnalysisConfig(detectors={"fragmentation": FragmentationConfig(
        inactive_split_share=0.02, inactive_split_sustain_seconds=120)})
    analyzer, _ = replay(split_server(lambda e: 3 * GiB, reserved=72 * GiB), cfg)
    assert of_kind(analyzer, "fragmentation", 10)
    cfg = AnalysisConfig(detectors={"fragmentation": FragmentationConfig(alloc_retries_min=20)})
    analyzer, _ = replay(retrying_server(lambda e: max(0, (e - 1200) // 60)), cfg)
    assert of_kind(analyzer, "fragmentation") == []
    with pytest.raises(ValueError):
        FragmentationConfig(alloc_retries_min=0)
    with pytest.raises(ValueError, match="inactive_split_sustain_seconds"):
        AnalysisConfig(history_raw_seconds=1000, detectors={"fragmentation": FragmentationConfig(
            inactive_split_sustain_seconds=1200)})


def test_the_knob_depends_on_the_allocator_in_use():
    def advice(**kw):
        analyzer, _ = replay(retrying_server(lambda e: max(0, (e - 1200) // 60), seconds=1800,
                                             **kw))
        (f,) = of_kind(analyzer, "fragmentation", 10)
        return f.advice[0]
    assert advice().startswith("Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    # vLLM sleep mode's pool refuses expandable segments: max_split_size_mb.
    sleep = advice(cumem_bytes=40 * GiB)
    assert "max_split_size_mb:512" in sleep and "cannot use expandable segments" in sleep
    assert "expandable_segments is already on" in advice(
        alloc_conf=(("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),))


# ------------------------------------------------------------------ history

def test_history_keeps_allocator_series_bounded_and_per_process():
    h = History(raw_seconds=600, retention_seconds=1800, dead_grace_seconds=120)
    for i in range(400):  # one sample every 5 s for 2000 s
        t = T0 + 5 * i
        procs = [vllm_proc(10, 30 * GiB, start=T0,
                           allocator=stats(20 * GiB + i * MiB, 25 * GiB, split=GiB, retries=i))]
        if i < 100:
            procs.append(vllm_proc(11, 10 * GiB, start=T0, allocator=stats(GiB, 2 * GiB)))
        h.update(snap(t, [gpu(procs)]))
    ident = (10, T0)
    now = T0 + 5 * 399
    # Components: a tier (one point a minute, retention bound), no raw history.
    tier = h.process_allocator("torch_allocated", "GPU-0", ident)
    assert 1800 / 60 - 2 <= len(tier) <= 1800 / 60 + 1
    assert len(h.process_allocator("torch_allocated", "GPU-0", ident, since=0)) == 1
    assert h.process_allocator("non_torch", "GPU-0", ident, since=0).values == (5 * GiB,)
    # Retries and splits: raw points for raw_seconds.
    raw = h.process_allocator("alloc_retries", "GPU-0", ident, since=0)
    assert raw.times[0] >= now - 600 and raw.values[-1] == 399
    assert len(h.process_allocator("alloc_retries", "GPU-0", ident, since=now - 60)) == 13
    # The process gone for longer than dead_grace_seconds: all its series dropped.
    assert all(len(h.process_allocator(n, "GPU-0", (11, T0))) == 0 for n in ALLOCATOR_SERIES)
    # The GPU's used and unowned series, the live process's memory series and its allocator series.
    assert h.series_count() == 2 + 1 + len(ALLOCATOR_SERIES)
    with pytest.raises(ValueError):
        h.process_allocator("bogus", "GPU-0", ident)


def test_non_torch_while_vllm_sleeps_counts_the_released_pool():
    """Asleep, vLLM's pool (cumem, inside reserved) has no physical memory: NVML's figure is
    below reserved and outside-PyTorch memory is used - (reserved - cumem) (docs/probe.md)."""
    h = History()
    # The allocator's numbers are the same awake and asleep: PyTorch does not see the release.
    awake = asleep = stats(50 * GiB, 60 * GiB, cumem_bytes=55 * GiB)
    h.update(snap(T0, [gpu([vllm_proc(10, 63 * GiB, start=T0, allocator=awake)])]))
    h.update(snap(T0 + 5, [gpu([vllm_proc(10, 8 * GiB, start=T0, allocator=asleep)])]))
    raw = h.process_allocator("non_torch", "GPU-0", (10, T0), since=T0 + 5)
    assert raw.values == (3 * GiB,)  # 8 - (60 - 55): the same 3 GiB as awake
    # NVML below even that (read at another moment): no figure rather than a wrong one.
    h.update(snap(T0 + 10, [gpu([vllm_proc(10, 4 * GiB, start=T0, allocator=asleep)])]))
    assert h.process_allocator("non_torch", "GPU-0", (10, T0), since=T0 + 10).times == (T0 + 5,)
