"""Renders the last published State as Prometheus metric families at scrape time.

A custom collector, not global metric objects: the series of a process that exited simply are
not yielded any more, so they disappear from the next scrape. Every family is created from its
declaration in the catalogue (exporter/catalogue/families.py): its name, help and labels are
written there and nowhere else. This module decides only the series and their values.
"""
from __future__ import annotations

import platform
from collections.abc import Callable, Iterable, Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector, CollectorRegistry

from .. import __version__
from ..catalogue import families as m
from ..catalogue.family import Family
from ..model import (
    BUDGETS,
    AllocHistoryStats,
    Analysis,
    ListenerStats,
    ProcessSample,
    RecorderStats,
    ReloadStats,
    Snapshot,
    State,
)
from .admission import LIMITS as LISTENER_LIMITS


class StateCollector(Collector):
    def __init__(self, get_state: Callable[[], State], now: Callable[[], float],
                 listeners: Callable[[], Iterable[ListenerStats]] = tuple):
        self.get_state = get_state
        self.now = now
        self.listeners = listeners  # the HTTP listeners' budgets, read live (not part of a tick)

    def collect(self) -> Iterable[Metric]:
        # Families with no series (no vLLM endpoint configured, say) are left out entirely.
        return (_printable(family) for family in self._families() if family.samples)

    def _families(self) -> Iterable[Metric]:
        state = self.get_state()
        yield from self._self_metrics(state)
        yield from self._listeners(tuple(self.listeners()))
        if state.reload is not None:
            yield from self._reload(state.reload)
        snap = state.snapshot
        if snap is None:
            return
        yield from self._gpus(snap)
        yield from self._processes(snap)
        yield from self._host(snap)
        yield from self._vllm(state)
        yield from self._oom_events(state)
        if state.analysis is not None:
            yield from self._analysis(state.analysis)
        if state.recorder is not None:
            yield from self._recorder(state.recorder)
        if state.alloc_history is not None:
            yield from self._alloc_history(state.alloc_history)

    # -- exporter health ------------------------------------------------------------------
    def _self_metrics(self, state: State) -> Iterator[Metric]:
        info = m.EXPORTER_BUILD_INFO.new()
        info.add_metric([__version__, platform.python_version(),
                         state.snapshot.driver_version if state.snapshot else ""], 1)
        yield info
        up = m.EXPORTER_SOURCE_UP.new()
        dur = m.EXPORTER_SOURCE_DURATION_SECONDS.new()
        for s in state.snapshot.sources if state.snapshot is not None else ():
            up.add_metric([s.source], 1 if s.up else 0)
            dur.add_metric([s.source], s.duration_seconds)
        yield up
        yield dur
        if state.snapshot is not None:
            yield m.EXPORTER_SAMPLE_DURATION_SECONDS.of(state.sample_duration_seconds)
        errors = m.EXPORTER_ERRORS_TOTAL.new()
        for (source, kind), n in sorted(state.errors_total.items()):
            errors.add_metric([source, kind], n)
        yield errors
        dropped = m.EXPORTER_BUDGET_DROPPED_TOTAL.new()
        for budget in BUDGETS:  # every budget from the start, so rate() sees the first drop
            dropped.add_metric([budget], state.budget_dropped_total.get(budget, 0))
        yield dropped
        yield m.EXPORTER_SAMPLES_TOTAL.of(state.samples_total)
        if state.last_sample_at is not None:
            yield m.EXPORTER_LAST_SAMPLE_TIMESTAMP_SECONDS.of(state.last_sample_at)
            yield m.EXPORTER_SAMPLE_AGE_SECONDS.of(max(0.0, self.now() - state.last_sample_at))

    # -- GPUs and processes ---------------------------------------------------------------
    def _gpus(self, snap: Snapshot) -> Iterator[Metric]:
        info = m.GPU_INFO.new()
        up = m.GPU_UP.new()
        fams = {f: family.new() for f, family in (
            ("total", m.GPU_MEMORY_TOTAL_BYTES), ("used", m.GPU_MEMORY_USED_BYTES),
            ("free", m.GPU_MEMORY_FREE_BYTES), ("reserved", m.GPU_MEMORY_RESERVED_BYTES))}
        for g in snap.gpus:
            labels = [g.index, g.uuid]
            info.add_metric([g.index, g.uuid, g.name, str(g.unified).lower(), str(g.mig).lower()], 1)
            up.add_metric(labels, 1 if g.up else 0)
            for f, fam in fams.items():
                value = getattr(g, f"{f}_bytes")
                if value is not None:
                    fam.add_metric(labels, value)
        yield info
        yield up
        yield from fams.values()

    def _processes(self, snap: Snapshot) -> Iterator[Metric]:
        used = m.PROCESS_MEMORY_USED_BYTES.new()
        rss = m.PROCESS_HOST_RSS_BYTES.new()
        seen_rss: set[int] = set()
        for g in snap.gpus:
            for p in g.processes:
                if p.used_bytes is not None:
                    used.add_metric([g.index, g.uuid, str(p.pid), p.name, p.role, p.container,
                                     p.pod, p.namespace], p.used_bytes)
                if p.host_rss_bytes is not None and p.pid not in seen_rss:
                    seen_rss.add(p.pid)
                    rss.add_metric([str(p.pid), p.name, p.role, p.container, p.pod, p.namespace],
                                   p.host_rss_bytes)
        # A server on no GPU (vLLM's CPU backend): its own processes; on unified memory (or with no
        # GPU), the host's largest, whichever they are: any of them eats the memory the model runs in.
        for p in (*(p for v in snap.vllm for p in v.processes), *snap.host_processes):
            if p.host_rss_bytes is not None and p.pid not in seen_rss:
                seen_rss.add(p.pid)
                rss.add_metric([str(p.pid), p.name, p.role, p.container, p.pod, p.namespace], p.host_rss_bytes)
        yield used
        yield rss
        yield from self._allocator(snap)

    def _allocator(self, snap: Snapshot) -> Iterator[Metric]:
        """PyTorch's allocator in each probed process (docs/probe.md); a process without a
        probe, or a number its torch does not report, has no series (never a zero)."""
        fams: list[tuple[GaugeMetricFamily | CounterMetricFamily, Callable[[ProcessSample], int | None]]] = [
            (m.PROCESS_TORCH_ALLOCATED_BYTES.new(), lambda p: p.allocator.allocated_bytes if p.allocator else None),
            (m.PROCESS_TORCH_RESERVED_BYTES.new(), lambda p: p.allocator.reserved_bytes if p.allocator else None),
            (m.PROCESS_TORCH_INACTIVE_SPLIT_BYTES.new(),
             lambda p: p.allocator.inactive_split_bytes if p.allocator else None),
            (m.PROCESS_NON_TORCH_BYTES.new(), lambda p: p.non_torch_bytes),
            (m.PROCESS_ALLOC_RETRIES_TOTAL.new(), lambda p: p.allocator.alloc_retries if p.allocator else None),
            (m.PROCESS_TORCH_OOMS_TOTAL.new(), lambda p: p.allocator.ooms if p.allocator else None),
        ]
        for g in snap.gpus:
            for p in g.processes:
                if p.allocator is None:
                    continue
                labels = [g.index, g.uuid, str(p.pid), p.name, p.role, p.container, p.pod, p.namespace]
                for fam, value_of in fams:
                    value = value_of(p)
                    if value is not None:
                        fam.add_metric(labels, value)
        for fam, _ in fams:
            yield fam

    def _host(self, snap: Snapshot) -> Iterator[Metric]:
        h = snap.host
        if h is None:
            return
        yield m.HOST_MEMORY_TOTAL_BYTES.of(h.total_bytes)
        yield m.HOST_MEMORY_AVAILABLE_BYTES.of(h.available_bytes)
        if h.psi_some_avg10 is not None:
            yield m.HOST_MEMORY_PRESSURE_SOME_RATIO.of(h.psi_some_avg10 / 100.0)
        if h.oom_kills is not None:
            yield m.HOST_OOM_KILLS_TOTAL.of(h.oom_kills)

    # -- vLLM -----------------------------------------------------------------------------
    def _vllm(self, state: State) -> Iterator[Metric]:
        up = m.VLLM_UP.new()
        dur = m.VLLM_SCRAPE_DURATION_SECONDS.new()
        age = m.VLLM_PAGE_AGE_SECONDS.new()
        kv = m.VLLM_KV_CACHE_USAGE_RATIO.new()
        running = m.VLLM_REQUESTS_RUNNING.new()
        waiting = m.VLLM_REQUESTS_WAITING.new()
        counters = {
            "preemptions_total": m.VLLM_PREEMPTIONS_TOTAL.new(),
            "prefix_cache_queries_total": m.VLLM_PREFIX_CACHE_QUERIES_TOTAL.new(),
            "prefix_cache_hits_total": m.VLLM_PREFIX_CACHE_HITS_TOTAL.new(),
            "request_preemptions_total": m.VLLM_REQUEST_PREEMPTIONS_TOTAL.new(),
            "requests_finished_total": m.VLLM_REQUESTS_FINISHED_TOTAL.new(),
        }
        by_reason = m.VLLM_REQUESTS_WAITING_BY_REASON.new()
        rejections = m.VLLM_ADMISSION_REJECTIONS_TOTAL.new()
        budget = m.VLLM_MEMORY_BUDGET_BYTES.new()
        budget_used = m.VLLM_MEMORY_USED_BYTES.new()
        for b in state.analysis.budgets if state.analysis is not None else ():
            if b.budget_bytes is not None:
                budget.add_metric([b.endpoint, b.gpu, b.uuid], b.budget_bytes)
            if b.used_bytes is not None:  # None: NVML gave no per-process figure
                budget_used.add_metric([b.endpoint, b.gpu, b.uuid], b.used_bytes)
        profile = m.VLLM_MEMORY_PROFILE_BYTES.new()
        cfg = m.VLLM_CACHE_CONFIG_INFO.new()
        for v in state.snapshot.vllm if state.snapshot is not None else ():
            up.add_metric([v.endpoint], 1 if v.up else 0)
            dur.add_metric([v.endpoint], v.scrape_duration_seconds)
            age.add_metric([v.endpoint], v.page_age_seconds)
            for e in v.engines:
                labels = [v.endpoint, e.model, e.engine]
                for fam, value in ((kv, e.kv_cache_usage_ratio), (running, e.requests_running),
                                   (waiting, e.requests_waiting)):
                    if value is not None:
                        fam.add_metric(labels, value)
                for attr, counter in counters.items():
                    value = getattr(e, attr)
                    if value is not None:
                        counter.add_metric(labels, value)
                for reason, n in e.requests_waiting_by_reason:
                    by_reason.add_metric([*labels, reason], n)
            for model, reason, n in v.admission_rejections:
                rejections.add_metric([v.endpoint, model, reason], n)
            for component, value in v.memory_profile:
                profile.add_metric([v.endpoint, component], value)
            c = v.cache_config
            if c is not None:
                cfg.add_metric([v.endpoint, _str(c.block_size), c.cache_dtype,
                                _str(c.gpu_memory_utilization), _str(c.num_gpu_blocks), c.enable_prefix_caching,
                                c.kv_offloading_backend, c.kv_offloading_size], 1)
        errors = m.VLLM_SCRAPE_ERRORS_TOTAL.new()
        for (endpoint, kind), n in sorted(state.vllm_errors_total.items()):
            errors.add_metric([endpoint, kind], n)
        sleep = m.VLLM_ENGINE_SLEEP_STATE.new()
        levels = {"awake": 0, "weights_offloaded": 1, "asleep": 1, "discard_all": 2}
        for v in state.snapshot.vllm if state.snapshot is not None else ():
            engine_levels: dict[str, int] = {}
            for e in v.engines:  # one model per server; the deepest sleep if an engine repeats
                if e.sleep_state in levels:
                    engine_levels[e.engine] = max(levels[e.sleep_state], engine_levels.get(e.engine, 0))
            for engine, level in sorted(engine_levels.items()):
                sleep.add_metric([v.endpoint, engine], level)
        yield from (up, dur, age, kv, running, waiting, by_reason, *counters.values(), rejections, cfg, budget,
                    budget_used, profile, sleep, *self._kv_caches(state.analysis), errors)

    def _kv_caches(self, analysis: Analysis | None) -> Iterator[Metric]:
        tokens = m.VLLM_KV_CACHE_CAPACITY_TOKENS.new()
        capacity = m.VLLM_KV_CACHE_CAPACITY_BYTES.new()
        used_tokens = m.VLLM_KV_CACHE_USED_TOKENS.new()
        used = m.VLLM_KV_CACHE_USED_BYTES.new()
        max_len = m.VLLM_MAX_MODEL_LEN_TOKENS.new()
        fits = m.VLLM_KV_CACHE_MAX_CONCURRENCY.new()
        for k in analysis.kv_caches if analysis is not None else ():
            labels = [k.endpoint, k.model, k.engine]
            for fam, value in ((tokens, k.capacity_tokens), (capacity, k.capacity_bytes),
                               (used_tokens, k.used_tokens), (used, k.used_bytes),
                               (max_len, k.max_model_len), (fits, k.max_concurrency)):
                if value is not None:
                    fam.add_metric(labels, value)
        yield from (tokens, capacity, used_tokens, used, max_len, fits)

    def _oom_events(self, state: State) -> Iterator[Metric]:
        ooms = m.OOM_EVENTS_TOTAL.new()
        for (kind, klass), n in sorted(state.oom_events_total.items()):
            ooms.add_metric([kind, klass], n)
        yield ooms

    # -- analysis -------------------------------------------------------------------------
    def _analysis(self, analysis: Analysis) -> Iterator[Metric]:
        util = m.GPU_MEMORY_UTILIZATION_RATIO.new()
        beyond = m.GPU_MEMORY_BEYOND_BUDGET_BYTES.new()
        unattributed = m.GPU_MEMORY_UNATTRIBUTED_BYTES.new()
        ttf = m.GPU_TIME_TO_FULL_SECONDS.new()
        admission = m.ADMISSION_OPEN.new()
        for g in analysis.gpus:
            labels = [g.gpu, g.uuid]
            if g.utilization_ratio is not None:
                util.add_metric(labels, g.utilization_ratio)
            if g.beyond_budget_bytes is not None:
                beyond.add_metric(labels, g.beyond_budget_bytes)
            if g.unattributed_bytes is not None:
                unattributed.add_metric(labels, g.unattributed_bytes)
            if g.time_to_full_seconds is not None:
                ttf.add_metric(labels, g.time_to_full_seconds)
            admission.add_metric([g.gpu], 1 if g.admission_open else 0)
        yield from (util, beyond, unattributed, ttf, admission)

        leak = m.LEAK_SUSPECTED.new()
        growth = m.PROCESS_MEMORY_GROWTH_BYTES_PER_SECOND.new()
        for t in analysis.process_trends:
            labels = [t.gpu, str(t.pid), t.process, t.role]
            leak.add_metric(labels, 1 if t.leak_suspected else 0)
            if t.growth_bytes_per_second is not None:
                growth.add_metric(labels, t.growth_bytes_per_second)
        yield leak
        yield growth

        active = m.FINDING_ACTIVE.new()
        for f in analysis.findings:
            active.add_metric([f.kind, f.severity, f.gpu or "", "" if f.pid is None else str(f.pid),
                               f.process, f.role, f.endpoint], 1)
        yield active


    def _recorder(self, stats: RecorderStats) -> Iterator[Metric]:
        yield m.RECORDER_WRITES_TOTAL.of(stats.writes_total)
        for family, counts in ((m.RECORDER_ERRORS_TOTAL, stats.errors_total),
                               (m.RECORDER_TRIGGERS_TOTAL, stats.triggers_total),
                               (m.RECORDER_DEBOUNCED_TOTAL, stats.debounced_total)):
            yield _counted(family, counts)
        if stats.last_write_timestamp is not None:
            yield m.RECORDER_LAST_WRITE_TIMESTAMP_SECONDS.of(stats.last_write_timestamp)

    def _listeners(self, listeners: tuple[ListenerStats, ...]) -> Iterator[Metric]:
        opened, refused, evicted = (m.EXPORTER_LISTENER_CONNECTIONS.new(), m.EXPORTER_LISTENER_REFUSED_TOTAL.new(),
                                    m.EXPORTER_LISTENER_EVICTED_TOTAL.new())
        for s in listeners:
            opened.add_metric([s.listener], s.open_connections)
            for reason in LISTENER_LIMITS:
                refused.add_metric([s.listener, reason], s.refused_total.get(reason, 0))
            evicted.add_metric([s.listener], s.evicted_total)
        yield from (opened, refused, evicted)

    def _reload(self, stats: ReloadStats) -> Iterator[Metric]:
        yield m.EXPORTER_CONFIG_LAST_RELOAD_SUCCESSFUL.of(1 if stats.successful else 0)
        yield m.EXPORTER_CONFIG_LAST_RELOAD_SUCCESS_TIMESTAMP_SECONDS.of(stats.last_success_at)

    def _alloc_history(self, stats: AllocHistoryStats) -> Iterator[Metric]:
        yield _counted(m.ALLOCATOR_HISTORY_REQUESTS_TOTAL, stats.requests_total)
        yield _counted(m.ALLOCATOR_HISTORY_RESULTS_TOTAL, stats.results_total)


