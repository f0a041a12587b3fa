"""vLLM's KV cache: its capacity and use (the numbers behind --max-num-seqs and --max-model-len),
and saturation that vLLM's own preemption counter does not show.

Capacity comes from `vllm:cache_config_info` (0.11+: `kv_cache_size_tokens`,
`kv_cache_max_concurrency`, `kv_cache_memory_bytes`; older: `num_gpu_blocks x block_size`),
else from the start-up log (analysis never guesses it). Bytes are per GPU: each worker of a
tensor-parallel server holds its share of every token.

Saturation: vLLM (V1 scheduler) counts a preemption in `vllm:num_preemptions` only when the
preempted request next produces output (the scheduler records the event; the output processor
counts it with that request's next output), so a cache that is full, a queue that grows and
requests that sit preempted show zero preemptions for as long as it lasts. And a real
saturated cache is never full in every sample: its usage saw-tooths (a real vLLM 0.32 under a
ramp of 160 clients: 75 % of 0.25-s samples at 0.98 or more, stretches of a few seconds, dips to
40 %), while requests wait and preemptions are counted. The finding (`kv_saturation`) reads the
share of a window's samples at the ceiling with requests waiting, and holds through the dips.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from ..model import Finding, KvCache, Snapshot, VllmEngineStats, VllmSample
from ..units import GiB, counted, format_bytes
from .detector import DetectorSpec, FindingAlert, FindingKind, Tick
from .history import History


def kv_caches(snapshot: Snapshot) -> tuple[KvCache, ...]:
    """One KvCache per (server, model, engine) that reported its engines this tick."""
    out = []
    for server in snapshot.vllm:
        if not server.up:
            continue
        tokens, capacity, max_len, concurrency = _capacity(server)
        for e in server.engines:
            usage = e.kv_cache_usage_ratio
            out.append(KvCache(
                endpoint=server.endpoint, model=e.model, engine=e.engine,
                capacity_tokens=tokens, capacity_bytes=capacity, usage_ratio=usage,
                used_tokens=round(usage * tokens) if usage is not None and tokens is not None else None,
                used_bytes=round(usage * capacity) if usage is not None and capacity is not None else None,
                max_model_len=max_len, max_concurrency=concurrency))
    return tuple(out)


def _capacity(server: VllmSample) -> tuple[int | None, int | None, int | None, float | None]:
    """(tokens, bytes per GPU, max_model_len, requests of max_model_len that fit)."""
    c, p = server.cache_config, server.startup
    tokens = c.kv_capacity_tokens if c is not None else None
    if tokens is None and p is not None:
        tokens = p.kv_cache_tokens
    capacity = c.kv_cache_memory_bytes if c is not None and c.kv_cache_memory_bytes else None
    if capacity is None and p is not None and p.kv_cache_bytes is not None and p.kv_cache_bytes > 0:
        capacity = p.kv_cache_bytes
    max_len = p.max_model_len if p is not None else None
    concurrency = c.kv_cache_max_concurrency if c is not None else None
    if concurrency is None and p is not None:
        concurrency = p.kv_cache_max_concurrency
    if concurrency is None and tokens is not None and max_len:
        concurrency = tokens / max_len
    if max_len is None and concurrency and tokens is not None:
        max_len = round(tokens / concurrency)  # vLLM's concurrency is tokens / max_model_len
    return tokens, capacity, max_len, concurrency


@dataclass(frozen=True)
class KvSaturationConfig:
    usage_ratio: float = 0.95  # a sample whose KV cache usage is at or above this is full
    window_seconds: float = 60.0  # judged over the samples of this window
    min_full_share: float = 0.3  # raised when at least this share of them is full ...
    min_waiting: int = 1  # ... and this many requests wait ...
    min_queued_share: float = 0.3  # ... in at least this share of them, or a preemption was counted
    clear_full_share: float = 0.1  # raised, it stays while this share is full, a window after the last raise
    min_samples: int = 4  # a window with fewer samples (or covering less than half of it) is not judged

    def __post_init__(self) -> None:
        shares = (self.usage_ratio, self.min_full_share, self.min_queued_share, self.clear_full_share)
        if not all(0 < x <= 1 for x in shares) or self.clear_full_share > self.min_full_share:
            raise ValueError("kv_saturation: usage_ratio and the shares within (0, 1], "
                             "clear_full_share <= min_full_share")
        if self.window_seconds <= 0 or self.min_waiting < 1 or self.min_samples < 2:
            raise ValueError("kv_saturation: window_seconds > 0, min_waiting >= 1, min_samples >= 2")


class _Sample(NamedTuple):
    t: float
    full: bool
    queued: bool
    waiting: float | None
    preemptions: float | None
    running: float | None


class _Window(NamedTuple):
    """What one window of an engine's samples shows."""

    samples: int
    full_share: float
    queued_share: float
    preempted: float  # preemptions vLLM counted in it
    span: float  # seconds from its first sample to its last


