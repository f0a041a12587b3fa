"""Renders the last published State as Prometheus metric families at scrape time.

A custom collector, not global metric objects: the series of a process that exited simply are
not yielded any more, so they disappear from the next scrape. Every family here is described
in docs/metrics.md (a test keeps the two in step).
"""
from __future__ import annotations

import platform
from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector, CollectorRegistry

from .. import __version__
from ..model import AllocHistoryStats, Analysis, ProcessSample, RecorderStats, ReloadStats, Snapshot, State

GPU = ["gpu", "uuid"]
PROCESS = ["gpu", "uuid", "pid", "process", "role", "container", "pod", "namespace"]
TREND = ["gpu", "pid", "process", "role"]


def _gauge(name: str, doc: str, labels: Iterable[str] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=list(labels))


class StateCollector(Collector):
    def __init__(self, get_state: Callable[[], State], now: Callable[[], float]):
        self.get_state = get_state
        self.now = now

    def collect(self) -> Iterable[Metric]:
        # Families with no series (no vLLM endpoint configured, say) are left out entirely.
        return (family for family in self._families() if family.samples)

    def _families(self) -> Iterable[Metric]:
        state = self.get_state()
        yield from self._self_metrics(state)
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
        info = _gauge("gpumem_exporter_build_info", "Build information; always 1.",
                      ["version", "python", "driver_version"])
        info.add_metric([__version__, platform.python_version(),
                         state.snapshot.driver_version if state.snapshot else ""], 1)
        yield info
        up = _gauge("gpumem_exporter_source_up", "1 if the source worked in the last sample.", ["source"])
        dur = _gauge("gpumem_exporter_source_duration_seconds",
                     "Time the last sample spent in the source.", ["source"])
        for s in state.snapshot.sources if state.snapshot is not None else ():
            up.add_metric([s.source], 1 if s.up else 0)
            dur.add_metric([s.source], s.duration_seconds)
        yield up
        yield dur
        if state.snapshot is not None:
            yield GaugeMetricFamily("gpumem_exporter_sample_duration_seconds",
                                    "Time the last tick took: every source and the analysis.",
                                    value=state.sample_duration_seconds)
        errors = CounterMetricFamily("gpumem_exporter_errors", "Faults seen by each source, by kind.",
                                     labels=["source", "kind"])
        for (source, kind), n in sorted(state.errors_total.items()):
            errors.add_metric([source, kind], n)
        yield errors
        yield CounterMetricFamily("gpumem_exporter_samples", "Sampling ticks completed.",
                                  value=state.samples_total)
        if state.last_sample_at is not None:
            yield GaugeMetricFamily("gpumem_exporter_last_sample_timestamp_seconds",
                                    "When the last sample completed (Unix seconds).",
                                    value=state.last_sample_at)
            yield GaugeMetricFamily("gpumem_exporter_sample_age_seconds",
                                    "Age of the sample this scrape shows; grows when sampling is stuck.",
                                    value=max(0.0, self.now() - state.last_sample_at))

    # -- GPUs and processes ---------------------------------------------------------------
    def _gpus(self, snap: Snapshot) -> Iterator[Metric]:
        info = _gauge("gpumem_gpu_info", "GPU identity; always 1.", ["gpu", "uuid", "name", "unified", "mig"])
        up = _gauge("gpumem_gpu_up", "1 if the GPU answered NVML in the last sample.", GPU)
        fams = {f: _gauge(f"gpumem_gpu_memory_{f}_bytes", doc, GPU) for f, doc in (
            ("total", "Total GPU memory (host memory on unified-memory devices)."),
            ("used", "GPU memory in use, as NVML reports it."),
            ("free", "GPU memory free."),
            ("reserved", "GPU memory reserved by the driver and firmware (NVML memory info v2)."))}
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
        used = _gauge("gpumem_process_memory_used_bytes", "GPU memory used by a process on a GPU.", PROCESS)
        rss = _gauge("gpumem_process_host_rss_bytes", "Host resident memory of a process using a GPU.",
                     ["pid", "process", "role", "container", "pod", "namespace"])
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
        yield used
        yield rss
        yield from self._allocator(snap)

    def _allocator(self, snap: Snapshot) -> Iterator[Metric]:
        """PyTorch's allocator in each probed process (docs/probe.md); a process without a
        probe, or a number its torch does not report, has no series (never a zero)."""
        fams: list[tuple[GaugeMetricFamily | CounterMetricFamily, Callable[[ProcessSample], int | None]]] = [
            (_gauge("gpumem_process_torch_allocated_bytes",
                    "GPU memory held by live PyTorch tensors in a process (allocator probe).", PROCESS),
             lambda p: p.allocator.allocated_bytes if p.allocator else None),
            (_gauge("gpumem_process_torch_reserved_bytes",
                    "GPU memory PyTorch's caching allocator holds from the driver: allocated + cached.",
                    PROCESS),
             lambda p: p.allocator.reserved_bytes if p.allocator else None),
            (_gauge("gpumem_process_torch_inactive_split_bytes",
                    "PyTorch's cached memory in free pieces of split blocks (fragmentation).", PROCESS),
             lambda p: p.allocator.inactive_split_bytes if p.allocator else None),
            (_gauge("gpumem_process_non_torch_bytes",
                    "GPU memory of a process outside PyTorch's allocator: NVML used - torch reserved.",
                    PROCESS),
             lambda p: p.non_torch_bytes),
            (CounterMetricFamily("gpumem_process_alloc_retries",
                                 "Times PyTorch's allocator flushed its cache and retried cudaMalloc.",
                                 labels=PROCESS),
             lambda p: p.allocator.alloc_retries if p.allocator else None),
            (CounterMetricFamily("gpumem_process_torch_ooms",
                                 "Out-of-memory errors PyTorch's allocator raised in a process.", labels=PROCESS),
             lambda p: p.allocator.ooms if p.allocator else None),
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
        yield GaugeMetricFamily("gpumem_host_memory_total_bytes", "Host memory (MemTotal).", value=h.total_bytes)
        yield GaugeMetricFamily("gpumem_host_memory_available_bytes", "Host memory available (MemAvailable).",
                                value=h.available_bytes)
        if h.psi_some_avg10 is not None:
            yield GaugeMetricFamily("gpumem_host_memory_pressure_some_ratio",
                                    "Share of time some task stalled on memory (PSI some avg10).",
                                    value=h.psi_some_avg10 / 100.0)
        if h.oom_kills is not None:
            yield CounterMetricFamily("gpumem_host_oom_kills", "Kernel OOM kills (/proc/vmstat oom_kill).",
                                      value=h.oom_kills)

    # -- vLLM -----------------------------------------------------------------------------
    def _vllm(self, state: State) -> Iterator[Metric]:
        up = _gauge("gpumem_vllm_up", "1 if the vLLM endpoint answered with valid metrics.", ["endpoint"])
        dur = _gauge("gpumem_vllm_scrape_duration_seconds", "Time taken to scrape the vLLM endpoint.",
                     ["endpoint"])
        eng = ["endpoint", "model", "engine"]
        kv = _gauge("gpumem_vllm_kv_cache_usage_ratio", "KV cache blocks in use (0-1).", eng)
        running = _gauge("gpumem_vllm_requests_running", "Requests running on the engine.", eng)
        waiting = _gauge("gpumem_vllm_requests_waiting", "Requests waiting to be scheduled.", eng)
        counters = {
            "preemptions_total": CounterMetricFamily("gpumem_vllm_preemptions",
                                                     "Requests preempted for lack of KV cache.", labels=eng),
            "prefix_cache_queries_total": CounterMetricFamily("gpumem_vllm_prefix_cache_queries",
                                                              "Prefix cache queries (tokens).", labels=eng),
            "prefix_cache_hits_total": CounterMetricFamily("gpumem_vllm_prefix_cache_hits",
                                                           "Prefix cache hits (tokens).", labels=eng),
        }
        budget = _gauge("gpumem_vllm_memory_budget_bytes",
                        "What the server planned to use on the GPU: gpu_memory_utilization x total, or "
                        "--kv-cache-memory plus its non-KV memory.", ["endpoint", *GPU])
        budget_used = _gauge("gpumem_vllm_memory_used_bytes", "What the server's processes use on the GPU.",
                             ["endpoint", *GPU])
        for b in state.analysis.budgets if state.analysis is not None else ():
            if b.budget_bytes is not None:
                budget.add_metric([b.endpoint, b.gpu, b.uuid], b.budget_bytes)
            if b.used_bytes is not None:  # None: NVML gave no per-process figure
                budget_used.add_metric([b.endpoint, b.gpu, b.uuid], b.used_bytes)
        profile = _gauge("gpumem_vllm_memory_profile_bytes",
                         "The server's start-up memory profile from its log, by component.", ["endpoint", "component"])
        cfg = _gauge("gpumem_vllm_cache_config_info", "The server's KV cache configuration; always 1.",
                     ["endpoint", "block_size", "cache_dtype", "gpu_memory_utilization", "num_gpu_blocks"])
        for v in state.snapshot.vllm if state.snapshot is not None else ():
            up.add_metric([v.endpoint], 1 if v.up else 0)
            dur.add_metric([v.endpoint], v.scrape_duration_seconds)
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
            for component, value in v.memory_profile:
                profile.add_metric([v.endpoint, component], value)
            c = v.cache_config
            if c is not None:
                cfg.add_metric([v.endpoint, _str(c.block_size), c.cache_dtype,
                                _str(c.gpu_memory_utilization), _str(c.num_gpu_blocks)], 1)
        errors = CounterMetricFamily("gpumem_vllm_scrape_errors", "Failed scrapes of a vLLM endpoint, by kind.",
                                     labels=["endpoint", "kind"])
        for (endpoint, kind), n in sorted(state.vllm_errors_total.items()):
            errors.add_metric([endpoint, kind], n)
        sleep = _gauge("gpumem_vllm_engine_sleep_state",
                       "Sleep mode: 0 awake, 1 asleep at level 1 (weights offloaded), 2 at level 2 "
                       "(weights discarded).", ["endpoint", "engine"])
        levels = {"awake": 0, "weights_offloaded": 1, "asleep": 1, "discard_all": 2}
        for v in state.snapshot.vllm if state.snapshot is not None else ():
            engine_levels: dict[str, int] = {}
            for e in v.engines:  # one model per server; the deepest sleep if an engine repeats
                if e.sleep_state in levels:
                    engine_levels[e.engine] = max(levels[e.sleep_state], engine_levels.get(e.engine, 0))
            for engine, level in sorted(engine_levels.items()):
                sleep.add_metric([v.endpoint, engine], level)
        yield from (up, dur, kv, running, waiting, *counters.values(), cfg, budget, budget_used, profile,
                    sleep, *self._kv_caches(state.analysis), errors)

    def _kv_caches(self, analysis: Analysis | None) -> Iterator[Metric]:
        eng = ["endpoint", "model", "engine"]
        tokens = _gauge("gpumem_vllm_kv_cache_capacity_tokens", "Tokens the KV cache holds.", eng)
        capacity = _gauge("gpumem_vllm_kv_cache_capacity_bytes",
                          "The KV cache's memory on each of the engine's GPUs.", eng)
        used_tokens = _gauge("gpumem_vllm_kv_cache_used_tokens", "KV cache in use, in tokens.", eng)
        used = _gauge("gpumem_vllm_kv_cache_used_bytes",
                      "KV cache in use on each of the engine's GPUs: usage ratio x capacity bytes.", eng)
        max_len = _gauge("gpumem_vllm_max_model_len_tokens", "Tokens per request the server accepts.", eng)
        fits = _gauge("gpumem_vllm_kv_cache_max_concurrency",
                      "Requests of max_model_len tokens the KV cache holds at once.", eng)
        for k in analysis.kv_caches if analysis is not None else ():
            labels = [k.endpoint, k.model, k.engine]
            for fam, value in ((tokens, k.capacity_tokens), (capacity, k.capacity_bytes),
                               (used_tokens, k.used_tokens), (used, k.used_bytes),
                               (max_len, k.max_model_len), (fits, k.max_concurrency)):
                if value is not None:
                    fam.add_metric(labels, value)
        yield from (tokens, capacity, used_tokens, used, max_len, fits)

    def _oom_events(self, state: State) -> Iterator[Metric]:
        ooms = CounterMetricFamily("gpumem_oom_events", "Out-of-memory events found in the watched logs.",
                                   labels=["kind", "class"])
        for (kind, klass), n in sorted(state.oom_events_total.items()):
            ooms.add_metric([kind, klass], n)
        yield ooms

    # -- analysis -------------------------------------------------------------------------
    def _analysis(self, analysis: Analysis) -> Iterator[Metric]:
        util = _gauge("gpumem_gpu_memory_utilization_ratio", "Used over total GPU memory (0-1).", GPU)
        beyond = _gauge("gpumem_gpu_memory_beyond_budget_bytes",
                        "Used memory the vLLM servers did not budget for (all of it on a GPU without vLLM).", GPU)
        unattributed = _gauge("gpumem_gpu_memory_unattributed_bytes",
                              "GPU memory used that no live process accounts for.", GPU)
        ttf = _gauge("gpumem_gpu_time_to_full_seconds",
                     "Projected seconds until the GPU is full at its current growth; absent if not growing.", GPU)
        admission = _gauge("gpumem_admission_open",
                           "1 while the GPU has headroom for new requests (closes above, reopens below thresholds).",
                           ["gpu"])
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

        leak = _gauge("gpumem_leak_suspected", "1 if the process's memory grows like a leak.", TREND)
        growth = _gauge("gpumem_process_memory_growth_bytes_per_second",
                        "Robust trend of the process's GPU memory.", TREND)
        for t in analysis.process_trends:
            labels = [t.gpu, str(t.pid), t.process, t.role]
            leak.add_metric(labels, 1 if t.leak_suspected else 0)
            if t.growth_bytes_per_second is not None:
                growth.add_metric(labels, t.growth_bytes_per_second)
        yield leak
        yield growth

        active = _gauge("gpumem_finding_active", "One series per active finding of the detectors.",
                        ["kind", "severity", "gpu", "pid", "process", "role", "endpoint"])
        for f in analysis.findings:
            active.add_metric([f.kind, f.severity, f.gpu or "", "" if f.pid is None else str(f.pid),
                               f.process, f.role, f.endpoint], 1)
        yield active


    def _recorder(self, stats: RecorderStats) -> Iterator[Metric]:
        yield CounterMetricFamily("gpumem_recorder_writes", "Trace files the flight recorder wrote.",
                                  value=stats.writes_total)
        for name, doc, label, counts in (
                ("errors", "Flight recorder failures (disk full, permission, ...), by kind.", "kind",
                 stats.errors_total),
                ("triggers", "Events that made the flight recorder write, by trigger.", "trigger",
                 stats.triggers_total),
                ("debounced", "Triggers suppressed because the same kind wrote recently.", "trigger",
                 stats.debounced_total)):
            fam = CounterMetricFamily(f"gpumem_recorder_{name}", doc, labels=[label])
            for key, n in sorted(counts.items()):
                fam.add_metric([key], n)
            yield fam
        if stats.last_write_timestamp is not None:
            yield GaugeMetricFamily("gpumem_recorder_last_write_timestamp_seconds",
                                    "When the flight recorder last finished a trace file.",
                                    value=stats.last_write_timestamp)

    def _reload(self, stats: ReloadStats) -> Iterator[Metric]:
        yield GaugeMetricFamily("gpumem_exporter_config_last_reload_successful",
                                "1 if the last configuration load (start or SIGHUP reload) succeeded.",
                                value=1 if stats.successful else 0)
        yield GaugeMetricFamily("gpumem_exporter_config_last_reload_success_timestamp_seconds",
                                "When the configuration was last loaded successfully (start or reload).",
                                value=stats.last_success_at)

    def _alloc_history(self, stats: AllocHistoryStats) -> Iterator[Metric]:
        requests = CounterMetricFamily(
            "gpumem_allocator_history_requests",
            "Allocation-history requests to probes, by result (written, rate_limited, or an error kind).",
            labels=["result"])
        for result, n in sorted(stats.requests_total.items()):
            requests.add_metric([result], n)
        yield requests
        results = CounterMetricFamily(
            "gpumem_allocator_history_results",
            "The probes' answers to those requests: done, failed, unanswered.", labels=["state"])
        for state, n in sorted(stats.results_total.items()):
            results.add_metric([state], n)
        yield results


def _str(value: object) -> str:
    return "" if value is None else str(value)


def build_registry(get_state: Callable[[], State], now: Callable[[], float]) -> CollectorRegistry:
    """A registry with our collector plus the exporter's own process metrics."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StateCollector(get_state, now))
    ProcessCollector(registry=registry)
    return registry
