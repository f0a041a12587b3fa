"""What a trace says about its vLLM servers, for the report and `analyze`'s text: each server's
models, its settings and every change of them (a restart at a lower gpu_memory_utilization is
the first thing to know about an incident), its memory budget against what it used on each GPU,
and its KV cache and queue at their worst.

Pure: snapshots in, summaries out (the trace's `vllm` cells and the processes' endpoints).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ..analysis.budget import memory_budgets
from ..model import CacheConfig, MemoryProfile, Snapshot, VllmSample
from ..units import format_bytes


@dataclass(frozen=True)
class SettingsChange:
    """The server's settings from `at` on; `previous` None for the first ones seen."""

    at: float
    config: CacheConfig
    previous: CacheConfig | None
    restarted: bool  # its processes changed too (new pids)


@dataclass
class GpuUse:
    """The server's budget and its processes' memory on one GPU over the trace."""

    budgets: list[int] = field(default_factory=list)  # each budget it had, in order
    basis: str = ""
    peak_used_bytes: int | None = None
    peak_at: float | None = None
    over_bytes: int = 0  # the most its processes used beyond the budget of that moment
    over_at: float | None = None


@dataclass
class ServerStory:
    endpoint: str
    first_seen: float
    last_seen: float
    models: list[str] = field(default_factory=list)
    samples: int = 0
    down_samples: int = 0
    first_down: float | None = None
    settings: list[SettingsChange] = field(default_factory=list)
    # Each start's start-up log figures, with when the trace first carried them: a restarted
    # server's second start reports its own (a smaller KV cache at a lower utilization).
    startups: list[tuple[float, MemoryProfile]] = field(default_factory=list)
    gpus: dict[str, GpuUse] = field(default_factory=dict)
    kv_peak: float | None = None
    kv_peak_at: float | None = None
    waiting_peak: float | None = None
    running_peak: float | None = None
    preemptions: float | None = None  # over the trace (a counter's rise)
    sleep_states: list[str] = field(default_factory=list)

    @property
    def config(self) -> CacheConfig | None:
        return self.settings[-1].config if self.settings else None


def servers_in(snapshots: Iterable[Snapshot]) -> list[ServerStory]:
    """One ServerStory per endpoint seen, in the order first seen."""
    stories: dict[str, ServerStory] = {}
    pids: dict[str, tuple[int, ...]] = {}
    preempt_first: dict[str, float] = {}
    for snap in snapshots:
        for server in snap.vllm:
            story = stories.get(server.endpoint)
            if story is None:
                story = stories[server.endpoint] = ServerStory(server.endpoint, snap.timestamp,
                                                               snap.timestamp)
            story.last_seen = snap.timestamp
            _sample(story, server, snap.timestamp, pids, preempt_first)
        for budget in memory_budgets(snap) if snap.vllm else ():
            story = stories.get(budget.endpoint)
            if story is None:
                continue
            use = story.gpus.setdefault(budget.gpu, GpuUse())
            if budget.budget_bytes is not None:
                if not use.budgets or use.budgets[-1] != budget.budget_bytes:
                    use.budgets.append(budget.budget_bytes)
                use.basis = budget.basis
            if budget.used_bytes is None:
                continue
            if use.peak_used_bytes is None or budget.used_bytes > use.peak_used_bytes:
                use.peak_used_bytes, use.peak_at = budget.used_bytes, snap.timestamp
            if budget.budget_bytes is not None and budget.used_bytes - budget.budget_bytes > use.over_bytes:
                use.over_bytes, use.over_at = budget.used_bytes - budget.budget_bytes, snap.timestamp
    return list(stories.values())