def detect_kv_saturation(history: History, snapshot: Snapshot, config: KvSaturationConfig,
                         caches: tuple[KvCache, ...]) -> list[Finding]:
    """One finding per server with an engine whose KV cache is saturated, read from what a real
    server shows (vLLM 0.32 under a concurrency ramp, docs/vllm-cpu.md): usage saw-tooths
    (blocks freed by finishing and preempted requests are taken again within a second), so a
    share of the window's samples is at the ceiling, never all of them; requests wait, and
    preemptions are counted while it lasts. Raised when at least min_full_share of the window's
    samples are full and requests waited in min_queued_share of them (or vLLM counted a
    preemption); once raised, it stays while clear_full_share of a window is still full, for a
    window after the condition last held, so one dip does not clear it."""
    now = snapshot.timestamp
    since = now - 2 * config.window_seconds
    past: list[Snapshot] | None = None
    by_engine = {(k.endpoint, k.model, k.engine): k for k in caches}
    findings = []
    for server in snapshot.vllm:
        if not server.up:
            continue
        worst: tuple[float, Finding] | None = None
        for e in server.engines:
            if e.kv_cache_usage_ratio is None or _never_full(history, server.endpoint, e, since, config):
                continue
            if past is None:
                past = [s for s in history.recent(since) if s.timestamp < now]
            series = _series(past, server.endpoint, e.model, e.engine, config)
            series.append(_sample(now, e, config))
            judged = _judge(series, now, config)
            if judged is None:
                continue
            window, raised_at = judged
            finding = _finding(server, e, by_engine.get((server.endpoint, e.model, e.engine)), now, window,
                               raised_at, series, config)
            if worst is None or window.full_share > worst[0]:
                worst = (window.full_share, finding)
        if worst is not None:
            findings.append(worst[1])
    return findings


def _never_full(history: History, endpoint: str, e: VllmEngineStats, since: float,
                config: KvSaturationConfig) -> bool:
    """No sample of the engine since `since` is full, now included (the history's index says so
    without reading the frames; #18): then no window of them is saturated."""
    if config.min_full_share <= 0 or config.clear_full_share <= 0:
        return False  # a window with nothing full could still count: read it
    peak = history.kv_usage_peak(endpoint, e.model, e.engine, since)
    usage = e.kv_cache_usage_ratio
    return (peak is None or peak < config.usage_ratio) and usage is not None and usage < config.usage_ratio


def _sample(t: float, e: VllmEngineStats, config: KvSaturationConfig) -> _Sample:
    usage, waiting = e.kv_cache_usage_ratio, e.requests_waiting
    return _Sample(t, usage is not None and usage >= config.usage_ratio,
                   waiting is not None and waiting >= config.min_waiting, waiting, e.preemptions_total,
                   e.requests_running)


def _series(past: list[Snapshot], endpoint: str, model: str, engine: str,
            config: KvSaturationConfig) -> list[_Sample]:
    out = []
    for snap in past:
        old = _engine(snap, endpoint, model, engine)
        if old is not None and old.kv_cache_usage_ratio is not None:
            out.append(_sample(snap.timestamp, old, config))
    return out


