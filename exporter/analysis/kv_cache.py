"""vLLM's KV cache: its capacity and use (the numbers behind --max-num-seqs and --max-model-len),
and saturation that vLLM's own preemption counter does not show.

Capacity comes from `vllm:cache_config_info` (0.11+: `kv_cache_size_tokens`,
`kv_cache_max_concurrency`, `kv_cache_memory_bytes`; older: `num_gpu_blocks x block_size`),
else from the start-up log (analysis never guesses it). Bytes are per GPU: each worker of a
tensor-parallel server holds its share of every token.

Saturation: vLLM (V1 scheduler) counts a preemption in `vllm:num_preemptions` only when the
preempted request next produces output (the scheduler records the event; the output processor
counts it with that request's next output), so a cache that is full, a queue that grows and
requests that sit preempted show zero preemptions for as long as it lasts. The finding
(`kv_saturation`) reads the state instead: usage at the ceiling for a while, a growing queue.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..model import Finding, KvCache, Snapshot, VllmEngineStats, VllmSample
from .detector import DetectorSpec, FindingAlert, FindingKind, Tick
from .history import History

GIB = 1 << 30


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
    usage_ratio: float = 0.98  # KV cache usage at or above this is "full" ...
    window_seconds: float = 120.0  # ... in every sample for this long ...
    min_waiting: int = 1  # ... with at least this many waiting, more than at the start

    def __post_init__(self) -> None:
        if not 0 < self.usage_ratio <= 1 or self.window_seconds <= 0 or self.min_waiting < 1:
            raise ValueError("kv_saturation: 0 < usage_ratio <= 1, window_seconds > 0, min_waiting >= 1")


def detect_kv_saturation(history: History, snapshot: Snapshot, config: KvSaturationConfig,
                         caches: tuple[KvCache, ...]) -> list[Finding]:
    """One finding per server with an engine whose KV cache stayed full for window_seconds
    while its queue grew, whatever the preemption counter says."""
    now = snapshot.timestamp
    past = [s for s in history.recent(now - 2 * config.window_seconds) if s.timestamp < now]
    by_engine = {(k.endpoint, k.model, k.engine): k for k in caches}
    findings = []
    for server in snapshot.vllm:
        if not server.up:
            continue
        worst: tuple[float, Finding] | None = None
        for e in server.engines:
            if e.kv_cache_usage_ratio is None or e.kv_cache_usage_ratio < config.usage_ratio:
                continue
            # Walk back while the cache was full: since = the start of this full stretch.
            since, start = now, e
            for snap in reversed(past):
                old = _engine(snap, server.endpoint, e.model, e.engine)
                if old is None or old.kv_cache_usage_ratio is None \
                        or old.kv_cache_usage_ratio < config.usage_ratio:
                    break
                since, start = snap.timestamp, old
            waiting, waiting_before = e.requests_waiting, start.requests_waiting
            if now - since < config.window_seconds or waiting is None or waiting < config.min_waiting \
                    or (waiting_before is not None and waiting <= waiting_before):
                continue
            preempted = None
            if e.preemptions_total is not None and start.preemptions_total is not None:
                preempted = max(0.0, e.preemptions_total - start.preemptions_total)
            finding = _finding(server, e.model, e.engine, by_engine.get((server.endpoint, e.model, e.engine)),
                               now, since, e.kv_cache_usage_ratio, waiting, waiting_before,
                               e.requests_running, preempted)
            if worst is None or waiting > worst[0]:
                worst = (waiting, finding)
        if worst is not None:
            findings.append(worst[1])
    return findings


def _engine(snap: Snapshot, endpoint: str, model: str, engine: str) -> VllmEngineStats | None:
    for v in snap.vllm:
        if v.endpoint == endpoint and v.up:
            for e in v.engines:
                if e.model == model and e.engine == engine:
                    return e
    return None


def _finding(server: VllmSample, model: str, engine: str, kv: KvCache | None, now: float,
             since: float, usage: float, waiting: float, waiting_before: float | None,
             running: float | None, preempted: float | None) -> Finding:
    evidence: list[tuple[str, float | int | str]] = [
        ("model", model), ("engine", engine), ("kv_cache_usage_ratio", round(usage, 4)),
        ("full_for_seconds", round(now - since, 1)), ("requests_waiting", waiting)]
    if waiting_before is not None:
        evidence.append(("requests_waiting_at_start", waiting_before))
    if running is not None:
        evidence.append(("requests_running", running))
    if preempted is not None:
        evidence.append(("preemptions_in_window", preempted))
    if kv is not None:
        for name, value in (("kv_cache_capacity_tokens", kv.capacity_tokens),
                            ("kv_cache_capacity_bytes", kv.capacity_bytes),
                            ("max_model_len", kv.max_model_len),
                            ("max_concurrency", round(kv.max_concurrency, 2) if kv.max_concurrency else None)):
            if value is not None:
                evidence.append((name, value))
    counted = "" if preempted else (
        "; no preemption counted (vLLM counts one only when the preempted request next "
        "produces output)")
    summary = (f"{server.endpoint}: KV cache {usage:.0%} full for {(now - since) / 60:.0f} min "
               f"with {waiting:.0f} request(s) waiting (was {waiting_before or 0:.0f})"
               + (f" and {running:.0f} running" if running is not None else "") + counted)
    return Finding(kind="kv_saturation", severity="warning", first_detected_at=now,
                   endpoint=server.endpoint, summary=summary, evidence=tuple(evidence),
                   advice=_advice(server, kv, running))


def _advice(server: VllmSample, kv: KvCache | None, running: float | None) -> tuple[str, ...]:
    advice = []
    tokens = kv.capacity_tokens if kv is not None else None
    max_len = kv.max_model_len if kv is not None else None
    fits = kv.max_concurrency if kv is not None else None
    if tokens is not None and running:
        per_request = tokens / running
        advice.append(
            f"The KV cache holds {tokens:,} tokens, about {per_request:,.0f} per running request "
            f"({running:.0f} running). Lower --max-num-seqs (to about {max(1, int(running * 0.8))}) "
            "so requests wait to be admitted instead of being preempted and recomputed.")
    else:
        advice.append("Lower --max-num-seqs so requests wait to be admitted instead of being "
                      "preempted and recomputed.")
    if max_len is not None and fits is not None:
        advice.append(
            f"Only {fits:.1f} requests of --max-model-len {max_len:,} tokens fit at once: long "
            f"requests crowd the cache. Lowering --max-model-len caps them (at {max_len // 2:,}, "
            f"{fits * 2:.1f} full-length requests fit).")
    else:
        advice.append("Lower --max-model-len if a few long requests crowd the cache.")
    c = server.cache_config
    per_gib = None
    if kv is not None and kv.capacity_bytes and tokens:
        per_gib = tokens * GIB / kv.capacity_bytes
    more = f" (each GiB of KV cache holds about {per_gib:,.0f} tokens)" if per_gib else ""
    if c is not None and c.kv_cache_memory_bytes:
        advice.append(f"Give the KV cache more memory: raise --kv-cache-memory (now "
                      f"{c.kv_cache_memory_bytes / GIB:.1f} GiB){more}, if the GPU has room.")
    elif c is not None and c.gpu_memory_utilization is not None:
        advice.append(f"Give the KV cache more memory: raise --gpu-memory-utilization (now "
                      f"{c.gpu_memory_utilization:g}){more}, if the GPU has room; or add replicas.")
    else:
        advice.append(f"Give the KV cache more memory (--gpu-memory-utilization or "
                      f"--kv-cache-memory){more}, or add replicas.")
    return tuple(advice)


def _detect(tick: Tick, config: KvSaturationConfig) -> list[Finding]:
    return detect_kv_saturation(tick.history, tick.snapshot, config, tick.kv_caches)


DETECTOR = DetectorSpec(
    name="kv_saturation", config=KvSaturationConfig, create=lambda: _detect,
    help="A vLLM KV cache full while requests queue up, whether or not vLLM counted a preemption.",
    history_needed={"window_seconds": 2},
    kinds=(FindingKind(
        "kv_saturation", scenario="kv-saturation",
        help=(f"a vLLM KV cache full (usage at least {KvSaturationConfig.usage_ratio:g}) for "
              f"{KvSaturationConfig.window_seconds:g} s while the queue grows, whether or not vLLM has "
              "counted a preemption yet"),
        alert=FindingAlert(
            "VllmKvCacheSaturated", severity="ticket", for_="5m",
            summary=("vLLM {{ $labels.endpoint }} on {{ $labels.instance }} has a full KV cache and a growing "
                     "queue."),
            description=("The KV cache of {{ $labels.endpoint }} on {{ $labels.instance }} has stayed full while "
                         "its queue grew: "
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
        "usage_ratio": "KV cache usage at or above this is full ...",
        "window_seconds": "... in every sample for this long ...",
        "min_waiting": "... with at least this many requests waiting, more than when it filled.",
    })