def _sample(story: ServerStory, server: VllmSample, ts: float,
            pids: dict[str, tuple[int, ...]], preempt_first: dict[str, float]) -> None:
    story.samples += 1
    if not server.up:
        story.down_samples += 1
        if story.first_down is None:
            story.first_down = ts
    restarted = bool(server.pids) and server.endpoint in pids and pids[server.endpoint] != server.pids
    if server.pids:
        pids[server.endpoint] = server.pids
    config = server.cache_config
    last = story.config
    if config is not None and config != last:
        story.settings.append(SettingsChange(ts, config, last, restarted))
    if server.startup is not None and not server.startup.empty and (
            not story.startups or story.startups[-1][1] != server.startup):
        story.startups.append((ts, server.startup))
    for engine in server.engines:
        if engine.model and engine.model not in story.models:
            story.models.append(engine.model)
        if engine.sleep_state and engine.sleep_state not in story.sleep_states:
            story.sleep_states.append(engine.sleep_state)
        kv = engine.kv_cache_usage_ratio
        if kv is not None and (story.kv_peak is None or kv > story.kv_peak):
            story.kv_peak, story.kv_peak_at = kv, ts
        story.waiting_peak = _max(story.waiting_peak, engine.requests_waiting)
        story.running_peak = _max(story.running_peak, engine.requests_running)
        if engine.preemptions_total is not None:
            key = f"{server.endpoint}|{engine.model}|{engine.engine}"
            first = preempt_first.setdefault(key, engine.preemptions_total)
            rise = max(0.0, engine.preemptions_total - first)
            story.preemptions = max(story.preemptions or 0.0, rise)


def _max(have: float | None, value: float | None) -> float | None:
    if value is None:
        return have
    return value if have is None else max(have, value)


# ---------------------------------------------------------------- words

_SETTINGS = (  # (field, name in vLLM's words, how to show it)
    ("gpu_memory_utilization", "gpu_memory_utilization", lambda v: f"{v:g}"),
    ("kv_cache_memory_bytes", "kv_cache_memory", format_bytes),
    ("num_gpu_blocks", "GPU blocks", lambda v: f"{v:,}"),
    ("block_size", "block size", str),
    ("cache_dtype", "KV dtype", str),
    ("kv_cache_size_tokens", "KV capacity (tokens)", lambda v: f"{v:,}"),
    ("kv_cache_max_concurrency", "max concurrency", lambda v: f"{v:g}"),
)


def settings_text(config: CacheConfig, previous: CacheConfig | None = None) -> str:
    """'gpu_memory_utilization 0.6 (was 0.9), 3,000 GPU blocks (was 7,000), ...': every setting
    known, each change with what it was."""
    parts = []
    for name, label, show in _SETTINGS:
        value = getattr(config, name)
        if value is None or value == "":
            continue
        was = getattr(previous, name) if previous is not None else None
        text = f"{label} {show(value)}"
        if was not in (None, "") and was != value:
            text += f" (was {show(was)})"
        parts.append(text)
    return ", ".join(parts) or "no settings reported"


def changes_text(story: ServerStory, when: Callable[[float], str]) -> list[str]:
    """One line per settings change after the first settings (restarts included)."""
    return [f"{when(c.at)}: " + ("restarted with " if c.restarted else "settings changed to ")
            + settings_text(c.config, c.previous) for c in story.settings[1:]]


def startup_text(p: MemoryProfile | None) -> str:
    """The start-up log's figures the trace carries, or ""."""
    if p is None:
        return ""
    named = (("max_model_len", p.max_model_len, lambda v: f"{v:,}"),
             ("weights", p.weights_bytes, format_bytes),
             ("KV cache", p.kv_cache_bytes, format_bytes),
             ("activation peak", p.activation_peak_bytes, format_bytes),
             ("non-torch", p.non_torch_bytes, format_bytes),
             ("CUDA graphs", p.cuda_graph_bytes, format_bytes))
    return ", ".join(f"{n} {show(v)}" for n, v, show in named if v is not None)


__all__ = ["GpuUse", "ServerStory", "SettingsChange", "changes_text", "servers_in",
           "settings_text", "startup_text"]