def _judge(series: list[_Sample], now: float, config: KvSaturationConfig) -> tuple[_Window, float] | None:
    """(this window, when the raise condition last held) while the engine is saturated, else None.
    Linear in the samples: counts over any window come from running sums."""
    w = config.window_seconds
    full, queued, preempted = [0], [0], [0.0]  # running sums up to each sample
    last_count: float | None = None
    for p in series:
        full.append(full[-1] + p.full)
        queued.append(queued[-1] + p.queued)
        rise = 0.0
        if p.preemptions is not None:
            if last_count is not None:
                rise = p.preemptions - last_count if p.preemptions >= last_count else p.preemptions  # a drop: restart
            last_count = p.preemptions
        preempted.append(preempted[-1] + rise)
    starts: list[int] = []  # for each sample, the first sample of the window that ends with it
    first = 0
    for sample in series:
        while series[first].t <= sample.t - w:
            first += 1
        starts.append(first)

    def window(i: int) -> _Window | None:
        a = starts[i]
        n = i + 1 - a
        span = series[i].t - series[a].t
        if n < config.min_samples or span < w / 2:
            return None
        # The first sample's own rise happened before the window.
        return _Window(n, (full[i + 1] - full[a]) / n, (queued[i + 1] - queued[a]) / n,
                       preempted[i + 1] - preempted[a + 1], span)

    def raised(win: _Window | None) -> bool:
        return win is not None and win.full_share >= config.min_full_share and (
            win.queued_share >= config.min_queued_share or win.preempted > 0)

    last = len(series) - 1
    current = window(last)
    if current is None:
        return None
    if raised(current):
        return current, now
    if current.full_share < config.clear_full_share:
        return None
    for i in range(last - 1, -1, -1):  # the raise condition within a window before: still raised
        if series[i].t <= now - w:
            break
        if raised(window(i)):
            return current, series[i].t
    return None


def _engine(snap: Snapshot, endpoint: str, model: str, engine: str) -> VllmEngineStats | None:
    for v in snap.vllm:
        if v.endpoint == endpoint and v.up:
            for e in v.engines:
                if e.model == model and e.engine == engine:
                    return e
    return None


def _finding(server: VllmSample, e: VllmEngineStats, kv: KvCache | None, now: float, window: _Window,
             raised_at: float, series: list[_Sample], config: KvSaturationConfig) -> Finding:
    recent = [p for p in series if p.t > now - config.window_seconds]
    waiting = [p.waiting for p in recent if p.waiting is not None]
    usage = e.kv_cache_usage_ratio
    evidence: list[tuple[str, float | int | str]] = [
        ("model", e.model), ("engine", e.engine),
        ("full_share", round(window.full_share, 3)), ("usage_ratio_threshold", config.usage_ratio),
        ("queued_share", round(window.queued_share, 3)), ("window_seconds", config.window_seconds),
        ("samples", window.samples), ("preemptions_in_window", window.preempted)]
    if usage is not None:
        evidence.append(("kv_cache_usage_ratio", round(usage, 4)))
    if waiting:
        evidence += [("requests_waiting", waiting[-1]), ("requests_waiting_max", max(waiting))]
    if e.requests_running is not None:
        evidence.append(("requests_running", e.requests_running))
    if raised_at < now:
        evidence.append(("condition_last_held_seconds_ago", round(now - raised_at, 1)))
    if e.request_preemptions_total is not None and e.requests_finished_total:
        evidence.append(("preemptions_per_finished_request",
                         round(e.request_preemptions_total / e.requests_finished_total, 3)))
    if kv is not None:
        for name, value in (("kv_cache_capacity_tokens", kv.capacity_tokens),
                            ("kv_cache_capacity_bytes", kv.capacity_bytes),
                            ("max_model_len", kv.max_model_len),
                            ("max_concurrency", round(kv.max_concurrency, 2) if kv.max_concurrency else None)):
            if value is not None:
                evidence.append((name, value))
    preempted = (f", {counted(window.preempted, 'preemption')} counted in those {config.window_seconds:.0f} s"
                 if window.preempted
                 else "; no preemption counted yet (vLLM counts one only when the preempted request next "
                      "produces output)")
    running = f"; {e.requests_running:.0f} running now" if e.requests_running is not None else ""
    summary = (f"{server.endpoint}: KV cache full (at least {config.usage_ratio:.0%}) in {window.full_share:.0%} of "
               f"the samples of the last {config.window_seconds:.0f} s, requests waiting in "
               f"{window.queued_share:.0%} (up to {max(waiting) if waiting else 0:.0f} waiting{running}){preempted}")
    return Finding(kind="kv_saturation", severity="warning", first_detected_at=now,
                   endpoint=server.endpoint, summary=summary, evidence=tuple(evidence),
                   advice=_advice(server, kv, max((p.running for p in recent if p.running is not None),
                                                  default=None)))