def _counted(family: Family, counts: Mapping[str, int]) -> Metric:
    """A family with one label, one series per key of `counts`, in key order."""
    metric = family.new()
    for key, n in sorted(counts.items()):
        metric.add_metric([key], n)
    return metric


def _printable(family: Metric) -> Metric:
    """The family with every label value printable: process names (any local user sets its own
    `comm`), model names and pod names come from outside, and an escape sequence in a label
    would reach every terminal and log that prints the series. A character that is not
    printable becomes U+FFFD; the exposition format escapes the rest (backslash, quote,
    newline). One join and one test per series: the common, clean case costs little."""
    for i, sample in enumerate(family.samples):
        if not "".join(sample.labels.values()).isprintable():
            family.samples[i] = sample._replace(labels={
                k: "".join(c if c.isprintable() else "\ufffd" for c in v) for k, v in sample.labels.items()})
    return family


def _str(value: object) -> str:
    return "" if value is None else str(value)


def build_registry(get_state: Callable[[], State], now: Callable[[], float],
                   listeners: Callable[[], Iterable[ListenerStats]] = tuple) -> CollectorRegistry:
    """A registry with our collector plus the exporter's own process metrics."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StateCollector(get_state, now, listeners))
    ProcessCollector(registry=registry)
    return registry