def _advice(server: VllmSample, kv: KvCache | None, running: float | None) -> tuple[str, ...]:
    """`running`: the most requests running at once in the window (the instant's count swings
    with every batch, and is 0 once a load has ended while the finding still holds)."""
    advice = []
    tokens = kv.capacity_tokens if kv is not None else None
    max_len = kv.max_model_len if kv is not None else None
    fits = kv.max_concurrency if kv is not None else None
    if tokens is not None and running:
        per_request = tokens / running
        advice.append(
            f"The KV cache holds {tokens:,} tokens: about {per_request:,.0f} per request when the most "
            f"ran at once ({running:.0f} in the window). Lower --max-num-seqs (to about "
            f"{max(1, int(running * 0.8))}) "
            "so requests wait to be admitted instead of being preempted and recomputed.")
    else:
        advice.append("Lower --max-num-seqs so requests wait to be admitted instead of being "
                      "preempted and recomputed.")
    if max_len is not None and fits is not None:
        advice.append(
            f"Only {round(fits, 1):g} requests of --max-model-len {max_len:,} tokens fit at once: long "
            f"requests crowd the cache. Lowering --max-model-len caps them (at {max_len // 2:,}, "
            f"{round(fits * 2, 1):g} full-length requests fit).")
    else:
        advice.append("Lower --max-model-len if a few long requests crowd the cache.")
    c = server.cache_config
    per_gib = None
    if kv is not None and kv.capacity_bytes and tokens:
        per_gib = tokens * GiB / kv.capacity_bytes
    more = f" (each GiB of KV cache holds about {per_gib:,.0f} tokens)" if per_gib else ""
    if c is not None and c.kv_cache_memory_bytes:
        advice.append(f"Give the KV cache more memory: raise --kv-cache-memory-bytes (now "
                      f"{format_bytes(c.kv_cache_memory_bytes)}){more}, if the memory is there.")
    elif c is not None and c.gpu_memory_utilization is not None:
        advice.append(f"Give the KV cache more memory: raise --gpu-memory-utilization (now "
                      f"{c.gpu_memory_utilization:g}){more}, if the GPU has room; or add replicas.")
    else:
        advice.append(f"Give the KV cache more memory (--gpu-memory-utilization or "
                      f"--kv-cache-memory-bytes){more}, or add replicas.")
    return tuple(advice)


def _detect(tick: Tick, config: KvSaturationConfig) -> list[Finding]:
    return detect_kv_saturation(tick.history, tick.snapshot, config, tick.kv_caches)


DETECTOR = DetectorSpec(
    name="kv_saturation", config=KvSaturationConfig, create=lambda: _detect,
    help=("A vLLM KV cache full in a share of a window's samples while requests wait, whether or not "
          "vLLM counted a preemption (a saturated cache saw-tooths: never full in every sample)."),
    history_needed={"window_seconds": 2},
    kinds=(FindingKind(
        "kv_saturation", scenario="kv-saturation",
        help=(f"a vLLM KV cache full (usage at least {KvSaturationConfig.usage_ratio:g}) in "
              f"{KvSaturationConfig.min_full_share:.0%} or more of the last "
              f"{KvSaturationConfig.window_seconds:g} s of samples while requests wait, whether or not vLLM "
              "has counted a preemption yet"),
        alert=FindingAlert(
            "VllmKvCacheSaturated", severity="ticket", for_="5m",
            summary="vLLM {{ $labels.endpoint }} on {{ $labels.instance }} has a full KV cache and a queue.",
            description=("The KV cache of {{ $labels.endpoint }} on {{ $labels.instance }} keeps filling while "
                         "requests wait: it is "
                         '{{ with printf "max(gpumem_vllm_kv_cache_usage_ratio{instance=%q,endpoint=%q})" '
                         "$labels.instance $labels.endpoint | query }}{{ . | first | value "
                         "| humanizePercentage }}{{ end }} used, with "
                         '{{ with printf "sum(gpumem_vllm_requests_waiting{instance=%q,endpoint=%q})" '
                         "$labels.instance $labels.endpoint | query }}{{ . | first | value }}{{ end }} requests "
                         'waiting and {{ with printf "sum(gpumem_vllm_requests_running{instance=%q,endpoint=%q})" '
                         "$labels.instance $labels.endpoint | query }}{{ . | first | value }}{{ end }} running, "
                         "whether or not vLLM has counted a preemption yet. Latency grows with the queue; the "
                         "server needs more KV cache or less load."))),),
    settings={
        "usage_ratio": "a sample whose KV cache usage is at or above this is full ...",
        "window_seconds": "... judged over the samples of this window:",
        "min_full_share": "raised when at least this share of them is full ...",
        "min_waiting": "... and at least this many requests wait ...",
        "min_queued_share": "... in at least this share of them (or vLLM counted a preemption);",
        "clear_full_share": "once raised, it stays while this share of a window is full (through the dips).",
    })
